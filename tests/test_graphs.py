"""The static-shape decode path (engine/graphs.py), run eagerly on the CPU: what a CUDA graph records.

* On every zoo architecture it is token-exact to a cache-free transformers loop and matches the dynamic
  path's log-probs, in padded batches (3 sequences run as 4 rows) and unpadded ones, across block-table
  widths, with forks and a warm cache.
* Nothing in the step returns to the host or freezes host data (`HostSyncCheck`, a dispatch mode), on
  every architecture, for the probe and for real steps; and the check does see such ops where they are
  (dynamic RoPE, the packed MoE experts' loop), which turns graphs off with the op and line named.
* The step samples inside (the LM head, the sampling's device part, the token statistics, one packed
  buffer) where its rows all sample at the default widths, and its tokens, log-probs, entropies and top-k
  equal the dynamic path's bit for bit, sampled, greedy and mixed, padded or not; wider requests fall back
  to sampling after the step, still equal; every step reads its results back with one `.tolist()`.
* The padding rows' scratch block is never handed to a sequence.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import pytest
import torch

from svrmad_local.engine import graphs, tp
from svrmad_local.engine.tp import Group
from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.params import SamplingParams
from svrmad_local.engine.sampler import sample
from svrmad_local.engine.stats import stats_from_logits

from .model_zoo import _COMMON, EXACT, WINDOW, loop_greedy, make_zoo_model, rand_prompt

NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, top_k=40, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=EXACT)
def zoo(request):
    return request.param, make_zoo_model(request.param)


def engine(model, **kw):
    kw = {"kv_cache_memory": 4 * 2**20, "block_size": 4, "max_num_seqs": 8, **kw}
    return Engine(model, None, EngineConfig(**kw))


def _record_shapes(eng):
    """Wraps the static path's run to record (decode rows, padded rows, table width) of every step."""
    static, seen = eng.runner.static, []
    run = static.run

    def recording(step, shape, *rest):
        seen.append((step.num_decode, *shape))
        return run(step, shape, *rest)

    static.run = recording
    return seen


def test_static_decode_is_token_exact_padded_and_unpadded(zoo):
    name, model = zoo
    head = rand_prompt(3 * WINDOW + 1, 1)
    prompts = [head + rand_prompt(n, 10 + n) for n in (2, 7, 13)] + [rand_prompt(2 * WINDOW + 5, 2)]
    refs = [loop_greedy(model, p, NEW) for p in prompts]
    eng, plain = engine(model, cuda_graphs="static"), engine(model, cuda_graphs="off")
    assert eng.info["cuda_graphs"] == "static (eager)" and plain.runner.static is None
    seen = _record_shapes(eng)
    padded = eng.generate_sync(prompts[:3], GREEDY)  # 3 sequences in 4 rows
    unpadded = eng.generate_sync(prompts, GREEDY)  # 4 in 4, three of them from a warm cache
    single = eng.generate_sync(prompts[3], GREEDY)  # alone, in a narrower table
    assert single[0].completions[0].token_ids == refs[3], name
    assert [o.completions[0].token_ids for o in padded] == refs[:3], name
    assert [o.completions[0].token_ids for o in unpadded] == refs, name
    assert {(3, 4), (4, 4)} <= {(b, p) for b, p, _ in seen}, seen
    assert {w for _, _, w in seen} == {8, 16}, seen  # contexts of up to 8 and of 9-16 blocks of 4 tokens
    ref = plain.generate_sync(prompts, GREEDY)
    for a, b in zip(unpadded, ref):
        assert a.completions[0].logprobs == pytest.approx(b.completions[0].logprobs, abs=1e-5), name
    forks = eng.generate_sync([prompts[1]], SamplingParams(n=3, temperature=0, max_tokens=NEW, ignore_eos=True))[0]
    assert [c.token_ids for c in forks.completions] == [refs[1]] * 3, name


def test_no_op_of_the_static_step_returns_to_the_host(zoo):
    """The step a graph captures, its LM head, sampling and statistics included, over sampled and greedy rows."""
    name, model = zoo
    eng = engine(model, cuda_graphs="static")
    static = eng.runner.static
    assert static.found == [] and static.head_found == [] and static.sampling, (name, static.found, static.head_found)
    checks, packed = [], []
    forward = static._forward

    def checked(P, W):
        with graphs.HostSyncCheck() as check:
            out = forward(P, W)
        checks.append(check)
        packed.append(out.packed is not None)
        return out

    static._forward = checked
    eng.generate_sync([rand_prompt(2 * WINDOW + 5 + i, 60 + i) for i in range(3)],
                      [replace(SAMPLED, seed=1), GREEDY, replace(SAMPLED, seed=2)])
    assert len(checks) == NEW - 1 and all(packed)  # every decode step went through the static path, sampling inside
    assert [c.found for c in checks] == [[]] * len(checks), name


