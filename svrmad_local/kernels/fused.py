"""The small ops of a decoder layer around its linears and its attention (engine/decoder.py): one
interface, chosen per device and dtype among three implementations.

- `rms_norm` / `add_rms_norm`: RMSNorm in a family's own rounding (`NormStyle`), the second with the
  residual add before it (it returns the new residual too). x may be a split-K linear's unsummed
  partials (kernels/shares.py): the Triton kernel sums them as it loads the row, the others first.
- `rope_store`: the q/k norms (Qwen3, Gemma 3), RoPE from the model's own cos/sin (full or partial
  rotary), and the rotated K and the V written to their cache slots, in one call.
- `act_mul`: act(gate) * up, SiLU or GELU (tanh), over the two halves of a gate/up output.

Implementations (`Ops(device, dtype)` picks them once, for a loop that calls them ~4 times a layer; the
module-level functions pick per call):
- "cpp": kernels/cpu_ops.py's compiled ops, on the CPU for a dtype in `cpu_ops.DTYPES` (fp32 and bf16). Its
  RMSNorm sums in an order of its own, so the engine swaps the model's norm modules for ones that call
  this interface (engine/families.FastRMSNorm): the decoder and the modules then compute the same bits.
  RoPE, the cache write and SiLU-and-multiply are transformers' elementwise operations, rounded where its
  bf16 ops round (bitwise); GELU-tanh has no C++ op and runs its reference.
- "triton": kernels/fused_triton.py where Triton runs (a CUDA device, or kernel_impl="triton" under its
  interpreter): one program per row, fp32 arithmetic, bitwise the reference where it only adds and
  multiplies (RoPE, the cache write), within rounding where it sums (RMSNorm) or takes exp/tanh.
- "torch": the reference, transformers' formulas op for op in the same order, on any device and dtype:
  where it runs, the decoder's values are the modules' bit for bit without any swap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_ops
from ._backend import choose, fall_back
from .norms import ACTS, CAST_LAST, GEMMA, PLAIN, NormStyle  # noqa: F401  (the interface's names)
from .shares import summed

# ------------------------------------------------------------------------------ the torch references


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: NormStyle = PLAIN) -> torch.Tensor:
    x = summed(x)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if style.offset:
        return (h * (style.offset + weight.float())).to(x.dtype)
    if style.cast_last:
        return (weight * h).to(x.dtype)
    return weight * h.to(x.dtype)


def reference_add_rms_norm(x, residual, weight, eps, style: NormStyle = PLAIN):
    s = residual + summed(x)
    return reference_rms_norm(s, weight, eps, style), s


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' RoPE on x [T, heads, D] with cos/sin [T, r] (r <= D: the first r dims rotate,
    `rotate_half` convention, the rest pass), in its order of operations."""
    c, s = cos[:, None, :], sin[:, None, :]
    r = c.shape[-1]
    part = x if r == x.shape[-1] else x[..., :r]
    half = r // 2
    out = (part * c) + (torch.cat((-part[..., half:], part[..., :half]), dim=-1) * s)
    return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)


def reference_rope_store(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm=None, k_norm=None) -> torch.Tensor:
    if q_norm is not None:
        q, k = reference_rms_norm(q, *q_norm), reference_rms_norm(k, *k_norm)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)
    return q


