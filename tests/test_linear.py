"""The CPU linear backends (models/linear.py): our panels and oneDNN's layout, packed once, in place
of the dense weights, exact against a reference on the same backend, within fp32 rounding of plain
F.linear."""

from __future__ import annotations

import gc

import pytest
import torch

from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.params import SamplingParams
from svrmad_local.kernels import cpu_linear
from svrmad_local.models import layouts
from svrmad_local.models.linear import FusedPart, PackedLinear, PanelEmbedding, relayout, select_linear, weight_bytes

from .model_zoo import EXACT, full_logprobs, loop_greedy, make_zoo_model, rand_prompt

ONEDNN = torch.backends.mkldnn.is_available()
needs_onednn = pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN")
BACKENDS = [pytest.param("onednn", marks=needs_onednn),
            pytest.param("panels", marks=pytest.mark.skipif(not cpu_linear.available(),
                                                            reason=f"no panel kernel: {cpu_linear.unavailable_reason()}"))]
NAMES = {"onednn": "oneDNN packed", "panels": "panels"}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# fp32 reassociation: oneDNN sums in another order than MKL, so log-probs move by ~1e-6 on these models
LOGPROB_TOL = 1e-4


def engine(model, **kw):
    kw.setdefault("kv_cache_memory", 4 * 2**20)
    kw.setdefault("block_size", 4)
    return Engine(model, None, EngineConfig(**kw))


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_linears_replace_the_dense_ones_and_match_f_linear(backend):
    model = make_zoo_model("llama")
    plain = {n: (m.weight.detach().clone(), m.in_features) for n, m in model.named_modules()
             if type(m) is torch.nn.Linear}
    before = weight_bytes(model)
    what = select_linear(model, backend).line
    layers = len(model.model.layers)  # q/k/v one GEMM, gate/up one GEMM: 7 linears a layer in 4 calls
    assert what.startswith(f"{NAMES[backend]} ({len(plain)} linears, float32), as {4 * layers + 1} GEMMs")
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert before <= weight_bytes(model) <= 1.1 * before  # panels pad to 16 columns
    for name, (w, k) in plain.items():
        m = model.get_submodule(name)
        fused = name.rpartition(".")[2] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        assert isinstance(m, FusedPart if fused else PackedLinear), name
        x = torch.randn(5, k)
        torch.testing.assert_close(m(x), x @ w.T, rtol=1e-5, atol=1e-5)
        assert torch.equal(m.dense_weight(), w)
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, 64)
    q = attn.q_proj(x)
    assert attn.k_proj(x).data_ptr() == q.data_ptr() + attn.q_proj.out_features * 4  # one GEMM served both
    assert not select_linear(make_zoo_model("llama"), backend, fuse=False).line.count("fused")


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_weight_is_packed_once_over_a_generate(monkeypatch, backend):
    calls = []
    if backend == "onednn":
        real = layouts._reorder
        monkeypatch.setattr(layouts, "_reorder", lambda w, hint: calls.append(tuple(w.shape)) or real(w, hint))
    else:
        real = cpu_linear.pack
        monkeypatch.setattr(cpu_linear, "pack", lambda w: calls.append(tuple(w.shape)) or real(w))
    model = make_zoo_model("qwen2")  # q/k/v (with biases) and gate/up fused: 4 packed matrices a layer
    n = 4 * len(model.model.layers) + 1
    eng = engine(model, linear=backend)
    eng.generate_sync([rand_prompt(11, 1), rand_prompt(5, 2)], GREEDY)
    eng.generate_sync([rand_prompt(7, 3)], GREEDY)
    assert len(calls) == n
    second = engine(model)  # a second engine on the same model does not pack it again
    second.generate_sync([rand_prompt(9, 4)], GREEDY)
    assert len(calls) == n and "packed by an earlier engine" in second.info["linear"]
    with pytest.raises(ValueError, match=f"were packed as {NAMES[backend]} by an earlier engine"):
        engine(model, linear="aten")


