"""With no C++ compiler on PATH and nothing cached, the CPU kernels are skipped in
one svrmad line (which kernels, why, what runs instead, how to get them), without torch's compiler
banners. Run in a fresh interpreter whose PATH holds ninja and Python but no compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CODE = """
import warnings
from svrmad_local import cli  # noqa: F401  (the CLI's one-line warning format is set by cli.main)
warnings.formatwarning = lambda message, category, *rest: f"svrmad run: warning: {message}\\n"
import sys
from svrmad_local.kernels._cpu_build import Kernel
src = sys.argv[1]  # a .cpp file (a path, not a name in csrc/)
a = Kernel("test_nocxx_a", src, "SVRMAD_TEST_A", "test kernel A")
b = Kernel("test_nocxx_b", src, "SVRMAD_TEST_B", "test kernel B")
assert a.load() is None and b.load() is None
print("reason:", a.why_not())
"""


def real_ninja() -> str | None:
    """A ninja binary (not a shim that needs the rest of PATH): torch gets as far as calling the
    compiler, where its banners came from."""
    try:
        import ninja

        if (Path(ninja.BIN_DIR) / "ninja").is_file():
            return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError:
        pass
    return next((p for p in ("/usr/bin/ninja", "/usr/local/bin/ninja") if Path(p).is_file()), shutil.which("ninja"))


@pytest.mark.skipif(sys.platform != "linux", reason="PATH layout of a Linux venv")
def test_no_compiler_is_one_svrmad_line_and_no_torch_banner(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = {"ninja": real_ninja(), "bash": shutil.which("bash"), "sh": shutil.which("sh")}
    for tool, found in tools.items():  # the build tool and a shell are there; the compiler is not
        if found:
            (bin_dir / tool).symlink_to(found)
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    env.update(PATH=str(bin_dir), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    src = tmp_path / "answer.cpp"
    src.write_text("int answer() { return 42; }\n")
    out = subprocess.run([sys.executable, "-c", CODE, str(src)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "reason: no C++ compiler (c++ is not on PATH)" in out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # one line for both kernels, no banner
    line = lines[0]
    assert line.startswith("svrmad run: warning: no C++ compiler (c++ is not on PATH)")
    assert "test kernel A, test kernel B" in line and "torch's own CPU ops run instead" in line
    assert "install one" in line and "not compatible" not in out.stderr and "!!" not in out.stderr
