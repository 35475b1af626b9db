"""Tiny quantized checkpoints in the published layouts, written by the tests (no hub, no weights).

Each writer quantizes a random zoo model itself and writes two folders with the same weights:
``q`` in the published layout (GPT-OSS: MXFP4 experts as `_blocks`/`_scales`, the rest bf16;
DeepSeek-V3: every projection FP8 e4m3 with `weight_scale_inv`, experts under the per-expert keys
`experts.{i}.gate_proj/up_proj/down_proj`, or transformers' fused keys), and ``ref``: the same
weights dequantized to fp32 in a plain checkpoint, the reference the engine must reproduce.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from svrmad_local.kernels.mxfp4 import FP4_VALUES

from .model_zoo import _COMMON, make_zoo_model

BLOCK = [16, 16]  # small FP8 blocks, so a CPU-small model still has ragged edges (72 = 4.5 blocks)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] -> blocks [..., rows, cols/32, 16], scales [..., rows, cols/32]: each group of 32
    gets the smallest power of two that brings it within +-6, each value the nearest e2m1 code."""
    g = w.float().unflatten(-1, (-1, 32))
    amax = g.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127)).clamp(-127, 127)
    lut = torch.tensor(FP4_VALUES)
    codes = ((g / torch.exp2(exp)).unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp.squeeze(-1) + 127).to(torch.uint8)


def quantize_fp8(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] -> e4m3 weight and fp32 scale_inv [..., ceil(out/b0), ceil(in/b1)] (partial edge blocks)."""
    rows, cols = w.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    pad = torch.zeros(*w.shape[:-2], grid[0] * block[0], grid[1] * block[1])
    pad[..., :rows, :cols] = w.float()
    tiles = pad.unflatten(-1, (grid[1], block[1])).unflatten(-3, (grid[0], block[0]))  # [.., g0, b0, g1, b1]
    scale = (tiles.abs().amax(dim=(-3, -1)) / 448.0).clamp(min=1e-12)  # [.., g0, g1]
    full = scale.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
    return (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _write(folder: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def _bf16_values(model) -> None:
    """Round every weight to a bf16 value: the published files keep unquantized weights in bf16."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def write_gpt_oss(root: Path, seed: int = 0) -> tuple[Path, Path]:
    from svrmad_local.kernels.mxfp4 import dequantize_mxfp4

    model = make_zoo_model("gpt-oss", seed)
    _bf16_values(model)
    q = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if type(mod).__name__ != "GptOssExperts":
                continue
            for proj in ("gate_up_proj", "down_proj"):  # the model keeps [E, in, out]; the file [E, out, in]
                p = getattr(mod, proj)
                blocks, scales = quantize_mxfp4(p.transpose(1, 2))
                p.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
                del q[f"{name}.{proj}"]
                q[f"{name}.{proj}_blocks"], q[f"{name}.{proj}_scales"] = blocks, scales
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    qdir = _write(root / "gpt-oss-mxfp4", config, q)
    model.save_pretrained(root / "gpt-oss-ref")
    return qdir, root / "gpt-oss-ref"


def deepseek_config(**overrides):
    """DeepSeek-V3 with ragged shapes: hidden 72 and kv_a_proj_with_mqa's 24 rows (16 + 8) are 4.5 and
    1.5 blocks of 16; the MoE intermediate 40 is 2.5. `overrides` change fields (tests/test_tp.py
    takes sizes that split over 2 ranks on the block grid)."""
    from transformers import CONFIG_MAPPING

    c = dict(_COMMON, hidden_size=72, intermediate_size=100, num_key_value_heads=4, n_routed_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=40, n_shared_experts=1, first_k_dense_replace=1,
             kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1,
             topk_group=1, rope_scaling=None)
    return CONFIG_MAPPING["deepseek_v3"](**{**c, **overrides})


def write_deepseek(root: Path, fused: bool = False, seed: int = 0, config=None) -> tuple[Path, Path]:
    from transformers import AutoModelForCausalLM

    from svrmad_local.kernels.fp8 import dequantize_fp8

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config or deepseek_config(), dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)  # routing must read it from the file
    _bf16_values(model)
    q = {k: (v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16))
         for k, v in model.state_dict().items()}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head" and not name.endswith("mlp.gate"):
                w, s = quantize_fp8(mod.weight)
                mod.weight.copy_(dequantize_fp8(w, s, BLOCK, torch.float32))
                q[f"{name}.weight"], q[f"{name}.weight_scale_inv"] = w, s
            elif type(mod).__name__ == "DeepseekV3Experts":
                i = mod.intermediate_dim
                for proj in ("gate_up_proj", "down_proj"):
                    del q[f"{name}.{proj}"]
                for e in range(mod.num_experts):
                    parts = {"gate_proj": mod.gate_up_proj[e, :i], "up_proj": mod.gate_up_proj[e, i:],
                             "down_proj": mod.down_proj[e]}
                    if fused:
                        parts = {"gate_up_proj": mod.gate_up_proj[e], "down_proj": mod.down_proj[e]}
                    for proj, w in parts.items():
                        wq, s = quantize_fp8(w)
                        w.copy_(dequantize_fp8(wq, s, BLOCK, torch.float32))
                        if fused:
                            q.setdefault(f"{name}.{proj}", []).append(wq)
                            q.setdefault(f"{name}.{proj}_scale_inv", []).append(s)
                        else:
                            q[f"{name}.{e}.{proj}.weight"], q[f"{name}.{e}.{proj}.weight_scale_inv"] = wq, s
    q = {k: torch.stack(v) if isinstance(v, list) else v for k, v in q.items()}
    layers = model.config.num_hidden_layers  # a multi-token-prediction layer, as published: never used
    q[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
    config = model.config.to_dict()
    config["num_nextn_predict_layers"] = 1
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": BLOCK}
    tag = "fused" if fused else "per-expert"
    qdir = _write(root / f"deepseek-fp8-{tag}", config, q)
    model.save_pretrained(root / f"deepseek-ref-{tag}")
    return qdir, root / f"deepseek-ref-{tag}"


def write_all(root: Path) -> dict[str, tuple[Path, Path]]:
    """Every published layout the tests hold the engine to, each as (q, ref) folders under `root`."""
    return {"gpt-oss": write_gpt_oss(root), "deepseek": write_deepseek(root),
            "deepseek-fused": write_deepseek(root, fused=True)}
