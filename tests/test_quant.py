"""The published quantized layouts (MXFP4 GPT-OSS, FP8 DeepSeek-V3) read by our own code.

The engine on a quantized folder, native (packed) or dequantized, gives exactly the greedy tokens
of transformers' cache-free loop on a folder with the same weights dequantized to fp32; its
log-probabilities agree within 1e-4 (native computes the same products in another order).
Dequantizers are checked against values worked out by hand, refusals are one line naming the
tensor or the method, and native keeps the bytes packed.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from svrmad_local.engine.engine import Engine
from svrmad_local.models.linear import weight_bytes
from svrmad_local.engine.params import SamplingParams
from svrmad_local.kernels import _quant_common, dequantize_fp8, dequantize_mxfp4, fp8_matmul, mxfp4_matmul
from svrmad_local.models import hf
from svrmad_local.models.loader import load_model
from svrmad_local.models.quant import Fp8Experts, Fp8Linear, Mxfp4Experts, QuantError, choose_mode, quant_spec
from svrmad_local.models.quant.formats import QuantSpec

from .model_zoo import WINDOW, full_logprobs, loop_greedy, rand_prompt
from .quant_zoo import BLOCK, write_all

NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
LOGPROB_TOL = 1e-4  # native vs dequantized: the same fp32 products, summed in another order


# ------------------------------------------------------------------------------ dequantizers


def test_mxfp4_dequantize_by_hand():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x21  # low nibble 1 (+0.5) first, then 2 (+1.0)
    blocks[0, 0, 1] = 0xF9  # 9 (-0.5), then 15 (-6.0)
    blocks[0, 0, 2] = 0x77  # 7 (+6.0) twice
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2^(128-127) = 2
    w = dequantize_mxfp4(blocks, scales, torch.float32)
    assert w.shape == (1, 32)
    assert w[0, :6].tolist() == [1.0, 2.0, -1.0, -12.0, 12.0, 12.0]
    assert w[0, 6:].abs().sum() == 0
    assert dequantize_mxfp4(blocks, torch.tensor([[120]], dtype=torch.uint8), torch.bfloat16)[0, 3].item() == -6 / 128


def test_fp8_dequantize_ragged_by_hand():
    """5x3 in blocks of 2x2: a 3x2 scale grid whose last row and column are partial blocks."""
    w = torch.tensor([[1.0, -2.0, 0.5], [4.0, 0.25, -1.5], [3.0, 2.0, 1.0], [-0.5, 6.0, 8.0], [1.0, 1.0, -2.0]])
    s = torch.tensor([[1.0, 10.0], [0.5, 100.0], [2.0, -3.0]])
    got = dequantize_fp8(w.to(torch.float8_e4m3fn), s, (2, 2), torch.float32)
    want = [[w[r, c].item() * s[r // 2, c // 2].item() for c in range(3)] for r in range(5)]
    assert got.tolist() == want
    pow2 = torch.tensor([[1.0, 8.0], [0.5, 64.0], [2.0, 0.25]])  # UE8M0 scales (DeepSeek-V3.1's scale_fmt)
    assert torch.equal(dequantize_fp8(w.to(torch.float8_e4m3fn), pow2.to(torch.float8_e8m0fnu), (2, 2), torch.float32),
                       dequantize_fp8(w.to(torch.float8_e4m3fn), pow2, (2, 2), torch.float32))
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \[2, 2\].*needs \[3, 2\]"):
        dequantize_fp8(w.to(torch.float8_e4m3fn), s[:2], (2, 2))


def test_fp8_dequantize_deepseek_kv_a_shape():
    """576 rows (4.5 blocks of 128), the shape that failed in transformers' path, and a 192-row one."""
    for rows in (576, 192):
        w = (torch.randn(rows, 256) * 50).to(torch.float8_e4m3fn)
        s = torch.rand(-(-rows // 128), 2) + 0.1
        got = dequantize_fp8(w, s, (128, 128), torch.float32)
        ref = w.float() * s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)
        assert torch.equal(got, ref)
        assert torch.equal(got[512:], w[512:].float() * s[4:5].repeat_interleave(128, 1)) if rows == 576 else True


@pytest.mark.parametrize("chunked", [False, True])
def test_matmuls_equal_dequantize_then_matmul(monkeypatch, chunked):
    if chunked:  # force the block-row slices a large matrix takes
        monkeypatch.setattr(_quant_common, "MAX_DENSE_ELEMENTS", 40 * 64)
    torch.manual_seed(0)
    x = torch.randn(5, 64)
    blocks = torch.randint(0, 256, (100, 2, 16), dtype=torch.uint8)
    scales = torch.randint(120, 130, (100, 2), dtype=torch.uint8)
    bias = torch.randn(100)
    w = dequantize_mxfp4(blocks, scales, torch.float32)
    torch.testing.assert_close(mxfp4_matmul(x, blocks, scales, bias, "torch"), x @ w.T + bias, rtol=1e-5, atol=1e-4)
    wq, s = (torch.randn(100, 64) * 30).to(torch.float8_e4m3fn), torch.rand(7, 4)
    w = dequantize_fp8(wq, s, BLOCK, torch.float32)
    torch.testing.assert_close(fp8_matmul(x, wq, s, BLOCK, bias, "torch"), x @ w.T + bias, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("quant"))


@pytest.fixture(scope="module")
def refs(folders):
    return {k: load_model(ref, device="cpu", dtype="fp32").model for k, (_, ref) in folders.items()}


PACKED = {"gpt-oss": Mxfp4Experts, "deepseek": Fp8Experts, "deepseek-fused": Fp8Experts}


@pytest.mark.parametrize("mode", ["native", "dequantize"])
@pytest.mark.parametrize("name", ["gpt-oss", "deepseek", "deepseek-fused"])
def test_engine_on_quantized_folder_matches_the_fp32_reference(folders, refs, name, mode):
    qdir, _ = folders[name]
    ref = refs[name]
    eng = Engine.from_pretrained(qdir, quantization=mode, device="cpu", dtype="fp32", kv_cache_memory=4 * 2**20, block_size=4)
    try:
        packed = [m for m in eng.model.modules() if isinstance(m, PACKED[name])]
        assert bool(packed) == (mode == "native")
        if name.startswith("deepseek") and mode == "native":
            assert isinstance(eng.model.model.layers[0].self_attn.kv_a_proj_with_mqa, Fp8Linear)
        prompts = [rand_prompt(2 * WINDOW + 3, 1), rand_prompt(WINDOW + 1, 2), rand_prompt(5, 3)]
        outs = eng.generate_sync(prompts, GREEDY)
        for p, o in zip(prompts, outs):
            c = o.completions[0]
            assert c.token_ids == loop_greedy(ref, p, NEW), (name, mode)
            lp = full_logprobs(ref, p + c.token_ids)
            want = [lp[len(p) + i - 1, t].item() for i, t in enumerate(c.token_ids)]
            assert c.logprobs == pytest.approx(want, abs=LOGPROB_TOL), (name, mode)
    finally:
        eng.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dequantize_gives_every_weight_the_dtype_a_plain_checkpoint_gets(folders, dtype):
    """fp32 asked: every weight fp32 (transformers' own path left 17 in bf16). bf16: as a plain load of
    the same model, so DeepSeek's router stays in the fp32 its architecture keeps it in."""
    for name, (qdir, ref) in folders.items():
        got = load_model(qdir, device="cpu", dtype=dtype, quantization="dequantize").model
        want = load_model(ref, device="cpu", dtype=dtype).model
        assert {n: t.dtype for n, t in got.state_dict().items()} == {n: t.dtype for n, t in want.state_dict().items()}
        if dtype == "fp32":
            assert {t.dtype for t in got.state_dict().values()} == {torch.float32}
        for (n, a), b in zip(got.state_dict().items(), want.state_dict().values()):
            assert torch.equal(a, b), n  # exact: the reference holds the same dequantized values


def test_native_keeps_the_bytes_packed(folders):
    native = load_model(folders["gpt-oss"][0], device="cpu", dtype="fp32", quantization="native").model
    dense = load_model(folders["gpt-oss"][0], device="cpu", dtype="fp32", quantization="dequantize").model
    experts = [m for m in native.modules() if isinstance(m, Mxfp4Experts)]
    for m in experts:
        params = m.num_experts * 3 * m.hidden_size * m.intermediate_size  # gate, up and down
        packed = sum(t.numel() for n, t in m.named_buffers())
        assert packed * 8 / params == 4.25  # 4 bits a value, 8 bits a scale per 32
    saved = sum(m.num_experts * 3 * m.hidden_size * m.intermediate_size * (4 - 4.25 / 8) for m in experts)
    assert weight_bytes(dense) - weight_bytes(native) == saved  # fp32 dense vs packed, biases equal

    ds = load_model(folders["deepseek"][0], device="cpu", dtype="fp32", quantization="native").model
    lin = ds.model.layers[0].self_attn.kv_a_proj_with_mqa
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight_scale_inv.shape == (2, 5)  # 24x72 in 16x16
    assert lin.packed_bytes() == 24 * 72 + 2 * 5 * 4


def test_dense_weight_and_dtype_casts(folders, refs):
    native = load_model(folders["deepseek"][0], device="cpu", dtype="fp32", quantization="native").model
    ref = refs["deepseek"]
    lin = native.model.layers[0].self_attn.kv_b_proj
    assert torch.equal(lin.dense_weight(), ref.model.layers[0].self_attn.kv_b_proj.weight)
    ex, ref_ex = native.model.layers[1].mlp.experts, ref.model.layers[1].mlp.experts
    assert torch.equal(ex.dense_weight("gate_up_proj"), ref_ex.gate_up_proj)
    assert torch.equal(ex.dense_weight("down_proj", 2), ref_ex.down_proj[2])
    gpt = load_model(folders["gpt-oss"][0], device="cpu", dtype="fp32", quantization="native").model
    g_ex, g_ref = gpt.model.layers[0].mlp.experts, refs["gpt-oss"].model.layers[0].mlp.experts
    assert torch.equal(g_ex.dense_weight("down_proj", 1).T, g_ref.down_proj[1])
    native.to(torch.bfloat16)  # a cast must not touch e4m3 codes or fp32 block scales
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight_scale_inv.dtype == torch.float32
    assert native.model.embed_tokens.weight.dtype == torch.bfloat16


def test_engine_reports_packed_weight_bytes(folders):
    eng = Engine.from_pretrained(folders["deepseek"][0], device="cpu", kv_cache_memory=2**20)
    try:
        assert any(isinstance(m, Fp8Linear) for m in eng.model.modules())  # auto on the CPU: native
        assert eng.info["weight_bytes"] == weight_bytes(eng.model)
        assert eng.info["weight_bytes"] < weight_bytes(load_model(folders["deepseek"][1], device="cpu", dtype="fp32").model)
    finally:
        eng.close()


# ------------------------------------------------------------------------------ refusals


def _copy(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def _refused(path, match, **kw):
    with pytest.raises(QuantError, match=match) as info:
        load_model(path, device="cpu", **kw)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("method,cfg", [("awq", {"quant_method": "awq", "bits": 4}),
                                        ("gptq", {"quant_method": "gptq", "bits": 4}),
                                        ("bitsandbytes", {"load_in_4bit": True})])
def test_unsupported_methods_are_named(folders, tmp_path, method, cfg):
    def edit(c):
        c["quantization_config"] = cfg
    path = _copy(folders["gpt-oss"][1], tmp_path / method, edit_config=edit)
    _refused(path, rf"quantization '{method}'.*not a format.*mxfp4.*fp8")


LAYER = "model.layers.1.mlp.experts"


@pytest.mark.parametrize("mode", ["native", "dequantize"])
@pytest.mark.parametrize("case,edit,match", [
    ("missing-scales", lambda t: t.pop(f"{LAYER}.down_proj_scales"), f"{LAYER}.down_proj_scales is missing"),
    ("short-blocks", lambda t: t.update({f"{LAYER}.gate_up_proj_blocks": t[f"{LAYER}.gate_up_proj_blocks"][:, :-2]}),
     f"{LAYER}.gate_up_proj_blocks"),
    ("bad-scales", lambda t: t.update({f"{LAYER}.down_proj_scales": t[f"{LAYER}.down_proj_scales"][..., :1]}),
     f"{LAYER}.down_proj_scales"),
])
def test_bad_mxfp4_tensors_are_named(folders, tmp_path, case, edit, match, mode):
    path = _copy(folders["gpt-oss"][0], tmp_path / case, edit_tensors=edit)
    _refused(path, match, quantization=mode)


ATTN = "model.layers.0.self_attn.kv_a_proj_with_mqa"


@pytest.mark.parametrize("mode", ["native", "dequantize"])
@pytest.mark.parametrize("case,edit,match", [
    ("missing-scale", lambda t: t.pop(f"{ATTN}.weight_scale_inv"), f"{ATTN}.weight_scale_inv is missing"),
    ("bad-scale", lambda t: t.update({f"{ATTN}.weight_scale_inv": t[f"{ATTN}.weight_scale_inv"][:1]}),
     f"{ATTN}.weight_scale_inv"),
    ("missing-expert", lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"),
     "model.layers.2.mlp.experts.3.up_proj.weight is missing"),
    ("stray", lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
     "not used by the config's architecture.*model.layers.0.mlp.extra.weight"),
])
def test_bad_fp8_tensors_are_named(folders, tmp_path, case, edit, match, mode):
    path = _copy(folders["deepseek"][0], tmp_path / case, edit_tensors=edit)
    _refused(path, match, quantization=mode)


def test_modes_without_a_path_are_refused(folders):
    spec = QuantSpec("fp8", (128, 128))
    # tensor parallelism keeps the weights packed: dequantize, or a device without a packed path, is refused
    assert choose_mode("native", spec, "cuda", True, None)[0] == "native"
    with pytest.raises(QuantError, match="tensor parallelism over a fp8 checkpoint keeps the weights packed .* "
                                         "use --quantization native or auto"):
        choose_mode("dequantize", spec, "cpu", True, None)
    with pytest.raises(QuantError, match="tensor parallelism over a fp8 checkpoint keeps the weights packed, which "
                                         "runs on cpu and cuda, not mps"):
        choose_mode("auto", spec, "mps", True, None)
    with pytest.raises(QuantError, match="'native' has no path on mps"):
        choose_mode("native", spec, "mps", False, None)
    assert choose_mode("auto", spec, "mps", False, None)[0] == "dequantize"
    assert choose_mode("auto", spec, "cpu", False, None)[0] == "native"
    assert choose_mode("auto", None, "cpu", False, None)[0] == "plain"
    _refused(folders["gpt-oss"][1], "'native' asked for, but the checkpoint is not quantized", quantization="native")
    _refused(folders["gpt-oss"][0], "quantization 'packed': use one of auto, native, dequantize", quantization="packed")
    with pytest.raises(QuantError, match="fp8 format 'e5m2'"):
        quant_spec({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}})


def test_device_maps_keep_packed_modules_whole(folders, refs, tmp_path):
    qdir = folders["gpt-oss"][0]
    prompt = rand_prompt(2 * WINDOW + 1, 5)
    want = loop_greedy(refs["gpt-oss"], prompt, NEW)
    for device_map in ("auto", {"model": "cpu", "lm_head": "cpu"}):
        model = load_model(qdir, device_map=device_map, dtype="fp32", quantization="native").model
        assert any(isinstance(m, Mxfp4Experts) for m in model.modules())
        assert loop_greedy(model, prompt, NEW) == want
    cut = {"": "cpu", "model.layers.1.mlp.experts.down_proj_blocks": "cpu"}
    _refused(qdir, r"device_map entry 'model.layers.1.mlp.experts.down_proj_blocks' cuts the packed module "
                   r"model.layers.1.mlp.experts", device_map=cut, quantization="native")


def test_run_option_and_the_one_info_line(folders, caplog):
    import argparse
    import logging

    from svrmad_local.job.flags import add_run_arguments, from_args

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    assert from_args(parser.parse_args(["--quantization", "dequantize"])).quantization == "dequantize"
    assert from_args(parser.parse_args([])).quantization == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])
    with caplog.at_level(logging.INFO, logger="svrmad_local.models"):
        model = load_model(folders["gpt-oss"][0], device="cpu").model
    lines = [r.getMessage() for r in caplog.records if r.name == "svrmad_local.models"]
    assert len(lines) == 1 and "MXFP4" in lines[0] and "packed (native)" in lines[0] and "on cpu" in lines[0]
    assert model.svrmad_quantization["summary"] == lines[0]


