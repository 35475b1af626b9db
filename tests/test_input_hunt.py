"""Hostile and new-user inputs across run, report, replay, merge, plan and prepare: damaged run
folders, flags that compare false (NaN), and commands that refuse without leaving a trace. Every case
is one line and exit 2, never a traceback, and the run folder keeps what it had (scripted agents: see
runharness.py)."""

from __future__ import annotations

import json

import pytest

from svrmad_local import cli

from .runharness import run, state, use_script


def refused(capsys, says: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and says in err[-1] and "Traceback" not in "\n".join(err), err


@pytest.fixture
def done(tmp_path, monkeypatch):
    """A finished run folder."""
    use_script(monkeypatch)
    out = tmp_path / "done"
    assert run(tmp_path, out) == 0
    return out


@pytest.mark.parametrize("flags, says", [
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    (["--tau", "nan"], "--tau must be a finite number, got nan"),
    (["--threshold", "nan"], "--threshold must be a finite number, got nan"),
    (["--skip-rate", "nan"], "--skip-rate must be in [0, 1], got nan"),
    (["--out", ""], "--out is empty"),
])
def test_flags_that_would_compare_false_are_refused(tmp_path, monkeypatch, capsys, flags, says):
    use_script(monkeypatch)
    assert run(tmp_path, tmp_path / "out", *flags) == 2
    refused(capsys, says)


@pytest.mark.parametrize("name, text, says", [
    ("run.json", "[]", "run.json is a JSON list, not the object a run writes"),
    ("run.json", '{"config": 3}', "run.json: config is not a JSON object"),
    ("trace.jsonl", '{"agents": []}\n', 'trace.jsonl:4: '),  # after the 3 debated questions: its "id"
    ("skipped.jsonl", '{"answer": "B"}\n', 'skipped.jsonl:3: no "id"'),
    ("errors.jsonl", '{"stage": "initial"}\n', 'errors.jsonl:1: no "id"'),
    ("results.jsonl", '{"method": "svr-mad"}\n', 'results.jsonl:'),
])
def test_a_damaged_run_file_is_named_and_nothing_is_lost(tmp_path, monkeypatch, capsys, done, name, text, says):
    before = {p.name: p.read_bytes() for p in done.iterdir() if p.is_file() and p.name != name}
    path = done / name
    path.write_text(text if name == "run.json" or not path.exists() else path.read_text() + text)
    capsys.readouterr()
    assert run(tmp_path, done) == 2
    refused(capsys, says)
    assert {p.name: p.read_bytes() for p in done.iterdir() if p.is_file() and p.name != name} == before
    assert cli.main(["report", str(done)]) == 2
    refused(capsys, says)


def test_a_saved_config_naming_an_unknown_method_is_one_line(done, capsys):
    meta = json.loads((done / "run.json").read_text())
    meta["config"]["methods"] = ["no-such-method"]
    meta.pop("post_hoc")
    (done / "run.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert cli.main(["report", str(done)]) == 2
    refused(capsys, f"{done / 'run.json'}: the run's methods ['no-such-method'] are not a list of known methods")


@pytest.mark.parametrize("flags, says", [
    (["--method", "sid-et", "--skip-rate", "2"], "--skip-rate must be in [0, 1], got 2.0"),
    (["--S", "0"], "--S must be >= 1, got 0"),
    (["--tau", "nan"], "--tau must be a finite number, got nan"),
    (["--method", "all-to-all", "--rounds", "0"], "--rounds must be >= 1, got 0"),
])
def test_replay_checks_its_options_as_run_does(done, capsys, flags, says):
    capsys.readouterr()
    assert cli.main(["replay", "--trace", str(done / "trace.jsonl"), *flags]) == 2
    refused(capsys, says)


def test_a_refused_merge_creates_no_folder(tmp_path, done, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "run.json").write_text("[]")
    for sources, says in (([tmp_path / "nope"], "is not a run folder"), ([bad], "is a JSON list"),
                          ([done], "nothing to merge")):
        out = done if says == "nothing to merge" else tmp_path / "merged"
        assert cli.main(["merge", *map(str, sources), "--out", str(out)]) == 2
        refused(capsys, says)
        assert not (tmp_path / "merged").exists()
    (tmp_path / "file").write_text("x")
    assert cli.main(["merge", str(done), "--out", str(tmp_path / "file")]) == 2
    refused(capsys, "--out")
    assert state(done)["trace"]  # the source is untouched
