"""Chat prompts built as token segments.

The model's chat template is rendered once with sentinel contents and cut at the sentinels; each
template piece is tokenized on its own and each content part goes in as given: text is tokenized,
a list of ints is inserted as is. An agent's own answer therefore re-enters a later prompt as the
exact tokens it generated (no decode/re-encode round trip).

An assistant message marked `"generated": True` is a completion as the model produced it, right
after the generation prompt of the messages before it: the prompt is then that earlier prompt,
token for token, plus the completion, plus the template's text after the turn. So [question + own
answer] in a debate prompt is the very token run whose KV was written while the answer was
generated, whatever the template does to earlier assistant turns (a reasoning template rewrites
them: GPT-OSS's drops the analysis channel and re-heads the turn as `final`).
"""

from __future__ import annotations

from typing import Union

from svrmad_local.errors import UserError

Part = Union[str, list[int]]
Content = Union[Part, list[Part]]

_SENTINEL = "\x1e{}\x1f"


class ChatError(UserError, ValueError):
    """Chat messages this format cannot take, or a chat template that fails on them."""


def check_messages(messages) -> None:
    """Every message a dict with a text `role` and a `content` of text, token ids, or a list of
    those: a missing key is named here, not a KeyError inside the rendering."""
    if not isinstance(messages, (list, tuple)):
        raise ChatError(f"chat messages must be a list of {{'role': ..., 'content': ...}}, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatError(f"message {i} is a {type(m).__name__}, not a {{'role': ..., 'content': ...}} dict")
        missing = [k for k in ("role", "content") if k not in m]
        if missing:
            raise ChatError(f"message {i} has no {' and no '.join(repr(k) for k in missing)} (keys: {sorted(m)})")
        if not isinstance(m["role"], str):
            raise ChatError(f"message {i}: role must be text, got {m['role']!r:.80}")
        if not _is_content(m["content"]):
            raise ChatError(f"message {i} ({m['role']}): content must be text, token ids, or a list of those, "
                            f"got {type(m['content']).__name__}")


def _is_content(content, top: bool = True) -> bool:
    if isinstance(content, str):
        return True
    if not isinstance(content, (list, tuple)):
        return False
    if all(isinstance(t, int) and not isinstance(t, bool) for t in content):
        return True
    return top and all(_is_content(part, False) for part in content)


class ChatFormat:
    def __init__(self, tokenizer, eos_ids: set[int] | None = None, template_kwargs: dict | None = None):
        """`template_kwargs` go to every rendering of the template (e.g. `reasoning_effort`, see
        `models.reasoning.effort_kwargs`)."""
        if tokenizer is None:
            raise ValueError("chat prompts need a tokenizer; the checkpoint folder has none")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass prompts as token lists instead")
        self.tok = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos_ids or ()) | ({eos} if isinstance(eos, int) else set(eos or ()))
        self.template_kwargs = dict(template_kwargs or {})
        self._piece_cache: dict[str, list[int]] = {}

    def _encode_text(self, text: str) -> list[int]:
        if text not in self._piece_cache:
            self._piece_cache[text] = self.tok.encode(text, add_special_tokens=False)
        return self._piece_cache[text]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The template's text with message i's content replaced by sentinel i."""
        from jinja2 import TemplateError

        placeholders = [{"role": m["role"], "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
        try:
            return self.tok.apply_chat_template(placeholders, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, **self.template_kwargs)
        except (TemplateError, TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as exc:
            # a syntax error, the template's own raise_exception(...), or an operation its code cannot do
            roles = ", ".join(m["role"] for m in messages)
            raise ChatError(f"the chat template failed on messages ({roles}): {type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:300]}") from None

    def probe(self) -> None:
        """Render the conversations a debate sends (a user turn; user, assistant, user) with the
        generation prompt: a template that fails on them is refused before any weight is read,
        naming what it raised (ChatError), instead of failing every question after the load."""
        self.generation_prompt()
        for messages in ([{"role": "user", "content": "2 + 3?"}],
                         [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5"},
                          {"role": "user", "content": "Another agent says 6. Answer again."}]):
            self.encode(messages)

    def generation_prompt(self) -> str:
        """The text the template appends to open the assistant's turn (e.g. "<|start|>assistant",
        or "<｜Assistant｜><think>" for a template that opens the reasoning itself)."""
        one = [{"role": "user", "content": ""}]
        closed = self._render(one, False).split(_SENTINEL.format(0), 1)[1]
        opened = self._render(one, True).split(_SENTINEL.format(0), 1)[1]
        return opened[len(closed):] if opened.startswith(closed) else opened

    def encode(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """`messages`: [{"role": ..., "content": str | list[int] | list[str | list[int]]}], an assistant
        message optionally `"generated": True` (see the module docstring)."""
        check_messages(messages)
        text = self._render(messages, add_generation_prompt)
        last = max((i for i, m in enumerate(messages) if m.get("generated")), default=None)
        if last is None:
            ids, rest, start = [], text, 0
        else:
            ids = self.encode(messages[:last], add_generation_prompt=True) + self._content_ids(messages[last]["content"])
            mark = _SENTINEL.format(last)
            if mark not in text:
                raise ValueError(f"the chat template dropped message {last} (assistant); cannot build segments")
            rest, start = text.split(mark, 1)[1], last + 1
        for i in range(start, len(messages)):
            m, mark = messages[i], _SENTINEL.format(i)
            if mark not in rest:
                raise ValueError(f"the chat template dropped message {i} ({m['role']}); cannot build segments")
            head, rest = rest.split(mark, 1)
            if head:
                ids += self._encode_text(head)
            ids += self._content_ids(m["content"])
        if rest:
            ids += self._encode_text(rest)
        return ids

    def _content_ids(self, content: Content) -> list[int]:
        if isinstance(content, str):
            return self.tok.encode(content, add_special_tokens=False)
        if content and all(isinstance(t, int) for t in content):
            toks = list(content)
            while toks and toks[-1] in self.eos_ids:  # the template closes the turn itself
                toks.pop()
            return toks
        out: list[int] = []
        for part in content:
            out += self._content_ids(part)
        return out
