"""Chat prompts built as token segments.

The model's chat template is rendered once with sentinel contents and cut at the sentinels; each
template piece is tokenized on its own and each content part goes in as given: text is tokenized,
a list of ints is inserted as is. An agent's own answer therefore re-enters a later prompt as the
exact tokens it generated (no decode/re-encode round trip), and [question + own answer] in a debate
prompt is the same token run whose KV was written while that answer was generated.
"""

from __future__ import annotations

from typing import Union

Part = Union[str, list[int]]
Content = Union[Part, list[Part]]

_SENTINEL = "\x1e{}\x1f"


class ChatFormat:
    def __init__(self, tokenizer, eos_ids: set[int] | None = None):
        if tokenizer is None:
            raise ValueError("chat prompts need a tokenizer; the checkpoint folder has none")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass prompts as token lists instead")
        self.tok = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos_ids or ()) | ({eos} if isinstance(eos, int) else set(eos or ()))
        self._piece_cache: dict[str, list[int]] = {}

    def _encode_text(self, text: str) -> list[int]:
        if text not in self._piece_cache:
            self._piece_cache[text] = self.tok.encode(text, add_special_tokens=False)
        return self._piece_cache[text]

    def encode(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """`messages`: [{"role": ..., "content": str | list[int] | list[str | list[int]]}]."""
        placeholders = [{"role": m["role"], "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
        text = self.tok.apply_chat_template(placeholders, tokenize=False, add_generation_prompt=add_generation_prompt)
        ids: list[int] = []
        rest = text
        for i, m in enumerate(messages):
            mark = _SENTINEL.format(i)
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
