"""Grading at run scale: linear-time extraction, load-independent verdicts, the worker's budget as
an error (never a verdict), and the async API that keeps the event loop free (docs/grading.md)."""

import asyncio
import importlib.util
import os
import subprocess
import threading
import sys
import time
from pathlib import Path

import pytest

from svrmad_local import grading
from svrmad_local.grading import equivalent, extract_answer, is_correct, worker

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_grading", ROOT / "benchmarks" / "bench_grading.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# inputs an earlier extractor took quadratic time on, and the worst ones of benchmarks/bench_grading.py
SLOW_INPUTS = ["newlines", "boxed then newlines", "digits", "unclosed boxes", "nested boxes", "dashes",
               "number lists", "text commands"]


@pytest.mark.parametrize("name", SLOW_INPUTS)
def test_extraction_is_fast_on_200k_degenerate_responses(name):
    text = bench.degenerate(200_000)[name]
    for kind, choices in (("math", None), ("mc", bench.TEN)):
        start = time.perf_counter()
        answer = extract_answer(text, kind, choices)
        assert time.perf_counter() - start < 1.0, (name, kind)
        is_correct(answer, "5", kind)  # normalising a 200k-character answer must not hang either


# Pairs that reach sympy, one per path of symbolic.py, with their verdicts.
SLOW_PAIRS = [
    ("(x+y+z+w)^{60}(x-y)", "(x+y+z+w)^{60}x-(x+y+z+w)^{60}y", True),  # random points (expand: a minute)
    (r"\frac{1}{n}4\cos^{2}\frac{\pi}{2n}", r"\frac{2(1+\cos\frac{\pi}{n})}{n}", True),  # trig identity
    (r"|x|^2", "x^2", False),  # non-analytic: points agree, expand and simplify cannot prove it
    (r"\sqrt{x}\sqrt{y}", r"\sqrt{xy}", False),  # differs where both are negative
    (r"\sqrt{2}+\sqrt{3}", r"\sqrt{5+2\sqrt{6}}", True),  # constant: 50 digits
    ("(x+1)^{9000}", "(x+1)^{8999}(x+1)+1", False),  # expand gate: 9001 terms, not expanded
]


def _verdicts() -> list[bool]:
    grading.clear_cache()  # every pair goes to the worker again
    return [equivalent(a, b, "math") for a, b, _ in SLOW_PAIRS]


def test_verdicts_do_not_change_under_cpu_saturating_load():
    idle = _verdicts()
    assert idle == [v for _, _, v in SLOW_PAIRS]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        time.sleep(0.2)
        loaded = _verdicts()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert loaded == idle


def test_a_request_past_its_budget_is_an_error_not_a_cached_verdict(monkeypatch, caplog):
    a, b = "(x+y+z+w)^{59}(x-y)", "(x+y+z+w)^{59}x-(x+y+z+w)^{59}y"  # asked nowhere else: uncached
    grading.clear_cache()
    worker.call("ping")
    undecided = grading.stats["undecided"]
    monkeypatch.setattr(worker, "BUDGETS", (1e-4,))
    assert not equivalent(a, b, "math")
    assert grading.stats["undecided"] == undecided + 1
    assert "ran past every budget" in caplog.text and "not cached" in caplog.text
    monkeypatch.setattr(worker, "BUDGETS", (20.0,))
    assert equivalent(a, b, "math")  # decided by a fresh worker: the expiry was not remembered


def test_a_reply_found_past_the_deadline_is_an_expiry(monkeypatch):
    """The budget runs from the sending of a request to the reading of its reply. A caller held up in between
    (descheduled on a busy machine, a GC pause) finds the reply waiting when it looks; the test above once got
    its pair's verdict so under a 1e-4 s budget: the deadline was set after the sending, and a reply select saw
    on a late wake was taken. Here the caller stalls right after sending a ping."""
    w = worker.Worker()
    try:
        w.call("ping")
        sent = w._proc.stdin

        class Stalled:
            write = sent.write

            def flush(self):
                sent.flush()
                time.sleep(0.2)  # the ping's reply comes meanwhile

        w._proc.stdin = Stalled()
        monkeypatch.setattr(worker, "BUDGETS", (0.05,))
        with pytest.raises(worker.GradingTimeout):
            w.call("ping")
        monkeypatch.setattr(worker, "BUDGETS", (20.0,))
        assert w.call("ping") is True and w.restarts == 2  # a fresh worker
    finally:
        w.stop()