RSS_SCRIPT = """
import gc, psutil, torch
from svrmad_local.models.linear import select_linear, weight_bytes
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)]).eval()  # ~100 MB
size = weight_bytes(model)
from svrmad_local.kernels import cpu_linear
cpu_linear.available()  # the panel kernel's library (~12 MB of code) loads before the measure, not in it
gc.collect()
rss0 = psutil.Process().memory_info().rss
select_linear(model, BACKEND)
gc.collect()
print((psutil.Process().memory_info().rss - rss0) / size)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_packing_does_not_keep_the_dense_weights(backend):
    import subprocess
    import sys
    import weakref

    model = make_zoo_model("llama")
    dense = [weakref.ref(m.weight) for m in model.modules() if type(m) is torch.nn.Linear]
    select_linear(model, backend)
    gc.collect()
    assert all(r() is None for r in dense), "a dense weight outlived its packing"
    # resident memory, in a fresh process (the engine's allocator settings keep freed memory in the heap)
    pytest.importorskip("psutil")
    grown = float(subprocess.run([sys.executable, "-c", RSS_SCRIPT.replace("BACKEND", repr(backend))], capture_output=True, text=True,
                                 check=True).stdout.split()[-1])
    assert grown <= 0.1, f"packing grew the process by {grown:.0%} of the weights"


@needs_onednn
def test_a_tied_lm_head_runs_on_the_shared_dense_matrix():
    model = make_zoo_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight
    before = weight_bytes(model)
    x = torch.randn(3, 64)
    want = x @ model.lm_head.weight.detach().T
    what = select_linear(model, "onednn").line
    assert "the tied LM head on its shared dense weight" in what
    head = model.lm_head
    assert isinstance(head, PackedLinear) and not head.packed and head.weight is model.model.embed_tokens.weight
    assert weight_bytes(model) == before  # no second copy of the matrix
    torch.testing.assert_close(head(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_linear.available(), reason=f"no panel kernel: {cpu_linear.unavailable_reason()}")
def test_a_tied_lm_head_and_its_embedding_share_one_panel_matrix():
    model = make_zoo_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight
    dense = model.lm_head.weight.detach().clone()
    before = weight_bytes(model)
    x, ids = torch.randn(3, 64), torch.tensor([[0, 5, 127, 5]])
    want = x @ dense.T
    assert "the tied LM head and the embedding share its panels" in select_linear(model, "panels").line
    head, emb = model.lm_head, model.model.embed_tokens
    assert isinstance(head, PackedLinear) and head.packed and emb.weight is head.weight
    assert weight_bytes(model) <= 1.1 * before  # one matrix, padded to 16 columns
    torch.testing.assert_close(head(x), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(emb(ids), dense[ids])  # lookups copy the very values
    state = model.state_dict()
    assert torch.equal(state["model.embed_tokens.weight"], dense) and torch.equal(state["lm_head.weight"], dense)


def test_fallbacks_say_why_and_bad_choices_are_refused(monkeypatch):
    model = make_zoo_model("llama")
    assert select_linear(model, "aten").line == "aten (F.linear), as asked"
    assert any(type(m) is torch.nn.Linear for m in model.modules())
    with pytest.raises(ValueError, match="linear must be one of auto, panels, onednn, aten"):
        select_linear(model, "mkl")
    half = make_zoo_model("llama").half()
    assert "packing is off: torch.float16 weights" in select_linear(half, "auto").line
    with pytest.raises(ValueError, match="linear='onednn' cannot run here: torch.float16 weights"):
        select_linear(half, "onednn")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    bf16 = make_zoo_model("llama").to(torch.bfloat16)
    if cpu_linear.available():  # bf16 panels run on any AVX2 CPU: oneDNN without its bf16 path is not needed
        assert select_linear(bf16, "auto").line.startswith("panels (22 linears, bfloat16)")
    else:
        assert "no avx512_bf16/AMX" in select_linear(bf16, "auto").line
    with pytest.raises(ValueError, match="linear='onednn' cannot run here: bf16 weights on a CPU without a oneDNN bf16"):
        select_linear(make_zoo_model("llama").to(torch.bfloat16), "onednn")
    with pytest.raises(ValueError, match="linear='panels' cannot run here: float16 weights"):
        select_linear(make_zoo_model("llama").half(), "panels")
    monkeypatch.setenv("SVRMAD_CPU_LINEAR", "0")  # no kernel: auto takes oneDNN where it can
    if ONEDNN:
        assert select_linear(make_zoo_model("llama"), "auto").line.startswith("oneDNN packed")
    with pytest.raises(ValueError, match="no panel kernel: SVRMAD_CPU_LINEAR=0"):
        select_linear(make_zoo_model("llama"), "panels")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", EXACT)
def test_engine_is_token_exact_against_a_reference_on_the_same_backend(name, backend):
    model = make_zoo_model(name)
    plain = make_zoo_model(name)  # the same weights (same seed), left on F.linear
    eng = engine(model, linear=backend)
    assert eng.info["linear"].startswith(NAMES[backend])
    prompts = [rand_prompt(n, 50 + n) for n in (3, 12, 21)]
    out = eng.generate_sync(prompts, GREEDY)
    for p, o in zip(prompts, out):
        got = o.completions[0].token_ids
        assert got == loop_greedy(model, p, 8), name  # the reference runs the same packed linears
        ref = full_logprobs(plain, p + got)[len(p) - 1 : -1]
        lp = torch.tensor(o.completions[0].logprobs)
        assert (lp - ref.gather(1, torch.tensor(got)[:, None])[:, 0]).abs().max() < LOGPROB_TOL, name
        if got != loop_greedy(plain, p, 8):  # plain F.linear may differ only where two tokens nearly tie
            top2 = ref.topk(2, -1).values
            assert ((top2[:, 0] - top2[:, 1]) < LOGPROB_TOL).any(), f"{name}: a flip that is not a near-tie"


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_statistics_of_the_default_checkpoint_on_packed_linears(backend):
    """The embedded default (its LM head is tied to the embedding): the statistics the engine
    reports are log_softmax of the logits it sampled from (1e-4), and stay within LOGPROB_TOL of a plain
    transformers forward on F.linear."""
    from svrmad_local.models.default import ensure_default_model
    from svrmad_local.models.loader import load_model

    path = ensure_default_model()
    lm, plain = load_model(path, device="cpu", dtype="fp32"), load_model(path, device="cpu", dtype="fp32")
    eng = Engine(lm.model, lm.tokenizer, EngineConfig(kv_cache_memory=64 * 2**20, linear=backend))
    assert "tied LM head" in eng.info["linear"] and isinstance(lm.model.lm_head, PackedLinear)
    seen = []
    logits_of = eng.runner.logits
    eng.runner.logits = lambda h: seen.append(logits_of(h)) or seen[-1]
    prompt = eng.encode([{"role": "user", "content": "What is 12 times 7? Answer briefly."}])
    out = eng.generate_sync([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].completions[0]
    logp = torch.log_softmax(torch.cat(seen).float(), -1)
    ids = torch.tensor(out.token_ids)
    assert (torch.tensor(out.logprobs) - logp.gather(1, ids[:, None])[:, 0]).abs().max() < 1e-4
    assert (torch.tensor(out.entropies) - -(logp.exp() * logp).sum(-1)).abs().max() < 1e-4
    ref = full_logprobs(plain.model, prompt + out.token_ids)[len(prompt) - 1 : -1]
    assert (torch.tensor(out.logprobs) - ref.gather(1, ids[:, None])[:, 0]).abs().max() < LOGPROB_TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_packed_model_saves_and_reloads_as_a_plain_checkpoint(tmp_path, backend):
    from svrmad_local.models.loader import load_model

    model = make_zoo_model("llama")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    select_linear(model, backend)
    model.save_pretrained(tmp_path)
    again = load_model(tmp_path, device="cpu", dtype="fp32").model
    assert all(torch.equal(again.state_dict()[k], v) for k, v in want.items())


@pytest.mark.skipif(not (ONEDNN and cpu_linear.available()), reason="needs oneDNN and the panel kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relayout_moves_every_weight_exactly_and_keeps_the_tie(dtype):
    """panels -> oneDNN -> F.linear -> panels on a model with a tied head: the same weights (state_dict) at
    each stop, the head and embedding one matrix again, and the same outputs as a model packed so directly."""
    model = make_zoo_model("llama").to(dtype)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[5, 17, 3, 90, 41]])
    select_linear(model, "panels")
    assert isinstance(model.model.embed_tokens, PanelEmbedding)
    for choice in ("onednn", "aten", "panels"):
        sel = relayout(model, choice)
        assert sel.value == {"onednn": "oneDNN packed", "aten": "aten", "panels": "panels"}[choice]
        got = model.state_dict()
        assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items()), choice
        head, emb = model.get_output_embeddings(), model.get_input_embeddings()
        assert choice != "aten" or head.weight is emb.weight
        twin = make_zoo_model("llama").to(dtype)
        twin.load_state_dict(want)
        twin.lm_head.weight = twin.model.embed_tokens.weight
        select_linear(twin, choice)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, twin(ids).logits), choice


# Siblings fused on their plain weights (layouts.DENSE): what "auto" does on a GPU, checked here on the CPU


def test_auto_on_a_gpu_fuses_the_siblings_on_their_plain_weights(monkeypatch):
    """On a device of FUSE_DEVICES (cuda; here the meta device stands in) "auto" packs nothing but fuses
    q/k/v and gate/up into one F.linear each; fuse=False, and devices outside it, keep every module."""
    from svrmad_local.models import linear as linear_mod

    monkeypatch.setattr(linear_mod, "FUSE_DEVICES", ("meta",))
    model = make_zoo_model("llama").to("meta")
    layers, n = len(model.model.layers), sum(type(m) is torch.nn.Linear for m in make_zoo_model("llama").modules())
    sel = select_linear(model, "auto")
    assert sel.value == "aten" and not sel.fell_back
    assert sel.line == f"aten (F.linear) on meta, as {4 * layers + 1} GEMMs (q/k/v and gate/up fused)"
    parts = [m for m in model.modules() if isinstance(m, FusedPart)]
    assert len(parts) == 5 * layers and all(p.group.layout is layouts.DENSE for p in parts)
    assert sum(type(m) is torch.nn.Linear for m in model.modules()) == n - 5 * layers  # o_proj, down, the head
    assert select_linear(model, "auto").value == "aten"  # a second engine on it keeps what the first made
    assert select_linear(make_zoo_model("llama").to("meta"), "auto", fuse=False).line == "aten (F.linear): weights on meta"
    monkeypatch.setattr(linear_mod, "FUSE_DEVICES", ())
    assert select_linear(make_zoo_model("llama").to("meta"), "auto").line == "aten (F.linear): weights on meta"


def test_fused_dense_siblings_compute_their_linears_and_give_up_their_weights():
    """Each part gives its own linear's output (a column slice of one GEMM) and its dense weight; the parts'
    own weights leave the device (a weight still used elsewhere in the model stays); a sibling under an
    accelerate hook is left alone, with its group."""
    import weakref

    from svrmad_local.models.linear import fuse_dense

    model = make_zoo_model("llama")
    first, second = model.model.layers[0], model.model.layers[1]
    second.self_attn.o_proj.weight = first.self_attn.q_proj.weight  # shared with a module that stays
    second.mlp.up_proj._hf_hook = object()  # accelerate's hook: layer 1's gate/up stay apart
    plain = {n: m.weight.detach().clone() for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    owned = [weakref.ref(m.weight) for m in (first.self_attn.k_proj, first.mlp.gate_proj, second.self_attn.v_proj)]
    fuse_dense(model)
    gc.collect()
    assert all(r() is None or r().device.type == "meta" for r in owned), "a fused part's weight stayed on its device"
    assert second.self_attn.o_proj.weight.device.type == "cpu"
    assert type(second.mlp.up_proj) is torch.nn.Linear and type(second.mlp.gate_proj) is torch.nn.Linear
    assert isinstance(first.mlp.up_proj, FusedPart) and isinstance(second.self_attn.k_proj, FusedPart)
    for name, w in plain.items():
        m, x = model.get_submodule(name), torch.randn(5, w.shape[1])
        torch.testing.assert_close(m(x), x @ w.T, rtol=1e-5, atol=1e-5)
        assert torch.equal(m.dense_weight() if isinstance(m, FusedPart) else m.weight, w), name


@pytest.mark.parametrize("name", EXACT)
def test_the_engine_over_fused_dense_siblings_is_token_exact(name):
    from svrmad_local.models.linear import fuse_dense

    model, plain = make_zoo_model(name), make_zoo_model(name)
    fuse_dense(model)
    eng = engine(model, linear="aten")  # what the fused model already runs (Phi-3's projections are one each)
    assert eng.info["linear"].startswith("aten"), eng.info["linear"]
    prompts = [rand_prompt(n, 50 + n) for n in (3, 12, 21)]
    for p, o in zip(prompts, eng.generate_sync(prompts, GREEDY)):
        got = o.completions[0].token_ids
        ref = full_logprobs(plain, p + got)[len(p) - 1 : -1]
        lp = torch.tensor(o.completions[0].logprobs)
        assert (lp - ref.gather(1, torch.tensor(got)[:, None])[:, 0]).abs().max() < LOGPROB_TOL, name
        if got != loop_greedy(plain, p, 8):  # one GEMM sums as the three did, but may block K otherwise
            top2 = ref.topk(2, -1).values
            assert ((top2[:, 0] - top2[:, 1]) < LOGPROB_TOL).any(), f"{name}: a flip that is not a near-tie"
    eng.close()
