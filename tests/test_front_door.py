"""The engine's front door: its settings (engine/config.py) import without torch, and the commands that
never load a model (`svrmad replay`, `svrmad merge`) import no torch, no kernels and no engine runtime.

Each command runs in a fresh interpreter (a subprocess), on real folders made by scripted runs, and
that interpreter reports the modules it ended with: an import added anywhere on their path shows here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .runharness import run, use_script

ROOT = Path(__file__).resolve().parents[1]

# What an engine-free process may hold of the engine package: its face and its settings.
ALLOWED_ENGINE = {"svrmad_local.engine", "svrmad_local.engine.config"}


def heavy_modules(code: str) -> list[str]:
    """Run `code` in a fresh interpreter; the torch, kernels and engine modules it ended with."""
    probe = code + (
        "\nimport json, sys\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'transformers')"
        " or m.startswith(('svrmad_local.kernels', 'svrmad_local.engine')))))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [m for m in json.loads(done.stdout.splitlines()[-1]) if m not in ALLOWED_ENGINE]


def test_engine_config_imports_without_torch():
    code = ("from svrmad_local.engine.config import EngineConfig, SamplingParams, SignalConfig\n"
            "EngineConfig(signals=SignalConfig(group_window=8)); SamplingParams(n=2)\n")
    assert heavy_modules(code) == []


def test_the_public_settings_are_the_config_modules():
    """`from svrmad_local import EngineConfig, SamplingParams` and the older paths name the same classes."""
    from svrmad_local import EngineConfig, SamplingParams
    from svrmad_local.engine import config, engine, params, stats

    assert EngineConfig is config.EngineConfig is engine.EngineConfig
    assert SamplingParams is config.SamplingParams is params.SamplingParams is engine.SamplingParams
    assert stats.SignalConfig is config.SignalConfig


def test_replay_and_merge_run_without_the_engine(tmp_path, monkeypatch, capsys):
    use_script(monkeypatch)
    assert run(tmp_path, tmp_path / "a", "--shard", "0/2") == 0
    assert run(tmp_path, tmp_path / "b", "--shard", "1/2") == 0
    capsys.readouterr()
    merged = tmp_path / "merged"
    code = ("from svrmad_local import cli\n"
            f"assert cli.main(['merge', {str(tmp_path / 'a')!r}, {str(tmp_path / 'b')!r}, '--out', {str(merged)!r}]) == 0\n"
            f"assert cli.main(['replay', '--trace', {str(merged / 'trace.jsonl')!r}, '--method', 'svr-mad']) == 0\n")
    assert heavy_modules(code) == []
    assert (merged / "results.jsonl").stat().st_size > 0  # the merge did its work in that process


def test_the_engine_side_never_loads_the_studys_openmp():
    """scikit-learn ships an OpenMP runtime of its own; a process that runs the engine must keep torch's
    alone (a second one keeps a second set of threads on the same cores), so only `svrmad signals`
    imports it."""
    probe = ("import sys, svrmad_local.cli, svrmad_local.job.run, svrmad_local.analysis.report, svrmad_local.engine.engine\n"
             "from pathlib import Path\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sklearn'))\n"
             "print(len({l.split()[-1] for l in Path('/proc/self/maps').read_text().splitlines() if 'libgomp' in l}))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    modules, runtimes = done.stdout.splitlines()[-2:]
    assert modules == "[]" and int(runtimes) <= 1
