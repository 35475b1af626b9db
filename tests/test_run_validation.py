"""Bad input (counts, memory strings such as "0.9", groups, stray method options, folders) fails in
one line with exit code 2 before any model is loaded."""

from __future__ import annotations

import json

import pytest

from svrmad_local import cli
from svrmad_local.engine.engine import parse_memory
from svrmad_local.job import run as run_mod

from .runharness import run, write_dataset


def test_memory_strings():
    assert parse_memory("0.9", 1000, 0) == 900  # a fraction, also as a string
    assert parse_memory(".5", 1000, 0) == 500
    assert parse_memory("1", 1000, 0) == 1 and parse_memory("4096", 1000, 0) == 4096
    assert parse_memory("1.5GiB", 0, 0) == 3 * 2**29
    for bad in ("1.5", "0", "0.0", "-1", "lots", 1.5, 0, -3):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            parse_memory(bad, 1000, 0)


@pytest.fixture
def no_model(monkeypatch):
    def load(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(run_mod, "make_backend", load)


@pytest.mark.parametrize("flags, says", [
    (["--S", "0"], "--S must be >= 1"),
    (["--C", "0"], "--C must be >= 1"),
    (["--agents", "1"], "--agents must be >= 2"),
    (["--agents", "0"], "--agents must be >= 2"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--limit", "-1"], "--limit must be >= 0"),
    (["--kv-cache-memory", "1.5"], "a fraction must be in (0, 1]"),
    (["--kv-cache-memory", "lots"], "expected bytes, a fraction"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--block-size", "0"], "--block-size must be >= 1, got 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--methods", "group-debate", "--groups", "3-3"], "--groups 3-3 does not split --agents 4"),
    (["--methods", "self-consistency", "--tau", "0.5"], "--tau given, but none of the methods"),
    (["--tau", "2"], "--tau must be in [-1, 1]"),
    (["--tau", "-1.5"], "--tau must be in [-1, 1]"),
    (["--methods", "sid-et", "--threshold", "0.5"], "--threshold is a min-LL, a log-probability (<= 0)"),
    (["--shard", "2/2"], "expected K/N"),
    (["--tp", "2"], "--tp 2 needs a number of processes that is a multiple of 2"),
    (["--tp", "0"], "--tp must be >= 1"),
])
def test_bad_settings_fail_in_one_line_before_loading(tmp_path, no_model, capsys, flags, says):
    assert run(tmp_path, tmp_path / "out", *flags) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_or_unwritable(tmp_path, no_model, capsys):
    (tmp_path / "file").write_text("x")
    assert run(tmp_path, tmp_path / "file") == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert run(tmp_path, tmp_path / "file" / "sub") == 2
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o500)
    import os

    if os.access(locked, os.W_OK):  # root writes anywhere
        pytest.skip("running as root: permissions are not enforced")
    assert run(tmp_path, locked / "out") == 2
    assert "not writable" in capsys.readouterr().err


def test_a_missing_model_folder(tmp_path, no_model, capsys):
    data = write_dataset(tmp_path / "qs.jsonl")
    assert cli.main(["run", "--model", str(tmp_path / "nope"), "--dataset", str(data), "--out", str(tmp_path / "o")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_an_empty_dataset_is_an_error(tmp_path, no_model, capsys):
    (tmp_path / "qs.jsonl").write_text("\n")
    assert run(tmp_path, tmp_path / "out") == 2
    assert "has no questions" in capsys.readouterr().err


def test_non_utf8_bytes_name_file_and_line(tmp_path, no_model, capsys, monkeypatch):
    data = write_dataset(tmp_path / "qs.jsonl")
    lines = data.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b"question q2", b"question \xff\xfe q2")
    data.write_bytes(b"".join(lines))
    assert run(tmp_path, tmp_path / "out", "--on-error", "fail") == 2
    err = capsys.readouterr().err.strip()
    assert f"{data}:3: not UTF-8" in err and len(err.splitlines()) == 1
    from .runharness import use_script

    use_script(monkeypatch)
    with pytest.warns(UserWarning, match=r"qs.jsonl:3: not UTF-8"):
        assert run(tmp_path, tmp_path / "out") == 0  # --on-error skip (the default) skips the line
    done = [json.loads(x)["id"] for name in ("trace.jsonl", "skipped.jsonl")
            for x in (tmp_path / "out" / name).read_text().splitlines()]
    assert sorted(done) == ["q0", "q1", "q3", "q4"]


def test_non_utf8_csv(tmp_path):
    from svrmad_local.job.datasets import DatasetError, load_dataset

    path = tmp_path / "math.csv"
    path.write_bytes(b"idx,Question,Answer\n0,What is 1+1?,2\n1,What is \xff?,3\n2,What is 2+2?,4\n")
    with pytest.warns(UserWarning, match=r"math.csv:3: not UTF-8"):
        assert [q.id for q in load_dataset(path)] == ["math-0000", "math-0002"]
    with pytest.raises(DatasetError, match=r"math.csv:3: not UTF-8"):
        load_dataset(path, on_error="fail")