def test_a_head_that_returns_to_the_host_stays_out_of_the_step():
    """An LM head the probe sees return to the host (here one that branches on a tensor) keeps only itself
    and the sampling out of the step: the body's step stays static (graphs stay on where they can), the Step
    samples after it, the info says why, and the tokens are the dynamic path's."""

    class Branching(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.out_features = inner, inner.out_features

        @property
        def weight(self):
            return self.inner.weight

        def forward(self, x):
            if x.sum() > 0:  # a read of a device value
                pass
            return self.inner(x)

    model = make_zoo_model("llama")
    model.lm_head = Branching(model.lm_head)
    eng, plain = engine(model, cuda_graphs="static"), engine(model, cuda_graphs="off")
    static = eng.runner.static
    assert static.found == [] and not static.sampling
    assert any("is_nonzero" in f or "_local_scalar_dense" in f for f in static.head_found), static.head_found
    assert "the LM head and sampling after the step: aten." in eng.info["cuda_graphs"], eng.info["cuda_graphs"]
    seen = _record_sampled_inside(eng)
    prompts = [rand_prompt(2 * WINDOW + 5 + i, 150 + i) for i in range(3)]
    plist = [replace(SAMPLED, seed=i) for i in range(3)]
    assert _results(eng.generate_sync(prompts, plist)) == _results(plain.generate_sync(prompts, plist))
    assert seen == [False] * (NEW - 1)


def _record_sampled_inside(eng) -> list[bool]:
    """Wraps the static path's run to record, for every step it runs, whether it sampled inside."""
    static, seen = eng.runner.static, []
    run = static.run

    def recording(step, shape, *rest):
        out = run(step, shape, *rest)
        seen.append(out.packed is not None)
        return out

    static.run = recording
    return seen


def _results(outs) -> list:
    return [(c.token_ids, c.logprobs, c.entropies, c.topk_logprobs, c.topk_ids) for o in outs for c in o.completions]


# batches of 3 and 5 run as 4 and 8 rows; Gemma 3 with a final logit softcap (its LM head's tanh in the step).
# (The MoE families are left out: their padding rows change how the experts group the rows, so their static
# step is held to a cache-free loop's tokens, above, not to the dynamic path's bits.)
@pytest.mark.parametrize("name,batch,softcap", [("llama", 3, None), ("llama", 5, None), ("gemma3", 3, 30.0)])
def test_the_static_step_samples_inside_and_equals_the_dynamic_path_bit_for_bit(name, batch, softcap):
    """Decode steps whose rows all sample at the default widths (top-k 40, 20 top log-probs) sample inside
    the static step: seeded sampled requests, greedy ones and a mix of both in one batch give the dynamic
    path's tokens, log-probs, entropies and top-k, bit for bit. A request asking a wider top-k (0: the whole
    vocabulary) or more top log-probs makes its steps sample after the static step: equal too."""
    model = make_zoo_model(name)
    if softcap is not None:
        model.config.get_text_config().final_logit_softcapping = softcap
    eng, plain = engine(model, cuda_graphs="static"), engine(model, cuda_graphs="off")
    seen = _record_sampled_inside(eng)
    prompts = [rand_prompt(2 * WINDOW + 5 + i, 130 + i) for i in range(batch)]
    sampled = [replace(SAMPLED, seed=i) for i in range(batch)]
    mixed = [sampled[i] if i % 2 else GREEDY for i in range(batch)]
    wide, more = [replace(sampled[0], top_k=0)] + sampled[1:], [replace(sampled[0], topk_logprobs=30)] + sampled[1:]
    runs = {}
    for what, plist, inside in (("sampled", sampled, True), ("greedy", [GREEDY] * batch, True), ("mixed", mixed, True),
                                ("top_k 0", wide, False), ("30 top log-probs", more, False)):
        seen.clear()
        got = _results(eng.generate_sync(prompts, plist))
        assert got == _results(plain.generate_sync(prompts, plist)), what
        # every decode step ran the static path (from the second run on, the cached prompts' last token too)
        assert len(seen) >= NEW - 1 and set(seen) == {inside}, (what, seen)
        runs[what] = got
    assert [len(r[4][0]) for r in runs["30 top log-probs"]] == [30] + [20] * (batch - 1)
    assert runs["sampled"] != runs["greedy"] and runs["mixed"][0] == runs["greedy"][0]  # (the rows do sample)
    assert eng.runner.softcap == softcap


@pytest.mark.parametrize("mode", ["off", "static"])
def test_a_step_reads_its_tokens_and_statistics_back_once(mode, monkeypatch):
    """One read from the device a step: the sampled tokens, log-probs, entropies and top-k come back in
    one packed tensor, on the dynamic path (computed after the forward) and the static one (inside it)."""
    eng = engine(make_zoo_model("llama"), cuda_graphs=mode)
    calls = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t, *a, **k: calls.append(1) or tolist(t, *a, **k))
    inside = _record_sampled_inside(eng) if mode == "static" else []
    checks = graphs.watch_steps(eng)
    watched, per_step = eng.stepper._sample, []

    def counted(*a, **k):
        before = len(calls)
        watched(*a, **k)
        per_step.append(len(calls) - before)

    eng.stepper._sample = counted
    prompts = [rand_prompt(2 * WINDOW + 5 + i, 140 + i) for i in range(3)]
    eng.generate_sync(prompts, [replace(SAMPLED, seed=1, max_tokens=4), replace(GREEDY, max_tokens=4),
                                replace(SAMPLED, seed=2, max_tokens=4)])
    assert per_step == [1] * 4, per_step  # the prefill step's first tokens, then three decode steps
    assert inside == ([True] * 3 if mode == "static" else [])
    samplings = checks[1::2]  # each step: its forward's check, then its sampling's
    assert len(samplings) == 4 and all(len(c.syncs) == 1 and c.syncs[0].startswith("Tensor.tolist (step.py:")
                                       and c.syncs[0].endswith("in _sample)") for c in samplings), \
        [c.syncs for c in samplings]
    assert all(graphs.waits(c) == [] for c in checks)


