"""`svrmad plan` against bytes counted by hand from the formats and the published configs, against
transformers' own models (parameter counts), and against real safetensors files (the header path).

The hand counts below are written from the config numbers and the format definitions, not through
plan.py: MXFP4 is 16 bytes of e2m1 codes + 1 byte e8m0 scale per 32 values; FP8 e4m3 is 1 byte a
value + an fp32 scale per 128x128 block, partial blocks at ragged edges; everything else bf16.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from svrmad_local.models.plan import PlanError, check_block_split, check_tp_heads, make_plan, parse_gpus

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
GiB = 2**30
SEQ = 1024 + 16384  # the plan's prompt + the paper's 16,384 new tokens


def gpt_oss_120b_by_hand():
    """(bf16 params, MXFP4 values) of GPT-OSS-120B: 36 layers, 128 experts, hidden 2880."""
    h, layers, e, inter, vocab = 2880, 36, 128, 2880, 201088
    q, kv = 64 * 64, 8 * 64
    attn = (q * h + q) + 2 * (kv * h + kv) + (h * q + h) + 64  # q, k, v, o with biases; 64 sinks
    per_layer_bf16 = attn + 2 * h + (e * h + e) + (e * 2 * inter + e * h)  # norms, router, expert biases
    packed = layers * (e * 2 * inter * h + e * h * inter)  # gate_up and down of every expert
    return 2 * vocab * h + h + layers * per_layer_bf16, packed


def deepseek_v31_native_by_hand():
    """Bytes of DeepSeek-V3.1 as published (FP8 projections, bf16 rest), the 61 layers transformers builds."""
    h, vocab, layers, dense, e, moe_i, inter, heads = 7168, 129280, 61, 3, 256, 2048, 18432, 128

    def fp8(rows, cols):
        return rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)

    attn = fp8(1536, h) + fp8(heads * 192, 1536) + fp8(512 + 64, h) + fp8(heads * 256, 512) + fp8(h, heads * 128)
    mlp = lambda i: 2 * fp8(i, h) + fp8(h, i)  # noqa: E731
    bf16 = 2 * vocab * h + h + layers * (2 * h + 1536 + 512) + (layers - dense) * e * h  # + router weights
    f32 = (layers - dense) * e  # e_score_correction_bias, published in fp32
    return 2 * bf16 + 4 * f32 + layers * attn + dense * mlp(inter) + (layers - dense) * (e + 1) * mlp(moe_i)


def test_gpt_oss_120b_packed_fits_one_80gib_gpu_with_kv_room_and_bf16_does_not():
    bf16_params, packed = gpt_oss_120b_by_hand()
    native_bytes = 2 * bf16_params + packed // 32 * 17
    p = make_plan(CONFIGS / "gpt-oss-120b", 1, 80 * GiB, "native")
    assert p["source"] == "config.json"
    assert p["weight_bytes"] == native_bytes and 60 * GiB < native_bytes < 61 * GiB  # "about 65 GB"
    # 18 full layers: K and V of 8 heads of 64, bf16; 18 sliding layers hold at most 128 tokens
    assert p["kv_bytes_per_token"] == 18 * 2 * 8 * 64 * 2
    assert p["kv_window_cap_bytes_per_sequence"] == 18 * 128 * 2 * 8 * 64 * 2
    # the engine's rule: 0.9 of what is free after loading (less a 1 GiB CUDA context), less its forward at
    # 2,048 tokens: the residual stream's 6 copies, and the larger of attention (q, k, v, out and their
    # copies) and the routed experts (4 of 128 a token: gate/up, the product, down, in and out rows)
    t, h = 2048, 2880
    forward = 6 * t * h * 2 + max(2 * t * (2 * 64 + 2 * 8) * 64 * 2, t * 4 * (3 * 2880 + 2 * h) * 2 + t * 128 * 4)
    assert p["forward_bytes_per_gpu"] == forward
    room = int(0.9 * (80 * GiB - GiB - native_bytes)) - forward
    assert p["kv_room_per_gpu"] == room > 10 * GiB
    assert p["sequences"] == room // (SEQ * 36864 + 18 * 128 * 2048) >= 6
    assert p["fits"] is True
    d = make_plan(CONFIGS / "gpt-oss-120b", 1, 80 * GiB, "dequantize")
    assert d["weight_bytes"] == 2 * (bf16_params + packed) > 200 * GiB  # "about 234 GB"
    assert d["fits"] is False and d["reason"] == f"needs {2 * (bf16_params + packed) / GiB:.1f} GiB of weights per GPU on 80.0 GiB"


def deepseek_v31_whole_by_hand() -> int:
    """What every --tp rank of DeepSeek-V3.1 holds whole: embeddings and LM head, norms, MLA's latent
    projections q_a and kv_a (FP8 + a scale per 128x128 block), and each MoE layer's router."""
    h, layers, moe_layers = 7168, 61, 58
    fp8 = lambda rows, cols: rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)  # noqa: E731
    per_layer = 2 * h * 2 + fp8(1536, h) + 1536 * 2 + fp8(576, h) + 512 * 2
    return 2 * 129280 * h * 2 + h * 2 + layers * per_layer + moe_layers * (256 * h * 2 + 256 * 4)


