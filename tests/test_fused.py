"""The fused ops of a decoder layer (kernels/fused.py): each torch reference is transformers' own formula
bit for bit (so where it runs, our decoder equals the modules without any swap); the compiled CPU ops
are the reference within fp32 rounding for norms and bitwise for RoPE and the cache write; the choice of
implementation is made per device and dtype and says why."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb as gpt_oss_rope
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope
from transformers.activations import ACT2FN

from svrmad_local.engine.families import rope_latent
from svrmad_local.kernels import cpu_ops, fused
from svrmad_local.kernels.fused import CAST_LAST, GEMMA, PLAIN, Ops

NORMS = [(LlamaRMSNorm, PLAIN), (GptOssRMSNorm, CAST_LAST), (Gemma3RMSNorm, GEMMA)]
cpp = pytest.mark.skipif(not cpu_ops.available(), reason=f"no fused CPU ops: {cpu_ops.unavailable_reason()}")


def angles(T: int, r: int, seed: int = 0):
    half = torch.randn(T, r // 2, generator=torch.Generator().manual_seed(seed)) * 30
    full = torch.cat([half, half], -1)
    return full.cos(), full.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls,style", NORMS)
def test_the_norm_reference_is_each_familys_module_bit_for_bit(cls, style, dtype):
    torch.manual_seed(0)
    norm = cls(64, eps=1e-6)
    norm.weight.data = torch.randn(64) * (0.3 if style.offset else 1.0)
    norm = norm.to(dtype) if cls is not GptOssRMSNorm else norm  # GPT-OSS keeps its norms in fp32
    x = (torch.randn(7, 64) * 3).to(dtype)
    want = norm(x)
    assert torch.equal(fused.reference_rms_norm(x, norm.weight, 1e-6, style), want)
    res = torch.randn(7, 64).to(dtype)
    y, s = fused.reference_add_rms_norm(x, res, norm.weight, 1e-6, style)
    assert torch.equal(s, res + x) and torch.equal(y, norm(res + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rope_reference_is_transformers_rope_bit_for_bit(dtype):
    """Full rotary (Llama...), partial (Phi-3), GPT-OSS's half-width tables (doubled: its pairing is
    rotate_half's), and DeepSeek's interleaved pairs (engine/families.rope_latent)."""
    torch.manual_seed(1)
    T, H, D = 5, 4, 16
    q, k = (torch.randn(T, H, D) * 4).to(dtype), (torch.randn(T, 2, D) * 4).to(dtype)
    cos, sin = (t.to(dtype) for t in angles(T, D))
    tr = lambda t: t[None].transpose(1, 2)  # noqa: E731  [T, H, D] -> transformers' [1, H, T, D]
    back = lambda t: t[0].transpose(0, 1)  # noqa: E731
    q_ref, k_ref = apply_rotary_pos_emb(tr(q), tr(k), cos[None], sin[None])
    assert torch.equal(fused.rotate(q, cos, sin), back(q_ref)) and torch.equal(fused.rotate(k, cos, sin), back(k_ref))
    pc, ps = (t.to(dtype) for t in angles(T, 10))  # partial: 10 of 16 dims rotate
    q_ref, _ = phi3_rope(tr(q), tr(k), pc[None], ps[None])
    assert torch.equal(fused.rotate(q, pc, ps), back(q_ref))
    half_c, half_s = cos[:, : D // 2], sin[:, : D // 2]
    q_ref, _ = gpt_oss_rope(tr(q), tr(k), half_c[None], half_s[None])
    assert torch.equal(fused.rotate(q, torch.cat([half_c, half_c], -1), torch.cat([half_s, half_s], -1)), back(q_ref))
    q_ref, k_ref = apply_rotary_pos_emb_interleave(tr(q), tr(k[:, :1]), cos[None], sin[None])
    assert torch.equal(rope_latent(q, cos, sin, True), back(q_ref))
    assert torch.equal(rope_latent(k[:, :1], cos, sin, True), back(k_ref))
    assert torch.equal(rope_latent(q, cos, sin, False), fused.rotate(q, cos, sin))


@pytest.mark.parametrize("act,name", [("silu", "silu"), ("gelu_tanh", "gelu_pytorch_tanh")])
def test_act_mul_is_the_mlps_activation_times_up(act, name):
    gate, up = torch.randn(6, 40) * 3, torch.randn(6, 40)
    assert torch.equal(fused.act_mul(gate, up, act), ACT2FN[name](gate) * up)


@cpp
@pytest.mark.parametrize("hidden", [64, 576, 13])
@pytest.mark.parametrize("cls,style", NORMS)
def test_the_compiled_norm_is_the_reference_within_rounding_and_each_row_alone(hidden, cls, style):
    torch.manual_seed(2)
    w = torch.randn(hidden) * (0.3 if style.offset else 1.0)
    x, res = torch.randn(9, hidden) * 3, torch.randn(9, hidden)
    ops = Ops("cpu", torch.float32)
    assert ops.impl == "cpp"
    ours, ref = ops.rms_norm(x, w, 1e-5, style), fused.reference_rms_norm(x, w, 1e-5, style)
    assert ((ours - ref).abs() / ref.abs().clamp_min(1e-3)).max() < 1e-5
    for i in range(9):  # a row's bits do not depend on the rows beside it
        assert torch.equal(ops.rms_norm(x[i : i + 1], w, 1e-5, style), ours[i : i + 1])
    y, s = ops.add_rms_norm(x, res, w, 1e-5, style)
    assert torch.equal(s, res + x) and torch.equal(y, ops.rms_norm(res + x, w, 1e-5, style))
    assert torch.equal(ops.rms_norm(x.view(3, 3, hidden), w, 1e-5, style), ours.view(3, 3, hidden))


@cpp
def test_the_compiled_rope_store_is_the_reference_bit_for_bit():
    """The compiled op from column slices of one fused q/k/v output (as the decoder passes them), with and
    without q/k norms: the same rotated q, the same rows written to the caches and no others."""
    torch.manual_seed(3)
    T, H, KVH, D = 5, 6, 2, 16
    qkv = torch.randn(T, (H + 2 * KVH) * D) * 4
    q, k, v = (qkv[:, a:b].view(T, -1, D) for a, b in ((0, H * D), (H * D, (H + KVH) * D), ((H + KVH) * D, None)))
    cos, sin = angles(T, D, 4)
    slots = torch.tensor([3, 7, 1, 11, 0])
    norm = (torch.randn(D), 1e-6, PLAIN)
    ops = Ops("cpu", torch.float32)
    for q_norm in (None, norm):
        caches = [torch.zeros(12, KVH, D) for _ in range(4)]
        got = ops.rope_store(q, k, v, cos, sin, caches[0], caches[1], slots, q_norm, q_norm)
        qn, kn = (q, k) if q_norm is None else (ops.rms_norm(q, *norm), ops.rms_norm(k, *norm))
        want = fused.reference_rope_store(qn, kn, v, cos, sin, caches[2], caches[3], slots)
        assert torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        untouched = torch.ones(12, dtype=torch.bool)
        untouched[slots] = False
        assert not caches[0][untouched].any() and not caches[1][untouched].any()
    kc = torch.zeros(12, KVH, D)
    with pytest.raises(RuntimeError, match="slot 12 outside the cache's 12 rows"):
        cpu_ops.rope_store(q, k, v, cos, sin, kc, kc.clone(), torch.tensor([3, 7, 1, 12, 0]))
    pc, ps = angles(T, 10)  # partial rotary: the reference runs it
    caches = [torch.zeros(12, KVH, D) for _ in range(4)]
    got = ops.rope_store(q, k, v, pc, ps, caches[0], caches[1], slots)
    assert torch.equal(got, fused.reference_rope_store(q, k, v, pc, ps, caches[2], caches[3], slots))


def test_the_choice_is_made_per_device_and_dtype_and_says_why(monkeypatch):
    bf16 = Ops("cpu", torch.bfloat16)
    if torch.bfloat16 not in cpu_ops.DTYPES:
        assert bf16.impl == "torch" and bf16.why == "the compiled CPU ops take float32, not bfloat16"
        assert bf16.rms_norm is fused.reference_rms_norm
    forced = Ops("cpu", torch.float32, kernel_impl="torch")
    assert forced.impl == "torch" and forced.why == "kernel_impl='torch'"
    monkeypatch.setenv("SVRMAD_CPU_OPS", "0")
    off = Ops("cpu", torch.float32)
    assert off.impl == "torch" and off.why == "the fused CPU ops are unavailable: SVRMAD_CPU_OPS=0"
    assert "torch reference (the fused CPU ops are unavailable: SVRMAD_CPU_OPS=0)" == off.describe()
    meta = Ops("meta", torch.float32)
    assert meta.impl == "torch" and meta.why


def _interpreter():
    from svrmad_local.kernels import _backend

    if not (_backend.HAS_TRITON and _backend.interpreter_ready()):
        pytest.skip("Triton's interpreter is not available in this process")
    return Ops("cpu", torch.float32, kernel_impl="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_ops_are_the_references_under_the_interpreter(dtype):
    """kernels/fused_triton.py on CPU tensors in Triton's interpreter: the residual add, RoPE and the cache
    writes bit for bit (no FMA contraction; bf16 rounded to nearest even by hand, as torch rounds); the norms
    and the activations within rounding (a tree sum, exp)."""
    assert _interpreter().impl == "triton"
    ops = Ops("cpu", dtype, kernel_impl="triton")
    torch.manual_seed(5)
    close = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for style in (PLAIN, CAST_LAST, GEMMA):
        x, res, w = (torch.randn(7, 64) * 3).to(dtype), torch.randn(7, 64).to(dtype), torch.randn(64).to(dtype)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6, style), fused.reference_rms_norm(x, w, 1e-6, style), **close)
        y, s = ops.add_rms_norm(x, res, w, 1e-6, style)
        y_ref, s_ref = fused.reference_add_rms_norm(x, res, w, 1e-6, style)
        assert torch.equal(s, s_ref)
        torch.testing.assert_close(y, y_ref, **close)
    T, H, KVH, D = 5, 6, 2, 16
    qkv = (torch.randn(T, (H + 2 * KVH) * D) * 4).to(dtype)
    q, k, v = (qkv[:, a:b].view(T, -1, D) for a, b in ((0, H * D), (H * D, (H + KVH) * D), ((H + KVH) * D, None)))
    slots = torch.tensor([3, 7, 1, 11, 0])
    for r in (D, 10):  # full and partial rotary
        cos, sin = (t.to(dtype) for t in angles(T, r, 6))
        for norm in (None, (torch.randn(D).to(dtype), 1e-6, PLAIN), (torch.randn(D).to(dtype), 1e-6, GEMMA)):
            caches = [torch.zeros(12, KVH, D, dtype=dtype) for _ in range(4)]
            got = ops.rope_store(q, k, v, cos, sin, caches[0], caches[1], slots, norm, norm)
            want = fused.reference_rope_store(q, k, v, cos, sin, caches[2], caches[3], slots, norm, norm)
            assert torch.equal(caches[1], caches[3])  # v copied
            if norm is None or dtype == torch.bfloat16:
                assert torch.equal(got, want) and torch.equal(caches[0], caches[2]), (r, norm)
            else:  # the head's norm sums in another order
                torch.testing.assert_close(got, want, **close)
                torch.testing.assert_close(caches[0], caches[2], **close)
    gate, up = (torch.randn(4, 40) * 3).to(dtype), torch.randn(4, 40).to(dtype)
    for act in ("silu", "gelu_tanh"):
        torch.testing.assert_close(ops.act_mul(gate, up, act), fused.reference_act_mul(gate, up, act), **close)


def test_a_failing_triton_op_falls_back_to_its_reference_once(monkeypatch):
    """Under "auto" a Triton op that raises (a compile error on an untested GPU) is said once and served by
    its reference from then on; asked for explicitly, it raises."""
    from svrmad_local.kernels import _backend

    monkeypatch.setattr(_backend, "_disabled", {})
    calls = []

    def broken(*a):
        calls.append(1)
        raise RuntimeError("compile error (injected)")

    op = fused._guarded("rms_norm", broken, fused.reference_rms_norm, "auto")
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.warns(RuntimeWarning, match="fused_rms_norm"):
        assert torch.equal(op(x, w, 1e-6, PLAIN), fused.reference_rms_norm(x, w, 1e-6))
    assert torch.equal(op(x, w, 1e-6, PLAIN), fused.reference_rms_norm(x, w, 1e-6)) and len(calls) == 1
    assert "fused_rms_norm" in _backend.disabled()
    with pytest.raises(RuntimeError, match="injected"):
        fused._guarded("rms_norm", broken, fused.reference_rms_norm, "triton")(x, w, 1e-6, PLAIN)


@cpp
def test_gemmas_offset_weight_is_made_once_and_again_when_the_weight_is_written():
    """The compiled norm multiplies by (1 + weight) for Gemma: made once per weight rather than every call
    (~4 norms a layer a step), and made again if the weight changes in place (never a stale scale)."""
    ops = Ops("cpu", torch.float32)
    torch.manual_seed(3)
    x, w = torch.randn(4, 64), torch.randn(64)
    first = ops.rms_norm(x, w, 1e-6, GEMMA)
    scale = w.svrmad_offset_scale[2]
    assert torch.equal(ops.rms_norm(x, w, 1e-6, GEMMA), first) and w.svrmad_offset_scale[2] is scale
    torch.testing.assert_close(first, fused.reference_rms_norm(x, w, 1e-6, GEMMA), atol=1e-6, rtol=1e-5)
    w.mul_(2)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6, GEMMA), fused.reference_rms_norm(x, w, 1e-6, GEMMA),
                               atol=1e-6, rtol=1e-5)
    assert w.svrmad_offset_scale[2] is not scale
