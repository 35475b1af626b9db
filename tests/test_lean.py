"""The lean decoder forward (engine/lean.py) and its fused CPU ops (kernels/cpu_ops.py): bitwise the
model's modules' computation (with the swapped norms), token-exact against a cache-free reference,
refused in one line where it does not apply."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.lean import FastRMSNorm, select_decoder
from svrmad_local.engine.params import SamplingParams
from svrmad_local.kernels import cpu_ops

from .model_zoo import full_logprobs, loop_greedy, make_zoo_model, rand_prompt

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason=f"no fused CPU ops: {cpu_ops.unavailable_reason()}")
LEAN = ["llama", "qwen2", "qwen2-sliding", "qwen3", "mistral-sliding"]
NOT_LEAN = {"qwen3-moe": "Qwen3MoeDecoderLayer", "phi3-sliding": "Phi3DecoderLayer", "gemma3": "Gemma3DecoderLayer",
            "gpt-oss": "GptOssDecoderLayer", "deepseek-v3": "DeepseekV3DecoderLayer"}


def engine(model, **kw):
    kw.setdefault("kv_cache_memory", 4 * 2**20)
    kw.setdefault("block_size", 4)
    return Engine(model, None, EngineConfig(**kw))


def test_rope_and_cache_writes_are_bitwise_transformers_rope():
    torch.manual_seed(0)
    T, H, KVH, D = 5, 6, 2, 16
    qkv = torch.randn(T, (H + 2 * KVH) * D) * 4  # column slices of one fused output, as the lean forward passes them
    q, k, v = (qkv[:, a:b].view(T, -1, D) for a, b in ((0, H * D), (H * D, (H + KVH) * D), ((H + KVH) * D, None)))
    half = torch.randn(T, D // 2) * 30
    cos, sin = torch.cat([half, half], -1).cos(), torch.cat([half, half], -1).sin()
    kc, vc = torch.zeros(12, KVH, D), torch.zeros(12, KVH, D)
    slots = torch.tensor([3, 7, 1, 11, 0])
    q_out = cpu_ops.rope_store(q, k, v, cos, sin, kc, vc, slots)
    q_ref, k_ref = apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2), cos[None], sin[None])
    assert torch.equal(q_out, q_ref[0].transpose(0, 1))
    assert torch.equal(kc[slots], k_ref[0].transpose(0, 1)) and torch.equal(vc[slots], v)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots] = False
    assert not kc[untouched].any() and not vc[untouched].any()
    with pytest.raises(RuntimeError, match="slot 12 outside the cache's 12 rows"):
        cpu_ops.rope_store(q, k, v, cos, sin, kc, vc, torch.tensor([3, 7, 1, 12, 0]))
    with pytest.raises(RuntimeError, match="fp32 or bf16 only"):
        cpu_ops.rope_store(q.double(), k, v, cos, sin, kc, vc, slots)


@pytest.mark.parametrize("hidden", [64, 576, 13])
def test_the_fused_norm_is_rmsnorm_within_rounding_and_each_row_alone(hidden):
    torch.manual_seed(1)
    norm = LlamaRMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden)
    x, res = torch.randn(9, hidden) * 3, torch.randn(9, hidden)
    ours = cpu_ops.rms_norm(x, norm.weight, 1e-5)
    assert ((ours - norm(x)).abs() / norm(x).abs().clamp_min(1e-3)).max() < 1e-5
    for i in range(9):  # a row's bits do not depend on the rows beside it
        assert torch.equal(cpu_ops.rms_norm(x[i : i + 1], norm.weight, 1e-5), ours[i : i + 1])
    y, s = cpu_ops.add_rms_norm(x, res, norm.weight, 1e-5)
    assert torch.equal(s, res + x) and torch.equal(y, cpu_ops.rms_norm(res + x, norm.weight, 1e-5))
    assert torch.equal(FastRMSNorm(norm)(x.view(3, 3, hidden)), ours.view(3, 3, hidden))
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_ops.rms_norm(x, torch.ones(hidden + 1), 1e-5)


@pytest.mark.parametrize("name", LEAN)
def test_lean_forward_is_bitwise_the_modules_forward(name):
    """Two engines on one model (the first swaps in the fused norms): the lean forward and transformers'
    modules give the same tokens and the same logprobs, bit for bit, over prefill chunks, decode and forks."""
    model = make_zoo_model(name)
    prompts = [rand_prompt(n, 70 + n) for n in (3, 17, 30)]
    params = SamplingParams(temperature=0.9, top_k=50, max_tokens=12, ignore_eos=True, seed=5, n=2)
    runs = []
    for decoder in ("lean", "modules"):
        eng = engine(model, decoder=decoder, max_num_batched_tokens=16)  # prompts split into chunks
        assert eng.info["decoder"].startswith("lean" if decoder == "lean" else "the model's modules")
        runs.append([(c.token_ids, c.logprobs, c.entropies) for o in eng.generate_sync(prompts, params)
                     for c in o.completions])
        eng.close()
    assert any(isinstance(m, FastRMSNorm) for m in model.modules())
    assert runs[0] == runs[1], name


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_bf16_lean_forward_is_bitwise_the_modules_forward(name):
    """In bf16 too: the fused ops round where transformers' bf16 ops round (kernels/cpu_ops.py), and the
    lean forward's SiLU-and-multiply is F.silu(gate) * up's bits."""
    model = make_zoo_model(name).to(torch.bfloat16)
    prompts = [rand_prompt(n, 70 + n) for n in (3, 17, 30)]
    params = SamplingParams(temperature=0.9, top_k=50, max_tokens=12, ignore_eos=True, seed=5, n=2)
    runs = []
    for decoder in ("lean", "modules"):
        eng = engine(model, decoder=decoder, max_num_batched_tokens=16)
        assert eng.info["decoder"].startswith("lean" if decoder == "lean" else "the model's modules")
        runs.append([(c.token_ids, c.logprobs, c.entropies) for o in eng.generate_sync(prompts, params)
                     for c in o.completions])
        eng.close()
    assert runs[0] == runs[1], name


@pytest.mark.parametrize("name", ["llama", "mistral-sliding"])
def test_decode_steps_call_the_kernels_themselves(name, monkeypatch):
    """In a step of decode rows only, the lean loop calls the in-place CPU attention kernel itself (not
    through paged_attention's dispatch) and the panel linears without their modules' Python; the test
    above holds it to the modules' bits."""
    from svrmad_local.engine import lean
    from svrmad_local.kernels import cpu_decode, cpu_linear

    model = make_zoo_model(name)
    eng = engine(model, linear="panels")
    if not (cpu_linear.available() and cpu_decode.available()):
        pytest.skip("the panel or the CPU decode kernel did not build")
    calls = {"dispatch": 0, "kernel": 0}
    for fn, key in ((lean.paged_attention, "dispatch"), (lean.paged_decode_cpu, "kernel")):
        monkeypatch.setattr(lean, fn.__name__, lambda *a, _f=fn, _k=key, **kw: (calls.__setitem__(_k, calls[_k] + 1), _f(*a, **kw))[1])
    eng.generate_sync([rand_prompt(9, 1)], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    n = model.config.num_hidden_layers
    assert calls == {"dispatch": n, "kernel": 4 * n}  # the prefill step; four decode steps
    assert not any(isinstance(f, torch.nn.Module) for L in eng.runner.lean.layers for f in (L.o_proj, L.down))


@pytest.mark.parametrize("name", LEAN)
def test_lean_engine_is_token_exact_against_a_cache_free_reference(name):
    model = make_zoo_model(name)
    plain = make_zoo_model(name)  # transformers' own norms and F.linear
    eng = engine(model)
    assert eng.info["decoder"].startswith("lean")
    prompts = [rand_prompt(n, 90 + n) for n in (4, 13, 25)]
    out = eng.generate_sync(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for p, o in zip(prompts, out):
        got = o.completions[0].token_ids
        assert got == loop_greedy(model, p, 8), name  # the reference runs the same norms and linears
        ref = full_logprobs(plain, p + got)[len(p) - 1 : -1].gather(1, torch.tensor(got)[:, None])[:, 0]
        assert (torch.tensor(o.completions[0].logprobs) - ref).abs().max() < 1e-4, name


@pytest.mark.parametrize("name", sorted(NOT_LEAN))
def test_other_architectures_keep_their_modules_and_say_why(name):
    model = make_zoo_model(name)
    eng = engine(model)
    assert eng.info["decoder"].startswith("the model's modules") and NOT_LEAN[name] in eng.info["decoder"]
    assert not any(isinstance(m, FastRMSNorm) for m in model.modules())
    eng.close()
    with pytest.raises(ValueError, match=f"decoder='lean' cannot run this model: .*{NOT_LEAN[name]}"):
        engine(make_zoo_model(name), decoder="lean")


def test_bad_choices_and_other_dtypes_are_refused_in_one_line(monkeypatch):
    eng = engine(make_zoo_model("llama"), decoder="modules")
    spec = eng.spec
    eng.close()
    with pytest.raises(ValueError, match="decoder must be one of auto, lean, modules, got 'fast'"):
        select_decoder(make_zoo_model("llama"), spec, "fast")
    fp16 = engine(make_zoo_model("llama").to(torch.float16), linear="aten")
    assert "torch.float16 on cpu (lean: float32, bfloat16 on the CPU)" in fp16.info["decoder"]
    fp16.close()
    monkeypatch.setenv("SVRMAD_CPU_OPS", "0")
    off = engine(make_zoo_model("llama"))
    assert "the fused CPU ops are unavailable: SVRMAD_CPU_OPS=0" in off.info["decoder"]


def test_a_lean_model_saves_and_reloads_with_its_norm_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    model = make_zoo_model("qwen3")
    keys = set(model.state_dict())
    engine(model).close()
    assert set(model.state_dict()) == keys
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for k, v in make_zoo_model("qwen3").state_dict().items():
        if "norm" in k:
            assert torch.equal(back.state_dict()[k], v), k


def test_off_the_cpu_the_modules_run_and_it_is_not_a_fallback():
    """The lean forward is the CPU's: on another device the record says so, and marks no fallback
    (a GPU runs the modules, with graphs); run here on the meta device."""
    eng = engine(make_zoo_model("llama"), decoder="modules")
    spec = eng.spec
    eng.close()
    decoder, choice = select_decoder(make_zoo_model("llama").to("meta"), spec)
    assert decoder is None and choice.value == "the model's modules"
    assert choice.reason == "on meta (the lean forward is the CPU's)" and not choice.fell_back
