"""Nothing lost, nothing silently wrong: the run layer under crashes, failing questions,
changed settings and a second run on the same folder (scripted agents: see runharness.py)."""

from __future__ import annotations

import itertools
import json

import pytest

from svrmad_local.debate.trace import read_jsonl
from svrmad_local.analysis import folder as folder_mod

from .runharness import SCRIPT, run, state, use_script


class Crash(BaseException):
    """The process dies here: nothing after it runs (not even `except Exception` handlers)."""


@pytest.fixture
def reference(tmp_path_factory, monkeypatch):
    use_script(monkeypatch)
    root = tmp_path_factory.mktemp("ref")
    assert run(root, root / "out", "--ablations") == 0
    return state(root / "out")


def count_writes(monkeypatch) -> list:
    calls = []
    real_lines, real_json = folder_mod.write_lines, folder_mod.write_json

    def lines(path, rows, sync=False):
        rows = list(rows)
        if rows:
            calls.append(path.name)
        real_lines(path, rows, sync)

    def whole(path, obj):
        calls.append(path.name)
        real_json(path, obj)

    monkeypatch.setattr(folder_mod, "write_lines", lines)
    monkeypatch.setattr(folder_mod, "write_json", whole)
    return calls


def crash_at(monkeypatch, k: int, torn: bool) -> None:
    """Die at the k-th write (1-based); `torn`: after writing the first half of its bytes."""
    counter = itertools.count(1)
    real_lines, real_json = folder_mod.write_lines, folder_mod.write_json

    def lines(path, rows, sync=False):
        rows = list(rows)
        if rows and next(counter) == k:
            if torn:
                data = "".join(json.dumps(r) + "\n" for r in rows).encode()
                with open(path, "ab") as f:
                    f.write(data[: len(data) // 2])
            raise Crash(path.name)
        real_lines(path, rows, sync)

    def whole(path, obj):
        if next(counter) == k:
            if torn:
                path.with_name(path.name + ".tmp").write_text(json.dumps(obj)[:20])
            raise Crash(path.name)
        real_json(path, obj)

    monkeypatch.setattr(folder_mod, "write_lines", lines)
    monkeypatch.setattr(folder_mod, "write_json", whole)


def test_a_crash_at_any_write_loses_nothing_and_duplicates_nothing(tmp_path, monkeypatch, reference):
    use_script(monkeypatch)
    with monkeypatch.context() as m:
        writes = count_writes(m)
        assert run(tmp_path, tmp_path / "count", "--ablations") == 0
    # every kind of write point is exercised: commits, derived rows, post-hoc, run.json
    assert {"trace.jsonl", "results.jsonl", "skipped.jsonl", "run.json", "ablations.jsonl.tmp"} <= set(writes)
    for k, torn in itertools.product(range(1, len(writes) + 1), (False, True)):
        out = tmp_path / f"crash{k}{'t' if torn else ''}"
        with monkeypatch.context() as m:
            crash_at(m, k, torn)
            with pytest.raises(Crash):
                run(tmp_path, out, "--ablations")
        assert run(tmp_path, out, "--ablations") == 0, (k, torn)
        got = state(out)
        for part in ("trace", "skipped", "results", "ablations"):
            assert got[part] == reference[part], (k, torn, writes[k - 1], part)
        paths = ("--dataset", "--model")  # the reference ran from another folder
        assert ({k: v for k, v in got["meta"]["fingerprint"].items() if k not in paths}
                == {k: v for k, v in reference["meta"]["fingerprint"].items() if k not in paths})
        assert got["meta"]["totals"]["questions"] == len(SCRIPT) and got["meta"]["totals"]["failed"] == 0


def test_results_lost_after_the_commit_are_rebuilt_from_the_trace(tmp_path, monkeypatch, reference, capsys):
    use_script(monkeypatch)
    out = tmp_path / "out"
    assert run(tmp_path, out, "--ablations") == 0
    (out / "results.jsonl").write_text("")  # the crash window between a trace line and its results
    assert run(tmp_path, out, "--ablations") == 0
    assert "rebuilt 6 results rows from trace.jsonl" in capsys.readouterr().err
    assert state(out)["results"] == reference["results"]


def test_a_failing_question_is_recorded_counted_and_retried(tmp_path, monkeypatch, reference, capsys):
    out = tmp_path / "out"
    use_script(monkeypatch, fail={"q1": "initial", "q3": "debate"})
    assert run(tmp_path, out, "--ablations") == 1  # the run goes on, and says it is incomplete
    printed = capsys.readouterr().out
    assert "2 failed" in printed and "Run the same command again to retry them" in printed
    errors = {e["id"]: e for e in read_jsonl(out / "errors.jsonl")}
    assert set(errors) == {"q1", "q3"}
    assert errors["q1"]["stage"] == "initial" and "does not fit the model's context" in errors["q1"]["message"]
    assert errors["q3"]["stage"].startswith("method ") and "RuntimeError" in errors["q3"]["message"]
    got = state(out)
    assert set(got["trace"]) == {"q4"} and set(got["skipped"]) == {"q0", "q2"}
    assert got["meta"]["totals"]["failed"] == 2
    use_script(monkeypatch)  # the cause is gone: a rerun retries exactly the failed questions
    assert run(tmp_path, out, "--ablations") == 0
    got = state(out)
    for part in ("trace", "skipped", "results", "ablations"):
        assert got[part] == reference[part]
    assert got["meta"]["totals"]["failed"] == 0 and got["meta"]["launches"][-1]["questions_run"] == 2


def test_resume_with_other_settings_is_refused_naming_them(tmp_path, monkeypatch, capsys):
    use_script(monkeypatch)
    out = tmp_path / "out"
    assert run(tmp_path, out, "--limit", "2") == 0
    before = (out / "run.json").read_text()
    capsys.readouterr()
    assert run(tmp_path, out, "--agents", "3", "--C", "3") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--agents 4 in the folder, 3 now" in err and "svr-mad --C 2 in the folder, 3 now" in err
    assert "--out" in err and "--concurrency" not in err
    assert (out / "run.json").read_text() == before  # nothing touched
    # settings that change no result may differ
    assert run(tmp_path, out, "--concurrency", "1") == 0
    assert len(state(out)["trace"]) + len(state(out)["skipped"]) == len(SCRIPT)


def test_a_second_run_on_the_same_folder_is_refused(tmp_path, monkeypatch, capsys):
    import subprocess
    import sys

    use_script(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from svrmad_local.analysis.folder import RunFolder; "
         "f = RunFolder(sys.argv[1]); f.lock(); print('locked', flush=True); time.sleep(60)", str(out)],
        stdout=subprocess.PIPE, text=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert run(tmp_path, out) == 2
        err = capsys.readouterr().err
        assert f"is in use by another run (pid {holder.pid}" in err
        assert not (out / "trace.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert run(tmp_path, out) == 0  # the lock died with its process


def test_ctrl_c_says_what_was_saved_and_how_to_resume(tmp_path, monkeypatch, reference):
    """A real SIGINT to a real process while a question is in flight."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from .runharness import METHODS, write_dataset

    data, out = write_dataset(tmp_path / "qs.jsonl"), tmp_path / "out"
    argv = ["run", "--model", str(tmp_path), "--dataset", str(data), "--out", str(out), "--agents", "4",
            "--limit", "0", "--methods", METHODS, "--ablations", "--concurrency", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "tests.runharness", "q4", *argv], stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1],
                            # a suite started in the background would hand down an ignored SIGINT
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stderr:
        if line.startswith("hanging in q4"):
            break
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    saved = len(read_jsonl(out / "trace.jsonl")) + len(read_jsonl(out / "skipped.jsonl"))
    assert saved == 4 and f"interrupted. {saved} questions are saved in {out}" in stderr
    assert "run the same command again to resume" in stderr and "Traceback" not in stderr
    use_script(monkeypatch)
    assert run(tmp_path, out, "--ablations", "--concurrency", "1") == 0
    got = state(out)
    for part in ("trace", "skipped", "results", "ablations"):
        assert got[part] == reference[part]


def test_a_model_that_cannot_load_is_one_line(tmp_path, capsys):
    from .runharness import write_dataset
    from svrmad_local import cli

    (tmp_path / "empty").mkdir()
    data = write_dataset(tmp_path / "qs.jsonl")
    assert cli.main(["run", "--model", str(tmp_path / "empty"), "--dataset", str(data), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"svrmad run: {tmp_path / 'empty'} has no config.json"


def test_prepare_with_an_unusable_cache_dir_is_one_line(tmp_path, capsys):
    from svrmad_local import cli

    (tmp_path / "file").write_text("x")
    assert cli.main(["prepare", "--cache-dir", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("svrmad prepare: ") and len(err.splitlines()) == 1 and str(tmp_path / "file") in err


def test_shards_merged_equal_one_run_with_sid_et_tuned_once(tmp_path, monkeypatch, reference, capsys):
    from svrmad_local import cli

    use_script(monkeypatch)
    shards = [tmp_path / f"shard{k}" for k in range(2)]
    for k, d in enumerate(shards):
        assert run(tmp_path, d, "--ablations", "--shard", f"{k}/2") == 0
    assert {r["id"] for r in read_jsonl(shards[0] / "trace.jsonl")} == {"q4"}  # q0, q2, q4 went to shard 0
    merged = tmp_path / "merged"
    assert cli.main(["merge", *map(str, shards), "--out", str(merged)]) == 0
    got = state(merged)
    for part in ("trace", "skipped", "results", "ablations"):
        assert got[part] == reference[part], part
    assert got["meta"]["post_hoc"]["questions"] == 3 and got["meta"]["totals"]["questions"] == 5
    assert cli.main(["merge", *map(str, shards), "--out", str(merged)]) == 0  # again: nothing new, nothing twice
    assert state(merged)["results"] == reference["results"]
    # the same folders joined by hand: `svrmad report` tunes SID-ET once over all questions
    by_hand = tmp_path / "by_hand"
    by_hand.mkdir()
    for name in ("trace.jsonl", "results.jsonl", "skipped.jsonl"):
        (by_hand / name).write_text("".join((d / name).read_text() for d in shards if (d / name).exists()))
    (by_hand / "run.json").write_text((shards[0] / "run.json").read_text())
    capsys.readouterr()
    assert cli.main(["report", str(by_hand)]) == 0
    assert "tuning it again over all of its questions" in capsys.readouterr().err
    sid = {k: v for k, v in state(by_hand)["results"].items() if k[1] == "sid-et"}
    assert sid == {k: v for k, v in reference["results"].items() if k[1] == "sid-et"}


def test_merge_refuses_folders_of_different_runs(tmp_path, monkeypatch, capsys):
    from svrmad_local import cli

    use_script(monkeypatch)
    assert run(tmp_path, tmp_path / "a", "--shard", "0/2") == 0
    assert run(tmp_path, tmp_path / "b", "--shard", "1/2", "--C", "3") == 0
    capsys.readouterr()
    assert cli.main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "was run with other settings" in err and "svr-mad --C 2 in the folder, 3 now" in err


def test_replay_of_sid_et_tunes_its_skip_rate_like_the_run(tmp_path, monkeypatch, capsys):
    from svrmad_local import cli

    use_script(monkeypatch)
    out = tmp_path / "out"
    assert run(tmp_path, out) == 0
    capsys.readouterr()
    assert cli.main(["replay", "--trace", str(out / "trace.jsonl"), "--method", "sid-et", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()][:-1]
    live = state(out)["results"]
    assert lines and all((x["answer"], x["ncomm"], x["tokens"]) == (live[x["id"], "sid-et"]["answer"],
                                                                    live[x["id"], "sid-et"]["ncomm"],
                                                                    live[x["id"], "sid-et"]["tokens"]) for x in lines)
