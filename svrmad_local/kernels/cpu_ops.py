"""The small fused ops of a Llama-shaped decoder layer on the CPU, fp32 and bf16: RMSNorm (with the
residual add before it), RoPE with the new K/V written to their cache slots, and SiLU-and-multiply;
and the row selections of sampling and the token statistics (`topk`, `argmax`).

Why: at decode these are ~20 tiny torch ops a layer, each ~5-20 us of dispatch on a 2-core EPYC for
a few hundred floats of work: transformers' RMSNorm alone took 86 us a call (8 ops) against ~3 us
here, 61 calls a step of the default.

Numerics:
- Every value is computed in fp32. In bf16, a value is rounded to bf16 wherever transformers' bf16
  modules round it (each of their torch ops returns bf16): the ops compute the modules' bits, not a
  more exact result.
- RoPE and the K/V copies are elementwise IEEE operations (x*cos, -x*sin, their sum; built with
  -ffp-contract=off, so no FMA fuses them): bitwise what transformers' `apply_rotary_pos_emb`
  computes, in fp32 and in bf16. The residual add is one IEEE add: bitwise too.
- SiLU-and-multiply (`silu_mul`): g / (1 + e^-g) with the exponential torch's own vectorised SiLU calls
  (Sleef's, exported by libtorch), then the product: bitwise F.silu(gate) * up, in fp32 and bf16 (in
  bf16 the SiLU rounded to bf16 first, as F.silu returns it). torch's loop takes two vectors a step and
  computes the last I % 2v elements of a row (v: its vector's elements, 16 fp32 or 32 bf16 under
  AVX-512) with std::exp; so does this. Where torch splits a large gate between threads it restarts
  that walk at each split: `silu_mul_is_torchs` says where the splits keep the tails in place.
- RMSNorm sums the squares in an order of its own (8 lanes, then the lanes in order, then the tail),
  so it differs from transformers' `pow(2).mean()` at fp32 rounding. That is why the engine swaps the
  model's norm modules for `engine.families.FastRMSNorm`, which calls this: the engine and any reference
  that runs the same model then compute the same bits. In bf16 the sum and the scale are fp32 as in
  transformers (`hidden_states.to(torch.float32)`), the normalised row is rounded to bf16 and then
  multiplied by the bf16 weight (rounded again): transformers' own steps, only the sum's order differs.
  A row's result never depends on the other rows (batch-invariant).
- `sample_pack` runs a step's sampling, statistics and packing (engine/sampler.py `sample_packed`) in one
  call: the draw as the same ATen ops in the same order, called from C++ (torch's tokens, without ~25
  Python dispatches a step); the statistics in one pass of its own over each row (a max, then the sums of
  e^(x - m) and e^(x - m) (x - m)), within float rounding of torch's log_softmax and entropy, as the GPU's
  Triton kernels are (kernels/sample_pack.py), at a tenth of the ~50 ops' time (~0.5 ms of a batch-1 step).
- `topk` and `argmax` select, they compute nothing: torch.topk's and torch.argmax's values and indices,
  ties in torch's order (csrc/cpu_ops.cpp says how), 4-8x faster on a 49k vocabulary. A sampled token
  and the recorded top log-probs therefore do not depend on which of the two ran.
"""

from __future__ import annotations

import torch

from ._backend import choose
from ._cpu_build import Kernel

NAME = "cpu_ops"  # its name for _backend.choose
DTYPES = (torch.float32, torch.bfloat16)  # the activation dtypes the compiled ops take; callers run a torch reference for others
_KERNEL = Kernel(NAME, "cpu_ops.cpp", "SVRMAD_CPU_OPS", "fused CPU decoder ops", needs_avx2=True,
                 extra_cflags=("-ffp-contract=off",))


def available() -> bool:
    """Compiles on first call (seconds; cached across processes). SVRMAD_CPU_OPS=0 turns it off."""
    return choose("auto", "cpu", NAME).impl == "cpp"


def unavailable_reason() -> str | None:
    """Why the torch path runs instead (None where the kernel does)."""
    return choose("auto", "cpu", NAME).why


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of an fp32 tensor of any leading shape."""
    h = x.shape[-1]
    return _KERNEL.module().rms_norm(x.reshape(-1, h).contiguous(), weight, eps).view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(residual + x), residual + x) for contiguous [rows, hidden] fp32 tensors."""
    return _KERNEL.module().add_rms_norm(x, residual, weight, eps)


