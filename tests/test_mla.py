"""MLA in the absorbed form (engine/mla.py) against the expanded form and a cache-free transformers loop,
on the tiny DeepSeek-V3 zoo model: greedy tokens exact, log-probs within 1e-4 (fp32 weights: the two
forms differ only in the order of the same fp32 sums), with forks sharing a prefix, a warm cache, and
steps that mix prefill chunks with decode rows."""

from __future__ import annotations

import pytest
import torch

from svrmad_local.engine import mla
from svrmad_local.engine.context import get_context
from svrmad_local.engine.kv_cache import BlockTables
from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.params import SamplingParams
from svrmad_local.kernels import HAS_TRITON

from .model_zoo import loop_greedy, make_zoo_model, rand_prompt

NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return make_zoo_model("deepseek-v3")


def engine(model, **kw):
    kw.setdefault("kv_cache_memory", 4 * 2**20)
    kw.setdefault("block_size", 4)
    return Engine(model, None, EngineConfig(**kw))


@pytest.fixture
def decode_calls(monkeypatch):
    """Each absorbed decode call: (decode rows, whether the step also has prefill runs)."""
    calls = []
    real = mla.decode_attention

    def spy(module, q, *args, **kw):
        ctx = get_context()
        calls.append((q.shape[0], len(ctx.runs) > ctx.decode_rows))
        return real(module, q, *args, **kw)

    monkeypatch.setattr(mla, "decode_attention", spy)
    return calls


def _prompts():
    head = rand_prompt(11, 1)  # ends inside a block: the later prompts copy its partial block
    return [head + rand_prompt(n, 10 + n) for n in (2, 7, 13)] + [rand_prompt(30, 2)]


def _run(eng, prompts, params):
    return eng.generate_sync(prompts, params)


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert [c.token_ids for c in x.completions] == [c.token_ids for c in y.completions]
        for cx, cy in zip(x.completions, y.completions):
            assert cx.logprobs == pytest.approx(cy.logprobs, abs=TOL)


def test_absorbed_equals_expanded_and_the_loop_with_mixed_steps(model, decode_calls):
    prompts = _prompts()
    refs = [loop_greedy(model, p, NEW) for p in prompts]
    # a small token budget chunks the long prompts' prefill over steps in which the others decode
    absorbed = engine(model, max_num_batched_tokens=12)
    assert "mla-absorbed:torch" in absorbed.info["attention"]
    got = _run(absorbed, prompts, GREEDY)
    assert [o.completions[0].token_ids for o in got] == refs
    assert any(mixed for _, mixed in decode_calls), "no step mixed prefill runs with absorbed decode rows"
    assert any(not mixed for _, mixed in decode_calls)
    expanded = engine(model, max_num_batched_tokens=12, mla="expanded")
    assert "mla-absorbed" not in expanded.info["attention"]
    _assert_same(got, _run(expanded, prompts, GREEDY))
    warm = _run(absorbed, prompts[:3], GREEDY)  # mostly from the cache now
    assert [o.completions[0].token_ids for o in warm] == refs[:3]


def test_forks_sharing_a_prefix(model, decode_calls):
    prompt = _prompts()[2]
    params = SamplingParams(n=3, temperature=0, max_tokens=NEW, ignore_eos=True)
    got = _run(engine(model), [prompt], params)[0]
    assert [c.token_ids for c in got.completions] == [loop_greedy(model, prompt, NEW)] * 3
    assert max(n for n, _ in decode_calls) == 3  # the three forks decode together
    sampled = SamplingParams(n=3, temperature=1.0, max_tokens=NEW, ignore_eos=True, seed=7)
    _assert_same(_run(engine(model, mla="expanded"), [prompt], sampled), _run(engine(model), [prompt], sampled))


