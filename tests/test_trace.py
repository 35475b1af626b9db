"""Response ids, the recording backend's memo and the trace.jsonl round trip."""

import asyncio
import json

import pytest

from svrmad_local.debate.scripted import ScriptedBackend
from svrmad_local.debate.trace import (RecordingBackend, agent_of, append_trace, read_trace,
                                       row_debates, row_initial, row_priors, row_question,
                                       split_id, split_repeat, trace_row, write_trace)
from svrmad_local.debate.types import Question, debate_id
from svrmad_local.methods import run_method

Q = Question(id="q7", question="What?", gold="A", answer_type="mc")


@pytest.mark.parametrize("own,peers,brief", [
    ("2", ["4"], []),
    ("0", ["1", "2", "3", "4", "5"], []),
    ("0<1+2", ["1<0+2", "2<0+1"], []),
    ("(0<1)<(1<0)", ["(1<0)<(0<1)"], ["2|3"]),
    ("0<1|3+4", ["1<0|3+4"], ["3<4|0+1", "4<3|0+1"]),
])
def test_split_id_inverts_debate_id(own, peers, brief):
    rid = debate_id(own, peers, brief)
    assert split_id(rid) == (own, peers, brief)
    assert agent_of(rid) == int(own.split("<")[0].strip("("))


def test_split_id_rejects_initial_ids():
    with pytest.raises(ValueError):
        split_id("3")


def test_repeat_ids():
    assert debate_id("0", ["5"]) == "0<5" and debate_id("0", ["5"], repeat=1) == "0<5"
    assert debate_id("0", ["5"], repeat=2) == "0<5#2"
    assert split_id("0<5#2") == ("0", ["5"], []) and agent_of("0<5#12") == 0
    assert split_repeat("0<5#2") == ("0<5", 2) and split_repeat("0<5") == ("0<5", 1)
    # a repeat used as a peer or own response is parenthesised like any compound id
    rid = debate_id("0<5#3", ["1<2#2"], repeat=2)
    assert rid == "(0<5#3)<(1<2#2)#2"
    assert split_id(rid) == ("0<5#3", ["1<2#2"], []) and split_repeat(rid) == ("(0<5#3)<(1<2#2)", 2)
    for bad in ("0<5#1", "0<5#x", "0<5#2#3"):
        with pytest.raises(ValueError):
            split_repeat(bad)
    with pytest.raises(ValueError):
        debate_id("0", ["5"], repeat=0)


def test_recording_backend_keeps_repeats_apart():
    rec = RecordingBackend(ScriptedBackend(["A", "B"], {(1, 0, 2): "B"}))

    async def go():
        initial = await rec.initial(Q, 2)
        return [await rec.debate(Q, initial[0], [initial[1]], repeat=k) for k in (1, 2, 2)]

    first, second, again = asyncio.run(go())
    assert rec.inner.calls == ["0<1", "0<1#2"] and second is again
    assert (first.answer, second.answer) == ("A", "B")
    assert [d["repeat"] for d in rec.trace_row(Q)["debates"]] == [1, 2]


def record(answers, outcomes, methods, priors):
    rec = RecordingBackend(ScriptedBackend(answers, outcomes, [{"min_ll": -float(i)}
                                                                for i in range(len(answers))]))

    async def go():
        initial = await rec.initial(Q, len(answers))
        return [await run_method(m, Q, initial, rec, **({"priors": priors} if "svr" in m else {}))
                for m in methods]

    return rec, asyncio.run(go())


def test_memo_computes_each_debate_once_and_every_method_counts_it():
    rec, (a2a, sid) = record(["A", "B", "A", "C"], {}, ["all-to-all", "sid-et"], [0] * 4)
    assert len(rec.inner.calls) == 8 and rec.hits == 8
    assert (a2a.tokens, a2a.ncomm) == (sid.tokens, sid.ncomm)


def test_concurrent_identical_calls_share_one_computation():
    rec = RecordingBackend(ScriptedBackend(["A", "B"]))

    async def go():
        initial = await rec.initial(Q, 2)
        return await asyncio.gather(*(rec.debate(Q, initial[0], [initial[1]]) for _ in range(3)))

    out = asyncio.run(go())
    assert rec.inner.calls == ["0<1"] and all(r is out[0] for r in out)


def test_trace_row_fields_and_json_round_trip():
    rec, _ = record(["A", "B", "A", "C"], {(1, 0): "B"}, ["svr-mad", "all-to-all"],
                    [0.9, 0.5, 0.1, 0.4])
    row = rec.trace_row(Q, [0.9, 0.5, 0.1, 0.4])
    back = json.loads(json.dumps(row))
    assert row_question(back) == Question(id="q7", question="What?", gold="A", answer_type="mc")
    assert row_priors(back) == [0.9, 0.5, 0.1, 0.4]
    assert row_initial(back) == rec.initials[Q.id]
    recorded = {rid: r for rid, r in rec.debates[Q.id].items()}
    assert row_debates(back) == recorded
    first = back["debates"][0]
    assert {k: first[k] for k in ("id", "sender", "receiver", "round", "peers", "brief", "answer",
                                  "outcome")} == {
        "id": "0<1", "sender": 1, "receiver": 0, "round": 1, "peers": ["1"], "brief": [],
        "answer": "B", "outcome": "changed"}
    a2a = next(d for d in back["debates"] if d["id"] == "0<1+2+3")
    assert a2a["sender"] is None and a2a["outcome"] == "retained"
    agent = back["agents"][1]
    assert (agent["correct"], agent["prior"], agent["signals"]) == (False, 0.5, {"min_ll": -1.0})
    rec.forget(Q.id)
    assert not rec.debates and not rec._memo


def test_trace_files(tmp_path):
    rows = [{"id": "a", "gold": "1", "agents": [], "debates": []},
            {"id": "b", "gold": "2", "agents": [], "debates": []}]
    path = tmp_path / "trace.jsonl"
    write_trace(path, rows[:1])
    append_trace(path, rows[1])
    append_trace(path, {**rows[0], "gold": "3"})  # a rerun of "a" replaces the earlier line
    with open(path, "a") as f:
        f.write('{"id": "torn"')  # a run killed mid-write
    assert read_trace(path) == [rows[1], {**rows[0], "gold": "3"}]


def test_trace_row_without_priors():
    row = trace_row(Q, asyncio.run(ScriptedBackend(["A"]).initial(Q, 1)), [])
    assert row["agents"][0]["prior"] is None and row["debates"] == []
