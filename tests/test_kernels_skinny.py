"""kernels/skinny.py (the few-row linear) against its fp32 reference, run on the CPU by Triton's interpreter.

Every configuration the engine may pick, plus split-K ones small enough to split here, at every row count
1..8, odd N and K (no multiple of any tile), with and without bias: fp32 within 1e-5 relative (the sums
run in another order than F.linear's); fp16/bf16 within one rounding of the output plus the sums'
order (tests/rounding.py); and the same bits on two calls (no atomics: the shares are summed in order).
"""

from __future__ import annotations

import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (see conftest)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from svrmad_local.kernels import skinny  # noqa: E402
from svrmad_local.kernels._backend import interpreter_ready  # noqa: E402
from svrmad_local.kernels.skinny import Config, reference, skinny_linear  # noqa: E402

from .rounding import assert_one_rounding  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreter_ready(), reason="triton was imported before TRITON_INTERPRET=1")

# split-K with tiles small enough that K = 301 splits into several shares (one of them short); the last
# one's products summed per tile even for one row (one warp), and a pipelined tensor-core tile
SPLITS = (Config(16, 32, 3), Config(16, 64, 2, dot=True), Config(32, 16, 5), Config(64, 64, 2, 1, 1),
          Config(32, 32, 4, 4, 5, dot=True))
N, K = 37, 301


