"""Token statistics read by `svrmad signals` and joined by `svrmad merge` are the run's own: a file
a killed run wrote before its question's trace line, or the run before a takeover left, is not
shown; damaged files are named and left out; a refused study writes nothing; merge reads its
sources only, and a refused merge leaves no --out. Scripted agents (runharness.py) whose responses
carry per-token statistics of one value per "model", so whose numbers are shown is plain."""

from __future__ import annotations

import builtins
import errno
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest

from svrmad_local import cli
from svrmad_local.debate.trace import read_jsonl
from svrmad_local.analysis import folder as folder_mod
from svrmad_local.job import run as run_mod
from svrmad_local.analysis import signals_page, token_files

from .runharness import PerQuestion, run, write_dataset

DEBATED = ["q1", "q3", "q4"]  # the script's questions that are not unanimous


class Crash(BaseException):
    """The process dies here."""


class WithStats(PerQuestion):
    """Scripted agents whose every token has log-prob `value` (one value per simulated model)."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def _stats(self, r):
        r.token_stats = (np.full(r.completion_tokens, self.value, np.float32),
                         np.full(r.completion_tokens, 0.5, np.float32))
        return r

    async def initial(self, q, n):
        return [self._stats(r) for r in await super().initial(q, n)]

    async def debate(self, q, own, peers, brief=(), repeat=1):
        return self._stats(await super().debate(q, own, peers, brief, repeat))


def use_model(monkeypatch, value: float) -> None:
    from svrmad_local.job import preflight

    monkeypatch.setattr(run_mod, "make_backend", lambda job: (WithStats(value), dict, lambda: None))
    monkeypatch.setattr(preflight, "check_model", lambda cfg, path: None)


def crash_at_trace_line(monkeypatch, k: int) -> None:
    """Die at the k-th trace.jsonl commit (after that question's token-stats file is written)."""
    counter, real = itertools.count(1), folder_mod.write_lines

    def lines(path, rows, sync=False):
        rows = list(rows)
        if rows and path.name == "trace.jsonl" and next(counter) == k:
            raise Crash(path.name)
        real(path, rows, sync)

    monkeypatch.setattr(folder_mod, "write_lines", lines)


def committed(out: Path) -> set[str]:
    return {r["id"] for r in read_jsonl(out / "trace.jsonl")}


def trace_tokens(out: Path) -> int:
    return sum(r["completion_tokens"] for row in read_jsonl(out / "trace.jsonl") for r in row["agents"] + row["debates"])


# ---------------------------------------------------------------- whose statistics the signals page reads

def test_a_file_written_before_a_kill_is_not_counted(tmp_path, monkeypatch, capsys):
    use_model(monkeypatch, -1.0)
    out = tmp_path / "out"
    write_dataset(tmp_path / "qs.jsonl", ids=["q1", "q3"])  # both debated: two files, then one trace line
    with monkeypatch.context() as m:
        crash_at_trace_line(m, 2)  # the second debated question dies between its file and its trace line
        with pytest.raises(Crash):
            run(tmp_path, out, "--save-token-stats")
    files = list((out / token_files.FOLDER).glob("*.npz"))
    assert len(files) == 2 and len(committed(out)) == 1
    saved = token_files.read(out)
    assert {qid for qid, _ in saved} == committed(out)
    assert token_files.bytes_per_token(out)[1] == trace_tokens(out)
    capsys.readouterr()
    signals_page.write_study([out], out / "signals", n_boot=0)
    err = capsys.readouterr().err
    assert "left out 1 file(s)" in err and "is not committed in trace.jsonl" in err
    assert run(tmp_path, out, "--save-token-stats") == 0  # resumed: the question runs again, its file counts
    assert {qid for qid, _ in token_files.read(out)} == committed(out) == {"q1", "q3"}
    assert token_files.bytes_per_token(out)[1] == trace_tokens(out)


def test_a_takeover_does_not_show_the_run_befores_statistics(tmp_path, monkeypatch, capsys):
    """Model A's run is killed after a file and before any trace line (nothing saved), so model B's
    run, without --save-token-stats, takes the folder over; A's file stays on disk but is not B's."""
    out, model_b = tmp_path / "out", tmp_path / "model-b"
    model_b.mkdir()
    write_dataset(tmp_path / "qs.jsonl", ids=DEBATED)  # no unanimous question saved before the kill
    use_model(monkeypatch, -9.0)
    with monkeypatch.context() as m:
        crash_at_trace_line(m, 1)
        with pytest.raises(Crash):
            run(tmp_path, out, "--save-token-stats")
    assert not committed(out) and list((out / token_files.FOLDER).glob("*.npz"))
    use_model(monkeypatch, -1.0)
    assert run(tmp_path, out, "--model", str(model_b)) == 0  # other settings, nothing saved: taken over
    assert committed(out) == set(DEBATED)
    assert token_files.read(out) == {}  # model A's tokens are not shown under model B's name
    kept, left = token_files.belonging(out)
    assert not kept and left and all("written under other settings than run.json's (--model" in line for line in left)
    page = signals_page.write_study([out], out / "signals", n_boot=0).read_text()
    assert "No run here saved its token statistics" in page


# ---------------------------------------------------------------- merge takes them along

def test_merge_takes_the_shards_token_stats(tmp_path, monkeypatch, capsys):
    use_model(monkeypatch, -1.0)
    shards = [tmp_path / f"shard{k}" for k in range(2)]
    for k, d in enumerate(shards):
        assert run(tmp_path, d, "--shard", f"{k}/2", "--save-token-stats") == 0
    # a stray: a file whose question never reached shard 1's trace (a kill) is not taken
    stray = token_files.write(shards[1], "q0", [], json.loads((shards[1] / "run.json").read_text())["fingerprint"])
    merged = tmp_path / "merged"
    assert cli.main(["merge", *map(str, shards), "--out", str(merged)]) == 0
    got = token_files.read(merged)
    assert got.keys() == token_files.read(shards[0]).keys() | token_files.read(shards[1]).keys()
    assert {qid for qid, _ in got} == set(DEBATED)
    assert not (merged / token_files.FOLDER / stray.name).exists()
    assert f"left out {stray}" in capsys.readouterr().err
    assert cli.main(["merge", *map(str, shards), "--out", str(merged)]) == 0  # again: nothing new
    assert token_files.read(merged).keys() == got.keys()


# ---------------------------------------------------------------- damaged files

def _np_savez(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize("damage, says", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "cannot be read"),
    (lambda p: p.write_bytes(b""), "cannot be read"),
    (lambda p: p.write_bytes(os.urandom(300)), "cannot be read"),
    (lambda p: _np_savez(p, qid=np.array("q1"), rids=np.array(["0"]), offsets=np.array([0, 2]),
                         logprob=np.zeros(2, np.float32)), "has no entropy"),
    (lambda p: _np_savez(p, qid=np.array("q1"), rids=np.array(["0"]), offsets=np.array([0, 9]),
                         logprob=np.zeros(2, np.float32), entropy=np.zeros(2, np.float32)),
     "offsets do not run from 0 up to the 2 tokens held"),
])
def test_a_damaged_file_is_named_and_left_out(tmp_path, monkeypatch, capsys, damage, says):
    use_model(monkeypatch, -1.0)
    out = tmp_path / "out"
    assert run(tmp_path, out, "--save-token-stats") == 0
    victim = out / token_files.FOLDER / token_files.file_name("q1")
    damage(victim)
    capsys.readouterr()
    assert cli.main(["signals", str(out), "--bootstrap", "0"]) == 0
    err = capsys.readouterr().err
    assert f"{victim}: " in err and says in err and "Traceback" not in err
    kept, left = token_files.belonging(out)
    assert set(kept) == {"q3", "q4"} and len(left) == 1 and left[0].startswith(f"{victim}: ") and says in left[0]


