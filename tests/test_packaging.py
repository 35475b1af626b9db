"""The install layout: every package folder is shipped, and kernels/ installs under our own name."""

from __future__ import annotations

import tomllib
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
    assert cfg["package-dir"] == {"svrmad_local.kernels": "kernels"}


def test_kernels_import_under_the_project_name():
    import svrmad_local.kernels as k

    assert Path(k.__file__).resolve().parent == ROOT / "kernels"
    assert k.__name__ == "svrmad_local.kernels"