def test_deepseek_v31_fp8_fits_8x141gib_not_8x80gib_and_says_why():
    native_bytes = deepseek_v31_native_by_hand()
    whole = deepseek_v31_whole_by_hand()
    for tp, per_gpu in ((None, math.ceil(native_bytes / 8)), (8, whole + math.ceil((native_bytes - whole) / 8))):
        big = make_plan(CONFIGS / "deepseek-v3.1", 8, 141 * GiB, "native", tp=tp)
        assert big["weight_bytes"] == native_bytes and 672e9 < native_bytes < 674e9  # "about 673 GB"
        assert big["weight_bytes_per_gpu"] == per_gpu
        assert big["fits"] is True and big["sequences"] >= 6, big["reason"]
        small = make_plan(CONFIGS / "deepseek-v3.1", 8, 80 * GiB, "native", tp=tp)
        assert small["fits"] is False
        gib = f"{per_gpu / GiB:.1f} GiB"
        assert small["reason"] == (f"needs {gib} of weights per GPU plus 2.0 GiB of reserve (the CUDA context and a "
                                   "forward of 2,048 tokens) on 80.0 GiB" if tp is None
                                   else f"needs {gib} of weights per GPU on 80.0 GiB")
    # the replicated parts make --tp 8 hold 4.2 GB a GPU more than an even split
    assert make_plan(CONFIGS / "deepseek-v3.1", 8, 141 * GiB, tp=8)["weight_bytes_whole_per_gpu"] == whole
    assert 4e9 < whole - whole / 8 < 4.5e9
    # 2 nodes of 8 x 80 GiB: --tp 16 fits
    two_nodes = make_plan(CONFIGS / "deepseek-v3.1", 16, 80 * GiB, tp=16)
    assert two_nodes["weight_bytes_per_gpu"] == whole + math.ceil((native_bytes - whole) / 16)
    assert two_nodes["fits"] is True, two_nodes["reason"]
    # MLA caches the latent (512) and the RoPE key (64) per layer, whole on every TP rank
    assert make_plan(CONFIGS / "deepseek-v3.1", 8, 141 * GiB, tp=8)["kv_bytes_per_token"] == 61 * (512 + 64) * 2
    full = make_plan(CONFIGS / "deepseek-v3.1", 8, 141 * GiB, "dequantize")
    assert full["weight_bytes"] == 2 * 671_026_419_200 and full["fits"] is False  # "about 1.34 TB"