@pytest.mark.parametrize("decoder", ["modules", "ours"])
def test_absorbed_steps_expand_only_bounded_chunks_of_prefill_context(model, monkeypatch, decoder):
    """With the absorbed form no step hands transformers' expand_kv or our decoder's kv_b anything (decode
    rows and prefill runs attend from the cache); kv_b_proj expands prefill contexts a chunk at a time
    (engine/mla.py) and nothing in a decode-only step. mla="expanded" still expands the whole context at
    every step (the reference)."""
    attn_cls = type(model.model.layers[0].self_attn)
    seen, rows = [], []
    real = attn_cls.expand_kv

    def spy(self, kv_nope, k_rot):
        seen.append(kv_nope.shape[2])
        return real(self, kv_nope, k_rot)

    def count_ours(eng):  # our loop calls kv_b itself (not through the module's hooks)
        for L in eng.runner.decoder.layers:
            L.latent.kv_b = lambda c, _f=L.latent.kv_b: (seen.append(c.shape[0]), _f(c))[1]

    monkeypatch.setattr(attn_cls, "expand_kv", spy)
    n_layers = len(model.model.layers)
    monkeypatch.setattr(mla, "PREFILL_CHUNK_BYTES", 1)  # one block a chunk
    prompt = rand_prompt(20, 3)
    eng = engine(model, decoder=decoder)
    if decoder == "ours":
        count_ours(eng)
    # (after the build: our decoder refuses a model with hooks, which its loop would skip)
    hooks = [layer.self_attn.kv_b_proj.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]))
             for layer in model.model.layers]
    seen.clear(), rows.clear()  # (the probe at Engine(...) expands two tokens)
    try:
        _run(eng, [prompt], GREEDY)
    finally:
        for h in hooks:
            h.remove()
    assert seen == [] and rows and max(rows) == 4  # block_size 4: one block of the context at a time
    assert len(rows) == n_layers * 20 // 4  # the prefill's 20 tokens in five chunks; no decode step expands
    eng = engine(model, mla="expanded", decoder=decoder)
    if decoder == "ours":
        count_ours(eng)
    seen.clear()
    _run(eng, [prompt], GREEDY)
    assert seen == [n for n in range(20, 20 + NEW) for _ in range(n_layers)]


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_kernel_in_the_engine(model):
    prompts = _prompts()[1:3]
    eng = engine(model, kernel_impl="triton", max_num_batched_tokens=12)
    assert "mla-absorbed:triton" in eng.info["attention"]
    _assert_same(_run(eng, prompts, GREEDY), _run(engine(model, mla="expanded"), prompts, GREEDY))


def test_absorbed_weights_are_cached_per_weight_version():
    model = make_zoo_model("deepseek-v3")  # not the shared one: an engine packs that one's linears for oneDNN
    attn = model.model.layers[0].self_attn
    h = model.config.num_attention_heads
    a = mla.absorbed_weights(attn, h)
    assert mla.absorbed_weights(attn, h)[0] is a[0]  # computed once
    w = attn.kv_b_proj.weight.detach().view(h, -1, attn.kv_lora_rank)
    torch.testing.assert_close(a[0], w[:, : attn.qk_nope_head_dim])
    torch.testing.assert_close(a[1], w[:, attn.qk_nope_head_dim:].transpose(1, 2))
    saved = attn.kv_b_proj.weight.detach().clone()
    try:
        with torch.no_grad():
            attn.kv_b_proj.weight.mul_(2.0)  # a new version: split again
        b = mla.absorbed_weights(attn, h)
        torch.testing.assert_close(b[0], 2 * a[0])
    finally:
        with torch.no_grad():
            attn.kv_b_proj.weight.copy_(saved)


def test_dense_weight_prefers_the_modules_own_dequantization():
    lin = torch.nn.Linear(4, 6, bias=False)
    assert mla.dense_weight(lin) is lin.weight
    lin.dense_weight = lambda: torch.ones(6, 4)
    assert torch.equal(mla.dense_weight(lin), torch.ones(6, 4))


def test_a_bad_mode_is_refused(model):
    with pytest.raises(ValueError, match="mla must be one of absorbed, expanded"):
        engine(model, mla="fast")


def test_bench_mla_runs_and_the_two_forms_agree_at_the_v31_shape():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_mla

    rows = bench_mla.run([20, 37], batch=2, heads=2, dtype=torch.float32, device=torch.device("cpu"), repeat=1)
    assert [r["context"] for r in rows] == [20, 37]
    assert all(r["max_abs_diff"] < 1e-4 and r["expanded_ms"] > 0 and r["absorbed_ms"] > 0 for r in rows)


