"""The install layout: every package folder is shipped, and kernels/ installs under our own name."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "svrmad_local").rglob("__init__.py")}
    assert folders <= listed, f"package folders missing from pyproject.toml: {sorted(folders - listed)}"
    assert cfg["package-dir"] == {"svrmad_local.kernels": "kernels"}


def test_kernels_import_under_the_project_name():
    import svrmad_local.kernels as k

    assert Path(k.__file__).resolve().parent == ROOT / "kernels"
    assert k.__name__ == "svrmad_local.kernels"
