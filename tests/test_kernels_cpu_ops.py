"""The fused CPU ops (kernels/cpu_ops.py) in bf16 and SiLU-and-multiply: each computes what transformers'
bf16 modules compute, bit for bit (their ops round to bf16 where the kernel rounds), except RMSNorm's sum
of squares, whose order is the kernel's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from svrmad_local.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason=f"no fused CPU ops: {cpu_ops.unavailable_reason()}")


def test_bf16_is_listed_where_the_ops_take_it():
    assert cpu_ops.DTYPES == (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1536, 1000, 37])  # whole vectors of torch's loop; and a scalar tail in each row
def test_silu_mul_is_bitwise_silu_times_up(dtype, inter):
    torch.manual_seed(inter)
    gate_up = (torch.randn(6, 2 * inter) * 4).to(dtype)  # the two halves of a fused gate/up output, as our decoder has them
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    assert torch.equal(cpu_ops.silu_mul(gate, up), F.silu(gate) * up)
    assert torch.equal(cpu_ops.silu_mul(gate[:1], up[:1]), (F.silu(gate) * up)[:1])
    with pytest.raises(RuntimeError, match="gate and up in one dtype"):
        cpu_ops.silu_mul(gate, up.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_meets_infinities_nans_and_extremes_as_torch_does(dtype):
    """The vector loop's rounding of the SiLU and of the product (csrc `mul_store8`) on what a diverging model
    hands it: NaN where torch gives NaN, infinities and the largest and smallest values as torch rounds them."""
    big, tiny = torch.finfo(dtype).max, torch.finfo(dtype).tiny
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), big, -big, tiny, -tiny, 0.0, -0.0, 88.0,
                            -88.0, 1e-30, 3.0, -3.0, 0.5, -0.5])
    gate_up = torch.cat([special.repeat(4), special.flip(0).repeat(4)]).view(1, -1).repeat(3, 1).to(dtype)
    inter = gate_up.shape[1] // 2
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    torch.testing.assert_close(cpu_ops.silu_mul(gate, up), F.silu(gate) * up, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_on_sixteen_lanes_gives_the_eight_lane_loops_bits(dtype):
    """Where the build and the CPU have AVX-512, SiLU-and-multiply runs sixteen lanes at a time (Sleef's
    sixteen-lane exponential): every lane computes what the eight-lane loop's does, so the bits are the AVX2
    path's, special values included, for rows of every tail (a half step of sixteen, a scalar tail)."""
    mod = cpu_ops._KERNEL.module()
    full = mod.set_isa_level(99)
    if mod.isa_level() < 1:
        pytest.skip("this CPU has no AVX-512")
    torch.manual_seed(16)
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 88.0, -88.0, 1e-30, 0.0, -0.0, 3.0, -3.0])
    outs = {}
    try:
        for inter in (1536, 1000, 37, 24):
            gate_up = (torch.randn(5, 2 * inter) * 6)
            gate_up[0, : min(inter, len(special))] = special[:inter]
            gate_up = gate_up.to(dtype)
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
            for level in (1, 0):
                mod.set_isa_level(level)
                outs[inter, level] = cpu_ops.silu_mul(gate, up)
    finally:
        mod.set_isa_level(full)
    for inter in (1536, 1000, 37, 24):
        torch.testing.assert_close(outs[inter, 1], outs[inter, 0], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("rows,inter", [(3, 11000), (7, 6013), (13, 4000), (1, 70001), (33, 1536), (9, 8960)])
def test_silu_mul_is_torchs_where_its_rule_says_so_at_any_split_between_threads(dtype, threads, rows, inter):
    """Tails of 16 < I % 32 fp32 elements (one vector of torch's two-vector step), and gates above torch's
    grain, which torch cuts between threads wherever the cut falls: where the rule says the compiled op
    gives torch's bits it does, and for the shapes whose cuts fall on whole steps it says so."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(rows * inter)
        gate_up = (torch.randn(rows, 2 * inter) * 6).to(dtype)
        for gate in (gate_up[:, :inter], gate_up[:, :inter].contiguous()):
            up = gate_up[:, inter:]
            if cpu_ops.silu_mul_is_torchs(gate, up):
                assert torch.equal(cpu_ops.silu_mul(gate, up), F.silu(gate) * up)
        if (rows, inter) in ((33, 1536), (9, 8960)):  # whole steps, cuts on steps: not sent to torch
            assert cpu_ops.silu_mul_is_torchs(gate_up[:, :inter], gate_up[:, inter:])
    finally:
        torch.set_num_threads(before)


def test_the_rule_refuses_a_cut_between_threads_off_a_step():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gate = torch.randn(1, 70001)  # one row cut in two at 35,001: off a 32-element step
        assert not cpu_ops.silu_mul_is_torchs(gate, gate)
        torch.set_num_threads(1)
        assert cpu_ops.silu_mul_is_torchs(gate, gate)
    finally:
        torch.set_num_threads(before)


def kernel_order_norm(x, w, eps):
    """transformers' bf16 RMSNorm steps on the kernel's sum of squares (csrc/cpu_ops.cpp, norm_row): eight
    lanes each summing every eighth square in order, the lanes added in order, then the tail."""
    xf, h = x.float(), x.shape[-1]
    lanes = torch.zeros(x.shape[0], 8)
    for i in range(0, h - h % 8, 8):
        lanes = lanes + xf[:, i : i + 8] * xf[:, i : i + 8]
    s = lanes[:, 0]
    for lane in range(1, 8):
        s = s + lanes[:, lane]
    for i in range(h - h % 8, h):
        s = s + xf[:, i] * xf[:, i]
    r = 1 / torch.sqrt(s / h + eps)
    return (w.float() * (xf * r[:, None]).bfloat16().float()).bfloat16()


@pytest.mark.parametrize("hidden", [576, 64, 13])
def test_bf16_rms_norm_takes_transformers_steps(hidden):
    """fp32 sum and scale, the normalised row rounded to bf16, times the bf16 weight, rounded: the same bits
    as transformers' bf16 RMSNorm but where the fp32 sum of squares (summed in another order) rounds to
    another bf16 scale; within one bf16 step of it, and each row alone."""
    torch.manual_seed(hidden)
    norm = LlamaRMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden) * 0.3 + 1
    norm = norm.to(torch.bfloat16)
    x, res = (torch.randn(9, hidden) * 3).bfloat16(), torch.randn(9, hidden).bfloat16()
    ours, theirs = cpu_ops.rms_norm(x, norm.weight, 1e-5), norm(x)
    assert ours.dtype == torch.bfloat16
    assert ((ours.float() - theirs.float()).abs() <= 2**-7 * theirs.float().abs()).all()
    assert (ours == theirs).float().mean() > 0.99
    assert torch.equal(ours, kernel_order_norm(x, norm.weight, 1e-5))
    for i in range(9):
        assert torch.equal(cpu_ops.rms_norm(x[i : i + 1], norm.weight, 1e-5), ours[i : i + 1])
    y, s = cpu_ops.add_rms_norm(x, res, norm.weight, 1e-5)
    assert torch.equal(s, res + x) and torch.equal(y, cpu_ops.rms_norm(res + x, norm.weight, 1e-5))
    with pytest.raises(RuntimeError, match="the weight's dtype must be x's"):
        cpu_ops.rms_norm(x, norm.weight.float(), 1e-5)


@pytest.mark.parametrize("D", [16, 64, 12])  # eight lanes at once over each half; a half of 6, one at a time
def test_bf16_rope_and_cache_writes_are_bitwise_transformers_rope(D):
    torch.manual_seed(D)
    T, H, KVH = 5, 6, 2
    qkv = (torch.randn(T, (H + 2 * KVH) * D) * 4).bfloat16()
    q, k, v = (qkv[:, a:b].view(T, -1, D) for a, b in ((0, H * D), (H * D, (H + KVH) * D), ((H + KVH) * D, None)))
    half = torch.randn(T, D // 2) * 30
    cos, sin = (torch.cat([half, half], -1).cos().bfloat16(), torch.cat([half, half], -1).sin().bfloat16())
    kc, vc = torch.zeros(12, KVH, D, dtype=torch.bfloat16), torch.zeros(12, KVH, D, dtype=torch.bfloat16)
    slots = torch.tensor([3, 7, 1, 11, 0])
    q_out = cpu_ops.rope_store(q, k, v, cos, sin, kc, vc, slots)
    q_ref, k_ref = apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2), cos[None], sin[None])
    assert torch.equal(q_out, q_ref[0].transpose(0, 1))
    assert torch.equal(kc[slots], k_ref[0].transpose(0, 1)) and torch.equal(vc[slots], v)
    with pytest.raises(RuntimeError, match="in one dtype"):
        cpu_ops.rope_store(q, k, v, cos.float(), sin, kc, vc, slots)


def _rows_with_ties(kind: str, R: int, V: int, gen: torch.Generator) -> torch.Tensor:
    """Logit-like rows: bf16-rounded (ties near the top, as a bf16 LM head gives), few values (ties
    everywhere), NaN and infinities among them, or a constant row."""
    if kind == "bf16":
        return (torch.randn(R, V, generator=gen) * 3).bfloat16().float()
    if kind == "few":
        return torch.randint(-3, 3, (R, V), generator=gen).float()
    if kind == "specials":
        x = torch.randn(R, V, generator=gen).bfloat16().float()
        u = torch.rand(R, V, generator=gen)
        x[u < 0.3] = float("-inf")
        x[(u > 0.5) & (u < 0.51)] = float("inf")
        x[u > 0.99] = float("nan")
        return x
    if kind == "sparse":  # -inf but a few equal values: the heap's top stays -inf for a long walk
        x = torch.full((R, V), float("-inf"))
        x[:, ::97] = 1.0
        return x
    return torch.zeros(R, V)


@pytest.mark.parametrize("kind", ["bf16", "few", "specials", "sparse", "constant"])
@pytest.mark.parametrize("R,V", [(1, 49152), (5, 2560), (32, 4099), (3, 151936)])
def test_topk_and_argmax_are_torchs_values_and_indices_ties_included(kind, R, V):
    """The sampler and the statistics select through cpu_ops: a sampled token and the recorded top
    log-probs must not depend on whether the compiled selection or torch's ran."""
    x = _rows_with_ties(kind, R, V, torch.Generator().manual_seed(R * V))
    for k in sorted({1, 20, 40, V // 64, V // 64 + 1}):  # the last is past torch's partial sort: torch's own
        ours, theirs = cpu_ops.topk(x, k), torch.topk(x, k, dim=-1)
        assert torch.equal(ours.indices, theirs.indices), (kind, k)
        assert torch.equal(ours.values.nan_to_num(0.5), theirs.values.nan_to_num(0.5)), (kind, k)
        assert torch.isnan(ours.values).equal(torch.isnan(theirs.values))
    assert torch.equal(cpu_ops.argmax(x), x.argmax(-1)), kind


def test_topk_runs_compiled_where_torch_partial_sorts_and_refuses_elsewhere():
    """The compiled top-k replays torch's partial sort, which torch takes only where k * 64 <= V."""
    mod = cpu_ops._KERNEL.module()
    x = torch.randn(2, 640)
    assert torch.equal(mod.topk_rows(x, 10)[1], x.topk(10, -1).indices)
    with pytest.raises(RuntimeError, match="k must be in"):
        mod.topk_rows(x, 11)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        mod.topk_rows(x.double(), 10)
    assert torch.equal(cpu_ops.topk(x.t().contiguous().t(), 10).indices, x.topk(10, -1).indices)  # made contiguous


def _torch_step(logits, draws):
    """What a step ran before the compiled call: the sampler's and the statistics' torch ops from Python."""
    from svrmad_local.engine import sampler, stats

    toks = sampler.sample_rows(logits, draws)
    return stats.pack(toks, stats.stats_from_logits(logits, toks, draws.topk))


def _same_bits(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("V", [30, 400, 5000, 49152, 262152])  # a full sort (K >= V), torch's own top-k (k * 64 > V),
# the compiled top-k; 262,152 entries end in a partial vector
def test_the_compiled_step_samples_torchs_tokens_with_statistics_within_rounding(V):
    """cpu_ops.sample_pack's draw is sample_rows' torch ops called from C++, its statistics one pass of its own:
    the tokens and top ids bit for bit, greedy rows, temperatures, widths and ties included; the log-probs
    and entropies within float rounding (stats.disagreement); and a later call leaves an earlier result as it was."""
    import random

    from svrmad_local.engine import sampler, stats
    from svrmad_local.engine.config import SamplingParams

    D = SamplingParams()
    cases = [[D] * 20, [D, SamplingParams(temperature=0), D, SamplingParams(temperature=0.7, top_p=0.5, top_k=7)],
             [SamplingParams(temperature=t) for t in (0.3, 0.7, 1.0, 1.3)], [SamplingParams(temperature=0)] * 3,
             [SamplingParams(top_k=0, topk_logprobs=30), D], [SamplingParams(topk_logprobs=0)] * 2]
    gen = torch.Generator().manual_seed(V)
    kept = []
    for c, params in enumerate(cases):
        for step in range(4):
            logits = torch.randn(len(params), V, generator=gen) * (1 + step)  # flat and peaked
            if step % 2:
                logits = logits.bfloat16().float()  # ties near the top, as a bf16 LM head gives
            draws = sampler.prepare(params, [random.Random(100 * c + 10 * step + i) for i in range(len(params))], V)
            got = cpu_ops.sample_pack(logits, torch.from_numpy(draws.table), draws.K, draws.topk)
            assert stats.disagreement(got, _torch_step(logits, draws), logits, draws.topk) is None
            kept.append((got, got.clone()))
    for got, copy in kept:
        _same_bits(got, copy)


def test_a_rows_statistics_do_not_depend_on_its_batch_mates_or_the_threads():
    """Each row's figures from its own values in a fixed order: alone, among others, on one thread or two."""
    import random

    from svrmad_local.engine import sampler
    from svrmad_local.engine.config import SamplingParams

    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(3)) * 3
    draws = lambda n: sampler.prepare([SamplingParams(temperature=0)] * n, [random.Random(0)] * n, 49152)  # noqa: E731
    table = torch.from_numpy(draws(6).table)
    together = cpu_ops.sample_pack(logits, table, 40, 20)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _same_bits(cpu_ops.sample_pack(logits, table, 40, 20), together)
    finally:
        torch.set_num_threads(threads)
    for r in range(6):
        _same_bits(cpu_ops.sample_pack(logits[r:r + 1], torch.from_numpy(draws(1).table), 40, 20), together[r:r + 1])


def test_the_compiled_step_meets_nan_and_infinite_logits_as_torchs_ops_do():
    """Sampled rows that are mostly, or all but one, -inf; a greedy step's rows with a NaN or +inf (torch.argmax
    takes the NaN's index; a step that samples any row cannot draw from such a row, in torch's ops as here):
    torch's tokens, and a NaN entropy on every row that holds a non-finite logit, so the step fails its request."""
    import random

    from svrmad_local.engine import sampler
    from svrmad_local.engine.config import SamplingParams

    logits = torch.randn(4, 5000)
    logits[0, 100:] = float("-inf")
    logits[1, :] = float("-inf")
    logits[1, 3] = 2.0
    logits[2, 7] = float("nan")
    logits[3, 11] = float("inf")
    for rows, params in ((slice(0, 2), [SamplingParams(), SamplingParams(temperature=0.5)]),
                         (slice(0, 4), [SamplingParams(temperature=0)] * 4)):
        draws = sampler.prepare(params, [random.Random(i) for i in range(len(params))], 5000)
        x = logits[rows].contiguous()
        got, ref = cpu_ops.sample_pack(x, torch.from_numpy(draws.table), draws.K, draws.topk), _torch_step(x, draws)
        assert torch.equal(got[:, 0], ref[:, 0])
        assert got[:, 2].isnan().all() and ref[:, 2].isnan().all()


def test_the_engines_sampling_takes_the_compiled_step_on_the_cpu(monkeypatch):
    """sampler.sample_packed calls the compiled step where it runs, and torch's ops where it does not
    (SVRMAD_CPU_OPS=0 here): the same tokens and ids, the statistics within rounding."""
    import random

    from svrmad_local.engine import sampler, stats
    from svrmad_local.engine.config import SamplingParams

    logits = torch.randn(3, 4096) * 4
    params = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(temperature=0.6, top_k=5)]
    draws = lambda: sampler.prepare(params, [random.Random(i) for i in range(3)], 4096)  # noqa: E731
    calls, real = [], cpu_ops.sample_pack
    monkeypatch.setattr(cpu_ops, "sample_pack", lambda *a: calls.append(1) or real(*a))
    compiled = sampler.sample_packed(logits, draws())
    assert calls == [1]
    monkeypatch.setenv("SVRMAD_CPU_OPS", "0")
    assert stats.disagreement(compiled, sampler.sample_packed(logits, draws()), logits, draws().topk) is None
    assert calls == [1]


def test_a_thread_that_ran_the_step_may_end_after_the_interpreter_began_to_finalize():
    """An engine's worker thread (its static path's probe step runs sample_pack under a dispatch mode, which
    gives the tensors it makes Python objects) whose OS thread ends only once the interpreter is finalizing,
    as a tensor-parallel follower's did in CI: the process ends with status 0. When sample_pack kept scratch
    buffers in a C++ thread_local, freeing them there took the interpreter's lock and the process aborted
    ("terminate called without an active exception"), every time under tests/late_thread_end.py's timing:
    nothing a kernel makes may outlive its call in a thread_local."""
    import ctypes
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not hasattr(ctypes.CDLL(None), "__cxa_thread_atexit_impl"):
        pytest.skip("the timing needs glibc's __cxa_thread_atexit_impl")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(root / "tests" / "late_thread_end.py")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "terminate called" not in res.stderr, (res.returncode, res.stderr[-3000:])
    assert res.stdout.strip() == "built"
