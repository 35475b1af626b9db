"""Replay: the same controllers against a recorded trace give the live results, and say clearly
when the trace lacks a debate; the `svrmad replay` subcommand."""

import argparse
import asyncio
import json

import pytest

from svrmad_local.debate.replay_backend import MissingDebate, ReplayBackend
from svrmad_local.debate.scripted import ScriptedBackend
from svrmad_local.debate.trace import RecordingBackend, row_initial, write_trace
from svrmad_local.debate.types import Question
from svrmad_local.analysis import replay as replay_cli
from svrmad_local.methods import METHODS, run_method, svr_mad

QUESTIONS = {
    "q1": (["A", "B", "A", "C", "B", "A"], {(1, 0): "B", (3, 1): "C"}, [0.9, 0.8, 0.1, 0.4, 0.2, 0.0]),
    "q2": (["B", "B", "A", "C", "D", "B"], {}, [0.2, 0.1, 0.9, 0.5, 0.3, 0.0]),
    "q3": (["C", "A", "B", "C", "A", "B"], {(0, 2): "C", (3, 2): "C"}, [0.0, 0.1, 0.9, 0.5, 0.3, 0.2]),
}
PARAMS = {"group-debate": {"groups": "2-2-2"}, "sid-et": {"threshold": -1.5}}


def question(qid):
    return Question(id=qid, question=f"question {qid}", gold="A", answer_type="mc")


def scripted(qid):
    answers, outcomes, _ = QUESTIONS[qid]
    return ScriptedBackend(answers, outcomes, [{"min_ll": -1.0 - i / 3} for i in range(6)])


def params_for(method, qid):
    extra = dict(PARAMS.get(method, {}))
    if method.startswith("svr-mad"):
        extra["priors"] = QUESTIONS[qid][2]
    return extra


def live_run():
    """Every method on every question through one recording backend per question."""
    rows, live = [], {}

    async def go():
        for qid in QUESTIONS:
            q, rec = question(qid), RecordingBackend(scripted(qid))
            initial = await rec.initial(q, 6)
            for m in METHODS:
                live[qid, m] = await run_method(m, q, initial, rec, **params_for(m, qid))
            rows.append(rec.trace_row(q, QUESTIONS[qid][2]))

    asyncio.run(go())
    return rows, live


@pytest.fixture(scope="module")
def recorded():
    return live_run()


def test_replay_equals_live(recorded):
    rows, live = recorded
    for row in rows:
        q = question(row["id"])
        for m in METHODS:
            backend = ReplayBackend(json.loads(json.dumps(row)))
            again = asyncio.run(run_method(m, q, row_initial(row), backend, **params_for(m, q.id)))
            assert again == live[q.id, m], (q.id, m)


def test_missing_debate_names_question_and_pair(recorded):
    rows, _ = recorded
    row = rows[0]
    backend = ReplayBackend(row)
    with pytest.raises(MissingDebate) as err:  # S=3 asks for a third challenger never recorded
        asyncio.run(svr_mad.run(question("q1"), row_initial(row), backend, S=3,
                                priors=QUESTIONS["q1"][2]))
    text = str(err.value)
    assert "'q1'" in text and "'0<4'" in text and "sender 4 -> receiver 0" in text
    with pytest.raises(ValueError):
        asyncio.run(backend.initial(question("q2"), 6))


def cli(*argv):
    parser = argparse.ArgumentParser()
    replay_cli.add_arguments(parser)
    return replay_cli.main(parser.parse_args(list(argv)))


def test_replay_cli_json(recorded, tmp_path, capsys):
    rows, live = recorded
    path = tmp_path / "trace.jsonl"
    write_trace(path, rows)
    assert cli("--trace", str(path), "--method", "svr-mad", "--S", "2", "--C", "2", "--json") == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["id"] for x in lines[:-1]] == list(QUESTIONS)
    for line in lines[:-1]:
        r = live[line["id"], "svr-mad"]
        assert line == {"id": line["id"], "answer": r.answer, "correct": r.correct,
                        "ncomm": r.ncomm, "tokens": r.tokens, "accepted": r.accepted}
    results = [live[qid, "svr-mad"] for qid in QUESTIONS]
    total = lines[-1]
    assert total["questions"] == 3 and total["method"] == "svr-mad"
    assert total["accuracy"] == pytest.approx(sum(r.correct for r in results) / 3)
    assert total["ncomm_mean"] == pytest.approx(sum(r.ncomm for r in results) / 3)
    assert total["tokens_mean"] == pytest.approx(sum(r.tokens for r in results) / 3)
    assert total["acceptance_rate"] == pytest.approx(sum(r.accepted for r in results) / 3)


