"""Run-ahead debates (RecordingBackend(run_ahead=True), `svrmad run --run-ahead`): SVR-MAD announces
the debates it may ask for next and they start at once, yet what every method receives, the trace,
NComm and the billed tokens are those of the sequential run; unused ones are counted apart."""

from __future__ import annotations

import asyncio
import json
import random

from svrmad_local.debate.scripted import ScriptedBackend
from svrmad_local.debate.trace import RecordingBackend
from svrmad_local.debate.types import Question
from svrmad_local.analysis.run_config import RunConfig
from svrmad_local.methods import svr_mad

from . import runharness as h


def scenario(seed: int):
    rnd = random.Random(seed)
    answers = [rnd.choice("ABC") for _ in range(6)]
    outcomes = {(s, r, k): rnd.choice("ABC") for s in range(6) for r in range(6) for k in (1, 2, 3)
                if s != r and rnd.random() < 0.3}
    priors = [rnd.random() for _ in range(6)]
    return answers, outcomes, priors


def one(seed: int, run_ahead: bool, **params):
    answers, outcomes, priors = scenario(seed)
    q = Question(id=f"q{seed}", question="?", gold="A", answer_type="mc")
    inner = ScriptedBackend(answers, outcomes, [{"min_ll": -p} for p in priors])
    rec = RecordingBackend(inner, run_ahead=run_ahead)

    async def go():
        initial = await rec.initial(q, 6)
        res = await svr_mad.run(q, initial, rec, priors=priors, **params)
        row = rec.trace_row(q, priors)
        await asyncio.sleep(0)  # let prefetches still running finish
        rec.forget(q.id)
        await asyncio.sleep(0)
        return res, row

    res, row = asyncio.run(go())
    return res, row, rec.ahead, inner.calls


def test_results_trace_and_billing_equal_the_sequential_run():
    ahead = {"started": 0, "used": 0, "unused": 0}
    for seed in range(60):
        for params in ({"S": 2, "C": 2}, {"S": 3, "C": 1}, {"S": 3, "C": 2, "tau": 0.5}):
            res0, row0, _, calls0 = one(seed, False, **params)
            res1, row1, got, calls1 = one(seed, True, **params)
            assert res1 == res0, (seed, params)  # answer, NComm, tokens, scores, every debate
            assert row1 == row0, (seed, params)  # the trace holds only what was asked for
            assert set(calls0) <= set(calls1) and len(calls1) == len(calls0) + got["unused"]
            assert got["started"] == got["used"] + got["unused"]
            for k in ahead:
                ahead[k] += got[k]
    # the test exercised both sides: prefetches that were asked for, and ones an acceptance made moot
    assert ahead["used"] > 0 and ahead["unused"] > 0, ahead


def test_without_run_ahead_nothing_starts_early():
    for seed in range(20):
        _, _, got, calls = one(seed, False, S=3, C=1)
        assert got["started"] == 0
        assert len(calls) == len(set(calls))


def test_unused_prefetches_are_counted_with_their_tokens():
    q = Question(id="q", question="?", gold="A", answer_type="mc")
    rec = RecordingBackend(ScriptedBackend(["A", "B"], {}), run_ahead=True)

    async def go():
        initial = await rec.initial(q, 2)
        rec.prefetch(q, initial[0], [initial[1]])
        rec.prefetch(q, initial[0], [initial[1]])  # once only
        await asyncio.sleep(0.01)
        assert rec.trace_row(q)["debates"] == []
        rec.forget(q.id)
        await asyncio.sleep(0)

    asyncio.run(go())
    assert rec.ahead["started"] == rec.ahead["unused"] == 1
    assert rec.ahead["unused_tokens"] == 50 + 50  # the scripted debate's completion and its computed prompt part
    assert not rec._memo


def test_svrmad_run_with_run_ahead_writes_the_same_folder(tmp_path, monkeypatch, capsys):
    h.use_script(monkeypatch)
    assert h.run(tmp_path, tmp_path / "seq", "--S", "3", "--C", "1") == 0
    assert h.run(tmp_path, tmp_path / "ahead", "--S", "3", "--C", "1", "--run-ahead") == 0
    printed = capsys.readouterr().out
    seq, ahead = h.state(tmp_path / "seq"), h.state(tmp_path / "ahead")
    assert ahead["trace"] == seq["trace"] and ahead["results"] == seq["results"]
    eng = ahead["meta"]["totals"]["engine"]
    assert eng["ahead_started"] == eng["ahead_used"] + eng["ahead_unused"] and eng["ahead_started"] > 0
    assert "run-ahead:" in printed
    assert "ahead_started" not in seq["meta"]["totals"]["engine"]


def test_run_ahead_is_not_a_result_setting():
    assert RunConfig(run_ahead=True).fingerprint() == RunConfig().fingerprint()