def test_triton_hand_off_takes_the_same_arguments():
    """kernel_impl="triton" goes to kernels/quant_triton.py with (x, blocks, scales, bias) /
    (x, weight, scale_inv, block, bias); without that file it says so (the torch path needs none)."""
    from svrmad_local.kernels._backend import interpreter_ready

    if not interpreter_ready():
        pytest.skip("triton's interpreter is not active")
    torch.manual_seed(1)
    x = torch.randn(3, 64)
    blocks = torch.randint(0, 256, (48, 2, 16), dtype=torch.uint8)
    scales = torch.randint(122, 130, (48, 2), dtype=torch.uint8)
    wq, s, bias = (torch.randn(48, 64) * 30).to(torch.float8_e4m3fn), torch.rand(3, 4), torch.randn(48)
    try:
        from svrmad_local.kernels import quant_triton  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="quant_triton.py cannot provide it"):
            mxfp4_matmul(x, blocks, scales, bias, "triton")
        return
    torch.testing.assert_close(mxfp4_matmul(x, blocks, scales, bias, "triton"),
                               mxfp4_matmul(x, blocks, scales, bias, "torch"), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(fp8_matmul(x, wq, s, BLOCK, bias, "triton"),
                               fp8_matmul(x, wq, s, BLOCK, bias, "torch"), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("name", ["gpt-oss", "deepseek", "deepseek-fused"])
def test_packed_experts_on_the_gpu_path_never_return_to_the_host(interp, folders, refs, name):
    """Where Triton runs, the packed experts compute as one grouped GEMM per projection over
    token-expert pairs sorted on the device (kernels/quant_triton.py): the same output as the per-expert
    loop, and a decode step a CUDA graph can capture (engine/graphs.py's check finds nothing), here run
    by Triton's interpreter; greedy tokens equal the fp32 reference's."""
    from svrmad_local.engine import graphs

    qdir, _ = folders[name]
    eng = Engine.from_pretrained(qdir, device="cpu", kv_cache_memory=4 * 2**20, block_size=4, kernel_impl="triton",
                                 cuda_graphs="static")
    try:
        experts = next(m for m in eng.model.modules() if isinstance(m, PACKED[name]))
        T, k = 7, 2
        g = torch.Generator().manual_seed(3)
        x = torch.randn(T, getattr(experts, "hidden_size", None) or experts.hidden_dim, generator=g)
        index = torch.randint(0, experts.num_experts, (T, k), generator=g)
        index[2, 1] = experts.num_experts  # a padding index: no expert, no contribution
        weights = torch.rand(T, k, generator=g)
        with graphs.HostSyncCheck() as check:
            grouped = experts(x, index, weights)
        assert check.syncs == [] and check.frozen == [], check.found
        experts.kernel_impl = "torch"  # the per-expert loop
        torch.testing.assert_close(grouped, experts(x, index, weights), rtol=1e-5, atol=1e-5)
        experts.kernel_impl = "triton"
        assert eng.runner.static.found == [], eng.runner.static.found
        prompts = [rand_prompt(WINDOW + 1, 1), rand_prompt(5, 3)]  # short: Triton's interpreter is slow
        outs = eng.generate_sync(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert [o.completions[0].token_ids for o in outs] == [loop_greedy(refs[name], p, 4) for p in prompts], name
    finally:
        eng.close()


def test_engine_passes_its_kernel_choice_to_packed_modules(folders):
    eng = Engine.from_pretrained(folders["gpt-oss"][0], device="cpu", kv_cache_memory=2**20, kernel_impl="torch")
    try:
        assert {m.kernel_impl for m in eng.model.modules() if isinstance(m, Mxfp4Experts)} == {"torch"}
    finally:
        eng.close()


FIXTURES = Path(__file__).parent / "fixtures" / "configs"  # the published config.json files, no weights


def _meta_packed(name: str, packed: bool):
    """The model of a published config on the meta device, its quantized modules swapped for ours."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(FIXTURES / name)
    block = tuple(config.quantization_config.get("weight_block_size") or (0, 0))
    del config.quantization_config
    # everything made on the meta device, not made and then moved there: an engine in the same process
    # keeps freed memory in its heap (engine/memory.py), so real empty tensors of these sizes would leave
    # hundreds of GB of address space behind, after which the process can no longer fork
    with init_empty_weights(include_buffers=False), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        hf.apply_dtype_plan(model, torch.bfloat16)  # as our loader's meta_model does
        _swap_packed(model, block, packed)
    return model


def _swap_packed(model, block: tuple, packed: bool) -> None:
    from svrmad_local.models.quant.load import _is_fused_experts

    for n, m in list(model.named_modules()) if packed else []:
        if type(m).__name__ == "GptOssExperts":
            model.set_submodule(n, Mxfp4Experts(m.num_experts, m.hidden_size, m.intermediate_size, m.alpha, m.limit,
                                                torch.bfloat16))
        elif block[0] and isinstance(m, torch.nn.Linear) and n != "lm_head" and not n.endswith("mlp.gate"):
            model.set_submodule(n, Fp8Linear(m.in_features, m.out_features, block, False, torch.bfloat16))
        elif block[0] and _is_fused_experts(m):
            e, two_i, h = m.gate_up_proj.shape
            model.set_submodule(n, Fp8Experts(e, h, two_i // 2, block, m.act_fn, torch.bfloat16, fused=False))


@pytest.mark.parametrize("name", ["gpt-oss-120b", "gpt-oss-20b", "deepseek-v3.1"])
def test_packed_bytes_at_the_published_sizes_agree_with_the_plan(name):
    """Our packed modules, built on the meta device from the published configs, hold the bytes
    `svrmad plan` counts from the formats (GPT-OSS-120B: 65 GB packed, 234 GB bf16; DeepSeek-V3.1:
    673 GB, 1.34 TB). The differences, stated: transformers keeps DeepSeek's router weights (and its
    score bias) in fp32 where the plan counts bf16, 2 bytes more a value in memory; weight_bytes also
    counts the RoPE frequency tables (256 bytes). The router weights are fp32 from transformers 5.24 on (its
    modeling code makes them so; 5.17 keeps them bf16), so they are counted in the dtype they have."""
    from svrmad_local.models.plan import make_plan

    for quantization, packed in (("native", True), ("dequantize", False)):
        model = _meta_packed(name, packed)
        want = make_plan(FIXTURES / name, 8, 141 * 2**30, quantization)["weight_bytes"]
        gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
        # router weights: bf16 in the file, fp32 in memory where the release keeps them so
        fp32 = sum(m.weight.numel() for m in gates if m.weight.dtype == torch.float32)
        if quantization == "dequantize":  # the plan counts every plain tensor in bf16; this bias stays fp32
            fp32 += sum(m.e_score_correction_bias.numel() for m in gates)
        tables = sum(b.numel() * b.element_size() for m in model.modules()  # RoPE frequencies, not weights
                     for k, b in m._buffers.items() if k in m._non_persistent_buffers_set)
        assert weight_bytes(model) - tables == want + 2 * fp32, (name, quantization)
    if name == "gpt-oss-120b":
        assert want // 10**9 == 233 and weight_bytes(_meta_packed(name, True)) // 10**9 == 65


def test_mxfp4_bytes_by_hand_at_gpt_oss_120b():
    """36 layers of 128 experts, gate+up+down 3 x 2880 x 2880 values each: bf16 2 bytes a value,
    packed 4.25 bits = 17/32 bytes; the biases and everything else are the same bf16 bytes."""
    dense, packed = weight_bytes(_meta_packed("gpt-oss-120b", False)), weight_bytes(_meta_packed("gpt-oss-120b", True))
    experts = 36 * 128 * 3 * 2880 * 2880
    assert dense - packed == experts * 2 - experts * 17 // 32
    assert dense // 10**9 == 233 and packed // 10**9 == 65
