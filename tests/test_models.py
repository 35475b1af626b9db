"""Loading checkpoints directly, with clear errors; chat prompts as exact token segments."""

import json

import pytest
import torch

from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.params import SamplingParams
from svrmad_local.models.chat import ChatFormat
from svrmad_local.models.loader import ModelLoadError, load_model

from .conftest import make_model


@pytest.fixture
def checkpoint(tmp_path, tiny_tokenizer):
    model = make_model("qwen2", vocab=len(tiny_tokenizer))
    model.save_pretrained(tmp_path / "ck", max_shard_size="200KB")  # sharded on purpose
    tiny_tokenizer.save_pretrained(tmp_path / "ck")
    return tmp_path / "ck", model


def test_load_sharded_checkpoint_and_generate(checkpoint):
    path, ref = checkpoint
    assert len(list(path.glob("*.safetensors"))) > 1
    lm = load_model(path, device="cpu", dtype="fp32")
    assert lm.model.dtype == torch.float32 and lm.tokenizer is not None
    for a, b in zip(lm.model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)
    eng = Engine(lm.model, lm.tokenizer, EngineConfig(kv_cache_memory=2**20))
    out = eng.generate_sync([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].completions[0].token_ids) == 3


@pytest.mark.parametrize("flags", [["avx512_bf16", "amx_bf16"], ["avx512_bf16"], []])
def test_auto_dtype_is_bf16_where_the_cpu_has_bf16_arithmetic_and_the_start_line_says_why(checkpoint, monkeypatch, flags):
    """--dtype auto: bf16 on a CPU with avx512_bf16 or AMX (as on a GPU), fp32 elsewhere; the engine's
    record names the dtype, its note and reason say why, and an explicit dtype reads "as asked"."""
    from svrmad_local.models import loader

    monkeypatch.setattr(loader, "native_bf16", lambda: flags)
    want = torch.bfloat16 if flags else torch.float32
    assert loader.default_dtype("cpu") == loader.parse_dtype("auto", "cpu") == loader.parse_dtype(None, "cpu") == want
    assert loader.default_dtype("cuda") == torch.bfloat16  # a GPU: bf16 whatever the CPU
    lm = load_model(checkpoint[0], device="cpu")
    assert lm.model.dtype == want
    eng = Engine(lm.model, lm.tokenizer, EngineConfig(kv_cache_memory=2**20))
    device = eng.info["execution"]["device"]
    eng.close()
    if flags:
        assert device["value"] == f"cpu bf16 (auto: {', '.join(flags)})"
        assert device["reason"].startswith(f"--dtype auto: bf16 on a CPU with bf16 arithmetic ({', '.join(flags)})")
        assert "--dtype fp32 --linear panels computes the same tokens on every machine" in device["reason"]
    else:
        assert device == {"value": "cpu fp32 (auto: no bf16 arithmetic here)", "fell_back": False,
                          "reason": "--dtype auto: fp32 on a CPU without bf16 arithmetic (no avx512_bf16 or AMX)"}
    other = load_model(checkpoint[0], device="cpu", dtype="fp32" if flags else "bf16")
    eng = Engine(other.model, other.tokenizer, EngineConfig(kv_cache_memory=2**20))
    assert eng.execution.line().startswith(f"engine: cpu {'fp32' if flags else 'bf16'} (as asked) · ")
    assert eng.info["execution"]["device"]["reason"] == f"as asked (--dtype auto would take {str(want)[6:]} here)"
    eng.close()


def test_native_bf16_reads_the_cpus_flags():
    from pathlib import Path

    from svrmad_local.models import loader

    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo")
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    assert loader.native_bf16() == [f for f in ("avx512_bf16", "amx_bf16") if f in flags]


def test_dtype_choice(checkpoint):
    assert load_model(checkpoint[0], device="cpu", dtype="bf16").model.dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model(checkpoint[0], device="cpu", dtype="fp7")


def test_load_errors(tmp_path, checkpoint):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(empty)
    (empty / "config.json").write_text((checkpoint[0] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(empty)
    # an architecture that is not a causal LM
    enc = tmp_path / "enc"
    enc.mkdir()
    (enc / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    (enc / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a decoder-only causal LM"):
        load_model(enc)
    # weights that do not match the config
    cfg = json.loads((checkpoint[0] / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (checkpoint[0] / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="does not match its config"):
        load_model(checkpoint[0], device="cpu")


def test_chat_segments_keep_exact_tokens_and_prefixes(tiny_tokenizer):
    chat = ChatFormat(tiny_tokenizer)
    q = [{"role": "user", "content": "What is 2 + 3?"}]
    head = chat.encode(q)
    answer = [17, 42, 99, 3, tiny_tokenizer.eos_token_id]  # as generated, EOS included
    debate = chat.encode(q + [{"role": "assistant", "content": answer},
                              {"role": "user", "content": ["These are the solutions: ", [5, 6], " go."]}])
    assert debate[: len(head)] == head
    assert debate[len(head) : len(head) + 4] == answer[:4]  # the answer goes in verbatim, EOS left to the template
    assert tiny_tokenizer.decode(debate).count("<|im_start|>assistant") == 2
    sub = debate.index(5)
    assert debate[sub : sub + 2] == [5, 6]