def test_async_grading_keeps_the_event_loop_free():
    a, b, expected = r"\binom{2n}{n}", r"\frac{(2n)!}{(n!)^2}", True  # a few tenths of a second of sympy
    grading.clear_cache()
    worker.call("ping")

    async def main():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.002)

        task = asyncio.create_task(ticker())
        start = time.perf_counter()
        verdict = await grading.aequivalent(a, b, "math")
        elapsed = time.perf_counter() - start
        done.set()
        await task
        return verdict, ticks, elapsed

    verdict, ticks, elapsed = asyncio.run(main())
    assert verdict is expected
    assert ticks >= min(3, elapsed / 0.01), "the loop did not run while sympy worked"


def test_settle_decides_every_pair_off_the_loop_then_sync_calls_hit_the_cache():
    grading.clear_cache()
    answers = ["x^2-1", "(x-1)(x+1)", r"\frac{1}{2}", "0.5", None]
    asyncio.run(grading.settle(answers[:3], "math", against=answers[3:], gold="x^2 - 1"))
    asked = grading.stats["worker"]
    assert equivalent("x^2-1", "(x-1)(x+1)", "math")
    assert equivalent(r"\frac{1}{2}", "0.5", "math")
    assert not equivalent("(x-1)(x+1)", "0.5", "math")
    assert is_correct("(x-1)(x+1)", "x^2 - 1", "math")
    assert asyncio.run(grading.ais_correct("(x-1)(x+1)", "x^2 - 1", "math"))
    assert grading.stats["worker"] == asked


def test_cheap_pairs_never_reach_the_worker():
    grading.clear_cache()
    asked = grading.stats["worker"]
    assert equivalent("1,234", "1234.00", "math")
    assert equivalent(r"\{1, \frac{1}{2}\}", "0.5, 1", "math")
    assert not equivalent("(1,2)", "(2,1)", "math")
    assert equivalent(r"x \ge 2", r"[2, \infty)", "math")
    assert grading.stats["worker"] == asked


def test_a_live_method_never_waits_for_sympy_on_the_event_loop(monkeypatch):
    """RecordingBackend settles each answer as it arrives: every worker request is made from a
    thread, and the method's own (sync) comparisons find their verdicts cached."""
    from svrmad_local.debate.scripted import ScriptedBackend
    from svrmad_local.debate.trace import RecordingBackend
    from svrmad_local.debate.types import Question
    from svrmad_local.grading import verdicts
    from svrmad_local.methods import run_method

    grading.clear_cache()
    on_loop_thread = []
    real = verdicts._from_worker

    def spy(key):
        on_loop_thread.append(threading.current_thread() is threading.main_thread())
        return real(key)

    monkeypatch.setattr(verdicts, "_from_worker", spy)
    q = Question(id="q", question="?", gold="x^2-1", answer_type="math")
    backend = RecordingBackend(ScriptedBackend(["(x-1)(x+1)", "x^2+1", "1-x^2", "x^2+1"],
                                               {(0, 1): "(x+1)(x-1)", (0, 3): "x^2 - 1"}))

    async def go():
        initial = await backend.initial(q, 4)
        results = [await run_method(m, q, initial, backend) for m in ("svr-mad", "all-to-all")]
        return results, backend.trace_row(q)

    results, row = asyncio.run(go())
    assert on_loop_thread and not any(on_loop_thread)
    assert row["agents"][0]["correct"] and not row["agents"][1]["correct"]
    assert all(r.answer is not None for r in results)


def test_a_forked_child_starts_its_own_worker():
    """A child forked while the parent's worker runs must not write to the parent's pipes."""
    worker.call("ping")
    parent_proc = worker._WORKER._proc
    pid = os.fork()
    if pid == 0:  # child
        grading.clear_cache()
        ok = worker._WORKER._proc is None and equivalent("x^2-1", "(x-1)(x+1)", "math") \
            and worker._WORKER._proc is not parent_proc
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert worker._WORKER._proc is parent_proc and parent_proc.poll() is None
    assert worker.call("ping") is True


def test_a_reply_left_unread_is_never_taken_for_the_next_requests():
    """A call stopped between writing its request and reading the reply (by an exception other than an expiry,
    which kills the worker) leaves that reply in the pipe, where the next request would read it as its own.
    Replies carry their request's number, and the client skips any other."""
    import json

    w = worker.Worker()
    try:
        w.call("ping")
        w._proc.stdin.write(json.dumps(["ping", [], -1]).encode() + b"\n")  # its reply is never read
        w._proc.stdin.flush()
        assert w.call("math", "x", "y") is False
        assert w.call("ping") is True and w.restarts == 1
    finally:
        w.stop()
