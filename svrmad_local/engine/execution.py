"""One record of how this engine runs: every execution choice, made once at build, with its reason.

Why one record: the choices (which attention path, which decode and prefill kernels, how the linears
and the layers run, CUDA graphs, the weights' quantization, tensor parallelism, the statistics'
kernels) are all made in one room, engine/choices.py, once, while engine/build.py builds the engine
(calling the modules that alone know a part: decoder.select_decoder, models/linear.select_linear,
graphs.why_off, kernels.select_impl; the quantization was decided when the checkpoint loaded,
models/quant.choose_mode), and gathered into one frozen `Execution` that everything downstream reads:
the runner, the attention hooks and the static decode path read its `AttentionPaths` every step
instead of recomputing flags, `Engine.info` reports it (run.json stores it), and `line()` is the one
line a command prints at start, naming the reason of every choice that fell back from the path "auto"
would have wanted.

What happens after build is not in the frozen record: a Triton kernel that fails once under
kernel_impl="auto" is served from its torch reference from then on (kernels._backend.fall_back);
`runtime_fallbacks()` lists those, and `Engine.info["fallbacks"]` reports them beside the record.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from svrmad_local.kernels import _backend


@dataclass(frozen=True)
class Choice:
    """One aspect of how the engine runs: `value` (short, what runs), `reason` (why), and `fell_back`:
    the path "auto" wanted cannot run here (a missing compiler, no Triton...), so the reason is news."""

    name: str
    value: str
    reason: str
    fell_back: bool = False

    def __str__(self) -> str:
        return f"{self.value} ({self.reason})" if self.reason else self.value

    def as_dict(self) -> dict:
        return {"value": self.value, "reason": self.reason, "fell_back": self.fell_back}


@dataclass(frozen=True)
class AttentionPaths:
    """The attention switches a step reads (plain attributes: read every step and layer, so cheap).

    `decode` is what the dynamic steps' per-head K/V decode rows take ("cpu" / "triton": in place
    through the block tables; None: padded gather, flash-attn or cascade); `inplace_decode` is the
    in-place kernel this machine has, which the static decode path (engine/graphs.py) takes even where
    flash-attn runs the dynamic steps. `cascade` is the cascade kernel's impl ("triton" / "torch"), or
    None when off. `summary` is the legacy one-string form (`Engine.info["attention"]`)."""

    kernel_impl: str
    flash: bool
    flash_paged: bool
    decode: str | None
    inplace_decode: str | None
    prefill_in_place: bool
    mla_absorbed: bool
    cascade: str | None
    summary: str


@dataclass(frozen=True)
class Execution:
    """How this engine runs, decided once at build (engine/choices.py). Aspects in the order they are
    said; `attention_paths` is what the runner and the hooks read."""

    device: Choice
    quantization: Choice
    linear: Choice
    gemv: Choice
    decoder: Choice
    attention: Choice
    decode: Choice
    prefill: Choice
    cascade: Choice
    mla: Choice
    graphs: Choice
    overlap: Choice
    pdl: Choice
    tp: Choice
    stats: Choice
    sampling: Choice
    threads: Choice
    attention_paths: AttentionPaths

    def choices(self) -> list[Choice]:
        return [getattr(self, f.name) for f in fields(self) if f.name != "attention_paths"]

    def as_dict(self) -> dict:
        """{aspect: {value, reason, fell_back}}: what Engine.info and run.json carry."""
        return {c.name: c.as_dict() for c in self.choices()}

    def line(self) -> str:
        """One line: every aspect's value (those that do not apply, such as MLA for a model without
        latent layers, left out), and each fallback's reason."""
        parts = [self.device.value] + [f"{c.name} {c.value}" for c in self.choices()[1:] if c.value != "none"]
        fell = [f"{c.name} {c.value}: {c.reason}" for c in self.choices() if c.fell_back]
        return "engine: " + " · ".join(parts) + ("; fell back: " + "; ".join(fell) if fell else "")


def runtime_fallbacks() -> list[str]:
    """Kernels whose Triton path failed after build and now run their torch reference, one line each
    (kernels._backend keeps them per process: every engine of the process is served the same way)."""
    return [f"{name}: Triton failed ({why}); the torch reference runs it" for name, why in _backend.disabled().items()]
