"""Our decoder forward (engine/decoder.py, engine/families.py): the model's own modules' computation, bit for
bit, for every architecture of the zoo (with the swapped norms where the compiled ops run; without any
swap where the torch references run, fp32 and bf16 alike); token-exact against a cache-free reference;
packed MXFP4/FP8 checkpoints included; the static decode path; an architecture not ported runs the
modules and the record says why."""

from __future__ import annotations

import pytest
import torch

from svrmad_local.engine import decoder as decoder_mod
from svrmad_local.engine.decoder import select_decoder
from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.families import FastRMSNorm
from svrmad_local.engine.params import SamplingParams
from svrmad_local.kernels import cpu_ops

from .model_zoo import EXACT, WINDOW, full_logprobs, loop_greedy, make_zoo_model, rand_prompt

SAMPLED = SamplingParams(temperature=0.9, top_k=50, max_tokens=12, ignore_eos=True, seed=5, n=2)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine(model, **kw):
    kw.setdefault("kv_cache_memory", 4 * 2**20)
    kw.setdefault("block_size", 4)
    return Engine(model, None, EngineConfig(**kw))


def outputs(model, prompts, params=SAMPLED, **kw):
    """Tokens, log-probs and entropies of every completion (prompts split into chunks of 16 tokens), and
    the decoder choice the engine recorded."""
    eng = engine(model, max_num_batched_tokens=16, **kw)
    try:
        return ([(c.token_ids, c.logprobs, c.entropies) for o in eng.generate_sync(prompts, params)
                 for c in o.completions], eng.execution.decoder)
    finally:
        eng.close()