def test_replay_cli_every_method_and_table(recorded, tmp_path, capsys):
    rows, live = recorded
    path = tmp_path / "trace.jsonl"
    write_trace(path, rows)
    for m in ("self-consistency", "all-to-all", "s2-mad"):
        assert cli("--trace", str(path), "--method", m, "--json") == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert [x["ncomm"] for x in lines[:-1]] == [live[q, m].ncomm for q in QUESTIONS]
    assert cli("--trace", str(path), "--method", "group-debate", "--groups", "2-2-2") == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["id", "answer", "correct", "ncomm", "tokens"]
    assert "accuracy" in out.splitlines()[-1]


def test_replay_cli_sid_et_skip_rate(recorded, tmp_path, capsys):
    rows, _ = recorded
    path = tmp_path / "trace.jsonl"
    write_trace(path, rows)
    # every question's most confident agent has min-LL -1.0: any positive skip rate skips all
    assert cli("--trace", str(path), "--method", "sid-et", "--skip-rate", "0.3", "--json") == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["ncomm"] for x in lines[:-1]] == [0, 0, 0]
    assert lines[-1]["acceptance_rate"] == 1.0


def test_replay_cli_errors(recorded, tmp_path, capsys):
    rows, _ = recorded
    path = tmp_path / "trace.jsonl"
    write_trace(path, rows)
    assert cli("--trace", str(path), "--method", "svr-mad", "--S", "3") == 1
    assert "no debate" in capsys.readouterr().err
    assert cli("--trace", str(path), "--method", "all-to-all", "--S", "3") == 2
    assert "--S" in capsys.readouterr().err


def test_replay_cli_prior_recomputes_from_signals(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(svr_mad, "prior_score", lambda s, name: s.get(name, 0.0))
    q, priors = question("q2"), QUESTIONS["q2"][2]  # recorded priors pick agent 2 first
    rec = RecordingBackend(scripted("q2"))  # its min_ll signals pick agent 0 first

    async def go():
        initial = await rec.initial(q, 6)
        return (await svr_mad.run(q, initial, rec, priors=priors),
                await svr_mad.run(q, initial, rec, prior="min_ll"))

    by_recorded, by_signal = asyncio.run(go())
    path = tmp_path / "trace.jsonl"
    write_trace(path, [rec.trace_row(q, priors)])
    for argv, want in (((), by_recorded), (("--prior", "min_ll"), by_signal)):
        assert cli("--trace", str(path), "--json", *argv) == 0
        line = json.loads(capsys.readouterr().out.splitlines()[0])
        assert (line["answer"], line["ncomm"], line["tokens"]) == (want.answer, want.ncomm,
                                                                   want.tokens)
    assert by_recorded.answer != by_signal.answer


def old_trace(tmp_path):
    """A 5-1 question recorded the way runs were before repeated pairs (each pair at most once)."""
    q = Question(id="q7", question="?", gold="A", answer_type="mc")
    priors = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
    rec = RecordingBackend(ScriptedBackend(["A"] * 5 + ["B"]))

    async def go():
        initial = await rec.initial(q, 6)
        return await svr_mad.run(q, initial, rec, priors=priors, repeat_pairs=False)

    live = asyncio.run(go())
    path = tmp_path / "trace.jsonl"
    write_trace(path, [rec.trace_row(q, priors)])
    return path, live


def test_replay_of_a_trace_without_repeats_names_the_missing_repeat(tmp_path, capsys):
    path, live = old_trace(tmp_path)
    assert (live.answer, live.ncomm) == ("B", 7)
    assert cli("--trace", str(path), "--method", "svr-mad") == 1
    err = capsys.readouterr().err
    assert ("question 'q7': the trace holds no debate '0<5#2' (sender 5 -> receiver 0, repeat 2)"
            in err and "--no-repeat-pairs" in err)
    assert cli("--trace", str(path), "--method", "svr-mad", "--no-repeat-pairs", "--json") == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert (line["answer"], line["ncomm"], line["tokens"], line["accepted"]) == (
        "B", 7, live.tokens, True)
    assert cli("--trace", str(path), "--method", "s2-mad", "--no-repeat-pairs") == 2  # not its option


def test_repeats_are_recorded_and_replay(tmp_path):
    q = Question(id="q7", question="?", gold="A", answer_type="mc")
    rec = RecordingBackend(ScriptedBackend(["A"] * 5 + ["B"], {(5, 0, 2): "A"}))

    async def go():
        initial = await rec.initial(q, 6)
        return await svr_mad.run(q, initial, rec, priors=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4])

    live = asyncio.run(go())
    row = json.loads(json.dumps(rec.trace_row(q)))
    assert [(d["id"], d["sender"], d["receiver"], d["repeat"]) for d in row["debates"]] == [
        ("0<5", 5, 0, 1), ("0<5#2", 5, 0, 2)]
    assert row["debates"][1]["prompt_tokens"] == row["debates"][0]["prompt_tokens"]
    again = asyncio.run(svr_mad.run(q, row_initial(row), ReplayBackend(row),
                                    priors=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]))
    assert again == live and live.ncomm == 2
