"""Loading never runs a checkpoint's code or unpickles its weights, and a broken tokenizer or config
is reported as what it is, not as a missing checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from svrmad_local.models.loader import ModelLoadError, load_model

from .conftest import make_model

ROOT = Path(__file__).resolve().parents[1]
EVIL = '''
import pathlib
pathlib.Path({marker!r}).write_text("the checkpoint's code ran")
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast
class EvilConfig(PretrainedConfig):
    model_type = "svrmad-evil"
class EvilForCausalLM(PreTrainedModel):
    config_class = EvilConfig
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
'''


def load_in_subprocess(path: Path) -> subprocess.CompletedProcess:
    """load_model in a fresh interpreter with "y" on stdin: the answer transformers' "run the custom
    code? [y/N]" prompt would take."""
    code = "import sys; from svrmad_local.models.loader import load_model; load_model(sys.argv[1])"
    return subprocess.run([sys.executable, "-c", code, str(path)], input="y\ny\n", capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


@pytest.fixture
def checkpoint(tmp_path, tiny_tokenizer):
    ck = tmp_path / "ck"
    make_model("llama", vocab=len(tiny_tokenizer)).save_pretrained(ck)
    tiny_tokenizer.save_pretrained(ck)
    return ck


def test_custom_model_code_never_runs(tmp_path):
    ck, marker = tmp_path / "evil", tmp_path / "ran.txt"
    ck.mkdir()
    (ck / "evil.py").write_text(EVIL.format(marker=str(marker)))
    (ck / "config.json").write_text(json.dumps({
        "model_type": "svrmad-evil", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"}}))
    save_file({"w": torch.zeros(1)}, ck / "model.safetensors")
    proc = load_in_subprocess(ck)
    assert not marker.exists(), "the checkpoint's Python code ran"
    assert proc.returncode != 0 and "never runs" in proc.stderr


def test_custom_tokenizer_code_never_runs(tmp_path, checkpoint):
    marker = tmp_path / "ran.txt"
    (checkpoint / "evil.py").write_text(EVIL.format(marker=str(marker)))
    cfg = json.loads((checkpoint / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "evil.EvilTokenizer"]})
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(cfg))
    proc = load_in_subprocess(checkpoint)
    assert not marker.exists(), "the tokenizer's Python code ran"
    assert proc.returncode != 0 and "tokenizer" in proc.stderr


def test_every_load_refuses_remote_code_and_pickles(checkpoint, monkeypatch):
    import transformers

    calls = []
    for cls in (transformers.AutoConfig, transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        real = cls.from_pretrained

        def spy(*a, _real=real, _name=cls.__name__, **k):
            calls.append((_name, k))
            return _real(*a, **k)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    load_model(checkpoint, device="cpu")
    assert {name for name, _ in calls} == {"AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"}
    for name, kwargs in calls:
        assert kwargs.get("trust_remote_code") is False and kwargs.get("local_files_only") is True, name
    assert all(k.get("use_safetensors") is True for name, k in calls if name == "AutoModelForCausalLM")


def test_a_corrupt_tokenizer_is_reported_as_such(checkpoint):
    text = (checkpoint / "tokenizer.json").read_text()
    (checkpoint / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(ModelLoadError, match=r"the tokenizer in .* \(tokenizer\.json.*\) cannot be loaded"):
        load_model(checkpoint, device="cpu")


def test_a_folder_without_tokenizer_files_loads_without_one(checkpoint):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (checkpoint / name).unlink()
    assert load_model(checkpoint, device="cpu").tokenizer is None


def test_a_corrupt_config_is_reported_as_such(checkpoint):
    (checkpoint / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        load_model(checkpoint, device="cpu")