def test_spec_does_not_import_attention():
    """engine/spec.py and engine/attention.py no longer import each other: the probe finds the step
    context in engine/context.py."""
    import os
    import subprocess
    import sys

    code = ("import sys, svrmad_local.engine.spec as s; "
            "assert 'svrmad_local.engine.attention' not in sys.modules, 'spec imports attention'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_absorbed_decode_never_waits_for_the_device(model):
    """No op of the absorbed decode reads a tensor value back to the host (.item, nonzero, a boolean
    index): the path can be captured in a CUDA graph. Checked on the torch reference's dispatch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    syncing = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    attn = model.model.layers[1].self_attn
    h = model.config.num_attention_heads
    c = torch.randn(64, 1, attn.kv_lora_rank)
    kr = torch.randn(64, 1, attn.qk_rope_head_dim)
    tables = BlockTables(torch.tensor([[3, 1, 0], [2, 0, 0]], dtype=torch.int32),
                              torch.tensor([9, 2], dtype=torch.int32))
    q = torch.randn(2, h, attn.qk_head_dim)
    mla.absorbed_weights(attn, h)  # the once-per-weight split is outside the step
    with torch.inference_mode(), Ops():
        mla.decode_attention(attn, q, c, kr, tables, 4, attn.scaling, "torch")
    assert seen and not syncing & set(seen), sorted(syncing & set(seen))


class _LargestFloat:
    """The bytes of the largest floating tensor any op makes (not in place, not a view) while active."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.bytes = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not func._schema.is_mutable and not func.is_view:
                    for t in out if isinstance(out, (tuple, list)) else (out,):
                        if torch.is_tensor(t) and t.is_floating_point():
                            counter.bytes = max(counter.bytes, t.numel() * t.element_size())
                return out

        self.mode = Mode


def test_prefill_over_a_long_cached_context_expands_one_chunk_at_a_time(model, monkeypatch):
    """A prompt continuing a long cached context: its prefill step makes no tensor larger at a 240-token
    context than at a 60-token one (the context is expanded a chunk of one block at a time), and its
    tokens are the cache-free loop's. mla="expanded" (the whole context at once) grows with it."""
    monkeypatch.setattr(mla, "PREFILL_CHUNK_BYTES", 1)  # one 4-token block a chunk
    largest = {}
    for mode in ("absorbed", "expanded"):
        for n in (60, 240):
            head = rand_prompt(n, 5)
            tail = head + rand_prompt(6, 9)
            eng = engine(model, mla=mode, max_num_batched_tokens=64)
            eng.generate_sync([head], SamplingParams(temperature=0, max_tokens=1))  # the context, now cached
            counter, real = _LargestFloat(), eng.runner.execute

            def counted(step, *rest, _real=real, _counter=counter):
                if step.num_decode:  # decode rows read the whole context by design (the torch reference)
                    return _real(step, *rest)
                with _counter.mode():
                    return _real(step, *rest)

            eng.runner.execute = counted
            got = eng.generate_sync([tail], GREEDY)[0].completions[0].token_ids
            if n == 240:
                assert got == loop_greedy(model, tail, NEW), mode
            largest[mode, n] = counter.bytes
    assert largest["absorbed", 60] == largest["absorbed", 240], largest
    assert largest["expanded", 240] > 2 * largest["expanded", 60], largest


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU check's tests step runs it)")
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_chunks_on_cuda_take_the_memory_efficient_kernel_and_match_fp32(causal):
    """engine/mla.py's chunk attention on a GPU: keys 192 wide, values 128 (DeepSeek's), bf16, through the
    memory-efficient kernel and its log-sum-exp, against the fp32 path the CPU takes."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(n, 16, 192, generator=g, device="cuda", dtype=torch.bfloat16) for n in (64, 64))
    v = torch.randn(64, 16, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    out, lse = mla._attend_cuda(q, k, v, 0.07, causal)
    ref_out, ref_lse = mla._attend_torch(q.cpu(), k.cpu(), v.cpu(), 0.07, causal)
    torch.testing.assert_close(out.cpu(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=2e-2, rtol=1e-3)


def test_a_deep_copy_of_an_engines_model_runs_its_own_weights():
    """The stand-in `expand_kv` an engine installs is bound to its module, so a deep copy (the fp32 truth a
    bf16 check makes from the model) expands through the copy's kv_b_proj, not the original's: in another
    dtype the original's weights would not even multiply."""
    import copy

    model = make_zoo_model("deepseek-v3")
    engine(model, decoder="modules", linear="aten").close()  # (the weights and norms as they were)
    twin = copy.deepcopy(model).to(torch.bfloat16)
    attn = twin.model.layers[0].self_attn
    assert attn.expand_kv.__self__ is attn
    ids = torch.tensor([rand_prompt(9, 1)])
    with torch.no_grad():
        got = twin(ids, use_cache=False).logits
    fresh = make_zoo_model("deepseek-v3").to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(got, fresh(ids, use_cache=False).logits)
