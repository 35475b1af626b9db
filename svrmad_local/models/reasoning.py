"""Reasoning models: the effort a chat template is told, and a completion's split into hidden
reasoning and final response.

The paper's runs are reasoning runs (GPT-OSS-120B and DeepSeek-V3.1 at reasoning effort medium).
Checkpoints take the setting as a chat-template variable, each family its own:

| template variable   | family (template)            | values                                  |
|---------------------|------------------------------|-----------------------------------------|
| `reasoning_effort`  | GPT-OSS (harmony)            | "low" / "medium" / "high" (default medium) |
| `thinking`          | DeepSeek-V3.1                | on / off (default off; reads `enable_thinking` when unset) |
| `enable_thinking`   | Qwen3                        | on / off (default on)                   |

An on/off template has one thinking level: we call it "medium" (the paper's setting for
DeepSeek-V3.1) and "none" turns thinking off; a level a template cannot express is refused, never
dropped. What a completion looks like is read from the tokenizer (its vocabulary and the template's
generation prompt), not from the model's name:

- harmony (`<|channel|>`, `<|message|>`, `<|start|>`, `<|end|>` are tokens): a sequence of messages
  `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`;
  the final response is the body of the last `final`-channel message.
- think tags (`</think>` is one token): the reasoning runs up to the first `</think>`; it is open
  from the first generated token when the generation prompt ends inside `<think>` (DeepSeek-V3.1
  thinking, Qwen3-Thinking-2507) or when the completion itself opens it (Qwen3).

A completion that ends inside its reasoning (cut by max_tokens, or stopped) has no final response.
"""

from __future__ import annotations

from dataclasses import dataclass

EFFORTS = ("none", "low", "medium", "high")
_LEVELS = ("low", "medium", "high")


def template_variables(template: str) -> set[str]:
    """The variables a chat template reads from its caller, parsed as transformers parses it."""
    from jinja2 import meta

    from svrmad_local.models import hf

    return meta.find_undeclared_variables(hf.template_environment(template).parse(template))


def effort_kwargs(template, effort: str | None, model: str) -> dict:
    """The template variables that set `effort` (one of EFFORTS) on this template; {} for None (the
    template's own default). A template that cannot take it is a ValueError naming `model`."""
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise ValueError(f"reasoning effort {effort!r}: expected one of {', '.join(EFFORTS)}")
    if isinstance(template, dict):  # named templates: apply_chat_template renders "default"
        template = template.get("default")
    if not template:
        raise ValueError(f"reasoning effort {effort}: {model} has no chat template to take it")
    names = template_variables(template)
    if "reasoning_effort" in names:
        if effort not in _LEVELS:
            raise ValueError(f"reasoning effort {effort}: the chat template of {model} takes reasoning_effort "
                             f"{'/'.join(_LEVELS)} and cannot turn reasoning off")
        return {"reasoning_effort": effort}
    switch = next((n for n in ("thinking", "enable_thinking") if n in names), None)
    if switch is not None:
        if effort not in ("none", "medium"):
            raise ValueError(f"reasoning effort {effort}: the chat template of {model} only switches thinking on or "
                             f"off ({switch}); use medium (on) or none (off)")
        return {switch: effort == "medium"}
    raise ValueError(f"reasoning effort {effort}: the chat template of {model} has no reasoning setting "
                     "(no reasoning_effort, thinking or enable_thinking variable)")


@dataclass(frozen=True)
class Split:
    """Where the final response lies in a completion's tokens: `ids[:start]` is hidden reasoning
    (with its markup), `ids[start:end]` the final response (terminators excluded). `final` is False
    when the completion ended inside its reasoning: then start == end == len(ids)."""

    start: int
    end: int
    final: bool = True


def _token_id(tok, token: str) -> int | None:
    """The id of `token` when it is a single token of the vocabulary."""
    i = tok.convert_tokens_to_ids(token)
    return None if i is None or i == tok.unk_token_id else i


def _trim(ids, start: int, end: int, stops: set[int]) -> int:
    while end > start and ids[end - 1] in stops:
        end -= 1
    return end


class Harmony:
    """GPT-OSS's harmony messages. The completion starts right after `<|start|>assistant`."""

    def __init__(self, tok, ids: dict[str, int]):
        self.tok = tok
        self.start, self.end, self.message, self.channel = (ids[k] for k in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>"))
        self.closers = {i for k, i in ids.items() if k in ("<|end|>", "<|return|>", "<|call|>")}
        self.returns = self.closers - {self.end}

    def _channel(self, header: list[int]) -> str | None:
        if self.channel not in header:
            return None
        words = self.tok.decode(header[header.index(self.channel) + 1:], skip_special_tokens=True).split()
        return words[0] if words else None

    def split(self, ids) -> Split:
        ids, n, head, found = list(ids), len(ids), 0, None
        while head < n:
            try:
                body = ids.index(self.message, head) + 1
            except ValueError:
                break  # cut inside a header
            close = next((k for k in range(body, n) if ids[k] in self.closers), n)
            if self._channel(ids[head:body]) == "final":
                found = (body, close)
            if close == n or ids[close] in self.returns:
                break
            head = close + 1
        return Split(*found) if found else Split(n, n, final=False)


class ThinkTags:
    """`<think> ... </think>` then the final response (DeepSeek-R1/V3.1, Qwen3). The blank lines
    after `</think>` belong to neither part (Qwen3's template strips them from an earlier turn)."""

    def __init__(self, tok, open_id: int | None, close_id: int, opens_in_reasoning: bool, eos_ids: set[int]):
        self.tok, self.open, self.close, self.opened, self.eos = tok, open_id, close_id, opens_in_reasoning, set(eos_ids)

    def split(self, ids) -> Split:
        ids, n = list(ids), len(ids)
        if self.close in ids:
            start = ids.index(self.close) + 1
            end = _trim(ids, start, n, self.eos)
            while start < end and not self.tok.decode([ids[start]]).strip():
                start += 1
            return Split(start, end)
        if self.opened or (self.open is not None and self.open in ids):
            return Split(n, n, final=False)
        return Split(0, _trim(ids, 0, n, self.eos))


def detect(tok, generation_prompt: str, eos_ids: set[int]) -> Harmony | ThinkTags | None:
    """The reasoning format of a tokenizer whose template opens the assistant turn with
    `generation_prompt` (`ChatFormat.generation_prompt`); None for a model without one."""
    harmony = {k: _token_id(tok, k) for k in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>")}
    if all(harmony[k] is not None for k in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>")):
        return Harmony(tok, {k: i for k, i in harmony.items() if i is not None})
    close = _token_id(tok, "</think>")
    if close is None:
        return None
    opened = generation_prompt.rfind("<think>") > generation_prompt.rfind("</think>")
    return ThinkTags(tok, _token_id(tok, "<think>"), close, opened, eos_ids)
