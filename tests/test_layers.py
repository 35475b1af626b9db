"""Layers point one way: no module of svrmad_local imports one of a higher layer.

The order is docs/architecture.md's "Layers" (the design's, with grading/ under debate/ and a ground
floor that everything may use); this test reads it from there, walks every import of svrmad_local/
(kernels/ included) with `ast` (nothing is imported, so an import inside a function counts too) and fails on an
arrow that runs back up, naming the file, the line and both layers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "svrmad_local"
SOURCES = {PACKAGE: ROOT / "svrmad_local"}


def layers() -> list[list[str]]:
    """The rooms of each layer, top first, from the fenced block under docs/architecture.md's "## Layers":
    one layer a line, its rooms before the first run of two spaces, separated by commas."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"^## Layers\b.*?^```\w*\n(.*?)^```", text, re.S | re.M)
    assert block, "docs/architecture.md has no fenced block under '## Layers'"
    rows = [re.split(r"\s{2,}", line.strip())[0] for line in block.group(1).splitlines() if line.strip()]
    return [[room.strip() for room in row.split(",")] for row in rows]


def module_name(path: Path) -> str:
    for name, src in SOURCES.items():
        if path.is_relative_to(src):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([name, *parts])
    raise AssertionError(path)


def modules() -> dict[str, Path]:
    found = {}
    for src in SOURCES.values():
        for path in src.rglob("*.py"):
            if "__pycache__" not in path.parts:
                found[module_name(path)] = path
    return found


def imports(path: Path, name: str, known: set[str]):
    """(line, imported module) for every import of ours in the file, relative ones resolved; `from
    svrmad_local import grading` names the module grading, not the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                yield node.lineno, target


def layer_of(module: str, table: list[list[str]]) -> int | None:
    """The layer whose room is the longest prefix of `module` (a room is a file or a folder of svrmad_local,
    written as in the docs: "engine/", "signals.py", "kernels/")."""
    best, best_len = None, -1
    for i, rooms in enumerate(table):
        for room in rooms:
            dotted = ".".join([PACKAGE, *Path(room.rstrip("/")).with_suffix("").parts]).removesuffix(".__init__")
            if room == "__init__.py":
                dotted = PACKAGE
            if (module == dotted or (room.endswith("/") and module.startswith(dotted + "."))) and len(dotted) > best_len:
                best, best_len = i, len(dotted)
    return best


def test_every_module_has_a_layer():
    table = layers()
    missing = sorted(m for m in modules() if layer_of(m, table) is None)
    assert not missing, f"modules on no layer of docs/architecture.md's 'Layers': {missing}"


def upward_imports(found: dict[str, Path], table: list[list[str]]) -> list[str]:
    """Every import of `found` (module name -> file) whose target sits on a higher layer than the importer."""
    upward = []
    for name, path in sorted(found.items()):
        mine = layer_of(name, table)
        for line, target in imports(path, name, set(found)):
            theirs = layer_of(target, table)
            if mine is not None and theirs is not None and theirs < mine:
                upward.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line} imports "
                              f"{target} ({', '.join(table[mine])} -> {', '.join(table[theirs])})")
    return upward


def test_no_import_runs_up_a_layer():
    upward = upward_imports(modules(), layers())
    assert not upward, "imports that run up a layer:\n" + "\n".join(upward)


def test_an_upward_import_is_caught(tmp_path):
    """models/plan.py used to import engine/memory.py inside a function: that shape is found."""
    fake = tmp_path / "plan.py"
    fake.write_text("def parse_gpus(text):\n    from svrmad_local.engine.memory import parse_memory\n")
    found = {**modules(), "svrmad_local.models.fake_plan": fake}
    upward = [u for u in upward_imports(found, layers()) if u.startswith(str(fake))]
    assert upward == [f"{fake}:2 imports svrmad_local.engine.memory (models/ -> engine/)"]


def test_the_walk_sees_the_arrows_it_guards():
    """The walk resolves relative imports, `from svrmad_local import X` and imports inside functions."""
    found = modules()
    runner = {t for _, t in imports(found["svrmad_local.engine.runner"], "svrmad_local.engine.runner", set(found))}
    assert {"svrmad_local.kernels", "svrmad_local.engine.graphs", "svrmad_local.engine.kv_cache"} <= runner
    made = {t for _, t in imports(found["svrmad_local.engine.choices"], "svrmad_local.engine.choices", set(found))}
    assert {"svrmad_local.engine.mla", "svrmad_local.models.linear", "svrmad_local.kernels.cpu_decode"} <= made
    engine = {t for _, t in imports(found["svrmad_local.engine.engine"], "svrmad_local.engine.engine", set(found))}
    assert "svrmad_local.models.loader" in engine  # imported inside Engine.from_pretrained
    table = layers()
    assert layer_of("svrmad_local.models.loader", table) > layer_of("svrmad_local.engine.engine", table)
    assert layer_of("svrmad_local.kernels.paged_decode", table) > layer_of("svrmad_local.models.linear", table)


def test_every_module_name_is_used_once():
    """One name per concept: two modules of one file name (an engine's config.py beside a run's,
    a replay backend's replay.py beside the replay command's) leave a reader asking which is meant.
    docs/architecture.md's "Names that sound alike" says which is which where names are near."""
    by_name: dict[str, list[str]] = {}
    for name, path in modules().items():
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(name)
    twice = {n: sorted(ms) for n, ms in by_name.items() if len(ms) > 1}
    assert not twice, f"module names used more than once: {twice}"