def rope_store(q, k, v, cos, sin, k_cache, v_cache, slots) -> torch.Tensor:
    """The rotated q [T, H, D]; the rotated k and v written to rows `slots` of the caches. See csrc/cpu_ops.cpp."""
    return _KERNEL.module().rope_store(q, k, v, cos, sin, k_cache, v_cache, slots)


def torch_vector_bytes() -> int:
    """Bytes of torch's own CPU vectors here (its kernels' vector loop; the rest of a row runs scalar)."""
    cap = torch.backends.cpu.get_cpu_capability()
    return 64 if cap.startswith("AVX512") else 32 if cap.startswith("AVX2") else 1


# elements of one step of torch's elementwise loop (two vectors; aten/src/ATen/native/cpu/Loops.h)
_VEC = {t: max(1, 2 * torch_vector_bytes() // torch.empty((), dtype=t).element_size()) for t in DTYPES}
_GRAIN = 32768  # at::internal::GRAIN_SIZE: the elements below which torch's elementwise loops stay on one thread


def _thread_splits(numel: int) -> range:
    """Where torch's parallel elementwise loop cuts [0, numel) between threads (at::parallel_for over
    OpenMP: as many pieces as threads, at most one a grain, each ceil(numel / pieces) long)."""
    if numel <= _GRAIN:
        return range(0)
    pieces = min(torch.get_num_threads(), -(-numel // _GRAIN))
    chunk = -(-numel // pieces)
    return range(chunk, numel, chunk) if pieces > 1 else range(0)


def silu_mul_is_torchs(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `silu_mul` gives F.silu(gate) * up's bits for these tensors: [rows, I] with contiguous rows,
    and each row's scalar tail where torch's is. torch walks a row alone when the rows are not one block
    (the gate half of a gate/up output) or there is one row; a contiguous gate of several rows it walks as
    one long row, whose tail is elsewhere unless I is a whole number of loop steps. A gate of more than
    a grain torch splits between this thread's team, and each piece starts the walk afresh: every split
    must fall on a loop step of its row (else the caller runs torch's own ops)."""
    if gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return False
    return silu_mul_fits(*gate.shape, gate.stride(0), gate.dtype)


def silu_mul_fits(rows: int, inter: int, row_stride: int, dtype: torch.dtype) -> bool:
    """`silu_mul_is_torchs` for a gate of `rows` x `inter` with contiguous rows `row_stride` apart."""
    vec = _VEC[dtype]
    if not (rows == 1 or row_stride != inter or inter % vec == 0):
        return False
    return all(cut % inter % vec == 0 for cut in _thread_splits(rows * inter))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up in one call, bit for bit where `silu_mul_is_torchs` says so."""
    return _KERNEL.module().silu_mul(gate, up, _VEC[gate.dtype])


def _selects(x: torch.Tensor) -> bool:
    """Whether the compiled selections take `x`: a [rows, V] fp32 tensor on the CPU, the module built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and available()


def topk(x: torch.Tensor, k: int):
    """torch.topk(x, k, dim=-1) over [rows, V], bit for bit (the values, the indices, their order among
    ties); compiled where torch takes its partial sort (k * 64 <= V) and `_selects`, else torch's own."""
    if 0 < k and k * 64 <= x.shape[-1] and _selects(x):
        return torch.return_types.topk(_KERNEL.module().topk_rows(x.contiguous(), k))
    return x.topk(k, dim=-1)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) over [rows, V], bit for bit (a NaN first, then the first of equal greatest)."""
    if x.shape[-1] > 0 and _selects(x):
        return _KERNEL.module().argmax_rows(x.contiguous())
    return x.argmax(-1)


def samples(logits: torch.Tensor) -> bool:
    """Whether `sample_pack` takes these logits (`_selects`: fp32 [rows, V] on the CPU, the module built)."""
    return logits.shape[-1] > 0 and _selects(logits)


def sample_pack(logits: torch.Tensor, table: torch.Tensor, K: int, topk: int) -> torch.Tensor:
    """stats.pack(toks, stats.stats_from_logits(logits, toks, topk)) with toks = sampler.sample_rows(logits, draws)
    for draws of `table` ([5, R] float64, sampler.Draws.table on the CPU) and widths K, topk, in one call: the
    tokens and top ids bit for bit, the log-probs and entropies within float rounding (csrc/cpu_ops.cpp `row_stats`)."""
    return _KERNEL.module().sample_pack(logits.contiguous(), table, K, topk)
