"""The install layout: every package folder is shipped, and the kernels are an ordinary subpackage
(svrmad_local/kernels/, no package-dir remap), so a plain checkout imports with only PYTHONPATH."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    """A folder of modules without __init__.py, or one missing from the explicit list, would be left
    out of a wheel while an editable install still finds it."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    code = {p.parent for p in (ROOT / "svrmad_local").rglob("*.py") if "__pycache__" not in p.parts}
    assert all((d / "__init__.py").exists() for d in code), sorted(str(d) for d in code if not (d / "__init__.py").exists())
    folders = {".".join(d.relative_to(ROOT).parts) for d in code}
    assert folders <= listed, f"package folders missing from pyproject.toml: {sorted(folders - listed)}"
    assert "package-dir" not in cfg, "no remap: every package lives under svrmad_local/ as it imports"


def test_kernels_import_under_the_project_name():
    import svrmad_local.kernels as k

    assert Path(k.__file__).resolve().parent == ROOT / "svrmad_local" / "kernels"
    assert k.__name__ == "svrmad_local.kernels"


def test_a_plain_checkout_imports_with_only_pythonpath(tmp_path):
    """No install: `-S` keeps site-packages' .pth files (an editable install's finder) off the path, so
    the tree on PYTHONPATH is the only place svrmad_local can come from."""
    sites = site.getsitepackages()  # torch and the rest, read as plain folders (their .pth files unread)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sites]))
    code = "import svrmad_local.kernels as k; print(k.__file__)"
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve().parent == ROOT / "svrmad_local" / "kernels"


def test_a_wheel_ships_the_kernels_csrc(tmp_path):
    """A non-editable install has no working tree to read the C++ from: the wheel must carry every
    csrc file. Built from a copy of the tree (setuptools writes build/ where it runs), offline."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "svrmad_local", src / "svrmad_local", ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-q", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "dist").glob("svrmad_local-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    csrc = ROOT / "svrmad_local" / "kernels" / "csrc"
    wanted = {p.relative_to(ROOT).as_posix() for p in csrc.iterdir() if p.suffix in (".cpp", ".h")}
    assert len(wanted) >= 4 and wanted <= shipped, sorted(wanted - shipped)