def operands(m: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("cfg", skinny.CONFIGS + SPLITS, ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_every_config_matches_the_reference_in_fp32(cfg, bias):
    for m in [m for m in (*range(1, 9), 12, 16, 24, 32) if skinny.runs(cfg, m)]:
        x, w, b = operands(m, torch.float32, bias, seed=m)
        got, ref = skinny_linear(x, w, b, cfg), reference(x, w, b)
        assert got.shape == (m, N) and got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("cfg", skinny.CONFIGS + SPLITS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_config_matches_the_reference_in_half_precision(cfg, dtype):
    for m in [m for m in (1, 2, 5, 8, 13, 32) if skinny.runs(cfg, m)]:
        x, w, b = operands(m, dtype, bias=m % 2 == 1, seed=m)
        got, ref = skinny_linear(x, w, b, cfg), reference(x, w, b)
        assert got.dtype == dtype
        assert_one_rounding(got, ref, (cfg, m, dtype))


@pytest.mark.parametrize("cfg", skinny.CONFIGS + SPLITS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_rows_are_act_muls_rows(cfg, dtype):
    """With `up` the kernel multiplies SiLU(gate) * up, read from the two halves of one gate/up output (their
    strides): the same as act_mul then the kernel on its output (in bf16, act_mul's rounding reproduced
    bit for bit), and within the fp32 reference's tolerance of the module's F.silu(gate) * up."""
    from svrmad_local.kernels import fused_triton

    for m in [m for m in (1, 3, 8, 24) if skinny.runs(cfg, m)]:
        g = torch.Generator().manual_seed(m)
        gate_up = (2 * torch.randn(m, 2 * K, generator=g)).to(dtype)
        gate, up = gate_up[:, :K], gate_up[:, K:]
        w = torch.randn(N, K, generator=g).to(dtype)
        b = torch.randn(N, generator=g).to(dtype) if m % 2 else None
        got = skinny_linear(gate, w, b, cfg, up=up)
        assert torch.equal(got, skinny_linear(fused_triton.act_mul(gate, up, "silu"), w, b, cfg)), (cfg, m)
        ref = reference(gate, w, b, up=up)
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("cfg", [c for c in skinny.CONFIGS if c.ahead]
                         + [Config(16, 32, 3, ahead=True), Config(32, 16, 5, ahead=True)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loading_a_tile_ahead_changes_no_bit(cfg, dtype):
    """An `ahead` config issues each tile's loads an iteration early: the same products summed in the same
    order as its twin without, so the same bits; at every row count it takes, gated or not, over one share
    and several (the tile past a share's end masked)."""
    twin = replace(cfg, ahead=False)
    for m in range(1, skinny.BROADCAST_ROWS + 1):
        x, w, b = operands(m, dtype, bias=m % 2 == 1, seed=m)
        assert torch.equal(skinny_linear(x, w, b, cfg), skinny_linear(x, w, b, twin)), (cfg, m)
        assert torch.equal(skinny_linear(x, w, b, cfg, up=x.flip(0)), skinny_linear(x, w, b, twin, up=x.flip(0)))


def test_ahead_is_for_the_broadcast_products_only():
    with pytest.raises(ValueError, match="ahead is for the broadcast products"):
        Config(32, 256, 1, 4, 3, dot=True, ahead=True)

def test_gated_rows_must_match_the_gate():
    x, w, b = operands(2, torch.float32, bias=True)
    with pytest.raises(ValueError, match="up must match the gate"):
        skinny_linear(x, w, b, up=x[:1])
    with pytest.raises(ValueError, match="up must match the gate"):
        skinny_linear(x, w, b, up=x.double())


@pytest.mark.parametrize("cfg", (skinny.DEFAULT, SPLITS[0], SPLITS[1], SPLITS[3]), ids=str)
def test_two_calls_give_the_same_bits(cfg):
    x, w, b = operands(7, torch.float32, bias=True)
    assert torch.equal(skinny_linear(x, w, b, cfg), skinny_linear(x, w, b, cfg))


@pytest.mark.parametrize("cfg", SPLITS[:3], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unsummed_shares_are_what_the_sum_kernel_sums(cfg, dtype):
    """`unsummed` (an output headed for an add + RMSNorm that sums it: kernels/shares.py): where K is split and
    there is no bias, the fp32 partials, whose sum in share order is the summed call's bits, gated or not;
    with a bias (added after the sum), or one share, the output itself."""
    from svrmad_local.kernels.shares import Shares

    for m in (1, 3, 8):
        x, w, _ = operands(m, dtype, bias=False, seed=m)
        for up in (None, x.flip(0)):
            got = skinny_linear(x, w, None, cfg, up=up, unsummed=True)
            assert isinstance(got, Shares) and got.shape == (m, N) and got.dtype == dtype
            assert got.parts.shape[0] == skinny.shares(cfg, N, K, skinny.SMS_DEFAULT)
            assert torch.equal(got.total(), skinny_linear(x, w, None, cfg, up=up)), (cfg, m)
    x, w, b = operands(2, dtype, bias=True)
    assert torch.equal(skinny_linear(x, w, b, cfg, unsummed=True), skinny_linear(x, w, b, cfg))
    one = skinny_linear(x, w, None, skinny.DEFAULT, unsummed=True)
    assert isinstance(one, torch.Tensor) and torch.equal(one, skinny_linear(x, w, None, skinny.DEFAULT))


def test_bound_hands_unsummed_to_the_kernel(monkeypatch):
    """The decoder's o_proj and down (`families.linear_call(..., unsummed=True)`) ask for the partials, gated or
    not; every other call for the output."""
    seen = []
    monkeypatch.setattr(skinny, "_GATED_RUNS", {})
    monkeypatch.setattr(skinny, "skinny_linear",
                        lambda x, w, b, cfg, up=None, unsummed=False: (seen.append((up is not None, unsummed)), w)[1])
    x, w, _ = operands(1, torch.float32, bias=False)
    picks = {1: SPLITS[0]}
    calls = [skinny.bound(w, None, picks), skinny.bound(w, None, picks, unsummed=True),
             skinny.bound_gated(w, None, picks, unsummed=True)]
    seen.clear()  # the gated call's trial launch at build
    for call in calls[:2]:
        call(x)
    calls[2](x, x, None)
    assert seen == [(False, False), (False, True), (True, True)]


NORMED = (skinny.DEFAULT, skinny.DEFAULT_DOT, SPLITS[0], SPLITS[1], Config(8, 512, 1, 4, 3, ahead=True),
          Config(32, 32, 1, 4, 5, dot=True, tma=True))


def norm_operands(m: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(m, K, generator=g)).to(dtype)
    res = torch.randn(m, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    nw = (0.3 * torch.randn(K, generator=g) + 1).to(dtype)
    return x, res, w, nw


@pytest.mark.parametrize("cfg", NORMED, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_normed_rows_are_add_rms_norms_rows(cfg, dtype):
    """With `norm` the kernel multiplies RMSNorm(x + residual) (or of x alone), as fused_triton's add_rms_norm
    computes it: the new residual bit for bit (program (0, 0) writes it), the product within the rounding the
    norm's sum of squares allows (it sums in another order) of add_rms_norm then the kernel, and of the fp32
    reference in fp32; x may be a split-K linear's shares, summed as loaded; every NormStyle."""
    from svrmad_local.kernels import fused, fused_triton
    from svrmad_local.kernels.norms import CAST_LAST, GEMMA, PLAIN
    from svrmad_local.kernels.shares import Shares

    for m in [m for m in (1, 3, 8, 24) if skinny.runs(cfg, m)]:
        x, res, w, nw = norm_operands(m, dtype, seed=m)
        for style in (PLAIN, CAST_LAST, GEMMA):
            norm = (nw, 1e-5, style)
            got, new = skinny_linear(x, w, None, cfg, norm=norm, residual=res)
            y, new_ref = fused_triton.add_rms_norm(x, res, *norm)
            assert torch.equal(new, new_ref), (cfg, m, style)
            want = reference(fused.reference_add_rms_norm(x, res, *norm)[0], w)
            assert_one_rounding(got, want, (cfg, m, style))
            alone, same = skinny_linear(x, w, None, cfg, norm=norm)
            assert same is x
            assert_one_rounding(alone, reference(fused.reference_rms_norm(x, *norm), w), (cfg, m, style))
        parts = torch.randn(3, m, K, generator=torch.Generator().manual_seed(m))
        shares = Shares(parts, dtype)
        got, new = skinny_linear(shares, w, None, cfg, norm=(nw, 1e-5, PLAIN), residual=res)
        assert torch.equal(new, fused_triton.add_rms_norm(shares.total(), res, nw, 1e-5, PLAIN)[1])
        assert_one_rounding(got, reference(fused.reference_add_rms_norm(shares.total(), res, nw, 1e-5)[0], w), cfg)


def test_a_normed_call_refuses_what_does_not_fit_in_one_line():
    from svrmad_local.kernels.norms import PLAIN
    from svrmad_local.kernels.shares import Shares

    x, res, w, nw = norm_operands(2, torch.float32, 0)
    with pytest.raises(ValueError, match=r"the norm's weight must be \[301\]"):
        skinny_linear(x, w, norm=(nw[:-1], 1e-5, PLAIN), residual=res)
    with pytest.raises(ValueError, match=r"the residual must be \[2, 301\]"):
        skinny_linear(x, w, norm=(nw, 1e-5, PLAIN), residual=res[:1])
    with pytest.raises(ValueError, match="gated .up. or normed .norm., not both"):
        skinny_linear(x, w, up=x, norm=(nw, 1e-5, PLAIN))
    with pytest.raises(ValueError, match="the norm gives torch.float32 rows, the weight is torch.bfloat16"):
        skinny_linear(x.bfloat16(), w.bfloat16(), norm=(nw, 1e-5, PLAIN))  # PLAIN's fp32 weight promotes
    with pytest.raises(ValueError, match="shares are read only by a normed call with a residual"):
        skinny_linear(Shares(torch.zeros(2, 2, K), torch.float32), w)


def test_both_ways_of_summing_are_covered_above():
    """Products summed once at the end (few rows) and per tile (more rows): the configs above take both, for
    one row as for several."""
    ways = {skinny.sums_late(c, m) for c in skinny.CONFIGS + SPLITS if not c.dot for m in (1, 2, 4, 8)}
    assert ways == {True, False}
    assert {skinny.sums_late(c, 1) for c in skinny.CONFIGS + SPLITS if not c.dot} == {True, False}
    assert skinny.sums_late(skinny.CONFIGS[0], 1) and not skinny.sums_late(skinny.CONFIGS[0], 8)


def test_split_configs_do_split_here():
    """The split cases above exercise the two-pass sum only if their shares come out above one."""
    assert [skinny.shares(c, N, K, skinny.SMS_DEFAULT) for c in SPLITS] == [3, 2, 5, 2, 4]


def test_auto_split_fills_the_gpu_only_for_narrow_outputs():
    cfg = Config(16, 256, 0)
    # Qwen3-1.7B's o_proj (2048 columns: 128 strips) on 132 SMs: split about two programs an SM
    assert skinny.shares(cfg, 2048, 2048, 132) == 2
    # the LM head's 151,936 columns fill any GPU alone
    assert skinny.shares(cfg, 151936, 2048, 132) == 1
    # never below four K tiles a share
    assert skinny.shares(cfg, 64, 2048, 132) == 2


def test_bound_takes_the_kernel_only_at_the_rows_it_was_picked_for(monkeypatch):
    """The engine's call: the picked config at M (by its padded row count), F.linear at other M and above 32."""
    seen = []
    monkeypatch.setattr(skinny, "skinny_linear",
                        lambda x, w, b, cfg, unsummed=False: (seen.append((x.shape[0], cfg)), w)[1])
    x8, w, b = operands(8, torch.float32, bias=True)
    call = skinny.bound(w, b, {1: SPLITS[0], 4: SPLITS[1]})
    for m in (1, 2, 3, 4, 8):
        call(x8[:m])
    call(torch.randn(9, K))
    call(torch.randn(33, K))
    assert seen == [(1, SPLITS[0]), (3, SPLITS[1]), (4, SPLITS[1])]


def test_bound_gated_folds_the_activation_in_only_where_the_kernel_runs(monkeypatch):
    """An MLP's down projection: at the picked rows one kernel call with `up` (after one trial launch at
    build); elsewhere act_mul (the decoder's op, handed in), then F.linear on its output."""
    seen, acts = [], []
    monkeypatch.setattr(skinny, "_GATED_RUNS", {})
    monkeypatch.setattr(skinny, "skinny_linear",
                        lambda x, w, b, cfg, up=None, unsummed=False: (seen.append((x.shape[0], cfg, up is not None)), w)[1])
    x8, w, b = operands(8, torch.float32, bias=True)
    call = skinny.bound_gated(w, b, {2: SPLITS[0]})
    assert seen == [(2, SPLITS[0], True)]  # the trial

    def act_mul(gate, up, act):
        acts.append((gate.shape[0], act))
        return gate * up

    for m in (1, 2, 9):
        x = torch.randn(m, K)
        out = call(x, x, act_mul)
        if m != 2:
            torch.testing.assert_close(out, torch.nn.functional.linear(x * x, w, b))
    assert seen[1:] == [(2, SPLITS[0], True)] and acts == [(1, "silu"), (9, "silu")]


def test_a_config_whose_gated_variant_cannot_launch_keeps_act_mul_then_the_kernel(monkeypatch):
    """A pipelined config can fit a GPU's shared memory without the gate's and up's tiles and not with them:
    its trial fails once (said at info level), and its rows take act_mul, then the same config plain."""
    seen, tried = [], []
    monkeypatch.setattr(skinny, "_GATED_RUNS", {})

    def launch(x, w, b, cfg, up=None, unsummed=False):
        if up is not None and cfg is SPLITS[1]:
            tried.append(x.shape[0])
            raise RuntimeError("out of resource: shared memory, Required: 131072, Hardware limit: 101376")
        seen.append((x.shape[0], cfg, up is not None))
        return w

    monkeypatch.setattr(skinny, "skinny_linear", launch)
    x8, w, b = operands(8, torch.float32, bias=True)
    call = skinny.bound_gated(w, b, {1: SPLITS[0], 4: SPLITS[1]})
    assert call.picks == {1: SPLITS[0]}
    seen.clear()
    call(x8[:1], x8[:1], lambda g, u, act: g * u)
    call(x8[:3], x8[:3], lambda g, u, act: g * u)
    assert seen == [(1, SPLITS[0], True), (3, SPLITS[1], False)]
    assert skinny.bound_gated(w, b, {4: SPLITS[1]}).picks == {} and tried == [4]  # tried once a shape


# tensor-descriptor configs small enough to split K = 328 here (bf16 rows of 656 bytes: 16-byte aligned)
TMAS = (Config(16, 32, 1, 4, 3, dot=True, tma=True), Config(32, 64, 2, 4, 4, dot=True, tma=True),
        Config(16, 32, 0, 4, 3, dot=True, tma=True))


# the engine's own tma configs in bf16 only: their fp32 tiles ask more shared memory than an H100 grants
TMA_CASES = [(c, d) for c in TMAS for d in (torch.float32, torch.bfloat16)] + \
    [(c, torch.bfloat16) for c in skinny.CONFIGS if c.tma]


@pytest.mark.parametrize("cfg, dtype", TMA_CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_a_tma_config_reads_the_tiles_its_pointer_twin_reads(cfg, dtype, monkeypatch):
    """Where a tensor descriptor can read the weight (contiguous along K, rows 16-byte aligned), a `tma`
    config takes its tiles through one (what lies past N and K reads as zero, as the pointer loads' masks
    make it): the same bits as the config without `tma`, plain and gated, one share and several. Where it
    cannot (K = 301: rows of 602 or 1,204 bytes), the same config loads by pointer, again the same bits."""
    made = []
    real = skinny.TensorDescriptor
    monkeypatch.setattr(skinny, "TensorDescriptor", lambda *a: made.append(a[3]) or real(*a))
    twin = replace(cfg, tma=False)
    for k in (328, 301):
        g = torch.Generator().manual_seed(k)
        w = torch.randn(N, k, generator=g).to(dtype)
        b = torch.randn(N, generator=g).to(dtype)
        assert skinny.reads_by_tma(w) == (k == 328)
        for m in (1, 5, 32):
            x = torch.randn(m, 2 * k, generator=g).to(dtype)
            gate, up = x[:, :k], x[:, k:]
            made.clear()
            assert torch.equal(skinny_linear(gate, w, b, cfg), skinny_linear(gate, w, b, twin)), (k, m)
            assert torch.equal(skinny_linear(gate, w, b, cfg, up=up), skinny_linear(gate, w, b, twin, up=up)), (k, m)
            assert made == ([[cfg.block_n, cfg.block_k]] * 2 if skinny.reads_by_tma(w) else []), (k, m)
    with pytest.raises(ValueError, match="tma is for the tl.dot configs"):
        Config(16, 256, tma=True)
    with pytest.raises(ValueError, match="at most 256 x 256"):
        Config(32, 512, dot=True, tma=True)


def test_the_timed_calls_are_the_calls_the_decoder_makes():
    """What the build times (`timed_call`, which `cuda_timer` repeats in a CUDA graph) is what runs: a plain
    shape's F.linear or kernel over the rotated copies of its weight in turn; a gated down projection's
    kernel with SiLU(gate) * up in its prologue, read from the two halves of one gate/up output, against
    act_mul then the plain shape's pick at that row count (F.linear where it has none); a linear after a norm,
    the kernel with the add + RMSNorm in its prologue against add_rms_norm then the pick."""
    from svrmad_local.kernels import fused_triton

    x8, w, b = operands(8, torch.bfloat16, bias=True)
    weights = [w, (2 * w).to(w.dtype)]
    run = skinny.timed_call(weights, b, 3, "torch")
    (x, _none) = run.operands
    assert torch.equal(run(), torch.nn.functional.linear(x, w, b))
    assert torch.equal(run(), torch.nn.functional.linear(x, weights[1], b))  # the next copy
    cfg, plain_cfg = skinny.CONFIGS[1], skinny.CONFIGS[0]
    kernel = skinny.timed_call(weights, b, 3, cfg)
    assert torch.equal(kernel(), skinny_linear(kernel.operands[0], w, b, cfg))
    for m, plain in ((2, {2: plain_cfg}), (3, {2: plain_cfg})):  # 3 rows: padded to 4, no plain pick there
        gated = skinny.timed_call(weights, b, m, cfg, plain)
        gate, up = gated.operands
        assert gate.shape == up.shape == (m, K) and gate.stride() == up.stride() == (2 * K, 1)
        assert torch.equal(gated(), skinny_linear(fused_triton.act_mul(gate, up, "silu"), w, b, cfg))
        unfused = skinny.timed_call(weights, b, m, "torch", plain)
        y = fused_triton.act_mul(*unfused.operands, "silu")
        expect = skinny_linear(y, w, b, plain_cfg) if m == 2 else torch.nn.functional.linear(y, w, b)
        assert torch.equal(unfused(), expect), m
    # a linear after a norm: the kernel with the add + RMSNorm in its prologue, against add_rms_norm then the pick
    for m, plain in ((2, {2: plain_cfg}), (3, {2: plain_cfg})):
        normed = skinny.timed_call(weights, b, m, cfg, plain, "norm")
        x, res, norm = normed.operands
        assert x.shape == res.shape == (m, K) and norm[0].shape == (K,)
        assert torch.equal(normed(), skinny_linear(x, w, b, cfg, norm=norm, residual=res)[0])
        unfused = skinny.timed_call(weights, b, m, "torch", plain, "norm")
        x, res, norm = unfused.operands
        y = fused_triton.add_rms_norm(x, res, *norm)[0]
        expect = skinny_linear(y, w, b, plain_cfg) if m == 2 else torch.nn.functional.linear(y, w, b)
        assert torch.equal(unfused(), expect), m
    # o_proj and down as the decoder runs them: a split config's partials left for the norm after them
    from svrmad_local.kernels.shares import Shares

    left = skinny.timed_call(weights, None, 2, SPLITS[0], unsummed=True)
    out = left()  # over the first copy of the weight
    assert isinstance(out, Shares) and torch.equal(out.total(), skinny_linear(left.operands[0], w, None, SPLITS[0]))
    gated_left = skinny.timed_call(weights, None, 2, "torch", {2: SPLITS[0]}, unsummed=True)
    assert isinstance(gated_left(), Shares)
    with pytest.raises(ValueError, match="prologue must be one of silu, norm"):
        skinny.timed_call(weights, b, 2, cfg, {2: plain_cfg}, "gelu")


def test_the_timings_copies_hold_twice_the_l2_cache_and_at_most_sixteen(monkeypatch):
    """`cold_copies`: the weight itself first, then clones (equal, not the same storage) until the copies hold
    twice the device's L2 cache, at most 16 in all, at least the weight alone."""
    from types import SimpleNamespace

    l2 = 1 << 16
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(L2_cache_size=l2))
    for rows, expected in ((64, 4), (8, 16), (1024, 1)):  # 32 KB, 4 KB and 512 KB of fp32 at 128 columns
        w = torch.randn(rows, 128)
        copies = skinny.cold_copies(w)
        assert len(copies) == expected and copies[0] is w, (rows, len(copies))
        assert all(torch.equal(c, w) and c.data_ptr() != w.data_ptr() for c in copies[1:])


def test_bad_operands_are_refused_in_one_line():
    x, w, b = operands(2, torch.float32, bias=True)
    with pytest.raises(ValueError, match="at most 32 rows"):
        skinny_linear(torch.randn(33, K), w, cfg=skinny.DEFAULT_DOT)
    with pytest.raises(ValueError, match=r"n16k256s1w4p3 takes at most 8 rows .*, got 9: a tl.dot config takes up to 32"):
        skinny_linear(torch.randn(9, K), w)
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        skinny_linear(x[:, :-1], w)
    with pytest.raises(ValueError, match="share one of"):
        skinny_linear(x.bfloat16(), w)
    with pytest.raises(ValueError, match="bias must be"):
        skinny_linear(x, w, b[:-1])