def test_the_check_sees_what_would_return_to_the_host():
    x = torch.arange(6)
    with graphs.HostSyncCheck() as check:
        x[x > 2]
        x.nonzero()
        x[1].item()
        x.tolist()
        if x.sum() > 3:
            pass
        torch.tensor([1, 2])
        x.repeat_interleave(2)  # a Python count: fine
    assert [s.split(" (")[0] for s in check.syncs] == [
        "aten.index by a boolean mask", "aten.nonzero", "aten._local_scalar_dense", "Tensor.tolist",
        "aten._local_scalar_dense"]
    assert all("test_graphs.py" in s for s in check.found), check.found
    assert [s.split(" (")[0] for s in check.frozen] == ["torch.tensor of Python values"]
    assert "tolist" not in torch.Tensor.__dict__  # the patch is undone


def test_a_cuda_wait_the_dispatcher_never_sees_is_named_once(monkeypatch):
    """Where CUDA is initialised the check turns on its sync debug mode: a synchronizing call no
    dispatched op accounts for (torch.tensor's own upload) is named by its line; one inside an op the
    check already names (tolist) is not named twice; other warnings still reach the user. Here the
    CUDA side is simulated: the mode is recorded, and the warning is the one CUDA's would be."""
    import threading
    import warnings

    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    sync = "called a synchronizing CUDA operation"
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (warnings.warn(sync), original(t))[1])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with graphs.HostSyncCheck() as check:
            warnings.warn(sync)  # the upload inside torch.tensor(values, device="cuda")
            torch.arange(3).tolist()
            warnings.warn("something else")
            other = threading.Thread(target=warnings.warn, args=(sync,))  # another thread's wait: not counted
            other.start()
            other.join()
    assert modes == ["warn", 0]
    assert [s.split(" (")[0] for s in check.syncs] == ["cuda: a synchronizing call", "Tensor.tolist"], check.syncs
    assert "test_graphs.py" in check.syncs[0] and "from the host, blocking" in check.syncs[0]
    assert [str(w.message) for w in seen] == ["something else", sync]  # passed on as they came


def _staged_only(check) -> list[str]:
    """The host values a check saw entering the step by any other way than kernels._backend.staged
    (pinned, copied without blocking): a `torch.tensor(values, device="cuda")` there blocks the host."""
    return [f for f in check.frozen if "in staged)" not in f]


def test_sampling_and_statistics_after_the_step_never_wait_for_the_device():
    """What runs between a replay and the step's `.tolist()`: no sync (host values go in, none come out),
    and every host value goes in through `staged`, never a blocking copy."""
    logits = torch.randn(5, 50)
    import random

    gens = [random.Random(i) for i in range(5)]
    for temps in ([0.0, 0.7, 1.0, 0.0, 0.5], [0.7] * 5, [0.0] * 5):
        with graphs.HostSyncCheck() as check:
            toks = sample(logits, temps, [0, 5, 0, 0, 20], [1.0, 0.9, 0.8, 1.0, 1.0], gens)
            stats_from_logits(logits, toks, 4)
        assert check.syncs == [] and _staged_only(check) == [], (temps, check.found)


def test_a_dynamic_step_reads_nothing_back_and_stages_what_it_sends(interp):
    """The steps that do not replay a graph (prefill chunks, mixed steps) on the Triton path, in place:
    paged prefill lays out its tiles from the step's host lengths (it read the device's lengths back in
    every layer), the runner and the sampler stage their numbers; the only reads are the sampled
    tokens and their statistics."""
    model = make_zoo_model("llama")
    eng = engine(model, cuda_graphs="off", kernel_impl="triton")
    assert "paged-prefill:triton" in eng.info["attention"]
    checks = graphs.watch_steps(eng)
    prompts = [rand_prompt(2 * WINDOW + 5 + i, 110 + i) for i in range(3)]
    got = eng.generate_sync(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.completions[0].token_ids for o in got] == [loop_greedy(model, p, 4) for p in prompts]
    assert len(checks) == 8  # four steps, each a forward and a sampling
    for check in checks:
        assert graphs.waits(check) == [], check.syncs
        assert _staged_only(check) == [], check.frozen


@pytest.mark.parametrize("name,kw", [("deepseek-v3", dict(kernel_impl="triton")), ("deepseek-v3", {}), ("gpt-oss", {})],
                         ids=["mla-triton", "mla-torch", "gather"])
