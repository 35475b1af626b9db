"""benchmarks/gpu_check.py, the GPU check for a bare machine: what it would install from the carried
wheels, and its dry run on this CPU machine (the summary docs/gpu-check.md describes: every step ran or
skipped, a CUDA step never "ran" here, the files carried within 64 MiB)."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_check  # noqa: E402


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    w = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
        z.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n{meta}")
    return w


def test_a_wheel_is_installed_only_where_the_release_falls_short_and_brings_its_requirements(tmp_path):
    tf = _wheel(tmp_path, "transformers", "5.24.0", ["huggingface-hub<3.0,>=1.31.0", "tqdm>=4.60"])
    hub = _wheel(tmp_path, "huggingface_hub", "1.33.0", ["click>=8.4.2"])
    click = _wheel(tmp_path, "click", "8.5.1", [])
    pytest_w = _wheel(tmp_path, "pytest", "9.2.0", ["pluggy>=1.5"])
    pluggy = _wheel(tmp_path, "pluggy", "1.7.0", [])
    wheels = [tf, hub, click, pytest_w, pluggy]

    def machine(have):
        return lambda d: have.get(gpu_check._norm(d), "99.0")  # anything else: present and new enough

    # a GPU image with transformers 5.17 (the lowest of our range), an old hub and click, no pytest
    lent = {"transformers": "5.17.0", "huggingface-hub": "1.5.0", "click": "8.1.0", "pytest": None, "pluggy": None}
    todo, needs = gpu_check._plan(wheels, machine(lent))
    assert [w.name for w in todo] == [pytest_w.name, pluggy.name]
    # a release below our range: the carried transformers, and what it brings
    todo, needs = gpu_check._plan(wheels, machine({**lent, "transformers": "5.16.0"}))
    assert [w.name for w in todo] == [tf.name, hub.name, click.name, pytest_w.name, pluggy.name]
    assert any(r.name == "huggingface-hub" for r in needs)
    # a machine that has what we pin: nothing
    todo, _ = gpu_check._plan(wheels, machine({"transformers": "5.24.0", "huggingface-hub": "2.4.0"}))
    assert todo == []
    # the installed transformers meets our pin: its own requirements are its installer's business, not ours
    todo, _ = gpu_check._plan(wheels, machine({"transformers": "5.24.1", "huggingface-hub": "1.5.0"}))
    assert todo == []


def test_the_dry_run_writes_the_summary_and_never_runs_a_cuda_step(tmp_path, monkeypatch):
    monkeypatch.setenv("SVRMAD_GPU_CHECK_WORK", str(tmp_path / "work"))
    out = tmp_path / "out"
    code = gpu_check.main([str(out), "--dry-run", "--steps", "tests,graphs,bf16,flash"])
    summary = json.loads((out / "summary.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert summary["dry_run"] is True and code == 0, steps
    for s in summary["steps"]:
        assert {"name", "status", "reason", "needs_cuda"} <= set(s) and s["status"] in ("ran", "skipped"), s
        if s["needs_cuda"]:
            assert s["status"] == "skipped" and s["reason"].startswith("needs CUDA") and s["command"], s
        else:
            assert s["status"] == "ran" and s["result"] == "pass", s
    assert [n for n, s in steps.items() if s["needs_cuda"]] == ["tests", "graphs", "bf16", "flash"]
    carry = steps["carry"]["figures"]
    assert carry["total_bytes"] == carry["tree_bytes"] + sum(carry["wheels"].values()) < 64 * 2**20
    assert set(steps["models"]["figures"]["models"]) == {"smollm2-135m", "qwen3-1.7b", "gpt-oss-mxfp4", "deepseek-fp8",
                                                         gpu_check.LONG_MODEL}
    for folder in steps["models"]["figures"]["models"].values():
        assert (Path(folder) / "config.json").exists()
    assert Path(steps["package"]["figures"]["kernels"]).resolve().is_relative_to(gpu_check.ROOT)
    assert summary["timings_kept"] == [] and not (out / "logs" / "calibration").exists()  # no engine was built


def test_the_timings_the_steps_engines_kept_come_back_beside_the_logs(tmp_path, monkeypatch):
    """A build's kept gemv and sampling timings (under the steps' SVRMAD_CACHE) are copied to logs/calibration/
    and named in the summary: what each pick was chosen over."""
    monkeypatch.setenv("SVRMAD_GPU_CHECK_WORK", str(tmp_path / "work"))
    kept = tmp_path / "work" / "no-default-model" / "calibration"
    kept.mkdir(parents=True)
    for name in ("gemv-0123.json", "sampling-4567.json"):
        (kept / name).write_text(json.dumps({"key": {}, "figures": {"2048x2048": {"1": {"torch": 1e-5}}}}))
    out = tmp_path / "out"
    assert gpu_check.main([str(out), "--dry-run", "--steps", "graphs"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["timings_kept"] == ["gemv-0123.json", "sampling-4567.json"]
    for name in summary["timings_kept"]:
        assert (out / "logs" / "calibration" / name).read_text() == (kept / name).read_text()
    assert Path(gpu_check.Check(out, True, 1).env()["SVRMAD_CACHE"]) == kept.parent


def test_the_decode_step_runs_each_model_asked_for_and_refuses_an_unknown_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SVRMAD_GPU_CHECK_WORK", str(tmp_path / "work"))
    assert gpu_check.main([str(tmp_path / "bad"), "--dry-run", "--decode-models", "llama-70b"]) == 2
    assert "unknown model(s) llama-70b" in capsys.readouterr().err
    out = tmp_path / "out"
    assert gpu_check.main([str(out), "--dry-run", "--steps", "decode", "--decode-models", "smollm2-135m,qwen3-1.7b"]) == 0
    steps = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["steps"] if s["needs_cuda"]}
    assert list(steps) == ["decode-graphs-auto", "decode-graphs-auto-overlap-off", "decode-graphs-auto-pdl-off",
                           "host-ops-graphs-auto", "decode-graphs-off", "host-ops-graphs-off",
                           "decode-qwen3-1.7b-graphs-auto", "decode-qwen3-1.7b-graphs-auto-overlap-off",
                           "decode-qwen3-1.7b-graphs-auto-pdl-off", "host-ops-qwen3-1.7b-graphs-auto",
                           "decode-qwen3-1.7b-graphs-off", "host-ops-qwen3-1.7b-graphs-off"]
    for name, s in steps.items():
        model = "qwen3-1.7b" if "qwen3" in name else "smollm2-135m"
        assert s["status"] == "skipped" and s["command"][s["command"].index("--model") + 1].endswith(model), s
        engine = s["command"][s["command"].index("--engine") + 1]
        assert engine.endswith(",overlap=off") == name.endswith("-overlap-off"), s
        assert engine.endswith(",pdl=off") == name.endswith("-pdl-off"), s
    assert gpu_check.main([str(tmp_path / "bad"), "--dry-run", "--overlaps", "auto,maybe"]) == 2
    assert "unknown overlap value(s) maybe" in capsys.readouterr().err
    assert gpu_check.main([str(tmp_path / "bad"), "--dry-run", "--pdls", "sometimes"]) == 2
    assert "unknown pdl value(s) sometimes" in capsys.readouterr().err
    # the profile with PDL and without (without it a kernel's own time is its work alone)
    out = tmp_path / "profile"
    assert gpu_check.main([str(out), "--dry-run", "--steps", "profile", "--decode-models", "qwen3-1.7b"]) == 0
    steps = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["steps"] if s["needs_cuda"]}
    assert list(steps) == ["profile-qwen3-1.7b-graphs-auto", "profile-qwen3-1.7b-graphs-auto-pdl-off",
                           "profile-qwen3-1.7b-graphs-off"]
    engines = [s["command"][s["command"].index("--engine") + 1] for s in steps.values()]
    assert [e.endswith(",pdl=off") for e in engines] == [False, True, False]


def test_the_paper_model_steps_are_listed_with_their_commands_and_skipped_on_a_cpu(tmp_path, monkeypatch):
    """Parts 4 and 5: the packed GEMMs (with the tiling sweep), absorbed MLA at 128 heads and a TP-8 rank's 16,
    decode at 1k and 16k contexts and the memory of a 16k run, each skipped here with the command it would
    run; the few-layer GPT-OSS-120B model they run on is built from the published config."""
    monkeypatch.setenv("SVRMAD_GPU_CHECK_WORK", str(tmp_path / "work"))
    out = tmp_path / "out"
    assert gpu_check.main([str(out), "--dry-run", "--steps", "4"]) == 0
    assert gpu_check.main([str(tmp_path / "out5"), "--dry-run", "--steps", "5"]) == 0
    steps = {}
    for folder in (out, tmp_path / "out5"):
        summary = json.loads((folder / "summary.json").read_text())
        steps.update({s["name"]: s for s in summary["steps"] if s["needs_cuda"]})
    assert list(steps) == ["quant", "mla-128-heads", "mla-16-heads-tp8-rank", "mla-128-heads-batch32", "long-1k",
                           "long-16k", "memory"]
    for s in steps.values():
        assert s["status"] == "skipped" and s["reason"].startswith("needs CUDA") and s["command"], s
    assert "--sweep" in steps["quant"]["command"] and "bench_quant.py" in steps["quant"]["command"][1]
    assert steps["mla-16-heads-tp8-rank"]["command"][steps["mla-16-heads-tp8-rank"]["command"].index("--heads") + 1] \
        == "16"
    for name, tokens in (("long-1k", "1024"), ("long-16k", "16384"), ("memory", "16384")):
        cmd = steps[name]["command"]
        assert cmd[cmd.index("--prompt-tokens") + 1] == tokens and cmd[cmd.index("--model") + 1].endswith(
            gpu_check.LONG_MODEL)
    folder = Path(json.loads((out / "summary.json").read_text())["steps"][3]["figures"]["models"][gpu_check.LONG_MODEL])
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 and len(cfg["layer_types"]) == 4 and "quantization_config" not in cfg
    assert cfg["hidden_size"] == 2880 and cfg["num_local_experts"] == 128 and (folder / "tokenizer.json").exists()


def test_the_decode_peer_step_runs_the_engine_beside_transformers_compiled_generate(tmp_path, monkeypatch):
    """Part 6: bench_decode --hf-compile at Qwen3-1.7B's shape in bf16, batch 1, 8 and 32, skipped here with its
    command; a batch size the peer failed at fails the step with its line; a step that does not fit the call's
    time names the --steps that runs it."""
    monkeypatch.setenv("SVRMAD_GPU_CHECK_WORK", str(tmp_path / "work"))
    out = tmp_path / "out"
    assert gpu_check.main([str(out), "--dry-run", "--steps", "6"]) == 0
    steps = [s for s in json.loads((out / "summary.json").read_text())["steps"] if s["needs_cuda"]]
    assert [s["name"] for s in steps] == ["decode-peer-qwen3-1.7b"] and steps[0]["status"] == "skipped"
    cmd = steps[0]["command"]
    assert cmd[1] == "benchmarks/bench_decode.py" and "--hf-compile" in cmd and "--random-weights" in cmd
    assert cmd[cmd.index("--model") + 1].endswith("qwen3-1.7b") and cmd[cmd.index("--dtype") + 1] == "bf16"
    assert cmd[cmd.index("--batches") + 1] == "1,8,32"
    rows = [{"batch": 1, "engine_tok_s": 9.0, "hf_compile_tok_s": 6.0}, {"batch": 8, "engine_tok_s": 70.0,
                                                                          "hf_compile_error": "RuntimeError: OOM"}]
    figures, failures = gpu_check._peer_json("table\n" + json.dumps({"rows": rows}) + "\n")
    assert figures["rows"] == rows and failures == ["the peer at batch 8: RuntimeError: OOM"]
    chk = gpu_check.Check(tmp_path / "late", dry=False, budget_s=10)
    step = gpu_check.Step("decode-peer-qwen3-1.7b", needs_cuda=False)
    chk.run(step, [sys.executable, "-c", "pass"], expect=300)
    assert step.status == "skipped" and step.reason.endswith("(--steps decode-peer)"), step.reason
    assert [gpu_check.group_of(n) for n in ("host-ops-graphs-off", "decode-graphs-auto", "engine-qwen3-1.7b")] == [
        "decode", "decode", "engine"]


def test_part_2_lists_the_skinny_linear_step_and_skips_it_on_a_cpu(tmp_path, monkeypatch):
    """Part 2 times the few-row linear against cuBLAS (bench_skinny.py) and the sampling kernels against
    torch's ops (bench_sampling.py) beside the other kernels; here they are skipped with the command each
    would run."""
    monkeypatch.setenv("SVRMAD_GPU_CHECK_WORK", str(tmp_path / "work"))
    out = tmp_path / "out"
    assert gpu_check.main([str(out), "--dry-run", "--steps", "2"]) == 0
    steps = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["steps"] if s["needs_cuda"]}
    assert list(steps)[:4] == ["kernels", "fused", "sampling", "skinny"], list(steps)
    assert steps["sampling"]["command"][1:4] == ["benchmarks/bench_sampling.py", "--device", "cuda"]
    s = steps["skinny"]
    assert s["status"] == "skipped" and s["reason"].startswith("needs CUDA")
    assert s["command"][1:] == ["benchmarks/bench_skinny.py", "--json", "--chain", "28", "--floor"]


SHARED = '''
import os

def test_passes():
    pass

def test_needs_the_device_alone():  # fails only among xdist's workers
    assert "PYTEST_XDIST_WORKER" not in os.environ

def test_always_fails():
    assert 1 == 2

def test_skipped():
    import pytest
    pytest.skip("nothing here")
'''


def test_the_tests_step_runs_over_workers_and_fails_only_what_fails_alone(tmp_path, capsys):
    """benchmarks/gpu_tests.py: among xdist's workers, then the failed tests alone; only a test that fails alone
    fails the step, one that passes alone is named; with one worker nothing is run twice; the step's command
    carries the workers asked for."""
    import gpu_tests

    (tmp_path / "test_shared.py").write_text(SHARED)
    got = gpu_tests.run([str(tmp_path / "test_shared.py")], workers=2, cwd=str(tmp_path))
    assert got["workers"] == 2 and got["counts"] == {"passed": 1, "failed": 2, "skipped": 1}, got
    assert got["failed"] == ["test_shared.py::test_always_fails"], got
    assert got["passed_alone"] == ["test_shared.py::test_needs_the_device_alone"], got
    assert got["failures"] == ["1 failed: test_shared.py::test_always_fails"], got
    one = gpu_tests.run([str(tmp_path / "test_shared.py")], workers=1, cwd=str(tmp_path))
    assert one["workers"] == 1 and one["passed_alone"] == [] and one["failed"] == [
        "test_shared.py::test_always_fails"] and one["counts"] == {"passed": 2, "failed": 1, "skipped": 1}, one
    out = capsys.readouterr().out
    assert out.count("run again alone") == 1 and "test_needs_the_device_alone" in out
    # a run that ends without a summary (here: a usage error among the workers) is run again without them
    bad = gpu_tests.run(["--no-such-option", str(tmp_path / "test_shared.py")], workers=2, cwd=str(tmp_path))
    assert bad["workers"] == 1 and "workers_failed" in bad and bad["failures"][0].startswith("pytest exit 4"), bad
    (tmp_path / "test_fine.py").write_text("def test_fine():\n    pass\n")
    fine = gpu_tests.run([str(tmp_path / "test_fine.py")], workers=2, cwd=str(tmp_path))
    assert fine["failures"] == [] and fine["failed"] == [] and fine["counts"] == {"passed": 1}, fine
    assert gpu_tests.main(["--workers", "2", str(tmp_path / "test_fine.py")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["workers"] == 2 and out["failures"] == []


def test_the_tests_step_takes_its_workers_and_refuses_none(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SVRMAD_GPU_CHECK_WORK", str(tmp_path / "work"))
    out = tmp_path / "out"
    assert gpu_check.main([str(out), "--dry-run", "--steps", "tests", "--test-workers", "6"]) == 0
    step = next(s for s in json.loads((out / "summary.json").read_text())["steps"] if s["name"] == "tests")
    cmd = step["command"]
    assert cmd[1].endswith("gpu_tests.py") and cmd[cmd.index("--workers") + 1] == "6" and "tests/test_gpu.py" in cmd
    assert gpu_check.main([str(tmp_path / "bad"), "--dry-run", "--test-workers", "0"]) == 2
    assert "--test-workers must be 1 or more" in capsys.readouterr().err