# ---------------------------------------------------------------- `svrmad signals` refuses before it writes

@pytest.fixture
def studied(tmp_path, monkeypatch):
    """A run with token statistics, and an earlier study of it in its signals/ folder."""
    use_model(monkeypatch, -1.0)
    out = tmp_path / "out"
    assert run(tmp_path, out, "--save-token-stats") == 0
    assert cli.main(["signals", str(out), "--bootstrap", "0"]) == 0
    return out, {p.name: p.read_bytes() for p in (out / "signals").iterdir()}


def refused(capsys, says: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and says in err[-1] and "Traceback" not in "\n".join(err), err


@pytest.mark.parametrize("flags, says", [
    (["--track", "foo"], "--track 'foo': expected QID:RID"),
    (["--track", "q1:nope"], "no response 'nope' of question 'q1'"),
    (["--seed", "-1"], "--seed must be >= 0"),
])
def test_bad_flags_are_one_line_and_leave_the_study_as_it_was(studied, capsys, flags, says):
    out, before = studied
    capsys.readouterr()
    assert cli.main(["signals", str(out), "--bootstrap", "0", *flags]) == 2
    refused(capsys, says)
    assert {p.name: p.read_bytes() for p in (out / "signals").iterdir()} == before


def test_a_run_without_a_debated_question_is_refused_before_writing(studied, tmp_path, monkeypatch, capsys):
    out, _ = studied
    empty = tmp_path / "empty"
    use_model(monkeypatch, -1.0)
    write_dataset(tmp_path / "unanimous.jsonl", ids=["q0", "q2"])
    assert cli.main(["run", "--model", str(tmp_path), "--dataset", str(tmp_path / "unanimous.jsonl"), "--out",
                     str(empty), "--agents", "4", "--limit", "0", "--methods", "svr-mad"]) == 0
    cmp = tmp_path / "cmp"
    cmp.mkdir()
    (cmp / "signals.md").write_text("an earlier comparison")
    capsys.readouterr()
    assert cli.main(["signals", str(out), str(empty), "--out", str(cmp), "--bootstrap", "0"]) == 2
    refused(capsys, f"no debated question in {empty}")
    assert [p.name for p in cmp.iterdir()] == ["signals.md"] and (cmp / "signals.md").read_text() == "an earlier comparison"


def test_a_new_study_replaces_the_old_one_whole(studied, capsys):
    """An earlier study drew a token track; one whose run has no saved tokens any more draws none,
    and the old track does not stay beside the new page."""
    out, before = studied
    assert "token_track.png" in before
    for f in (out / token_files.FOLDER).iterdir():
        f.unlink()
    assert cli.main(["signals", str(out), "--bootstrap", "0"]) == 0
    names = {p.name for p in (out / "signals").iterdir()}
    assert "token_track.png" not in names and "signals.md" in names
    assert not [p for p in out.iterdir() if p.name.startswith(".signals")]  # nothing staged is left


# ---------------------------------------------------------------- merge only reads its sources

def test_merge_from_read_only_sources(tmp_path, monkeypatch, capsys):
    """Any open of a source's file for writing fails as on a read-only mount (the test runs as any
    user, root included); the merge takes everything, and a torn last line there is passed over."""
    use_model(monkeypatch, -1.0)
    shards = [tmp_path / f"shard{k}" for k in range(2)]
    for k, d in enumerate(shards):
        assert run(tmp_path, d, "--shard", f"{k}/2", "--save-token-stats") == 0
    with open(shards[0] / "results.jsonl", "a") as f:
        f.write('{"id": "q9", "meth')  # a torn tail
    before = {p: p.read_bytes() for d in shards for p in d.rglob("*") if p.is_file()}
    real_open = builtins.open

    def read_only_open(file, mode="r", *a, **k):
        if any(Path(file).resolve().is_relative_to(d.resolve()) for d in shards) and set(mode) & set("wax+"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", read_only_open)
    merged = tmp_path / "merged"
    assert cli.main(["merge", *map(str, shards), "--out", str(merged)]) == 0
    monkeypatch.setattr(builtins, "open", real_open)
    assert committed(merged) == set(DEBATED) and {qid for qid, _ in token_files.read(merged)} == set(DEBATED)
    assert {p: p.read_bytes() for d in shards for p in d.rglob("*") if p.is_file()} == before


def test_a_merge_refused_for_a_busy_source_leaves_no_out(tmp_path, monkeypatch, capsys):
    use_model(monkeypatch, -1.0)
    src = tmp_path / "src"
    assert run(tmp_path, src, "--shard", "0/2") == 0
    live = folder_mod.RunFolder(src)
    live.lock()  # a run still going
    try:
        capsys.readouterr()
        assert cli.main(["merge", str(src), "--out", str(tmp_path / "merged")]) == 2
        refused(capsys, "is in use by another run")
        assert not (tmp_path / "merged").exists()
        other = tmp_path / "other"  # a source of another run: refused after --out was locked
        assert run(tmp_path, other, "--shard", "1/2", "--C", "3") == 0
    finally:
        live.unlock()
    assert cli.main(["merge", str(src), str(other), "--out", str(tmp_path / "merged")]) == 2
    refused(capsys, "was run with other settings")
    assert not (tmp_path / "merged").exists()


# ---------------------------------------------------------------- a full disk names the file

def test_a_full_disk_names_the_file(tmp_path):
    with pytest.raises(OSError) as got:
        folder_mod.write_lines(Path("/dev/full"), [{"id": "q1"}], sync=True)
    assert got.value.errno == errno.ENOSPC and "/dev/full" in str(got.value)


def test_a_full_disk_mid_run_is_one_line_naming_the_file_and_resumes(tmp_path, monkeypatch, capsys):
    """The token-stats file of a question is written to a full disk (its temporary name points at
    /dev/full): one line naming it, exit 2; the next run completes every question once."""
    use_model(monkeypatch, -1.0)
    out = tmp_path / "out"
    (out / token_files.FOLDER).mkdir(parents=True)
    full = out / token_files.FOLDER / (token_files.file_name("q3") + ".tmp")
    full.symlink_to("/dev/full")
    assert run(tmp_path, out, "--save-token-stats") == 2
    refused(capsys, f"No space left on device: '{full}'")
    full.unlink()
    assert run(tmp_path, out, "--save-token-stats") == 0
    assert committed(out) == set(DEBATED) and {qid for qid, _ in token_files.read(out)} == set(DEBATED)
    assert json.loads((out / "run.json").read_text())["totals"]["failed"] == 0