def reference_act_mul(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    if act == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


# ------------------------------------------------------------------------------ the compiled CPU ops


def _scale(weight: torch.Tensor, style: NormStyle) -> torch.Tensor:
    """The weight the compiled norm multiplies by: Gemma's (offset + weight), made once per weight (a norm
    runs ~4 times a layer a step) and again only if the weight is written in place (its version moves).
    In fp32, the only dtype the compiled ops take an offset in, it is the reference's (offset + weight)."""
    if not style.offset:
        return weight
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor keeps no version: it is not written in place outside inference
        version = None
    hit = getattr(weight, "svrmad_offset_scale", None)  # (version, offset, scale), kept on the weight itself
    if hit is None or hit[:2] != (version, style.offset):
        hit = (version, style.offset, weight + style.offset)
        weight.svrmad_offset_scale = hit
    return hit[2]


def _cpp_rms_norm(x, weight, eps, style: NormStyle = PLAIN):
    x = summed(x)
    if x.dtype != torch.float32 and style != PLAIN:  # another rounding than the kernel's: the reference
        return reference_rms_norm(x, weight, eps, style)
    return cpu_ops.rms_norm(x, _scale(weight, style), eps)


def _cpp_add_rms_norm(x, residual, weight, eps, style: NormStyle = PLAIN):
    x = summed(x)
    if x.dtype != torch.float32 and style != PLAIN:
        return reference_add_rms_norm(x, residual, weight, eps, style)
    return cpu_ops.add_rms_norm(x.contiguous(), residual.contiguous(), _scale(weight, style), eps)


def _cpp_rope_store(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm=None, k_norm=None):
    if cos.shape[-1] != q.shape[-1] or k_cache.dtype != q.dtype:  # partial rotary, or a cache of another dtype
        return reference_rope_store(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm, k_norm)
    if q_norm is not None:
        q, k = _cpp_rms_norm(q, *q_norm), _cpp_rms_norm(k, *k_norm)
    return cpu_ops.rope_store(q, k, v, cos, sin, k_cache, v_cache, slots)


def _cpp_act_mul(gate, up, act: str = "silu"):
    if act != "silu" or not cpu_ops.silu_mul_is_torchs(gate, up):  # (GELU-tanh has no C++ op)
        return reference_act_mul(gate, up, act)
    return cpu_ops.silu_mul(gate, up)


# ------------------------------------------------------------------------------ the choice


class Ops:
    """The fused ops bound for tensors of one device and dtype, each the implementation a call there
    takes, chosen once: `impl` ("cpp", "triton" or "torch") and, where the reference runs, `why`."""

    def __init__(self, device, dtype: torch.dtype, kernel_impl: str = "auto"):
        device = torch.device(device)
        self.device, self.dtype = device, dtype
        self.impl, self.why = _choose(device, dtype, kernel_impl)
        self.kernel_impl = kernel_impl
        self.rms_norm, self.add_rms_norm = reference_rms_norm, reference_add_rms_norm
        self.rope_store, self.act_mul = reference_rope_store, reference_act_mul
        if self.impl == "cpp":
            self.rms_norm, self.add_rms_norm, self.rope_store = _cpp_rms_norm, _cpp_add_rms_norm, _cpp_rope_store
            self.act_mul = _cpp_act_mul
        elif self.impl == "triton":
            from . import fused_triton as t

            self.rms_norm, self.add_rms_norm, self.rope_store, self.act_mul = (
                _guarded(name, getattr(t, name), globals()["reference_" + name], kernel_impl)
                for name in ("rms_norm", "add_rms_norm", "rope_store", "act_mul"))

    def describe(self) -> str:
        """One phrase for the record: which implementation runs, and why the reference where it does."""
        if self.impl == "cpp":
            return "compiled CPU ops (kernels/cpu_ops.py; GELU-tanh: torch)"
        if self.impl == "triton":
            return "Triton (kernels/fused_triton.py)"
        return f"torch reference ({self.why})"


def _guarded(name: str, fast, reference, kernel_impl: str):
    """`fast` (a Triton op) until it raises; under "auto" its reference from then on, said once
    (kernels._backend.fall_back: an explicit "triton", or a failure while a graph is captured, raises)."""
    state = {"on": True}

    def call(*args):
        if state["on"]:
            try:
                return fast(*args)
            except Exception as err:  # a compile error on an untested GPU, say
                fall_back("fused_" + name, err, kernel_impl)
                state["on"] = False
        return reference(*args)

    return call


def _choose(device: torch.device, dtype: torch.dtype, kernel_impl: str) -> tuple[str, str | None]:
    if device.type == "cpu" and kernel_impl != "triton":
        c = choose(kernel_impl, device, cpu_ops.NAME)
        if c.impl == "cpp" and dtype not in cpu_ops.DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in cpu_ops.DTYPES)
            return "torch", f"the compiled CPU ops take {names}, not {str(dtype).removeprefix('torch.')}"
        if c.impl == "cpp" or kernel_impl == "torch":
            return c.impl, c.why
        return "torch", f"the fused CPU ops are unavailable: {c.why}"
    c = choose(kernel_impl, device, "fused_ops")
    if c.impl != "triton":
        return "torch", c.why
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "torch", f"{dtype} (the Triton ops take fp32, bf16 and fp16)"
    try:
        from . import fused_triton  # noqa: F401
    except ImportError as exc:
        if kernel_impl == "triton":
            raise
        return "torch", f"kernels/fused_triton.py cannot load: {exc}"
    return "triton", None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: NormStyle = PLAIN) -> torch.Tensor:
    """RMSNorm over the last dimension, any leading shape."""
    return Ops(x.device, x.dtype).rms_norm(x, weight, eps, style)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 style: NormStyle = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) for [rows, hidden] tensors."""
    return Ops(x.device, x.dtype).add_rms_norm(x, residual, weight, eps, style)


def rope_store(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm=None, k_norm=None) -> torch.Tensor:
    """q [T, H, D], k [T, KVH, D], v [T, KVH, Dv]; cos/sin [T, r], r <= D; caches [slots, KVH, D|Dv];
    slots [T] int64; q_norm/k_norm: None or (weight [D], eps, NormStyle), applied per head first. Returns
    the rotated q; the rotated k and v are written to rows `slots` of the caches."""
    return Ops(q.device, q.dtype).rope_store(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm, k_norm)


def act_mul(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up, act one of ACTS."""
    return Ops(gate.device, gate.dtype).act_mul(gate, up, act)
