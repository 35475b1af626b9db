"""kernels/fused_triton.py (the decoder's small ops on a GPU) against kernels/fused.py's torch references,
run on the CPU by Triton's interpreter, and in the engine: the same greedy tokens as the references.

What is held exactly, and what within rounding (the kernels' docstring says why):
- bitwise, fp32 and bf16: the residual add, RoPE and the K/V cache write (q/k norms off), and the rows of
  the cache no slot names (untouched);
- within rounding: an RMSNorm differs from the reference only through its sum of squares: within 4 fp32
  ulps of the value (fp32), one bf16 ulp (bf16); where q/k norms precede RoPE, that difference goes
  through RoPE's products: within 4 ulps of the row's largest value. The activations go through exp (GELU's
  tanh written with exp): 4 fp32 ulps, one bf16 ulp, of |gate| * |up| (where GELU's output is tiny, the
  reference's 1 + tanh(z) cancels, and the kernel's x / (1 + exp(-2z)) does not);
- bf16 keeps the reference's roundings: at most 1% of the elements differ at all (a few fp32 ulps move a
  bf16 rounding only for a value that close to a rounding boundary), GELU excepted (see above);
- bf16: no further from an fp64 truth (the same formula in float64 on the same bf16 inputs) than the
  reference is, in mean absolute error (within 1%).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (see conftest)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from svrmad_local.engine.engine import Engine, EngineConfig  # noqa: E402
from svrmad_local.engine.params import SamplingParams  # noqa: E402
from svrmad_local.kernels import fused  # noqa: E402
from svrmad_local.kernels._backend import interpreter_ready  # noqa: E402
from svrmad_local.kernels.fused import CAST_LAST, GEMMA, PLAIN  # noqa: E402

from . import model_zoo  # noqa: E402
from .model_zoo import loop_greedy, make_zoo_model, rand_prompt  # noqa: E402

pytestmark = [pytest.mark.skipif(not interpreter_ready(), reason="triton was imported before TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore:overflow encountered in exp")]  # numpy's exp(88+) = inf, meant
if interpreter_ready():
    from svrmad_local.kernels import fused_triton as ft

STYLES = {"plain": PLAIN, "cast_last": CAST_LAST, "gemma": GEMMA}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ULPS = {torch.float32: 4, torch.bfloat16: 1}  # the stated rounding, in units of the dtype's eps


def within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float, scale: torch.Tensor | None = None,
                differing: float = 0.01) -> None:
    """|got - want| <= ulps * eps(dtype) * scale (default |want|), the same dtype and shape, and in bf16 at
    most a fraction `differing` of the elements differ at all."""
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = torch.finfo(want.dtype).eps
    scale = want.double().abs() if scale is None else scale
    err = (got.double() - want.double()).abs()
    bound = ulps * eps * scale + torch.finfo(want.dtype).tiny
    assert bool((err <= bound).all()), f"{(err / bound).max().item():.2f}x the bound of {ulps} ulps"
    if want.dtype == torch.bfloat16:
        assert (got != want).double().mean() <= differing, f"{(got != want).double().mean():.1%} of the elements differ"


def no_further_from_truth(got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor) -> None:
    """bf16: the kernel's mean |error| against an fp64 truth is at most the reference's (within 1%)."""
    ours, theirs = (got.double() - truth).abs().mean(), (want.double() - truth).abs().mean()
    assert ours <= 1.01 * theirs + 1e-12, (ours.item(), theirs.item())


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------ RMSNorm


def norm64(x: torch.Tensor, weight: torch.Tensor, eps: float, style) -> torch.Tensor:
    h = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    return h * (style.offset + weight.double())


def norm_case(rows: int, hidden: int, dtype, seed: int):
    g = gen(seed)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    res = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (torch.randn(hidden, generator=g) * 0.3 + 1).to(dtype)
    return x, res, w


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("style", STYLES.values(), ids=STYLES.keys())
@pytest.mark.parametrize("rows,hidden", [(1, 2048), (1, 300), (37, 96), (5, 1000)])
def test_rms_norm_is_the_reference_within_its_sums_rounding(dtype, style, rows, hidden):
    """Hidden sizes on and off a power of two (the block's edge), one row and many, every NormStyle."""
    x, _, w = norm_case(rows, hidden, dtype, rows * hidden)
    got, want = ft.rms_norm(x, w, 1e-6, style), fused.reference_rms_norm(x, w, 1e-6, style)
    within_ulps(got, want, ULPS[dtype])
    if dtype == torch.bfloat16:
        no_further_from_truth(got, want, norm64(x, w, 1e-6, style))
    for i in (0, rows - 1):  # a row's bits do not depend on the rows beside it
        assert torch.equal(ft.rms_norm(x[i:i + 1], w, 1e-6, style), got[i:i + 1])


def test_rms_norm_reads_views_and_keeps_leading_dimensions():
    """A column slice of a wider output (DeepSeek's latent beside its RoPE key) is read through its row
    stride; any leading shape comes back as it went in."""
    x, _, w = norm_case(6, 40, torch.float32, 3)
    wide = torch.cat([x, torch.randn(6, 8, generator=gen(4))], dim=1)
    view = wide[:, :40]
    assert not view.is_contiguous()
    got = ft.rms_norm(view, w, 1e-5, PLAIN)
    assert torch.equal(got, ft.rms_norm(x, w, 1e-5, PLAIN)) and got.is_contiguous()
    assert torch.equal(ft.rms_norm(x.view(2, 3, 40), w, 1e-5, PLAIN), got.view(2, 3, 40))
    assert ft.rms_norm(x[:0], w, 1e-5, PLAIN).shape == (0, 40)
    with pytest.raises(ValueError, match=r"rms_norm: weight \[41\] does not fit x \[6, 40\]"):
        ft.rms_norm(x, torch.ones(41), 1e-5, PLAIN)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("style", STYLES.values(), ids=STYLES.keys())
@pytest.mark.parametrize("rows,hidden", [(1, 2048), (3, 300), (33, 1000)])
def test_add_rms_norm_adds_bitwise_and_norms_as_rms_norm(dtype, style, rows, hidden):
    x, res, w = norm_case(rows, hidden, dtype, 7 * rows + hidden)
    x0, res0 = x.clone(), res.clone()
    got, s = ft.add_rms_norm(x, res, w, 1e-5, style)
    want, s_ref = fused.reference_add_rms_norm(x, res, w, 1e-5, style)
    assert torch.equal(s, s_ref) and s.dtype == s_ref.dtype
    assert torch.equal(got, ft.rms_norm(s, w, 1e-5, style))  # one pass computes what two would
    within_ulps(got, want, ULPS[dtype])
    if dtype == torch.bfloat16:
        no_further_from_truth(got, want, norm64(s_ref, w, 1e-5, style))
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("style", STYLES.values(), ids=STYLES.keys())
def test_a_linears_unsummed_shares_norm_as_their_sum(dtype, style):
    """A split-K linear's fp32 partials (kernels/shares.py) handed to the norms: summed in share order as they
    are loaded, the same bits as summing them first (what skinny's sum kernel writes) and norming that, in the
    kernel, the torch reference and the compiled CPU ops alike; the new residual too."""
    from svrmad_local.kernels import cpu_ops
    from svrmad_local.kernels.shares import Shares

    _, res, w = norm_case(5, 300, dtype, 11)
    parts = torch.randn(3, 5, 300, generator=gen(12)) * 2
    shares = Shares(parts, dtype)
    total = shares.total()
    assert total.dtype == dtype and torch.equal(total, (parts[0] + parts[1] + parts[2]).to(dtype))
    impls = [(ft.rms_norm, ft.add_rms_norm), (fused.reference_rms_norm, fused.reference_add_rms_norm)]
    if cpu_ops.available() and dtype in cpu_ops.DTYPES:
        impls.append((fused._cpp_rms_norm, fused._cpp_add_rms_norm))
    for rms, add in impls:
        assert torch.equal(rms(shares, w, 1e-5, style), rms(total, w, 1e-5, style)), rms
        got, new = add(shares, res, w, 1e-5, style)
        want, new_ref = add(total, res, w, 1e-5, style)
        assert torch.equal(got, want) and torch.equal(new, new_ref), add
    with pytest.raises(ValueError, match="fp32 \\[shares, rows, columns\\]"):
        Shares(parts[0], dtype)


# ------------------------------------------------------------------------------ RoPE + cache write


def rope_case(T, H, KVH, D, rot, dtype, norm, seed, cache_rows=40):
    """q/k/v as column views of one q/k/v GEMM output (how the decoder passes them), cos/sin of the first
    `rot` dimensions at scattered positions, caches full of values the call must not touch, slots
    scattered (a random permutation's first T)."""
    g = gen(seed)
    qkv = (torch.randn(T, (H + 2 * KVH) * D, generator=g) * 2).to(dtype)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).double() / rot))
    ang = torch.randint(0, 4000, (T, 1), generator=g).double() * inv
    cos, sin = (torch.cat([f(ang)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    kc = torch.randn(cache_rows, KVH, D, generator=g).to(dtype)
    vc = torch.randn(cache_rows, KVH, D, generator=g).to(dtype)
    slots = torch.randperm(cache_rows, generator=g)[:T]
    norms = (None, None)
    if norm is not None:
        norms = tuple((torch.randn(D, generator=g).to(dtype) * 0.3 + (0 if norm.offset else 1), 1e-6, norm)
                      for _ in range(2))
    return q, k, v, cos, sin, kc, vc, slots, *norms


def rope64(x, cos, sin, norm):
    """The reference's formula in float64, no intermediate rounding."""
    x = x.double()
    if norm is not None:
        x = norm64(x, norm[0], norm[1], norm[2])
    return fused.rotate(x, cos.double(), sin.double())


ROPE_SHAPES = {  # (T, H, KVH, D, rotated dimensions)
    "decode-gqa-128": (1, 16, 8, 128, 128),
    "batch-gqa-64": (5, 8, 2, 64, 64),
    "mqa-partial-half": (3, 6, 1, 64, 32),
    "mha-partial-3/4": (4, 6, 6, 128, 96),  # heads in blocks of 4 at 128 dims: a full block and a masked one
    "many-rows-odd-heads": (17, 3, 3, 64, 64),
}
NORMS = {"off": None, "plain": PLAIN, "gemma": GEMMA}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("norm", NORMS.values(), ids=NORMS.keys())
@pytest.mark.parametrize("shape", ROPE_SHAPES.values(), ids=ROPE_SHAPES.keys())
def test_rope_store_is_the_reference_and_writes_only_its_slots(dtype, norm, shape):
    T, H, KVH, D, rot = shape
    q, k, v, cos, sin, kc, vc, slots, qn, kn = rope_case(T, H, KVH, D, rot, dtype, norm, sum(shape))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    got = ft.rope_store(q, k, v, cos, sin, kc, vc, slots, qn, kn)
    want = fused.reference_rope_store(q, k, v, cos, sin, kc_ref, vc_ref, slots, qn, kn)
    assert torch.equal(vc, vc_ref)  # v copied; every row no slot names as it was
    untouched = torch.ones(kc.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(kc[untouched], kc_ref[untouched])
    if norm is None:
        assert torch.equal(got, want) and torch.equal(kc, kc_ref)
    else:  # the norm's sum moves a value by its rounding; RoPE carries that at the row's scale
        for mine, ref in ((got, want), (kc[slots], kc_ref[slots])):
            scale = ref.double().abs().amax(-1, keepdim=True).expand_as(ref)
            within_ulps(mine, ref, 4 * ULPS[dtype], scale)
    if dtype == torch.bfloat16:
        no_further_from_truth(got, want, rope64(q, cos, sin, qn))
        no_further_from_truth(kc[slots], kc_ref[slots], rope64(k, cos, sin, kn))


def test_rope_store_refuses_what_does_not_fit_in_one_line():
    q, k, v, cos, sin, kc, vc, slots, qn, kn = rope_case(3, 4, 2, 64, 64, torch.float32, PLAIN, 1)
    with pytest.raises(ValueError, match=r"cos \[3, 63\] and sin \[3, 63\] must be \[T=3, r\] with r even"):
        ft.rope_store(q, k, v, cos[:, :63], sin[:, :63], kc, vc, slots)
    with pytest.raises(ValueError, match=r"slots must be an int tensor \[T=3\]"):
        ft.rope_store(q, k, v, cos, sin, kc, vc, slots.float())
    with pytest.raises(ValueError, match="caches .* do not fit k"):
        ft.rope_store(q, k, v, cos, sin, kc[:, :1], vc, slots)
    with pytest.raises(ValueError, match="q_norm and k_norm go together"):
        ft.rope_store(q, k, v, cos, sin, kc, vc, slots, qn, None)
    with pytest.raises(ValueError, match="fp32, bf16 and fp16"):
        ft.rope_store(q.double(), k, v, cos, sin, kc, vc, slots)


# ------------------------------------------------------------------------------ act(gate) * up


def act64(gate, up, act):
    g = gate.double()
    if act == "silu":
        return g * torch.sigmoid(g) * up.double()
    return 0.5 * g * (1 + torch.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) * up.double()


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("act", fused.ACTS)
@pytest.mark.parametrize("rows,inter", [(1, 6144), (3, 1500), (17, 300)])  # tiles of 1,024 columns
def test_act_mul_reads_the_halves_of_one_gate_up_output(dtype, act, rows, inter):
    """gate and up as the two column halves of one [rows, 2I] GEMM output (non-contiguous views, as the
    decoder passes them); the output is a new contiguous [rows, I]."""
    gate_up = (torch.randn(rows, 2 * inter, generator=gen(rows + inter)) * 4).to(dtype)
    gate, up = gate_up.split([inter, inter], dim=-1)
    assert gate.stride(0) == up.stride(0) == 2 * inter
    got, want = ft.act_mul(gate, up, act), fused.reference_act_mul(gate, up, act)
    assert got.is_contiguous()
    within_ulps(got, want, ULPS[dtype], gate.double().abs() * up.double().abs(), 0.01 if act == "silu" else 1.0)
    if dtype == torch.bfloat16:
        no_further_from_truth(got, want, act64(gate, up, act))
    assert torch.equal(ft.act_mul(gate.contiguous(), up.contiguous(), act), got)
    assert torch.equal(ft.act_mul(gate.view(rows, 1, inter), up.view(rows, 1, inter), act), got.view(rows, 1, inter))


def test_act_mul_refuses_an_unknown_activation():
    x = torch.ones(2, 4)
    with pytest.raises(ValueError, match="act must be one of silu, gelu_tanh, got 'relu'"):
        ft.act_mul(x, x, "relu")
    with pytest.raises(ValueError, match=r"gate \[2, 4\] and up \[2, 3\] differ"):
        ft.act_mul(x, x[:, :3], "silu")


# ------------------------------------------------------------------------------ in the engine


def test_ops_on_cpu_tensors_bind_the_triton_kernels_when_asked(monkeypatch):
    """Each of Ops' four ops calls its Triton kernel (through the guard that falls back under "auto")."""
    called = []
    for name in ("rms_norm", "add_rms_norm", "rope_store", "act_mul"):
        monkeypatch.setattr(ft, name, lambda *a, _n=name: called.append(_n))
    ops = fused.Ops("cpu", torch.float32, "triton")
    assert ops.impl == "triton" and ops.describe() == "Triton (kernels/fused_triton.py)"
    ops.rms_norm(1), ops.add_rms_norm(2), ops.rope_store(3), ops.act_mul(4)
    assert called == ["rms_norm", "add_rms_norm", "rope_store", "act_mul"]


def engine(model, **kw):
    return Engine(model, None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4, decoder="ours", **kw))


def partial_rotary_phi3(monkeypatch):
    """Phi-3 rotating half of each head's dimensions (partial_rotary_factor 0.5: Phi-3-small's and
    Phi-4-mini's kind), the zoo's Phi-3 otherwise."""
    cfg = model_zoo._config("phi3-sliding")
    cfg.rope_parameters["partial_rotary_factor"] = 0.5
    monkeypatch.setattr(model_zoo, "_config", lambda name: cfg)
    model = make_zoo_model("phi3-sliding")
    assert 4 * model.model.rotary_emb.inv_freq.numel() == model.model.layers[0].self_attn.head_dim  # r = D / 2
    return model


# the dense families, Phi-3 with partial rotary, and two with MoE blocks for what else they hold: GPT-OSS's
# CAST_LAST norms and half-width cos/sin, DeepSeek-V3's norms over column views of its latent projections
FAMILIES = ["llama", "qwen2-sliding", "qwen3", "mistral-sliding", "phi3-sliding", "phi3-partial-rotary", "gemma3",
            "gpt-oss", "deepseek-v3"]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_decoder_on_the_triton_ops_gives_the_references_greedy_tokens(name, monkeypatch):
    """Our decoder with kernel_impl="triton" (every fused op a Triton kernel, in the interpreter): the
    greedy tokens of the same decoder on the torch references (and their log-probs within 1e-4), and of a
    cache-free loop over the model's own modules (a separate copy: the engine swaps the norms of the model
    it runs)."""
    make = (lambda: partial_rotary_phi3(monkeypatch)) if name == "phi3-partial-rotary" else lambda: make_zoo_model(name)
    prompts = [rand_prompt(n, 40 + n) for n in (3, 11)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    truth = [loop_greedy(make(), p, 6) for p in prompts]
    runs = {}
    for impl in ("torch", "triton"):
        eng = engine(make(), kernel_impl=impl)
        want = "Triton (kernels/fused_triton.py)" if impl == "triton" else "torch reference"
        assert eng.info["decoder"].startswith("ours") and want in eng.info["decoder"], eng.info["decoder"]
        runs[impl] = [o.completions[0] for o in eng.generate_sync(prompts, params)]
    assert [c.token_ids for c in runs["triton"]] == [c.token_ids for c in runs["torch"]] == truth
    for ours, ref in zip(runs["triton"], runs["torch"]):
        assert ours.logprobs == pytest.approx(ref.logprobs, abs=1e-4)


# ------------------------------------------------------------------------------ compiled for a GPU

# Run in a fresh interpreter without TRITON_INTERPRET: the host functions run on CPU tensors at the shapes
# below, each launch is recorded instead of run (its arguments typed and specialised as Triton's launcher
# does: ints equal to 1 become constants, 16-aligned pointers and multiples of 16 get divisibility hints)
# and compiled for an H100 (sm_90) down to a cubin by Triton's bundled ptxas. No GPU needed.
COMPILE_FOR_SM90 = r'''
import inspect, os, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from svrmad_local.kernels import fused, fused_triton as ft
from svrmad_local.kernels.fused import CAST_LAST, GEMMA, PLAIN

NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32"}
ptx = []

class Compile:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kw):
            names = self.fn.arg_names
            values = dict(zip(names, args), **{k: kw.pop(k) for k in list(kw) if k in names})
            for name, p in inspect.signature(self.fn.fn).parameters.items():  # a flag left at its default (PDL)
                if name not in values and p.default is not p.empty:
                    values[name] = p.default
            sig, consts, attrs = {}, {}, {}
            for i, (name, p) in enumerate(zip(names, self.fn.params)):
                v = values[name]
                if p.is_constexpr or (type(v) is int and v == 1):
                    sig[name], consts[name] = "constexpr", v
                elif torch.is_tensor(v):
                    sig[name] = "*" + NAMES[v.dtype]
                    if v.data_ptr() % 16 == 0:
                        attrs[(i,)] = [["tt.divisibility", 16]]
                elif type(v) is int:
                    sig[name] = "i32" if abs(v) < 2**31 else "i64"
                    if v % 16 == 0:
                        attrs[(i,)] = [["tt.divisibility", 16]]
                else:
                    sig[name] = "fp32"
            k = triton.compile(ASTSource(self.fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=kw)
            ptx.append((self.fn.__name__, str(values.get("Q", values.get("X", values.get("G"))).dtype), k.asm["ptx"]))
        return launch

for name in ("_rms_norm_kernel", "_rope_store_kernel", "_act_mul_kernel"):
    setattr(ft, name, Compile(getattr(ft, name)))

def case(dtype, B, hidden, H, KVH, D, rot, inter, style, act):
    x = torch.zeros(B, hidden, dtype=dtype)
    w = torch.ones(hidden, dtype=dtype)
    ft.rms_norm(x, w, 1e-6, style)
    ft.add_rms_norm(x, x.clone(), w, 1e-6, style)
    qkv = torch.zeros(B, (H + 2 * KVH) * D, dtype=dtype)
    q, k, v = (t.view(B, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
    cos = torch.zeros(B, rot, dtype=dtype)
    cache = torch.zeros(64, KVH, D, dtype=dtype)
    norm = (torch.ones(D, dtype=dtype), 1e-6, style) if style is not CAST_LAST else None
    ft.rope_store(q, k, v, cos, cos, cache, cache.clone(), torch.arange(B), norm, norm)
    gate, up = torch.zeros(B, 2 * inter, dtype=dtype).split([inter, inter], dim=-1)
    ft.act_mul(gate, up, act)

case(torch.bfloat16, 8, 2048, 16, 8, 128, 128, 6144, PLAIN, "silu")  # Qwen3-1.7B
case(torch.bfloat16, 1, 2560, 8, 4, 256, 256, 10240, GEMMA, "gelu_tanh")  # Gemma 3 4B
case(torch.float16, 32, 2880, 64, 8, 64, 64, 2880, CAST_LAST, "silu")  # GPT-OSS 20B's attention and norms
case(torch.float32, 4, 3072, 32, 8, 96, 48, 8192, PLAIN, "silu")  # partial rotary, fp32
fp32_rope = [p for name, dtype, p in ptx if name == "_rope_store_kernel" and dtype == "torch.float32"]
assert fp32_rope and not any("fma.rn.f32" in p for p in fp32_rope), "fp32 RoPE fuses multiply-adds"
print(f"compiled {len(ptx)} kernels for sm_90")
'''


def test_every_kernel_compiles_for_an_h100_as_launched(tmp_path):
    """The interpreter runs what a GPU would refuse to compile (a dtype mismatch between the branches of
    a runtime `if`, a missing constexpr...): each kernel is compiled for sm_90 from the arguments its host
    function passes, at four families' shapes and dtypes; fp32 RoPE's PTX has no fused multiply-add (the
    reference rounds each product)."""
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton has no bundled ptxas (its NVIDIA backend)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "compiled 16 kernels for sm_90"
