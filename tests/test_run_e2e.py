"""`svrmad run` end to end on a tiny random model through the real engine path: the answers are
nonsense, but the files, the accounting and resume must hold."""

from __future__ import annotations

import json

import pytest
import torch

from svrmad_local import cli
from svrmad_local.job import run as run_mod
from svrmad_local.analysis.metrics import read_jsonl
from svrmad_local.models.loader import default_dtype

from .conftest import make_model

QUESTIONS = [
    {"id": f"q{i}", "question": f"What is {i} + {i + 1}? Answer with a number.", "gold": str(2 * i + 1), "answer_type": "math"}
    for i in range(5)
]


@pytest.fixture
def setup(tmp_path, tiny_tokenizer):
    ck = tmp_path / "model"
    make_model("llama", vocab=len(tiny_tokenizer), seed=3).save_pretrained(ck)
    tiny_tokenizer.save_pretrained(ck)
    data = tmp_path / "qs.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return ck, data, tmp_path / "run"


def run(ck, data, out, *extra):
    argv = ["run", "--model", str(ck), "--dataset", str(data), "--out", str(out), "--max-tokens", "12",
            "--kv-cache-memory", "4MiB", "--block-size", "4", "--device", "cpu", *extra]
    return cli.main(argv)


def test_run_writes_trace_results_and_accounting_adds_up(setup, capsys):
    ck, data, out = setup
    assert run(ck, data, out, "--limit", "3", "--methods", "svr-mad,self-consistency,all-to-all") == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "SVR-MAD" in printed and "Prompt tok computed" in printed
    start = [line for line in captured.err.splitlines() if line.startswith("svrmad run: engine: ")]
    assert len(start) == 1 and "linear " in start[0] and "decode " in start[0], captured.err  # what runs, in one line
    trace, results = read_jsonl(out / "trace.jsonl"), read_jsonl(out / "results.jsonl")
    skipped = read_jsonl(out / "skipped.jsonl")
    assert len(trace) + len(skipped) == 3 and trace, "a random model should disagree with itself"
    assert {r["method"] for r in results} == {"svr-mad", "self-consistency", "all-to-all"}
    eng = json.loads((out / "run.json").read_text())["totals"]["engine"]
    auto = {torch.float32: "fp32", torch.bfloat16: "bf16"}[default_dtype("cpu")]  # no --dtype: this machine's
    assert eng["execution"]["device"]["value"].startswith(f"cpu {auto} (auto: ") and eng["fallbacks"] == []
    assert all(c["value"] and c["reason"] for c in eng["execution"].values())  # the record, with its reasons
    said = next(line for line in printed.splitlines() if " steps (" in line)  # how full the steps ran
    assert said.startswith(f"engine: {eng['steps']} steps (") and f"{eng['evictions']} cached blocks evicted" in said
    # every engine request is one response in a trace/skipped line: billed and computed tokens add up
    billed = computed = generated = 0
    for row in trace:
        for r in row["agents"] + row["debates"]:
            billed += r["prompt_tokens"]
            computed += r["computed_tokens"]
            generated += r["completion_tokens"]
    for row in skipped:
        billed += row["tokens"]
        computed += row["computed_tokens"]
    if not skipped:
        assert billed == eng["prompt_tokens"] and generated == eng["generated_tokens"]
    assert computed == eng["computed_tokens"]
    assert eng["computed_tokens"] < eng["prompt_tokens"]  # the cache was used
    for res in results:
        row = next(t for t in trace if t["id"] == res["id"])
        init = sum(a["prompt_tokens"] + a["completion_tokens"] for a in row["agents"])
        assert res["tokens"] >= init and res["tokens"] == res["prompt_tokens"] + res["completion_tokens"]
        if res["method"] == "self-consistency":
            assert res["tokens"] == init and res["ncomm"] == 0
        if res["method"] == "svr-mad":
            assert res["ncomm"] <= sum(1 for d in row["debates"] if d["sender"] is not None)
    assert sum(r["ncomm"] for r in results if r["method"] == "svr-mad") > 0


