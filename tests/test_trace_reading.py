"""Trace files as people write them: the minimal form, malformed lines, a torn last line, and
one-line errors at the CLI for corrupt run files."""

from __future__ import annotations

import asyncio
import json

import pytest

from svrmad_local import cli
from svrmad_local.debate.scripted import ScriptedBackend
from svrmad_local.debate.trace import RecordingBackend, TraceError, TornLineWarning, read_trace, write_trace
from svrmad_local.debate.types import Question
from svrmad_local.methods import run_method


def minimal(row: dict) -> dict:
    """The minimal trace form (debate/trace.py): agents by list position (no "agent"/"id"), debates without ids."""
    keep = ("answer", "prior", "prompt_tokens", "completion_tokens", "signals")
    return {"id": row["id"], "gold": row["gold"], "answer_type": row["answer_type"],
            "agents": [{k: a[k] for k in keep} for a in row["agents"]],
            "debates": [{k: d[k] for k in ("sender", "receiver", *keep) if k in d} for d in row["debates"]]}


@pytest.fixture
def full_trace():
    rows = []
    for qid, answers, outcomes in (("q1", ["A", "B", "A", "C"], {(1, 0): "B"}),
                                   ("q2", ["B", "B", "A", "C"], {(2, 0): "A", (3, 1): "C"})):
        q = Question(qid, "?", "A", "mc")
        rec = RecordingBackend(ScriptedBackend(answers, outcomes, [{"min_ll": -0.1 * (i + 1)} for i in range(4)]))

        async def go():
            initial = await rec.initial(q, 4)
            await run_method("svr-mad", q, initial, rec, priors=[0.9, 0.6, 0.3, 0.1])

        asyncio.run(go())
        rows.append(rec.trace_row(q, [0.9, 0.6, 0.3, 0.1]))
    return rows


def replay(path, *extra, capsys) -> tuple[int, list[dict], str]:
    code = cli.main(["replay", "--trace", str(path), "--json", *extra])
    out = capsys.readouterr()
    return code, [json.loads(x) for x in out.out.splitlines()], out.err


def test_the_minimal_form_replays_like_the_full_one(tmp_path, full_trace, capsys):
    write_trace(tmp_path / "full.jsonl", full_trace)
    write_trace(tmp_path / "min.jsonl", [minimal(r) for r in full_trace])
    assert "agent" not in json.loads((tmp_path / "min.jsonl").read_text().splitlines()[0])["agents"][0]
    for method in ("svr-mad", "self-consistency"):
        a = replay(tmp_path / "full.jsonl", "--method", method, capsys=capsys)
        b = replay(tmp_path / "min.jsonl", "--method", method, capsys=capsys)
        assert a[0] == b[0] == 0 and a[1] == b[1], method
    rows = read_trace(tmp_path / "min.jsonl")
    assert [a["agent"] for a in rows[1]["agents"]] == [0, 1, 2, 3]
    assert [d["id"] for d in rows[1]["debates"]] == [d["id"] for d in full_trace[1]["debates"]]


def test_repeated_pairs_without_ids_count_their_repeats(tmp_path):
    row = {"id": "r", "gold": "A", "agents": [{"answer": "A"}, {"answer": "B"}],
           "debates": [{"sender": 1, "receiver": 0, "answer": "A"}, {"sender": 1, "receiver": 0, "answer": "A"},
                       {"sender": 0, "receiver": 1, "answer": "B", "repeat": 3}]}
    write_trace(tmp_path / "t.jsonl", [row])
    assert [d["id"] for d in read_trace(tmp_path / "t.jsonl")[0]["debates"]] == ["0<1", "0<1#2", "1<0#3"]


@pytest.mark.parametrize("edit, says", [
    (lambda r: r["agents"][1].pop("answer"), ":2: agents[1].answer: missing"),
    (lambda r: r.pop("gold"), ":2: gold: missing"),
    (lambda r: r["agents"][0].update(prompt_tokens="many"), ":2: agents[0].prompt_tokens: expected a count"),
    (lambda r: r["debates"][0].pop("sender"), ":2: debates[0]: no 'id', and no 'sender' and 'receiver'"),
    (lambda r: r["debates"][0].update(receiver=9), ":2: debates[0].receiver: expected an agent index 0..3, got 9"),
    (lambda r: r.update(agents="four"), ":2: agents: missing or not a list"),
])
def test_a_malformed_line_names_file_line_and_field(tmp_path, full_trace, capsys, edit, says):
    rows = [minimal(r) for r in full_trace]
    edit(rows[1])
    path = tmp_path / "t.jsonl"
    write_trace(path, rows)
    with pytest.raises(TraceError, match=None) as err:
        read_trace(path)
    assert str(err.value) == f"{path}{says}" or str(err.value).startswith(f"{path}{says}")
    code, _, stderr = replay(path, capsys=capsys)
    assert code == 2 and stderr.strip().startswith(f"svrmad replay: {path}{says}") and len(stderr.splitlines()) == 1


def test_a_bad_line_that_is_not_the_last_is_an_error(tmp_path, full_trace, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, full_trace)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0][:40], lines[1]]) + "\n")
    code, _, err = replay(path, capsys=capsys)
    assert code == 2 and f"{path}:1: not valid JSON" in err


def test_a_torn_last_line_is_a_warning(tmp_path, full_trace, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, full_trace)
    with open(path, "a") as f:
        f.write('{"id": "q3", "gold": "A", "agents": [')
    with pytest.warns(TornLineWarning, match=":3: the last line is incomplete"):
        assert [r["id"] for r in read_trace(path)] == ["q1", "q2"]
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "svrmad_local.cli", "replay", "--trace", str(path), "--json"],
                          capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[-1])["questions"] == 2
    assert proc.stderr == (f"svrmad replay: warning: {path}:3: the last line is incomplete (a run stopped while "
                           "writing it?); ignored\n")


def test_report_on_a_corrupt_results_file_is_one_line(tmp_path, capsys):
    (tmp_path / "results.jsonl").write_text('{"id": "q1", "method": "svr-mad"}\n{"id": \n{"id": "q2"}\n')
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"svrmad report: {tmp_path / 'results.jsonl'}:2: not valid JSON (Expecting value")
    assert len(err.splitlines()) == 1