@pytest.mark.parametrize("name", ["gpt-oss-120b", "gpt-oss-20b", "deepseek-v3.1"])
def test_parameter_count_matches_transformers_model_of_the_published_config(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((CONFIGS / name / "config.json").read_text())
    raw.pop("quantization_config"), raw.pop("auto_map", None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
    assert make_plan(CONFIGS / name, 1, 80 * GiB)["parameters"] == sum(t.numel() for t in model.state_dict().values())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_dense_header_path_agrees_with_the_files_and_the_config_path(arch, tmp_path):
    from safetensors.torch import load_file

    from .conftest import make_model

    model = make_model(arch)
    model.save_pretrained(tmp_path / "full")
    tensors = {k: v for f in (tmp_path / "full").glob("*.safetensors") for k, v in load_file(f).items()}
    p = make_plan(tmp_path / "full", 1, 80 * GiB)
    assert p["source"].startswith("safetensors headers")
    assert p["weight_bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())  # fp32 as saved
    assert p["parameters"] == sum(t.numel() for t in model.state_dict().values())
    (tmp_path / "config").mkdir()
    shutil.copy(tmp_path / "full" / "config.json", tmp_path / "config")
    assert make_plan(tmp_path / "config", 1, 80 * GiB)["parameters"] == p["parameters"]


def _meta_state(config) -> dict:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}


def _write(folder: Path, config: dict, shards: list[dict]) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, folder / name)
    if len(shards) > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {k: n for n, s in zip(names, shards) for k in s}}))


def _bytes(shards):
    return sum(t.numel() * t.element_size() for s in shards for t in s.values())