def test_prefill_over_a_cached_context_reads_nothing_back(interp, name, kw):
    """A prefill chunk that continues a cached context: the latent layers' distinct slots (a unique
    on the GPU waited for it), and the gather path's padded rows (a nonzero did), are found on the host
    from the block tables (an H200 listed both in every prefill step)."""
    model = make_zoo_model(name)
    eng = engine(model, cuda_graphs="off", **kw)
    checks = graphs.watch_steps(eng)
    prompts = [rand_prompt(2 * WINDOW + 5 + i, 110 + i) for i in range(3)]
    eng.generate_sync(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    got = eng.generate_sync(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.completions[0].token_ids for o in got] == [loop_greedy(model, p, 4) for p in prompts]
    assert sorted({s for c in checks for s in graphs.waits(c)}) == []


def test_the_prefill_tiles_are_laid_out_once_per_step():
    from svrmad_local.kernels import paged_prefill as _  # noqa: F401
    import importlib

    pp = importlib.import_module("svrmad_local.kernels.paged_prefill")
    a = pp._tiles([0, 3, 40], [10, 37], 16, torch.device("cpu"))
    assert a.tolist() == [[0, 0, 3, 7], [1, 3, 16, 0], [1, 19, 16, 16], [1, 35, 5, 32]]
    assert pp._tiles([0, 3, 40], [10, 37], 16, torch.device("cpu")) is a  # the next layer of the step
    assert pp._tiles([0, 3, 40], [11, 37], 16, torch.device("cpu")) is not a


def test_dynamic_rope_keeps_graphs_off_and_says_where():
    from transformers import AutoModelForCausalLM
    from transformers import CONFIG_MAPPING as C

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(C["llama"](rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                                        **_COMMON)).eval()
    eng = engine(model, cuda_graphs="static")  # the static path runs eagerly; the probe names the branch
    assert eng.runner.static.found and all("dynamic_frequency_update" in s for s in eng.runner.static.found)
    prompts = [rand_prompt(2 * WINDOW + 5 + i, 70 + i) for i in range(3)]
    assert [o.completions[0].token_ids for o in eng.generate_sync(prompts, GREEDY)] == \
        [loop_greedy(model, p, NEW) for p in prompts]


def test_packed_moe_experts_are_named_as_what_returns_to_the_host(tmp_path):
    from .quant_zoo import write_gpt_oss

    q, _ = write_gpt_oss(tmp_path)
    eng = Engine.from_pretrained(q, kv_cache_memory=4 * 2**20, block_size=4, cuda_graphs="static")
    assert any("modules.py" in s and "_unique2" in s for s in eng.runner.static.found), eng.runner.static.found


def test_modes_and_refusals(zoo):
    name, model = zoo
    auto = engine(model)
    assert auto.runner.static is None and auto.info["cuda_graphs"].startswith("off: cpu: CUDA graphs need a CUDA device")
    with pytest.raises(ValueError, match="cuda_graphs='on' cannot run here: cpu: CUDA graphs need a CUDA device"):
        engine(model, cuda_graphs="on")
    with pytest.raises(ValueError, match="cuda_graphs must be one of auto, on, static, off, got 'yes'"):
        engine(model, cuda_graphs="yes")
    if any(s.kind == "kv" for s in auto.spec.layers):
        with pytest.raises(ValueError, match="static.*decode attention gathers the context"):
            engine(model, cuda_graphs="static", attention="sdpa")
    with pytest.raises(ValueError, match="cascade attention plans its levels on the host"):
        engine(model, cuda_graphs="static", cascade="on")
    eng = engine(model, cuda_graphs="static")
    r = eng.runner
    assert graphs.why_off("static", r.device, r.paths, r.spec, [t.device for t in r.cache.k], Group((0, 1), 0)) is None  # the static path runs under --tp
    if eng.spec.has_latent:
        with pytest.raises(ValueError, match="mla='expanded'"):
            engine(model, cuda_graphs="static", mla="expanded")


def test_graphs_under_tensor_parallel_need_collectives_a_graph_records(monkeypatch):
    """On a CUDA device, graphs under --tp need NCCL (its all-reduce runs on the device and is captured);
    over gloo (SVRMAD_DIST_BACKEND=gloo) the all-reduces go through the host: graphs off, saying so,
    while the static path still runs."""
    eng = engine(make_zoo_model("llama"), cuda_graphs="static")
    monkeypatch.setattr(graphs, "can_capture", lambda device: True)
    group = Group((0, 1), 0)
    r = eng.runner
    where = (r.device, r.paths, r.spec, [t.device for t in r.cache.k])
    for backend, why in (("gloo", "tensor parallel over gloo: its all-reduces go through the host"), ("nccl", None)):
        monkeypatch.setattr(tp, "graphs_record_collectives", lambda g, _b=backend: _b == "nccl")
        got = graphs.why_off("auto", *where, group)
        assert (got is None) if why is None else got.startswith(why), (backend, got)
        assert graphs.why_off("static", *where, group) is None
    assert graphs.why_off("auto", *where, None) is None


def test_the_scratch_block_is_never_handed_out():
    model = make_zoo_model("llama")
    eng = engine(model, cuda_graphs="static", kv_cache_memory=48 * 1024)  # a small cache: sequences evict
    cache_blocks = eng.built.cache.k[0].shape[0] // eng.cfg.block_size
    assert eng.blocks.num_blocks == cache_blocks - 1 == eng.runner.static.scratch
    owned = set()
    schedule = eng.scheduler.schedule

    def watching():
        batch = schedule()
        owned.update(b for w in batch.work for b in w.seq.blocks)
        return batch

    eng.scheduler.schedule = watching
    prompts = [rand_prompt(20 + i, 80 + i) for i in range(6)]
    out = eng.generate_sync(prompts, GREEDY)
    assert eng.runner.static.scratch not in owned and owned
    assert [o.completions[0].token_ids for o in out] == [loop_greedy(model, p, NEW) for p in prompts]


def test_sizes_and_widths():
    assert graphs.batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graphs.batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graphs.batch_sizes(1) == [1]
    assert graphs.widths(256) == [8, 16, 32, 64, 128, 256]
    assert graphs.widths(100) == [8, 16, 32, 64, 100]
    assert graphs.widths(3) == [3]
    # bounded: GPT-OSS-120B's 131,072 positions in 16-token blocks step by 4 (6 widths, not 11)
    assert graphs.widths(8192) == [8, 32, 128, 512, 2048, 8192]
    assert graphs.widths(512, most=7) == [8, 16, 32, 64, 128, 256, 512]
    assert all(len(graphs.widths(n)) <= graphs.MAX_WIDTHS for n in range(1, 70_000, 997))


@pytest.mark.parametrize("name", ["llama", "gpt-oss", "deepseek-v3"])
def test_the_gpu_kernels_in_the_static_step_never_return_to_the_host(interp, name):
    """What a graph on a GPU records: the Triton decode kernels (paged, absorbed MLA), run here by
    Triton's interpreter inside the static step; nothing returns to the host, tokens stay exact."""
    model = make_zoo_model(name)
    eng = engine(model, cuda_graphs="static", kernel_impl="triton")
    assert eng.runner.paths.inplace_decode == "triton" and eng.runner.static.found == [], eng.runner.static.found
    prompts = [rand_prompt(2 * WINDOW + 5 + i, 90 + i) for i in range(3)]
    got = eng.generate_sync(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [o.completions[0].token_ids for o in got] == [loop_greedy(model, p, 5) for p in prompts], name


def test_on_a_gpu_the_step_samples_with_two_triton_kernels(interp, monkeypatch):
    """What a GPU's steps sample with (emulated: the kernels in Triton's interpreter, the CPU's compiled
    sampling set aside): the static step and the eager steps sample through kernels/sample_pack.py,
    nothing returns to the host in the static step, and the tokens are the torch ops' (greedy: the
    cache-free loop's), log-probs and entropies within float rounding of theirs. (Which steps take the
    kernels: `fuses`, checked last.)"""
    from svrmad_local.engine import sampler as sampler_mod
    from svrmad_local.kernels import cpu_ops, sample_pack

    model = make_zoo_model("qwen3")
    monkeypatch.setattr(cpu_ops, "samples", lambda logits: False)
    prompts = [rand_prompt(9 + 4 * i, 40 + i) for i in range(3)]
    params = [GREEDY, replace(SAMPLED, seed=11, n=2, topk_logprobs=20)]
    calls = []
    inner = sample_pack.sample_pack
    monkeypatch.setattr(sample_pack, "sample_pack", lambda *a: calls.append(a[0].shape[0]) or inner(*a))

    def run(fused: bool):
        monkeypatch.setattr(sampler_mod, "fuses", (lambda *a: True) if fused else (lambda *a: False))
        eng = engine(model, cuda_graphs="static")
        assert eng.runner.static.found == [], eng.runner.static.found
        out = [[(c.token_ids, c.logprobs, c.entropies) for o in eng.generate_sync(prompts, p) for c in o.completions]
               for p in params]
        eng.close()
        return out

    fused, torch_ops = run(True), run(False)
    assert len(calls) > 2 * NEW
    for got, ref in zip(fused, torch_ops):
        for (tok, lp, ent), (tok_r, lp_r, ent_r) in zip(got, ref):
            assert tok == tok_r
            torch.testing.assert_close(torch.tensor(lp), torch.tensor(lp_r), atol=2e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(ent), torch.tensor(ent_r), atol=1e-4, rtol=1e-5)
    assert [c[0] for c in fused[0]] == [loop_greedy(model, p, NEW) for p in prompts]
    monkeypatch.undo()
    logits = torch.randn(2, 1000)
    assert sampler_mod.fuses(logits, 40, 20, "triton") and not sampler_mod.fuses(logits, 40, 20, "torch")
    assert not sampler_mod.fuses(logits, 40, 20, "auto")  # CPU tensors: the compiled sampling or the torch ops
    assert not sampler_mod.fuses(logits, 1000, 20, "triton") and not sampler_mod.fuses(logits.double(), 40, 20, "triton")



def test_the_steps_sample_by_the_row_counts_the_build_chose(interp, monkeypatch):
    """Where the build timed torch's ops faster at some row counts (sampler.FusedRows, the runner's
    `sampling`), the static step and the eager steps at those counts sample with torch's ops, elsewhere
    with the kernels; greedy tokens the cache-free loop's either way."""
    from svrmad_local.engine import sampler as sampler_mod
    from svrmad_local.kernels import cpu_ops, sample_pack

    model = make_zoo_model("qwen3")
    monkeypatch.setattr(cpu_ops, "samples", lambda logits: False)
    calls = []
    inner = sample_pack.sample_pack
    monkeypatch.setattr(sample_pack, "sample_pack", lambda *a: calls.append(a[0].shape[0]) or inner(*a))
    eng = engine(model, cuda_graphs="static", kernel_impl="triton")
    eng.runner.sampling = sampler_mod.FusedRows(((1, True), (2, False)))
    calls.clear()  # the build's probe step
    one = [rand_prompt(9, 50)]
    assert [o.completions[0].token_ids for o in eng.generate_sync(one, GREEDY)] == [loop_greedy(model, one[0], NEW)]
    assert len(calls) == NEW and set(calls) == {1}
    calls.clear()
    three = [rand_prompt(9 + 4 * i, 60 + i) for i in range(3)]
    got = eng.generate_sync(three, GREEDY)
    assert [o.completions[0].token_ids for o in got] == [loop_greedy(model, p, NEW) for p in three]
    assert calls == []
    eng.close()


def test_the_build_hands_its_sampling_choice_to_the_runner_and_the_record(monkeypatch):
    from svrmad_local.engine import choices
    from svrmad_local.engine import sampler as sampler_mod
    from svrmad_local.engine.execution import Choice

    rule = sampler_mod.FusedRows(((1, False), (8, True)))
    monkeypatch.setattr(choices, "sampling_choice", lambda *a, **k: (rule, Choice("sampling", str(rule), "by the test")))
    eng = engine(make_zoo_model("llama"))
    assert eng.runner.sampling is rule and eng.execution.sampling.reason == "by the test"
    assert "sampling torch's ops at 1 row, Triton kernels at 2+ rows" in eng.execution.line()
    eng.close()

# torch ops that launch no kernel: views, metadata, allocations (an empty tensor is not computed)
_NO_KERNEL = {"view", "unsqueeze", "squeeze", "select", "slice", "transpose", "t", "expand", "as_strided", "permute",
              "split", "split_with_sizes", "detach", "_unsafe_view", "alias", "unbind", "lift_fresh", "narrow",
              "_reshape_alias", "empty", "empty_strided", "empty_like", "new_empty", "promote_types", "result_type",
              "sym_size", "sym_stride", "sym_numel", "is_same_size", "dim"}
_MAYBE_COPY = {"to", "contiguous", "reshape"}  # a kernel only where the result is not the input's own memory


def _step_census(model, monkeypatch, **kw) -> tuple[Counter, Counter]:
    """(Triton kernels, kernel-launching torch ops) of one static decode step over the GPU's kernels, run
    here by Triton's interpreter: the fused ops, the in-place decode attention and the sampling kernels
    (the CPU's compiled sampling set aside), one sequence after a 9-token prompt. `kw`: more of the
    engine's settings."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    from svrmad_local.kernels import cpu_ops

    triton_calls, torch_ops, state = Counter(), Counter(), {"on": False, "inside": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            out = func(*args, **(kwargs or {}))
            copied = name not in _MAYBE_COPY or out.data_ptr() != args[0].data_ptr()
            if state["on"] and not state["inside"] and name not in _NO_KERNEL and copied:
                torch_ops[name] += 1
            return out

    launch = interpreter.GridExecutor.__call__

    def counted(self, *a, **k):
        if state["on"] and not state["inside"]:
            triton_calls[self.fn.__name__] += 1
        state["inside"] += 1
        try:
            return launch(self, *a, **k)
        finally:
            state["inside"] -= 1

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)
    monkeypatch.setattr(cpu_ops, "samples", lambda logits: False)
    eng = engine(model, cuda_graphs="static", kernel_impl="triton", **kw)
    forward, seen = graphs.StaticDecode._forward, []

    def first(self, P, W):
        if seen:
            return forward(self, P, W)
        seen.append(P)
        state["on"] = True
        try:
            with Count():
                return forward(self, P, W)
        finally:
            state["on"] = False

    monkeypatch.setattr(graphs.StaticDecode, "_forward", first)
    eng.generate_sync([rand_prompt(9, 3)], SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True, seed=2))
    eng.close()
    assert seen, "no static decode step ran"
    return triton_calls, torch_ops


def test_a_decode_layer_on_the_gpu_path_is_six_kernels(interp, monkeypatch):
    """What a GPU's decode step launches (the kernels in Triton's interpreter, counted in the static step, the
    linears as a GPU lays them out: q/k/v and gate/up fused on their plain weights, models/linear.fuse_dense,
    each through the skinny kernel): a layer more is the q/k/v linear with the add + RMSNorm before it in its
    prologue, q/k norm + RoPE + the cache write, the attention (one split at a short context: no merge), o_proj,
    the gate/up linear with its add + RMSNorm, and down with SiLU(gate) * up in its prologue, and nothing else
    (no norm, no act_mul, no copy of the attention's output, no torch op at all); outside the layers, the final
    norm, the LM head, and sampling and statistics in two kernels."""
    from svrmad_local.kernels import _backend
    from svrmad_local.models.linear import fuse_dense
    from tests import model_zoo

    if not _backend.interpreter_ready():
        pytest.skip("Triton's interpreter is not available in this process")
    counts = {}
    for layers in (2, 4):
        monkeypatch.setitem(model_zoo._COMMON, "num_hidden_layers", layers)
        model = make_zoo_model("qwen3")
        assert len(model.model.layers) == layers
        fuse_dense(model)
        counts[layers] = _step_census(model, monkeypatch, gemv="skinny", linear="aten")
        monkeypatch.undo()
    (t2, ops2), (t4, ops4) = counts[2], counts[4]
    per_layer = {k: (t4[k] - t2[k]) // 2 for k in t4 | t2}
    assert per_layer == {"_rms_norm_kernel": 0, "_skinny_kernel": 4, "_rope_store_kernel": 1, "_decode_split_kernel": 1,
                         "_vocab_kernel": 0, "_finish_kernel": 0}, per_layer
    assert sum(per_layer.values()) == 6
    assert t2["_vocab_kernel"] == t2["_finish_kernel"] == t2["_rms_norm_kernel"] == 1  # the final norm
    assert t2["_skinny_kernel"] == 2 * 4 + 1  # + the LM head
    assert ops4 == ops2, (ops2, ops4)  # no torch op grows with the layers
    # the only torch ops of the step: the embedding, and here the RoPE table's rows (engine/families.Rotary: grown
    # on the CPU, filled at build on a GPU): no linear, no sampling op, no copy of the draws or logits
    assert set(ops2) <= {"embedding", "max", "item", "index_select"}, ops2


def test_split_k_o_proj_and_down_leave_their_sums_to_the_next_norm(interp, monkeypatch):
    """The same step with every linear split over two K shares: the q/k/v and gate/up linears (read by RoPE and
    by down) and the LM head (by sampling) sum their shares in their own kernel; o_proj and down leave theirs
    (kernels/shares.py) to the add + RMSNorm after them, inside the next normed linear's prologue (the last
    down's: the final norm): two sum kernels a layer, not four, and nothing else more."""
    from svrmad_local.kernels import _backend, skinny
    from svrmad_local.models.linear import fuse_dense
    from tests import model_zoo

    if not _backend.interpreter_ready():
        pytest.skip("Triton's interpreter is not available in this process")
    halves = (skinny.Config(16, 16, 2), skinny.Config(16, 16, 2, dot=True))
    counts = {}
    for layers in (2, 4):
        monkeypatch.setitem(model_zoo._COMMON, "num_hidden_layers", layers)
        monkeypatch.setattr(skinny, "default", lambda rows: halves[rows > skinny.BROADCAST_ROWS])
        model = make_zoo_model("qwen3")
        fuse_dense(model)
        counts[layers] = _step_census(model, monkeypatch, gemv="skinny", linear="aten")[0]
        monkeypatch.undo()
    t2, t4 = counts[2], counts[4]
    per_layer = {k: (t4[k] - t2[k]) // 2 for k in t4 | t2}
    assert per_layer == {"_rms_norm_kernel": 0, "_skinny_kernel": 4, "_sum_shares_kernel": 2, "_rope_store_kernel": 1,
                         "_decode_split_kernel": 1, "_vocab_kernel": 0, "_finish_kernel": 0}, per_layer
    assert t2["_sum_shares_kernel"] == 2 * 2 + 1  # + the LM head's


class StandIn:
    """torch.cuda's graph API replaced on the CPU: a "capture" runs the step once (as the real capture
    does, recording instead of computing) and its replay recomputes that shape from the static buffers
    into the captured output (what a real replay does); `_backend.capturing()` is true inside it, as
    on a GPU; `fail(P, W)` says which captures raise (and what); `device_bytes` grows by `per_graph`
    bytes with each graph captured, standing in for the pool's memory."""

    def __init__(self, monkeypatch, fail=lambda P, W: None, per_graph: int = 1000):
        import contextlib

        from svrmad_local.kernels import _backend

        self.made, self.active = 0, None
        stand_in = self

        class Graph:
            def replay(self):
                self.recompute()

        @contextlib.contextmanager
        def graph(g, pool=None, capture_error_mode="global"):
            self.active = g
            try:
                yield
            finally:
                self.active = None
            self.made += 1

        forward = graphs.StaticDecode._forward

        def recorded(static, P, W):
            out = forward(static, P, W)
            g = stand_in.active
            if g is not None:
                err = fail(P, W)
                if err is not None:
                    raise err
                def recompute():
                    again = forward(static, P, W)
                    out.hidden.copy_(again.hidden)
                    if out.packed is not None:
                        out.packed.copy_(again.packed)

                g.recompute = recompute
            return out

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
        monkeypatch.setattr(graphs.StaticDecode, "_forward", recorded)
        monkeypatch.setattr(graphs, "can_capture", lambda device: True)
        monkeypatch.setattr(graphs, "device_bytes", lambda device: per_graph * self.made)
        monkeypatch.setattr(_backend, "capturing", lambda: self.active is not None)


def test_every_shape_is_captured_at_start_up_and_replayed(monkeypatch):
    """engine/graphs.py's capture path on the CPU with the stand-in graph API: every (batch size, width)
    is captured when the engine is built, before any request; serving captures nothing more, every
    decode step replays, and the tokens stay exact."""
    stand_in = StandIn(monkeypatch)
    model = make_zoo_model("qwen3")
    eng = engine(model)  # cuda_graphs="auto", as on a GPU
    static = eng.runner.static
    assert static.capture and set(static.graphs) == set(static.shapes) and static.failed == {}
    assert len(static.shapes) == len(static.sizes) * len(static.widths) > 4
    made = stand_in.made
    prompts = [rand_prompt(2 * WINDOW + 5 + i, 100 + i) for i in range(3)]
    got = eng.generate_sync(prompts, GREEDY)
    assert [o.completions[0].token_ids for o in got] == [loop_greedy(model, p, NEW) for p in prompts]
    assert stand_in.made == made and static.replays == NEW - 1  # every decode step, the first one too
    assert eng.info["cuda_graphs"] == f"on ({len(static.shapes)} shapes captured, {NEW - 1} steps replayed)"


def test_a_failed_capture_keeps_the_graphs_already_made(monkeypatch):
    """One shape's capture fails (an OOM at the widest table, say): the others are kept and replayed,
    that shape runs the same static step eagerly, the info says which and why."""
    StandIn(monkeypatch, fail=lambda P, W: RuntimeError("CUDA out of memory (injected)") if P == 4 else None)
    model = make_zoo_model("qwen3")
    eng = engine(model)
    static = eng.runner.static
    assert set(static.failed) == {(4, w) for w in static.widths}
    assert set(static.graphs) == set(static.shapes) - set(static.failed)
    prompts = [rand_prompt(2 * WINDOW + 5 + i, 100 + i) for i in range(3)]
    got = eng.generate_sync(prompts, GREEDY)  # 3 sequences in 4 rows: eagerly
    assert [o.completions[0].token_ids for o in got] == [loop_greedy(model, p, NEW) for p in prompts]
    assert static.replays == 0
    one = eng.generate_sync(prompts[0], GREEDY)[0].completions[0].token_ids  # batch 1: replayed
    assert one == loop_greedy(model, prompts[0], NEW) and static.replays >= NEW - 1  # (a cached prompt: NEW)
    info = eng.info["cuda_graphs"]
    assert f"{len(static.widths)} failed, run eagerly (batch 4, width" in info, info
    assert "RuntimeError: CUDA out of memory (injected)" in info, info


def test_the_graphs_memory_comes_out_of_the_kv_budget(monkeypatch):
    """Measured before the cache is sized: the largest shape's capture over a provisional cache, plus one
    output per other shape; the cache holds the budget less that."""
    StandIn(monkeypatch, per_graph=123_456)
    model = make_zoo_model("llama")
    eng = engine(model)
    static = eng.runner.static
    row = model.config.hidden_size * 4 + (3 + 2 * static.topk) * 8  # fp32 hidden states, float64 tokens and statistics
    assert static.sampling
    reserve = 123_456 + sum(p for p, _ in static.shapes[1:]) * row
    assert eng.built.budget.graph_reserve == reserve
    blocks = (eng.built.budget.bytes - reserve) // eng.built.budget.block_bytes
    assert eng.built.cache.k[0].shape[0] == blocks * eng.cfg.block_size and eng.blocks.num_blocks == blocks - 1
    assert eng.info["graph_bytes"] == {"reserved": reserve, "taken": 123_456 * len(static.shapes)}
    tight = 123_456 + 2 * eng.built.budget.block_bytes  # the graphs would leave at most 2 blocks: off, the budget the cache's
    small = engine(model, kv_cache_memory=tight)
    assert small.runner.static is None and small.built.budget.graph_reserve == 0, small.info["cuda_graphs"]
    assert re.match(r"off: the decode graphs take \d+ bytes, leaving less than 3 KV blocks", small.info["cuda_graphs"])
    assert small.blocks.num_blocks == tight // small.built.budget.block_bytes
    with pytest.raises(ValueError, match="cuda_graphs='on' cannot run here: the decode graphs take"):
        engine(model, kv_cache_memory=tight, cuda_graphs="on")
    plain = engine(model, cuda_graphs="static")  # nothing captured: the whole budget is the cache's
    assert plain.built.budget.graph_reserve == 0 and plain.blocks.num_blocks == plain.built.budget.bytes // plain.built.budget.block_bytes - 1


def test_a_kernel_failure_while_capturing_fails_the_capture_not_the_kernel(monkeypatch):
    """Defect 2 end to end: the absorbed MLA kernel's Triton path (taken under "auto", as on a GPU)
    raises only while a graph is captured; the capture fails and is recorded, the kernel is not turned
    off (eager steps keep taking it) and no reference is recorded into a graph."""
    import importlib

    from svrmad_local.kernels import _backend

    mla_mod = importlib.import_module("svrmad_local.kernels.mla_decode")
    stand_in = StandIn(monkeypatch)
    monkeypatch.setattr(_backend, "_disabled", {})
    calls = []

    def triton_path(*args):
        if _backend.capturing():
            raise RuntimeError("operation not permitted when stream is capturing (injected)")
        calls.append(1)
        return mla_mod.reference_mla_decode(*args[:8])  # (the kernel's own tiling arguments dropped)

    monkeypatch.setattr(mla_mod, "resolve_impl", lambda impl, dev, name: "triton")
    monkeypatch.setattr(mla_mod, "_mla_triton", triton_path)
    model = make_zoo_model("deepseek-v3")
    eng = engine(model)
    static = eng.runner.static
    assert static.graphs == {} and set(static.failed) == set(static.shapes) and stand_in.made == 0
    assert all("stream is capturing (injected)" in why for why in static.failed.values())
    assert _backend._disabled == {}
    calls.clear()
    prompts = [rand_prompt(2 * WINDOW + 5 + i, 120 + i) for i in range(2)]
    got = eng.generate_sync(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.completions[0].token_ids for o in got] == [loop_greedy(model, p, 4) for p in prompts]
    assert calls and _backend._disabled == {}  # the eager steps took the "Triton" path
