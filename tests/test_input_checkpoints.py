"""Checkpoint folders cut short (a partial download), inconsistent or of the wrong types are
refused in one line naming the file, the field or the tensor, from the headers alone, by the
loader (`svrmad run`) and by `svrmad plan` alike. Tiny checkpoints written here, then damaged."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from svrmad_local import cli
from svrmad_local.models.files import CheckpointFileError, check_files
from svrmad_local.models.loader import ModelLoadError, check_folder, load_model
from svrmad_local.models.plan import PlanError, make_plan
from svrmad_local.models.quant import QuantError

from .conftest import make_model
from .quant_zoo import write_deepseek


@pytest.fixture
def ck(tmp_path, tiny_tokenizer):
    """A one-layer Llama checkpoint with its tokenizer (chat template included), to damage."""
    path = tmp_path / "ck"
    make_model("llama", vocab=len(tiny_tokenizer), layers=1).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    return write_deepseek(tmp_path_factory.mktemp("fp8"))[0]


def cut(file, n: int) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:-n])


def rewrite_header(file, edit) -> None:
    """Apply `edit` to the JSON header of a safetensors file, keeping its data bytes as they are."""
    data = file.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- row 3: partial downloads, missing shards

def test_a_plain_shard_cut_short_is_named_with_its_shortfall(ck, tmp_path, capsys):
    cut(ck / "model.safetensors", 100)
    with pytest.raises(CheckpointFileError, match=r"model.safetensors is cut short by 100 bytes"):
        check_folder(ck, device="cpu")
    with pytest.raises(CheckpointFileError, match="cut short by 100 bytes"):
        load_model(ck, device="cpu")
    data = tmp_path / "qs.jsonl"
    data.write_text(json.dumps({"id": "a", "question": "1+1?", "gold": "2", "answer_type": "math"}) + "\n")
    assert cli.main(["run", "--model", str(ck), "--dataset", str(data), "--out", str(tmp_path / "out")]) == 2
    assert str(ck / "model.safetensors") in one_line(capsys)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_file_cut_inside_its_header(ck):
    f = ck / "model.safetensors"
    f.write_bytes(f.read_bytes()[:40])
    with pytest.raises(CheckpointFileError, match="shorter than its own header"):
        check_files(ck)


def test_a_quantized_shard_cut_short_is_named(fp8, tmp_path):
    import shutil

    path = tmp_path / "fp8"
    shutil.copytree(fp8, path)
    cut(path / "model.safetensors", 7)
    for mode in ("native", "dequantize"):
        with pytest.raises(CheckpointFileError, match=r"model.safetensors is cut short by 7 bytes"):
            load_model(path, device="cpu", quantization=mode)


def test_a_shard_the_index_names_but_is_missing(tmp_path, tiny_tokenizer):
    path = tmp_path / "sharded"
    make_model("llama", vocab=len(tiny_tokenizer), layers=2).save_pretrained(path, max_shard_size="100KB")
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 1 and (path / "model.safetensors.index.json").exists()
    shards[-1].unlink()
    with pytest.raises(CheckpointFileError, match=rf"weight files model.safetensors.index.json names is missing "
                                                  rf"\({shards[-1].name}\)"):
        check_folder(path, device="cpu")


@pytest.mark.parametrize("target", ["../elsewhere.safetensors", "/etc/passwd", 5, ""])
def test_an_index_pointing_outside_the_folder_is_refused(ck, target):
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": target}}))
    with pytest.raises(CheckpointFileError, match="which is not a file name in the model's folder"):
        check_folder(ck, device="cpu")
    with pytest.raises(PlanError, match="which is not a file name in the model's folder"):
        make_plan(ck, 1, 80 * 2**30)


def test_extra_bytes_after_the_data_are_named(ck):
    with open(ck / "model.safetensors", "ab") as f:
        f.write(b"\0" * 5)
    with pytest.raises(CheckpointFileError, match="5 bytes more data than its header describes"):
        check_files(ck)


# ---------------------------------------------------------------- row 5: the plan reads sizes too

def test_the_plan_refuses_a_shard_cut_short(ck, capsys):
    cut(ck / "model.safetensors", 64)
    with pytest.raises(PlanError, match="cut short by 64 bytes"):
        make_plan(ck, 1, 80 * 2**30)
    assert cli.main(["plan", "--model", str(ck), "--gpus", "1x80GiB"]) == 2
    assert "model.safetensors is cut short by 64 bytes" in one_line(capsys)


def _move_to_start(header, t) -> None:
    """Point tensor `t` at the start of the data, over the tensor already there."""
    begin, end = t["data_offsets"]
    t["data_offsets"] = [0, end - begin]


@pytest.mark.parametrize("edit, says", [
    (lambda h: h["lm_head.weight"].update(shape=[8, 8]), r"tensor lm_head.weight is F32 \[8, 8\] \(256 bytes\) but its "
                                                          r"data_offsets span"),
    (lambda h: _move_to_start(h, max((t for k, t in h.items() if k != "__metadata__"),
                                     key=lambda t: t["data_offsets"][0])),
     "tensors overlap or leave a gap"),
    (lambda h: h["lm_head.weight"].update(shape="64"), "lacks a dtype, a shape or data_offsets"),
])
def test_the_plan_refuses_headers_whose_shapes_disagree_with_their_offsets(ck, edit, says):
    rewrite_header(ck / "model.safetensors", edit)
    with pytest.raises(PlanError, match=says):
        make_plan(ck, 1, 80 * 2**30)
    with pytest.raises(CheckpointFileError, match=says):
        check_folder(ck, device="cpu")


# ---------------------------------------------------------------- row 6: config fields

@pytest.mark.parametrize("edit, says", [
    (lambda c: [], r"config.json holds \[\], not an object of fields"),
    (lambda c: None, "config.json holds null, not an object of fields"),
    (lambda c: {**c, "num_attention_heads": 0}, "num_attention_heads is 0; expected an integer >= 1"),
    (lambda c: {**c, "hidden_size": "64"}, 'hidden_size is "64"; expected an integer >= 1'),
    (lambda c: {**c, "num_hidden_layers": 1.5}, "num_hidden_layers is 1.5"),
    (lambda c: {**c, "num_key_value_heads": True}, "num_key_value_heads is true"),
    (lambda c: {**c, "text_config": "x"}, 'text_config is "x", not an object'),
    (lambda c: {**c, "tie_word_embeddings": "no"}, 'tie_word_embeddings is "no"; expected true or false'),
    (lambda c: {**c, "layer_types": "full_attention"}, 'layer_types is "full_attention"; expected a list of 1 layer'),
    (lambda c: {**c, "quantization_config": []}, r"quantization_config is \[\]; expected an object"),
    (lambda c: {**c, "quantization_config": {"quant_method": "fp8", "weight_block_size": "x"}},
     'weight_block_size is "x"; expected two integers'),
])
def test_config_fields_of_the_wrong_type_are_named(ck, capsys, edit, says):
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(edit(cfg)))
    with pytest.raises(PlanError, match=says):
        make_plan(ck, 1, 80 * 2**30)
    assert cli.main(["plan", "--model", str(ck), "--gpus", "1x80GiB"]) == 2
    assert says.replace("\\", "") in one_line(capsys)
    with pytest.raises(ModelLoadError, match=says):
        check_folder(ck, device="cpu")
    (ck / "model.safetensors").unlink()  # no weights: the plan counts from config.json, and checks the same
    with pytest.raises(PlanError, match=says):
        make_plan(ck, 1, 80 * 2**30)


# ---------------------------------------------------------------- row 9: packed weights of another dtype

ATTN = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"


@pytest.mark.parametrize("mode", ["native", "dequantize"])
@pytest.mark.parametrize("dtype, name", [(torch.float8_e5m2, "F8_E5M2"), (torch.uint8, "U8")])
@pytest.mark.parametrize("keep_scale", [True, False])
def test_a_packed_weight_of_an_unexpected_dtype_is_named(fp8, tmp_path, mode, dtype, name, keep_scale):
    path = tmp_path / "bad"
    path.mkdir()
    for f in fp8.iterdir():
        if f.name != "model.safetensors":
            (path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(fp8 / "model.safetensors"))
    w = tensors[ATTN]
    tensors[ATTN] = w.view(torch.uint8) if dtype == torch.uint8 else w.float().to(dtype)
    if not keep_scale:
        del tensors[ATTN + "_scale_inv"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(QuantError, match=rf"tensor {ATTN} \({name}\): a weight stored as {name} is not read") as info:
        load_model(path, device="cpu", quantization=mode)
    assert "\n" not in str(info.value)


def test_a_packed_weight_without_its_scale_is_named_from_the_headers(fp8, tmp_path):
    path = tmp_path / "noscale"
    path.mkdir()
    (path / "config.json").write_bytes((fp8 / "config.json").read_bytes())
    tensors = load_file(str(fp8 / "model.safetensors"))
    del tensors[ATTN + "_scale_inv"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(QuantError, match=rf"tensor {ATTN} \(F8_E4M3\): its scale tensor {ATTN}_scale_inv is missing"):
        check_folder(path, device="cpu")