def test_resume_after_interruption_redoes_nothing(setup, monkeypatch):
    ck, data, out = setup
    assert run(ck, data, out, "--limit", "2") == 0
    first = {r["id"] for r in read_jsonl(out / "trace.jsonl")} | {r["id"] for r in read_jsonl(out / "skipped.jsonl")}
    assert first == {"q0", "q1"}
    # the process dies while writing the next question's line: a torn last line
    with open(out / "trace.jsonl", "a") as f:
        f.write('{"id": "q2", "agents": [')
    seen = []
    real = run_mod.run_question

    async def spy(q, *a, **k):
        seen.append(q.id)
        return await real(q, *a, **k)

    monkeypatch.setattr(run_mod, "run_question", spy)
    assert run(ck, data, out, "--limit", "5") == 0
    assert sorted(seen) == ["q2", "q3", "q4"]  # finished questions are not redone, the torn one is
    ids = [r["id"] for r in read_jsonl(out / "trace.jsonl")] + [r["id"] for r in read_jsonl(out / "skipped.jsonl")]
    assert sorted(ids) == ["q0", "q1", "q2", "q3", "q4"]
    for line in (out / "trace.jsonl").read_text().splitlines():
        json.loads(line)  # still valid JSONL


def test_replay_of_a_live_trace_matches_live_results(setup, capsys):
    ck, data, out = setup
    assert run(ck, data, out, "--limit", "4", "--methods", "svr-mad") == 0
    live = {r["id"]: r for r in read_jsonl(out / "results.jsonl")}
    if not live:
        pytest.fail("every question was unanimous with this random model")
    capsys.readouterr()
    assert cli.main(["replay", "--trace", str(out / "trace.jsonl"), "--method", "svr-mad", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    for line in lines[:-1]:
        assert line["answer"] == live[line["id"]]["answer"]
        assert line["ncomm"] == live[line["id"]]["ncomm"]
        assert line["tokens"] == live[line["id"]]["tokens"]
    assert lines[-1]["questions"] == len(live)


def test_bad_input_is_a_clear_error(setup, capsys):
    ck, data, out = setup
    assert run(ck, data, out, "--methods", "svr-mad,telepathy") == 2
    assert "unknown method" in capsys.readouterr().err
    assert run(ck, out / "missing.jsonl", out) == 2


def test_shard_splits_questions_disjointly():
    qs = list(range(10))
    parts = [run_mod.shard(qs, f"{k}/3") for k in range(3)]
    assert sorted(sum(parts, [])) == qs and parts[1] == [1, 4, 7]
    with pytest.raises(ValueError, match="K/N"):
        run_mod.shard(qs, "3/3")


def test_an_over_long_question_fails_alone(setup, capsys):
    ck, data, out = setup
    rows = [json.loads(x) for x in data.read_text().splitlines()][:3]
    rows.insert(1, {"id": "long", "question": "What is 2 + 3? " * 600, "gold": "5", "answer_type": "math"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run(ck, data, out, "--limit", "0", "--methods", "svr-mad") == 1
    assert "1 failed" in capsys.readouterr().out
    errors = read_jsonl(out / "errors.jsonl")
    assert [(e["id"], e["stage"]) for e in errors] == [("long", "initial")]
    assert "does not fit the model's context" in errors[0]["message"]
    done = {r["id"] for r in read_jsonl(out / "trace.jsonl")} | {r["id"] for r in read_jsonl(out / "skipped.jsonl")}
    assert done == {"q0", "q1", "q2"}
    meta = json.loads((out / "run.json").read_text())
    assert meta["totals"]["failed"] == 1 and meta["totals"]["questions"] == 4


def test_a_debate_that_outgrows_the_context_gets_no_answer(tiny_model, tiny_tokenizer):
    import asyncio

    from svrmad_local.debate.engine_backend import EngineBackend
    from svrmad_local.debate.replay_backend import ReplayBackend
    from svrmad_local.debate.trace import RecordingBackend, row_initial
    from svrmad_local.debate.types import Question
    from svrmad_local.engine.engine import Engine, EngineConfig
    from svrmad_local.engine.params import SamplingParams
    from svrmad_local.methods import svr_mad

    engine = Engine(tiny_model, tiny_tokenizer, EngineConfig(kv_cache_memory="4MiB", block_size=4))
    rec = RecordingBackend(EngineBackend(engine, SamplingParams(max_tokens=10, ignore_eos=True), seed=1))
    q = Question("q", "What is 2 + 3?", "5")
    initial = asyncio.run(rec.initial(q, 3))
    for r, a in zip(initial, ["5", "6", "7"]):  # they disagree (the recorded responses too)
        r.answer = a
    # the initial prompts fit; a debate prompt (own answer + a peer's + instructions) does not
    engine.max_model_len = initial[0].prompt_tokens + initial[0].completion_tokens + 4
    d = asyncio.run(rec.debate(q, initial[0], [initial[1]]))
    assert (d.answer, d.finish_reason, d.prompt_tokens, d.completion_tokens, d.computed_tokens) == (None, "context", 0, 0, 0)
    assert engine.info["requests"] == 1  # nothing was sent for it
    res = asyncio.run(svr_mad.run(q, initial, rec, priors=[0.9, 0.5, 0.1], S=1, C=1))
    assert res.ncomm >= 1 and not res.accepted  # every debate "changed": nobody accepted, the fallback vote decides
    row = rec.trace_row(q, [0.9, 0.5, 0.1])
    assert all(x["finish_reason"] == "context" and x["outcome"] == "changed" for x in row["debates"])
    assert row["agents"][0]["finish_reason"] == "length"
    again = asyncio.run(svr_mad.run(q, row_initial(row), ReplayBackend(row), priors=[0.9, 0.5, 0.1], S=1, C=1))
    assert (again.answer, again.ncomm, again.tokens) == (res.answer, res.ncomm, res.tokens)


@pytest.mark.parametrize("repeats", [True, False])
def test_ablations_record_what_every_variant_needs(setup, repeats):
    """--ablations records every debate an SVR-MAD variant may ask for (with repeats when pairs
    repeat), so the Appendix B sweep replays; its SVR point at tau=1 is the live SVR-MAD."""
    ck, data, out = setup
    extra = [] if repeats else ["--no-repeat-pairs"]
    assert run(ck, data, out, "--limit", "3", "--methods", "svr-mad", "--ablations", *extra) == 0
    trace, results = read_jsonl(out / "trace.jsonl"), read_jsonl(out / "results.jsonl")
    if not results:
        pytest.fail("every question was unanimous with this random model")
    repeats_seen = max(d["repeat"] for row in trace for d in row["debates"])
    assert (repeats_seen > 1) == repeats
    assert all(r["params"]["repeat_pairs"] == repeats for r in results)
    point = next(p for p in read_jsonl(out / "ablations.jsonl") if p["posterior"] == "svr" and p["tau"] == 1.0)
    assert point["ncomm_mean"] == pytest.approx(sum(r["ncomm"] for r in results) / len(results))
    assert point["tokens_mean"] == pytest.approx(sum(r["tokens"] for r in results) / len(results))


def test_progress_moves_inside_a_question_with_the_engine_counters():
    from svrmad_local.job.launch import Dist

    info = {"generated_tokens": 0, "in_flight": 3}
    progress = run_mod.Progress(4, Dist(), lambda: dict(info))
    progress.refresh()
    info["generated_tokens"] = 500
    progress.refresh()  # no question finished, but the bar says what the engine is doing
    assert progress.bar.n == 0 and "3 requests in flight, 500 tokens" in progress.bar.postfix
    assert " tok/s" in progress.bar.postfix and not progress.bar.postfix.startswith("0 tok/s")
    progress.done_one()
    assert progress.bar.n == 1
    progress.close()