def test_mxfp4_header_path_reads_packed_bytes_and_agrees_with_config_path(tmp_path):
    """A tiny GPT-OSS in the published layout: experts as uint8 blocks [E, out, in/32, 16] and
    e8m0 scales [E, out, in/32], the rest bf16."""
    from transformers import GptOssConfig

    cfg = GptOssConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_local_experts=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8).to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    shard, values = {}, 0
    for name, shape in _meta_state(GptOssConfig(**cfg)).items():
        if name.endswith(("gate_up_proj", "down_proj")):  # transformers: [E, in, out]
            e, inp, out = shape
            shard[name + "_blocks"] = torch.randint(0, 256, (e, out, inp // 32, 16), dtype=torch.uint8)
            shard[name + "_scales"] = torch.randint(120, 130, (e, out, inp // 32), dtype=torch.uint8)
            values += e * inp * out
        else:
            shard[name] = torch.zeros(shape, dtype=torch.bfloat16)
    _write(tmp_path / "full", cfg, [shard])
    p = make_plan(tmp_path / "full", 1, 80 * GiB)
    assert p["source"] == "safetensors headers (1 files)"
    assert p["weight_bytes"] == _bytes([shard])
    assert p["parameters_by_format"]["mxfp4"] == values
    _write(tmp_path / "config", cfg, [])
    c = make_plan(tmp_path / "config", 1, 80 * GiB)
    assert c["source"] == "config.json" and c["weight_bytes"] == p["weight_bytes"] and c["parameters"] == p["parameters"]
    assert make_plan(tmp_path / "full", 1, 80 * GiB, "dequantize")["weight_bytes"] == 2 * p["parameters"]


def test_fp8_ragged_header_path_agrees_with_files_and_config_path(tmp_path):
    """A tiny DeepSeek-V3 in the published layout, ragged against 128x128 blocks (hidden 160,
    kv_a_proj_with_mqa 80 rows), per-expert keys, in two shards, with an MTP layer transformers does
    not build."""
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(vocab_size=100, hidden_size=160, intermediate_size=200, moe_intermediate_size=48,
                           num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=3, n_shared_experts=1,
                           num_experts_per_tok=1, n_group=1, topk_group=1, num_attention_heads=2, num_key_value_heads=2,
                           q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16,
                           v_head_dim=16).to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"}
    layout = {}
    for name, shape in _meta_state(DeepseekV3Config(**cfg)).items():
        if ".mlp.experts." in name:  # fused [E, out, in] -> published experts.{j}.{gate,up,down}_proj
            prefix, kind = name.rsplit(".", 1)
            for j in range(shape[0]):
                if kind == "gate_up_proj":
                    for half in ("gate_proj", "up_proj"):
                        layout[f"{prefix}.{j}.{half}.weight"] = (shape[1] // 2, shape[2])
                else:
                    layout[f"{prefix}.{j}.down_proj.weight"] = shape[1:]
        else:
            layout[name] = shape
    layout["model.layers.2.eh_proj.weight"] = (160, 320)  # the MTP layer: in the files, not in the model
    layout["model.layers.2.enorm.weight"] = (160,)
    shards, scales = [{}, {}], 0
    for i, (name, shape) in enumerate(sorted(layout.items())):
        shard = shards[i % 2]
        if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
            shard[name] = torch.zeros(shape).to(torch.float8_e4m3fn)
            grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
            shards[1 - i % 2][name + "_scale_inv"] = torch.ones(grid, dtype=torch.float32)  # scale in the other shard
            scales += 4 * grid[0] * grid[1] if not name.startswith("model.layers.2.") else 0
        else:
            dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
            shard[name] = torch.zeros(shape, dtype=dtype)
    assert layout["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (80, 160)
    _write(tmp_path / "full", cfg, shards)
    p = make_plan(tmp_path / "full", 1, 80 * GiB)
    assert p["source"] == "safetensors headers (2 files)"
    mtp = sum(t.numel() * t.element_size() for s in shards for k, t in s.items() if k.startswith("model.layers.2."))
    assert p["weight_bytes"] == _bytes(shards) - mtp
    model_params = sum(math.prod(s) for n, s in layout.items() if not n.startswith("model.layers.2."))
    assert p["parameters"] == model_params
    assert p["weight_bytes"] == p["parameters_by_format"]["fp8"] + scales + 2 * p["parameters_by_format"]["BF16"] \
        + 4 * p["parameters_by_format"]["F32"]
    _write(tmp_path / "config", cfg, [])
    c = make_plan(tmp_path / "config", 1, 80 * GiB)
    assert c["weight_bytes"] == p["weight_bytes"] and c["parameters"] == p["parameters"]
    # an index naming a shard that is not there: count from config.json instead
    (tmp_path / "full" / "model-00002-of-00002.safetensors").unlink()
    assert make_plan(tmp_path / "full", 1, 80 * GiB)["source"] == "config.json"


def test_tp_refuses_heads_it_does_not_divide():
    tiny = {"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 48}
    with pytest.raises(PlanError, match=r"--tp 2 does not divide the model's 3 attention heads"):
        check_tp_heads(tiny, 2)
    with pytest.raises(PlanError, match=r"--tp 4 does not divide the model's 2 KV heads"):
        check_tp_heads({"num_attention_heads": 8, "num_key_value_heads": 2}, 4)
    check_tp_heads(tiny, 3)
    check_tp_heads({"num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512}, 8)


def test_tp_load_path_refuses_before_transformers_shards(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from svrmad_local.models.loader import load_model

    cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=3, num_key_value_heads=3)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; the refusal comes before any collective
    with pytest.raises(PlanError, match=r"3 attention heads"):
        load_model(tmp_path, device="cpu", tp=True)
    with pytest.raises(PlanError, match=r"3 attention heads"):
        make_plan(tmp_path, 2, 80 * GiB, tp=2)


def test_block_split():
    check_block_split("w", (4096, 7168), (128, 128), 8, 0)  # 512 rows a rank: 4 blocks
    check_block_split("w", (576, 7168), (128, 128), 1, 0)  # no split: a ragged edge is fine
    with pytest.raises(PlanError, match=r"kv_a_proj_with_mqa.weight: splitting dimension 0 of \[576, 7168\] over 2 "
                                        r"ranks gives 288 per rank, which cuts its 128-wide quantization blocks"):
        check_block_split("kv_a_proj_with_mqa.weight", (576, 7168), (128, 128), 2, 0)
    with pytest.raises(PlanError, match=r"down_proj: splitting dimension 2 .* gives 360 per rank"):
        check_block_split("down_proj", (128, 2880, 2880), (1, 1, 32), 8, -1)
    with pytest.raises(PlanError, match="does not split over 3 ranks"):
        check_block_split("w", (128, 2880), (1, 32), 3, 0)


def test_plan_refuses_a_tp_that_cuts_fp8_blocks(tmp_path):
    cfg = json.loads((CONFIGS / "deepseek-v3.1" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    make_plan(tmp_path, 16, 80 * GiB, tp=16)  # experts 2048 / 16 = 128, dense 18432 / 16 = 1152: whole blocks
    with pytest.raises(PlanError, match=r"gate_proj.weight: splitting dimension 0 of \[18432, 7168\] over 32 ranks "
                                        r"gives 576 per rank"):
        make_plan(tmp_path, 32, 80 * GiB, tp=32)


def test_parse_gpus():
    assert parse_gpus("8x80GiB") == (8, 80 * GiB)
    assert parse_gpus("1x141GB") == (1, 141 * 10**9)
    assert parse_gpus("80GiB") == (1, 80 * GiB)
    for bad in ("8x80", "0x80GiB", "eightx80GiB", ""):
        with pytest.raises(PlanError, match="COUNTxMEMORY"):
            parse_gpus(bad)


def test_cli_prints_json_and_one_line_errors():
    env_cmd = [sys.executable, "-m", "svrmad_local", "plan", "--model", str(CONFIGS / "gpt-oss-120b")]
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(env_cmd + ["--gpus", "1x80GiB", "--json"], capture_output=True, text=True, cwd=root)
    plan = json.loads(out.stdout)
    assert out.returncode == 0 and plan["fits"] is True and plan["weight_bytes"] > 0
    text = subprocess.run(env_cmd + ["--gpus", "1x80GiB", "--quantization", "dequantize"], capture_output=True,
                          text=True, cwd=root)
    assert "fits: no: needs 217.6 GiB of weights per GPU on 80.0 GiB" in text.stdout
    bad = subprocess.run(env_cmd + ["--gpus", "8x80GiB", "--tp", "3"], capture_output=True, text=True, cwd=root)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--tp 3" in bad.stderr


def test_bad_input_is_one_plan_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(PlanError, match="quantization 'awq' is not one svrmad-local reads"):
        make_plan(tmp_path, 1, 80 * GiB)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3", "num_hidden_layers": 2}))
    with pytest.raises(PlanError, match="architecture 'phi3'.*put its \\*.safetensors next to config.json"):
        make_plan(tmp_path, 1, 80 * GiB)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(PlanError, match="has no 'hidden_size'"):
        make_plan(tmp_path, 1, 80 * GiB)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(PlanError, match="is not a safetensors file"):
        make_plan(tmp_path, 1, 80 * GiB)


def _scaled(tmp_path: Path, name: str, layers: int) -> tuple[Path, dict]:
    """The shipped config cut to its first `layers` layers: the real widths, a scaled-down depth."""
    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:layers]
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, cfg


def _engine_kv_specs(cfg: dict) -> list:
    """The engine's own view of each layer's cache (its spec probe, engine/spec.py), on a small model with
    the config's attention geometry (heads, KV heads and head width, windows; MLA's latent and RoPE
    widths) and tiny everything else: what a layer caches depends on nothing else."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from svrmad_local.engine.attention import Attachment
    from svrmad_local.engine.spec import inspect_model

    small = {k: v for k, v in cfg.items() if k != "quantization_config"} | dict(
        hidden_size=64, intermediate_size=32, moe_intermediate_size=32, vocab_size=128, q_lora_rank=32,
        num_local_experts=2, n_routed_experts=2, num_experts_per_tok=1, experts_per_token=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, rope_scaling=None, pad_token_id=0, eos_token_id=1, bos_token_id=0)
    config = AutoConfig.for_model(**small)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return inspect_model(model, Attachment(model)).layers


@pytest.mark.parametrize("name, layers, gpus, gpu_memory, tp", [("gpt-oss-120b", 4, 1, 80 * GiB, 1),
                                                                ("deepseek-v3.1", 5, 8, 141 * GiB, 8)])
def test_the_plan_counts_the_pool_the_engine_then_sizes(tmp_path, name, layers, gpus, gpu_memory, tp):
    """At a scaled-down depth of the paper's two models (the real widths, meta tensors, nothing
    allocated): the bytes the loader gives a GPU (GPT-OSS-120B on one 80 GiB GPU; DeepSeek-V3.1 at --tp 8
    on 8 x 141 GiB, its first and last rank), the engine's KV bytes a block from its own spec probe, and
    the engine's pool rule (engine/memory.py) over that GPU's memory free after loading, make the
    sequences the plan counts, and the pool fits the plan's KV room. The profiled forward cannot run
    here: the engine is given the plan's estimate of it (the GPU check's memory step measures it)."""
    from transformers import AutoConfig

    from svrmad_local.engine import memory
    from svrmad_local.engine.kv_cache import KVCache
    from svrmad_local.engine.tp import Group
    from svrmad_local.models.plan import CUDA_CONTEXT
    from svrmad_local.models.quant import quant_spec
    from svrmad_local.models.shard import meta_split

    from .test_tp import _published_index

    folder, cfg = _scaled(tmp_path, name, layers)
    plan = make_plan(folder, gpus, gpu_memory, tp=tp)
    specs = _engine_kv_specs(cfg)
    block_size, seq_blocks = 16, SEQ // 16
    layer_bytes = [KVCache.bytes_per_block([s], block_size, torch.bfloat16) for s in specs]
    gpu = torch.device("cuda", 0)
    for rank in sorted({0, tp - 1}):
        model, _, _ = meta_split(AutoConfig.from_pretrained(folder), torch.bfloat16, Group(tuple(range(tp)), rank),
                                 quant_spec(cfg), _published_index(folder))
        held = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
        weights = sum(t.numel() * t.element_size() for t in held)
        assert weights == pytest.approx(plan["weight_bytes_per_gpu"], rel=2e-3)  # FP8 scale grids round per rank
        free = gpu_memory - CUDA_CONTEXT - weights  # what the GPU reports free once the weights are in
        pool = memory.kv_pool(None, [gpu] * len(specs), layer_bytes, held={gpu: plan["forward_bytes_per_gpu"]},
                              free={gpu: free})
        blocks = pool.blocks()
        # the engine's paged cache keeps every token of sliding layers: the plan's uncapped count
        assert blocks // seq_blocks == plan["sequences_uncapped"] > 0
        # the pool is the plan's KV room, to within a block and the weights' per-rank rounding
        off = sum(layer_bytes) + abs(plan["weight_bytes_per_gpu"] - weights)
        assert blocks * sum(layer_bytes) == pytest.approx(plan["kv_room_per_gpu"], abs=off)
    if name == "deepseek-v3.1":  # the latent, whole on every rank
        assert sum(layer_bytes) // block_size == plan["kv_bytes_per_token"] == layers * 576 * 2


def test_the_plan_estimates_the_forward_the_engine_profiles():
    """The plan's forward is the engine's profiled one: max_num_batched_tokens' default tokens."""
    from svrmad_local.engine.config import EngineConfig
    from svrmad_local.models.plan import PREFILL_TOKENS

    assert PREFILL_TOKENS == EngineConfig().max_num_batched_tokens