PROMPTS = [rand_prompt(n, 70 + n) for n in (3, 17, 2 * WINDOW + 7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", EXACT)
def test_our_forward_is_bitwise_the_modules_forward(name, dtype):
    """Two engines on one model (the first swaps in the fused norms): our decoder and transformers' modules
    give the same tokens, log-probs and entropies, bit for bit, over prefill chunks, decode and forks; in
    bf16 too, where the compiled ops round wherever transformers' bf16 ops round (kernels/cpu_ops.py)."""
    model = make_zoo_model(name).to(dtype)
    ours, choice = outputs(model, PROMPTS, decoder="ours")
    assert choice.value == "ours" and "engine/decoder.py" in choice.reason
    assert any(isinstance(m, FastRMSNorm) for m in model.modules())
    modules, choice = outputs(model, PROMPTS, decoder="modules")
    assert choice.value == "the model's modules"
    assert ours == modules, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", EXACT)
def test_on_the_torch_references_it_is_the_unswapped_modules_bit_for_bit(name, dtype):
    """Where the fused ops run their torch references (a GPU without Triton, a dtype the compiled ops do not
    take, or kernel_impl='torch'), our decoder equals transformers' own forward with its own norms: the references
    are its formulas, op for op."""
    kw = {"kernel_impl": "torch"} if dtype == torch.float32 else {"kernel_impl": "torch", "linear": "aten"}
    ours, choice = outputs(make_zoo_model(name).to(dtype), PROMPTS, decoder="ours", **kw)
    assert "torch reference" in choice.reason
    modules, _ = outputs(make_zoo_model(name).to(dtype), PROMPTS, decoder="modules", **kw)
    assert ours == modules, name


@pytest.mark.parametrize("name", EXACT)
def test_our_engine_is_token_exact_against_a_cache_free_reference(name):
    model = make_zoo_model(name)
    plain = make_zoo_model(name)  # transformers' own norms and F.linear
    eng = engine(model)
    assert eng.execution.decoder.value == "ours"
    prompts = [rand_prompt(n, 90 + n) for n in (4, 13, 2 * WINDOW + 9)]
    out = eng.generate_sync(prompts, GREEDY)
    for p, o in zip(prompts, out):
        got = o.completions[0].token_ids
        assert got == loop_greedy(model, p, GREEDY.max_tokens), name  # the reference runs the same norms, linears
        ref = full_logprobs(plain, p + got)[len(p) - 1 : -1].gather(1, torch.tensor(got)[:, None])[:, 0]
        assert (torch.tensor(o.completions[0].logprobs) - ref).abs().max() < 1e-4, name


TOL = 0.05  # nats: benchmarks/gpu_probe.py's bf16 criterion (a bf16 logit carries ~3 significant digits)
# GPT-OSS's tiny zoo model has a router near-tie on these prompts: at layer 2, experts 1 and 2 score 0.224 and
# 0.226 in transformers' bf16 forward, 0.224 and 0.222 in the engine's (whose MoE block is the model's own
# module, as bitwise in bf16 under the modules as under ours: the torch-reference test above), so a
# different expert runs and one log-prob moves 0.5 nats. That is bf16 routing, not the forward.
BF16 = [n for n in EXACT if n != "gpt-oss"]


@pytest.mark.parametrize("name", BF16)
def test_bf16_stays_as_close_to_fp32_as_transformers_bf16(name):
    """bf16 against an fp32 truth (the same weights, upcast), the GPU check's bf16 rule: every greedy token
    is the argmax of the bf16 reference or of the truth (but at a near tie), and every log-prob is no
    further from the truth than transformers' own bf16 forward is, plus TOL."""
    model = make_zoo_model(name).to(torch.bfloat16)
    truth = make_zoo_model(name)
    with torch.no_grad():
        for p32, p16 in zip(truth.parameters(), model.parameters()):
            p32.copy_(p16.float())
    eng = engine(model, decoder="ours")
    prompts = [rand_prompt(n, 110 + n) for n in (5, 2 * WINDOW + 3)]
    for p, o in zip(prompts, eng.generate_sync(prompts, GREEDY)):
        toks, lps = o.completions[0].token_ids, o.completions[0].logprobs
        rows = slice(len(p) - 1, len(p) - 1 + len(toks))
        ref, r32 = (full_logprobs(m, p + toks)[rows] for m in (model, truth))
        for i, t in enumerate(toks):
            assert min(float(ref[i].max() - ref[i, t]), float(r32[i].max() - r32[i, t])) <= TOL, (name, i)
            assert abs(lps[i] - float(r32[i, t])) <= abs(float(ref[i, t] - r32[i, t])) + TOL, (name, i)
    eng.close()


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt-oss", "deepseek-v3"])
def test_the_static_decode_path_runs_our_forward_bit_for_bit(name):
    """cuda_graphs='static' (what a CUDA graph would record, run eagerly): our decoder and the modules give
    the same bits there too, and nothing in our step returns to the host."""
    model = make_zoo_model(name)
    ours, _ = outputs(model, PROMPTS, cuda_graphs="static", decoder="ours")
    eng = engine(model, cuda_graphs="static", decoder="ours")
    assert eng.runner.decoder is not None and eng.runner.static.found == [], eng.runner.static.found
    eng.close()
    modules, _ = outputs(model, PROMPTS, cuda_graphs="static", decoder="modules")
    assert ours == modules, name


@pytest.mark.parametrize("name", ["gemma3", "qwen3-moe", "phi3-sliding"])
def test_over_the_triton_ops_in_the_interpreter_it_is_token_exact(name):
    """Our decoder over kernels/fused_triton.py in Triton's interpreter (the ops swapped in after build, the
    model's norms with them; attention stays on this CPU's kernels: interpreted, it would take minutes):
    Gemma 3's q/k norms, (1 + w) norms and GELU-tanh, Qwen3-MoE's norms around its experts, Phi-3's fused
    projections; token-exact against a cache-free loop of the same model, log-probs within 1e-4 of
    transformers' own."""
    from svrmad_local.engine.families import swap_norms
    from svrmad_local.kernels import _backend
    from svrmad_local.kernels.fused import Ops

    if not (_backend.HAS_TRITON and _backend.interpreter_ready()):
        pytest.skip("Triton's interpreter is not available in this process")
    model, plain = make_zoo_model(name), make_zoo_model(name)
    eng = engine(model, decoder="ours")
    ops = Ops("cpu", torch.float32, kernel_impl="triton")
    assert ops.impl == "triton"
    swap_norms(model, ops)
    eng.runner.decoder.ops = ops
    p = rand_prompt(2 * WINDOW + 3, 7)
    got = eng.generate_sync([p], GREEDY)[0].completions[0]
    assert got.token_ids == loop_greedy(model, p, GREEDY.max_tokens), name
    ref = full_logprobs(plain, p + got.token_ids)[len(p) - 1 : -1].gather(1, torch.tensor(got.token_ids)[:, None])[:, 0]
    assert (torch.tensor(got.logprobs) - ref).abs().max() < 1e-4, name
    eng.close()


@pytest.mark.parametrize("name", ["llama", "mistral-sliding", "gpt-oss"])
def test_decode_steps_call_the_kernels_themselves(name, monkeypatch):
    """In a step of decode rows only, the loop calls the in-place CPU attention kernel itself (not through
    paged_attention's dispatch; GPT-OSS's sinks and windows passed) and the panel linears without their
    modules' Python; the tests above hold it to the modules' bits."""
    from svrmad_local.kernels import cpu_decode, cpu_linear

    model = make_zoo_model(name)
    eng = engine(model, linear="panels")
    if not (cpu_linear.available() and cpu_decode.available()):
        pytest.skip("the panel or the CPU decode kernel did not build")
    eng.runner.decoder.stack = None  # the loop itself (else its decode steps are one compiled call: test_stack.py)
    calls = {"dispatch": 0, "kernel": 0}
    for fn, key in ((decoder_mod.paged_attention, "dispatch"), (decoder_mod.paged_decode_cpu, "kernel")):
        monkeypatch.setattr(decoder_mod, fn.__name__,
                            lambda *a, _f=fn, _k=key, **kw: (calls.__setitem__(_k, calls[_k] + 1), _f(*a, **kw))[1])
    eng.generate_sync([rand_prompt(9, 1)], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    n = model.config.num_hidden_layers
    assert calls == {"dispatch": n, "kernel": 4 * n}  # the prefill step; four decode steps
    linears = [f for L in eng.runner.decoder.layers for f in (L.o_proj, L.dense.down if L.dense else L.o_proj)]
    assert not any(isinstance(f, torch.nn.Module) for f in linears)


@pytest.mark.parametrize("name", ["gpt-oss", "deepseek"])
def test_packed_checkpoints_run_our_forward_bit_for_bit(name, tmp_path):
    """MXFP4 experts (GPT-OSS) and FP8 linears and experts (DeepSeek-V3), kept packed: our decoder routes
    the rows itself and calls the packed experts as the model's own forward does, and gives its bits."""
    from svrmad_local.models.loader import load_model
    from svrmad_local.models.quant.modules import PackedModule

    from .quant_zoo import write_deepseek, write_gpt_oss

    qdir, _ = write_gpt_oss(tmp_path) if name == "gpt-oss" else write_deepseek(tmp_path)
    model = load_model(qdir, device="cpu", quantization="native").model
    assert any(isinstance(m, PackedModule) for m in model.modules())
    ours, choice = outputs(model, PROMPTS, decoder="ours")
    assert choice.value == "ours"
    modules, _ = outputs(model, PROMPTS, decoder="modules")
    assert ours == modules, name


def _unported():
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from .model_zoo import _COMMON

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG_MAPPING["olmo2"](**_COMMON), dtype=torch.float32).eval()


def test_an_architecture_not_ported_runs_the_modules_and_says_why():
    model = _unported()
    eng = engine(model)
    ex = eng.execution.decoder
    assert ex.value == "the model's modules" and ex.fell_back and "Olmo2DecoderLayer layers, not ported" in ex.reason
    assert "decoder the model's modules: Olmo2DecoderLayer layers, not ported" in eng.execution.line()
    p = rand_prompt(20, 3)
    assert eng.generate_sync([p], GREEDY)[0].completions[0].token_ids == loop_greedy(model, p, GREEDY.max_tokens)
    assert not any(isinstance(m, FastRMSNorm) for m in model.modules())
    eng.close()
    with pytest.raises(ValueError, match="^decoder='ours' cannot run this model: Olmo2DecoderLayer layers, not ported"):
        engine(_unported(), decoder="ours")


def test_the_choice_values_the_old_name_and_the_start_line():
    eng = engine(make_zoo_model("llama"), decoder="lean")  # the old name of "ours", still accepted
    assert eng.execution.decoder.value == "ours" and " · decoder ours · " in eng.execution.line()
    spec = eng.spec
    eng.close()
    with pytest.raises(ValueError, match="decoder must be one of auto, ours, modules .*, got 'fast'"):
        select_decoder(make_zoo_model("llama"), spec, "fast")
    bf16 = engine(make_zoo_model("llama").to(torch.bfloat16), linear="aten")
    if torch.bfloat16 not in cpu_ops.DTYPES:
        assert bf16.execution.decoder.value == "ours" and not bf16.execution.decoder.fell_back
        assert "torch reference (the compiled CPU ops take float32, not bfloat16)" in bf16.execution.decoder.reason
    bf16.close()


def test_without_the_compiled_ops_ours_runs_the_references_and_the_line_says_so(monkeypatch):
    monkeypatch.setenv("SVRMAD_CPU_OPS", "0")
    eng = engine(make_zoo_model("qwen3"))
    ex = eng.execution.decoder
    assert ex.value == "ours" and ex.fell_back
    assert "decoder ours: qwen3, engine/decoder.py; fused ops: torch reference (the fused CPU ops are unavailable: " \
           "SVRMAD_CPU_OPS=0)" in eng.execution.line()
    eng.close()


def test_off_the_cpu_auto_runs_ours_and_says_which_ops():
    """Off the CPU "auto" takes our decoder too (on CUDA over the Triton ops, held to the modules on a GPU by
    tests/test_gpu.py); on a device with neither compiled ops nor Triton it runs the torch references, and
    that is no fallback. Run here on the meta device."""
    eng = engine(make_zoo_model("llama"), decoder="modules")
    spec = eng.spec
    eng.close()
    for choice_name in ("auto", "ours"):
        decoder, choice = select_decoder(make_zoo_model("llama").to("meta"), spec, choice_name)
        assert decoder is not None and decoder.ops.impl == "torch" and choice.value == "ours", choice_name
        assert "fused ops: torch reference" in choice.reason and not choice.fell_back, choice


def test_a_model_our_decoder_ran_saves_and_reloads_with_its_norm_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    for name in ("qwen3", "gemma3"):  # Gemma's norms scale by (1 + weight): the stored weight stays w
        model = make_zoo_model(name)
        keys = set(model.state_dict())
        engine(model).close()
        assert set(model.state_dict()) == keys
        model.save_pretrained(tmp_path / name)
        back = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32)
        for k, v in make_zoo_model(name).state_dict().items():
            if "norm" in k:
                assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rope_tables_give_the_rotary_modules_rows_at_any_positions(dtype, head_dim):
    """On the CPU a static rope type's cos/sin come from tables filled once (and grown past 256 positions):
    bit for bit the module's own rows for the same positions, one at a time or several at once."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaModel

    from svrmad_local.engine.families import Rotary

    body = LlamaModel(LlamaConfig(vocab_size=32, hidden_size=4 * head_dim, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                  rope_theta=100000.0))
    rot = Rotary(body, "llama", {None})
    h = torch.zeros(1, 1, 4 * head_dim, dtype=dtype)
    for positions in ([0], [5], [255], [256], [700], [3, 9, 300, 301, 1023], list(range(40, 47))):
        pos = torch.tensor([positions])
        got = rot(h.expand(1, len(positions), -1), pos)[None]
        want = rot._rows(None, h.expand(1, len(positions), -1), pos)
        assert got[0].dtype == dtype and all(torch.equal(g, w) for g, w in zip(got, want)), positions
    assert rot.tables is not None and rot.tables[(None, dtype)][0].shape[0] == 1024  # grown by doubling


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt-oss", "deepseek-v3"])
def test_rope_tables_filled_at_build_give_the_modules_tokens_and_no_step_grows_them(name, monkeypatch):
    """What a GPU does (decoder.ROPE_AT_BUILD), run here on the CPU: every position's rows filled once at build
    (Gemma 3's two layer types, GPT-OSS's half-width rows doubled, DeepSeek-V3's latent RoPE), then a step reads
    them by index and asks nothing of the device (no max, no item): the engine's tokens, log-probs and entropies
    are the modules' bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(decoder_mod, "ROPE_AT_BUILD", ("cpu", "cuda"))
    model = make_zoo_model(name)
    eng = engine(model, decoder="ours", max_num_batched_tokens=16)
    rot = eng.runner.decoder.rotary
    n = model.config.max_position_embeddings
    assert rot.fixed and set(rot.tables) == {(k, torch.float32) for k in rot.keys}, rot.tables.keys()
    assert len(rot.keys) == (2 if name == "gemma3" else 1) and all(t[0].shape[0] == n for t in rot.tables.values())

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    pos, h = torch.tensor([[0, 7, n - 1]]), torch.zeros(1, 3, 4)
    with Ops() as seen:
        rows = rot(h, pos)
    assert set(seen.seen) == {"select", "index_select"}, seen.seen  # pos[0], a view; a row read a table
    for key, got in rows.items():
        assert all(torch.equal(g, w) for g, w in zip(got, rot._rows(key, h, pos))), key
    try:
        ours = [(c.token_ids, c.logprobs, c.entropies)
                for o in eng.generate_sync(PROMPTS, SAMPLED) for c in o.completions]
    finally:
        eng.close()
    modules, _ = outputs(model, PROMPTS, decoder="modules")
    assert ours == modules, name


def test_rope_tables_at_build_are_kept_only_where_the_module_agrees_bit_for_bit(monkeypatch):
    """prepare keeps no table where the module called at a step's shapes differs from the rows filled in chunks
    (a device whose cos/sin depend on how many values a call holds), where the rope type depends on more than
    the position, or where the tables would pass ROPE_TABLE_BYTES; a step then runs the module, as before."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaModel

    from svrmad_local.engine import families
    from svrmad_local.engine.families import Rotary

    common = dict(vocab_size=32, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1000)
    rot = Rotary(LlamaModel(LlamaConfig(**common)), "llama", {None})
    forward = rot.module.forward

    def odd(x, position_ids, *a):  # one ulp off wherever a call holds fewer positions than a chunk
        cos, sin = forward(x, position_ids, *a)
        return (cos.nextafter(cos + 1) if position_ids.shape[-1] < families.ROPE_CHUNK else cos), sin

    monkeypatch.setattr(rot.module, "forward", odd)
    assert rot.prepare(torch.float32, torch.device("cpu"), 1000) is False and not rot.fixed and rot.tables == {}
    monkeypatch.undo()
    dynamic = LlamaModel(LlamaConfig(**common, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert Rotary(dynamic, "llama", {None}).prepare(torch.float32, torch.device("cpu"), 1000) is False
    monkeypatch.setattr(families, "ROPE_TABLE_BYTES", 2 * 1000 * 16 * 4 - 1)  # one byte short of 1,000 rows of 16
    big = Rotary(LlamaModel(LlamaConfig(**common)), "llama", {None})
    assert big.prepare(torch.float32, torch.device("cpu"), 1000) is False and not big.fixed
    assert big.prepare(torch.float32, torch.device("cpu"), 999) is True and big.fixed
    assert big.tables[(None, torch.float32)][0].shape == (999, 16)


def test_rope_without_a_table_where_rows_depend_on_more_than_the_position():
    """A dynamic rope type (its frequencies follow the longest position of the call) and a width whose values
    torch's cos/sin would split between its vectorised loop and its scalar tail run the module every step."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaModel

    from svrmad_local.engine.families import Rotary

    common = dict(vocab_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    dynamic = LlamaModel(LlamaConfig(hidden_size=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0}, **common))
    assert Rotary(dynamic, "llama", {None}).tables is None
    narrow = Rotary(LlamaModel(LlamaConfig(hidden_size=32, **common)), "llama", {None})  # head_dim 8
    h, pos = torch.zeros(1, 2, 32), torch.tensor([[3, 100]])
    got, want = narrow(h, pos)[None], narrow._rows(None, h, pos)
    assert narrow.tables is None and all(torch.equal(g, w) for g, w in zip(got, want))
