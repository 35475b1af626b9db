"""`--linear auto` chooses from this machine's measurements (models/calibrate.py): the decision from injected
timings, the per-machine cache, the record in engine.info. No test times anything: the timer is a formula."""

from __future__ import annotations

import functools
import json
import logging

import pytest
import torch

from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.params import SamplingParams
from svrmad_local.kernels import cpu_linear
from svrmad_local.models import calibrate
from svrmad_local.models.calibrate import Workload, choose
from svrmad_local.models.layouts import ONEDNN, PANELS
from svrmad_local.models.linear import FusedPart, PackedLinear, select_linear

from .model_zoo import make_zoo_model

needs_both = pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and cpu_linear.available()),
                                reason="needs oneDNN and the panel kernel")

# ms per call of one GEMM: panels stream the weights fastest (small M), oneDNN computes fastest (large M)
PER_CALL = {"panels": lambda k, n, m: 1.0 + 0.010 * m, "onednn": lambda k, n, m: 1.2 + 0.004 * m,
            "aten": lambda k, n, m: 3.0 + 0.020 * m}


class FakeTimer:
    """`time_step`'s interface: a step costs the sum of PER_CALL (optionally overridden) over its GEMMs, the
    head at one row in a prefill chunk; `calls` counts the timings."""

    def __init__(self, per_call=None):
        self.per_call, self.calls = per_call or PER_CALL, []

    def __call__(self, plans, decode_rows, prefill_rows, budget_s, dtype=torch.float32):
        self.calls.append(plans)
        return {(b, kind, m): sum(self.per_call[b](k, n, 1 if head and kind == "prefill" else m) for k, n, head in plan)
                for b, plan in plans.items()
                for kind, sizes in (("decode", decode_rows), ("prefill", prefill_rows)) for m in sizes}


def figures(decode: dict, prefill: dict) -> dict:
    """figures from {backend: {M: ms}} tables."""
    return {"decode": {b: {str(m): v for m, v in t.items()} for b, t in decode.items()},
            "prefill": {b: {str(m): v for m, v in t.items()} for b, t in prefill.items()}}


# a machine like an AMX Intel Xeon: panels faster at decode sizes, oneDNN 1.7x faster at M=512
INTEL = figures(decode={"panels": {1: 25.0, 8: 40.0, 64: 240.0}, "onednn": {1: 28.0, 8: 44.0, 64: 200.0}},
                prefill={"panels": {64: 240.0, 512: 874.0}, "onednn": {64: 180.0, 512: 504.0}})


def test_the_choice_weighs_decode_against_prefill_by_the_workload_mix():
    decode_only = Workload(prompt_per_generated=0.0, decode_rows=(1, 8, 64), prefill_rows=(64, 512))
    assert choose(INTEL, decode_only)[0] == "panels"  # panels win every decode size
    choice, cost = choose(INTEL, Workload())  # 5 prompt tokens a generated one: prefill dominates
    assert choice == "onednn" and cost["onednn"] < cost["panels"]
    expect = (25 / 1 + 40 / 8 + 240 / 64) / 3 + 5 * (240 / 64 + 874 / 512) / 2
    assert cost["panels"] == pytest.approx(expect, rel=1e-4)
    # where the panels win everywhere (the EPYCs), no mix moves the choice
    epyc = figures(decode={"panels": {1: 25.0, 8: 44.0, 64: 243.0}, "onednn": {1: 39.0, 8: 61.5, 64: 272.0}},
                   prefill={"panels": {64: 243.0, 512: 1553.0}, "onednn": {64: 272.0, 512: 1600.0}})
    assert choose(epyc, Workload(prompt_per_generated=100.0))[0] == "panels"


def test_the_panels_are_kept_unless_another_backend_is_faster_by_the_margin():
    close = figures(decode={"panels": {1: 100.0}, "onednn": {1: 97.0}, "aten": {1: 300.0}},
                    prefill={"panels": {64: 100.0}, "onednn": {64: 97.0}, "aten": {64: 300.0}})
    wl = Workload(decode_rows=(1,), prefill_rows=(64,))
    assert choose(close, wl)[0] == "panels"  # 3% faster: within the 5% margin
    assert choose(close, Workload(decode_rows=(1,), prefill_rows=(64,), margin=0.0))[0] == "onednn"


def test_the_workload_follows_the_scheduler_limits():
    assert Workload.for_engine(64, 2048) == Workload(decode_rows=(1, 8, 64), prefill_rows=(64, 512))
    wl = Workload.for_engine(4, 100, prompt_per_generated=2.0)
    assert wl.decode_rows == (1, 4) and wl.prefill_rows == (64, 100) and wl.prompt_per_generated == 2.0


def test_a_step_is_every_gemm_as_it_runs_fused_and_the_head_at_one_row_in_prefill():
    model = make_zoo_model("llama")
    layers = len(model.model.layers)
    fused = calibrate.gemms(model, "panels")
    assert sum(g.count for g in fused) == 4 * layers + 1  # q/k/v one GEMM, gate/up one: as select_linear packs
    assert sum(g.count for g in calibrate.gemms(model, "aten")) == 7 * layers + 1
    wl = Workload(decode_rows=(1, 8), prefill_rows=(64,))
    timer = FakeTimer()
    got = calibrate.measure(model, ["panels", "onednn"], wl, timer=timer)
    head = next(g for g in fused if g.head)
    for b in ("panels", "onednn"):
        f = PER_CALL[b]
        assert got["decode"][b]["8"] == pytest.approx(sum(g.count * f(g.k, g.n, 8) for g in fused), abs=1e-3)
        body = sum(g.count * f(g.k, g.n, 64) for g in fused if not g.head)
        assert got["prefill"][b]["64"] == pytest.approx(body + f(head.k, head.n, 1), abs=1e-3)
    assert len(timer.calls) == 1  # one timing: every backend's steps take turns in it


class FakeClock:
    """A clock that moves only while a fake GEMM runs: the i-th call of a backend costs `cost(backend, i)`
    seconds. `passes[b]` lists each call as (k, n, rows, the weight's address)."""

    def __init__(self, cost):
        self.t, self.cost, self.calls = 0.0, cost, {}

    def __call__(self) -> float:
        return self.t

    def mm(self, b, x, w, n):
        done = self.calls.setdefault(b, [])
        self.t += self.cost(b, len(done))
        done.append((x.shape[1], n, x.shape[0], w.data_ptr()))
        return x.new_empty(x.shape[0], n)


def test_a_step_is_timed_as_the_forward_runs_it_every_call_counted():
    """One timed pass of F.linear is one call of each GEMM in the forward's order, each on a weight of its
    own; its figure is the sum of its calls, the slow ones included: MKL's calls at decode sizes alternate
    fast and slow on an AMX Intel Xeon, and the fastest call of each shape once read F.linear at half of
    what the engine's steps took."""
    model = make_zoo_model("llama")
    plan = calibrate.order(model, "aten")
    jitter = FakeClock(lambda b, i: 0.001 if i % 2 else 0.003)  # 2 ms a call on average, 1 ms at best
    got = calibrate.time_step({"aten": plan}, (1, 8), (64,), budget_s=1e3, mm=jitter.mm, clock=jitter)
    assert got["aten", "decode", 8] == pytest.approx(2.0 * len(plan))
    assert got["aten", "prefill", 64] == pytest.approx(2.0 * len(plan))
    warm = len({(k, n, h) for k, n, h in plan})  # one call of each shape before a size is timed
    calls = jitter.calls["aten"]
    first = calls[warm:warm + len(plan)]
    assert [(k, n) for k, n, _, _ in first] == [(k, n) for k, n, _ in plan]
    assert {m for _, _, m, _ in first} == {1}
    assert len({w for _, _, _, w in first}) == len(plan)  # every call streams its own weight, as in a step
    head = [c for c in calls if (c[0], c[1]) == (model.config.hidden_size, model.config.vocab_size)]
    assert {m for _, _, m, _ in head} == {1, 8}  # the head at one row in a prefill chunk, at B rows at decode


def test_a_pass_over_its_share_still_times_every_shape_and_counts_each_at_its_mean():
    model = make_zoo_model("llama")
    plan = calibrate.order(model, "aten")
    per_shape = {s: 0.001 * (i + 1) for i, s in enumerate(sorted({(k, n) for k, n, _ in plan}))}
    steady = FakeClock(lambda b, i: 0.0)
    costs = []

    def mm(b, x, w, n):  # a shape's calls cost its own fixed time
        steady.t += per_shape[x.shape[1], n]
        costs.append((x.shape[1], n))
        return x.new_empty(x.shape[0], n)

    got = calibrate.time_step({"aten": plan}, (1,), (), budget_s=1e-6, mm=mm, clock=steady)
    assert got["aten", "decode", 1] == pytest.approx(1e3 * sum(per_shape[k, n] for k, n, _ in plan))
    assert len(costs) < 2 * len(plan)  # the pass was cut short, yet every shape was called
    assert set(costs) == set(per_shape)
    # the weights streamed are bounded: a smaller budget of bytes takes the same weights again in turn
    few = FakeClock(lambda b, i: 0.001)
    layer = sum(k * n for k, n, _ in plan[:7]) * 4
    calibrate.time_step({"aten": plan}, (1,), (), budget_s=1e3, stream_bytes=layer, mm=few.mm, clock=few)
    assert len({w for _, _, _, w in few.calls["aten"]}) < len(plan)


@needs_both
def test_a_backend_with_fast_and_slow_calls_is_weighed_by_all_of_them(cache):
    """Panels at a steady 1.5 ms a call, F.linear alternating 1 and 3 ms: per step the panels are faster,
    though F.linear's fastest call is the fastest of all."""
    clock = FakeClock(lambda b, i: 0.0015 if b == "panels" else (0.001 if i % 2 else 0.003))
    timer = functools.partial(calibrate.time_step, mm=clock.mm, clock=clock)
    cal = calibrate.calibrate(make_zoo_model("llama"), ["panels", "aten"], timer=timer)
    assert cal.choice == "panels" and cal.cost["aten"] > 1.2 * cal.cost["panels"]


def test_a_figure_above_a_larger_row_counts_is_lowered_to_it():
    disturbed = {("panels", 1): 12.0, ("panels", 8): 0.35, ("panels", 64): 2.0, ("onednn", 1): 0.3}
    assert calibrate.monotone(disturbed) == {("panels", 1): 0.35, ("panels", 8): 0.35, ("panels", 64): 2.0,
                                             ("onednn", 1): 0.3}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SVRMAD_CACHE", str(tmp_path))
    monkeypatch.setenv("SVRMAD_CALIBRATE", "on")
    return tmp_path


def test_figures_are_cached_per_machine_and_reused_without_timing(cache, monkeypatch):
    model, timer = make_zoo_model("llama"), FakeTimer()
    first = calibrate.calibrate(model, ["panels", "onednn"], timer=timer)
    timed = len(timer.calls)
    assert timed and not first.cached and first.path.startswith(str(cache / "calibration"))
    again = calibrate.calibrate(model, ["panels", "onednn"], timer=timer)
    assert len(timer.calls) == timed and again.cached and again.figures == first.figures
    assert "(cached)" in again.reason
    # another workload mix is a new choice from the same figures, not a new timing
    calibrate.calibrate(model, ["panels", "onednn"], Workload(prompt_per_generated=0.0), timer=timer)
    assert len(timer.calls) == timed
    # another CPU, another torch, another dtype, other candidates: timed again
    monkeypatch.setattr(calibrate, "cpu_id", lambda: {"model": "Some Xeon", "flags": ["avx512f", "amx_tile"]})
    calibrate.calibrate(model, ["panels", "onednn"], timer=timer)
    assert len(timer.calls) == 2 * timed
    monkeypatch.setattr(torch, "__version__", "99.0")
    calibrate.calibrate(model, ["panels", "onednn"], timer=timer)
    assert len(timer.calls) == 3 * timed
    calibrate.calibrate(model, ["panels", "onednn", "aten"], timer=timer)
    assert len(timer.calls) > 3 * timed
    n = len(timer.calls)
    calibrate.calibrate(model, ["panels", "onednn", "aten"], timer=timer)
    assert len(timer.calls) == n
    monkeypatch.setenv("SVRMAD_CALIBRATE", "again")  # time again, overwriting the cached figures
    calibrate.calibrate(model, ["panels", "onednn", "aten"], timer=timer)
    assert len(timer.calls) > n
    monkeypatch.setenv("SVRMAD_CALIBRATE", "on")
    monkeypatch.setattr(calibrate, "TIMING", "figures taken some other way")  # how they were timed is in the key
    calibrate.calibrate(model, ["panels", "onednn", "aten"], timer=timer)
    assert len(timer.calls) == n + 2


@pytest.mark.parametrize("damage", ["{not json", '{"key": 1}', "", "BAD_FIGURES"])
def test_an_unreadable_cache_file_is_said_in_one_line_and_rewritten(cache, caplog, damage):
    model, timer = make_zoo_model("llama"), FakeTimer()
    first = calibrate.calibrate(model, ["panels", "onednn"], timer=timer)
    timed = len(timer.calls)
    path = cache / "calibration" / first.path.rpartition("/")[2]
    if damage == "BAD_FIGURES":
        data = json.loads(path.read_text())
        data["figures"]["decode"]["panels"] = {"1": "fast"}
        damage = json.dumps(data)
    path.write_text(damage)
    with caplog.at_level(logging.INFO, logger="svrmad_local"):
        again = calibrate.calibrate(model, ["panels", "onednn"], timer=timer)
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    if damage != '{"key": 1}':  # a file for another key is simply not ours
        assert len(warned) == 1 and "ignoring the unreadable linear calibration" in warned[0].getMessage()
    assert len(timer.calls) == 2 * timed and not again.cached and again.figures == first.figures
    assert json.loads(path.read_text())["figures"] == first.figures  # rewritten


def test_an_unwritable_cache_dir_costs_a_line_not_the_run(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SVRMAD_CACHE", str(blocker))  # a file where the folder should be
    with caplog.at_level(logging.WARNING, logger="svrmad_local"):
        cal = calibrate.calibrate(make_zoo_model("llama"), ["panels", "onednn"], timer=FakeTimer())
    assert cal.choice in ("panels", "onednn") and "could not save the linear calibration" in caplog.text


def test_a_failed_timing_is_one_line_and_the_fixed_rule(cache, caplog):
    def broken(*a, **k):
        raise RuntimeError("could not create a primitive")

    with caplog.at_level(logging.WARNING, logger="svrmad_local"):
        cal = calibrate.calibrate(make_zoo_model("llama"), ["onednn", "panels"], timer=broken)
    assert cal.choice == "panels" and "not measured (could not create a primitive)" in cal.reason
    assert "the linear calibration failed" in caplog.text and not (cache / "calibration").exists()


@needs_both
def test_auto_packs_the_measured_backend_and_says_tokens_may_then_differ(cache, monkeypatch):
    monkeypatch.setenv("SVRMAD_CALIBRATE", "again")  # each fake machine below is timed, not read from the cache
    onednn_wins = dict(PER_CALL, panels=lambda k, n, m: 5.0 + 0.05 * m)
    monkeypatch.setattr(calibrate, "time_step", FakeTimer(onednn_wins))
    model = make_zoo_model("llama")
    what = select_linear(model, "auto").line
    assert what.startswith("oneDNN packed") and "--linear panels computes the same tokens on every machine" in what
    assert calibrate.recorded(model).choice == "onednn"
    mods = [m for m in model.modules() if isinstance(m, (PackedLinear, FusedPart))]
    assert mods and all((m.group.layout if isinstance(m, FusedPart) else m.layout) is ONEDNN for m in mods)
    monkeypatch.setattr(calibrate, "time_step", FakeTimer())
    model = make_zoo_model("llama")
    what = select_linear(model, "auto").line
    assert what.startswith("panels") and "tokens may differ" not in what and "measured on this machine" in what
    assert next(m for m in model.modules() if isinstance(m, PackedLinear)).layout is PANELS
    monkeypatch.setattr(calibrate, "time_step", FakeTimer(dict(PER_CALL, aten=lambda k, n, m: 0.01)))
    model = make_zoo_model("llama")
    assert select_linear(model, "auto").line.startswith("aten (F.linear), measured on this machine")
    assert any(type(m) is torch.nn.Linear for m in model.modules())


def test_an_explicit_backend_or_calibrate_off_never_times(cache, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("timed")

    monkeypatch.setattr(calibrate, "time_step", refuse)
    for backend in ("panels", "onednn", "aten"):
        if backend == "panels" and not cpu_linear.available():
            continue
        model = make_zoo_model("llama")
        select_linear(model, backend)
        assert calibrate.recorded(model) is None
    half = make_zoo_model("llama").to(torch.float16)  # one backend can run: nothing to choose between
    assert "packing is off" in select_linear(half, "auto").line
    monkeypatch.setenv("SVRMAD_CALIBRATE", "0")
    model = make_zoo_model("llama")
    assert select_linear(model, "auto").line.startswith("panels" if cpu_linear.available() else "oneDNN")
    assert calibrate.recorded(model) is None


@needs_both
def test_engine_info_carries_the_choice_and_its_figures(cache, monkeypatch):
    monkeypatch.setattr(calibrate, "time_step", FakeTimer())
    eng = Engine(make_zoo_model("llama"), None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4, max_num_seqs=16,
                                                                   max_num_batched_tokens=256))
    try:
        info = eng.info["linear_calibration"]
        assert info["choice"] == "panels" and eng.info["linear"].startswith("panels")
        assert info["workload"]["decode_rows"] == [1, 2, 16] and info["workload"]["prefill_rows"] == [64, 256]
        assert set(info["figures"]["decode"]) == {"panels", "onednn", "aten"}
        assert set(info["figures"]["prefill"]["onednn"]) == {"64", "256"}
        assert info["cost_ms_per_token"]["panels"] < info["cost_ms_per_token"]["onednn"]
        json.dumps(eng.info)  # run.json stores engine.info as it is
    finally:
        eng.close()
    eng = Engine(make_zoo_model("llama"), None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4, linear="panels"))
    try:
        assert eng.info["linear_calibration"] is None
    finally:
        eng.close()


def test_a_refused_model_is_refused_before_any_timing(cache, monkeypatch):
    """The engine inspects the model before it calibrates the linears: a model it cannot run is
    refused in one line without paying for (or caching) a calibration first."""
    from svrmad_local.engine.engine import Engine, EngineConfig
    from svrmad_local.engine.spec import UnsupportedModel

    from .model_zoo import REFUSED

    def refuse(*a, **k):
        raise AssertionError("timed before the model was inspected")

    monkeypatch.setattr(calibrate, "time_step", refuse)
    name = sorted(REFUSED)[0]
    with pytest.raises(UnsupportedModel, match=REFUSED[name]):
        Engine(make_zoo_model(name), None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4))


class Quiet:
    """calibrate.LOAD for a machine with nothing else running."""

    def share(self):
        return 0.0


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """The fake timings are a formula: what the shared test machine does meanwhile must not decide
    whether they are cached (the tests of the load check below say otherwise)."""
    monkeypatch.setattr(calibrate, "LOAD", Quiet)


def test_the_cache_dir_of_the_run_holds_the_calibration(cache, tmp_path, monkeypatch):
    """--cache-dir (EngineConfig.cache_dir) moves the calibration with the model, away from $SVRMAD_CACHE."""
    from svrmad_local.job.flags import add_run_arguments, from_args
    import argparse

    ap = argparse.ArgumentParser()
    add_run_arguments(ap)
    cfg = from_args(ap.parse_args(["--cache-dir", str(tmp_path / "elsewhere")]))
    assert cfg.engine.cache_dir == str(tmp_path / "elsewhere")
    monkeypatch.setattr(calibrate, "time_step", FakeTimer())
    if not (torch.backends.mkldnn.is_available() and cpu_linear.available()):
        pytest.skip("needs two backends to calibrate between")
    eng = Engine(make_zoo_model("llama"), None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4,
                                                             cache_dir=str(tmp_path / "elsewhere")))
    try:
        path = eng.info["linear_calibration"]["cache_file"]
    finally:
        eng.close()
    assert path.startswith(str(tmp_path / "elsewhere" / "calibration")) and (tmp_path / "elsewhere" / "calibration").is_dir()
    assert not (cache / "calibration").exists()


@pytest.mark.parametrize("value", ["banana", "2", "onn"])
def test_an_unknown_calibrate_setting_is_refused_in_one_line(monkeypatch, value):
    monkeypatch.setenv("SVRMAD_CALIBRATE", value)
    with pytest.raises(calibrate.CalibrationSettingError, match=f"SVRMAD_CALIBRATE='{value}' means nothing: use on "
                                                                r"\(1, true, yes\), off \(0, false, no\) or again"):
        calibrate.setting()
    for spelled, meant in (("ON", "on"), (" yes ", "on"), ("1", "on"), ("False", "off"), ("again", "again")):
        monkeypatch.setenv("SVRMAD_CALIBRATE", spelled)
        assert calibrate.setting() == meant


@pytest.mark.parametrize("bad", ["Infinity", "NaN", "-Infinity", "1e999"])
def test_a_cached_figure_that_is_not_finite_is_timed_again(cache, caplog, bad):
    model, timer = make_zoo_model("llama"), FakeTimer()
    first = calibrate.calibrate(model, ["panels", "onednn"], timer=timer)
    path = cache / "calibration" / first.path.rpartition("/")[2]
    text = path.read_text()
    value = json.loads(text)["figures"]["decode"]["panels"]["1"]
    path.write_text(text.replace(json.dumps(value), bad, 1))
    with caplog.at_level(logging.WARNING, logger="svrmad_local"):
        again = calibrate.calibrate(model, ["panels", "onednn"], timer=timer)
    assert not again.cached and again.figures == first.figures and "unreadable linear calibration" in caplog.text
    json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} written back"))
    json.dumps(again.as_dict(), allow_nan=False)  # what run.json stores is standard JSON


def test_figures_that_are_not_finite_are_never_cached(cache, caplog):
    inf = dict(PER_CALL, onednn=lambda k, n, m: float("inf"))
    with caplog.at_level(logging.WARNING, logger="svrmad_local"):
        cal = calibrate.calibrate(make_zoo_model("llama"), ["panels", "onednn"], timer=FakeTimer(inf))
    assert cal.choice == "panels" and "not measured" in cal.reason and not (cache / "calibration").exists()


def test_figures_timed_on_a_busy_machine_choose_but_are_not_cached(cache, monkeypatch, caplog):
    class Busy:
        def share(self):
            return 0.5  # other processes had half the machine while it was timed

    monkeypatch.setattr(calibrate, "LOAD", Busy)
    model, timer = make_zoo_model("llama"), FakeTimer()
    with caplog.at_level(logging.WARNING, logger="svrmad_local"):
        cal = calibrate.calibrate(model, ["panels", "onednn"], timer=timer)
    assert cal.figures and cal.choice == "panels" and cal.busy == 0.5 and cal.as_dict()["busy_share"] == 0.5
    assert "busy (50% of its CPU time went to other processes; not cached)" in cal.reason
    assert "timed while other processes took 50% of this machine's CPU time" in caplog.text
    assert not (cache / "calibration").exists()
    monkeypatch.setattr(calibrate, "LOAD", Quiet)
    timed = len(timer.calls)
    again = calibrate.calibrate(model, ["panels", "onednn"], timer=timer)  # timed again, quiet now: kept
    assert len(timer.calls) == 2 * timed and not again.cached and again.busy == 0.0
    assert calibrate.calibrate(model, ["panels", "onednn"], timer=timer).cached


def test_the_load_meter_sees_another_process_burn_a_cpu():
    """OtherLoad counts CPU time other processes took over its window (from /proc/stat, less ours)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not Path("/proc/stat").exists():
        pytest.skip("no /proc/stat")
    meter = calibrate.OtherLoad()
    burn = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass"])
    burn.wait()
    share = meter.share()
    assert share is not None and share >= 0.4 / (os.cpu_count() or 1)


def test_a_step_costs_what_the_figures_say_between_and_beyond_the_sizes_timed():
    f = figures(decode={"panels": {1: 10.0, 8: 24.0, 64: 136.0}}, prefill={"panels": {64: 128.0, 512: 896.0}})
    assert calibrate.step_ms(f, "panels", "decode", 1) == 10.0
    assert calibrate.step_ms(f, "panels", "decode", 4) == pytest.approx(10 + 14 * 3 / 7)
    assert calibrate.step_ms(f, "panels", "decode", 128) == pytest.approx(272.0)  # the largest's cost a row
    assert calibrate.step_ms(f, "panels", "prefill", 16) == 128.0  # fewer rows cost no less
    assert calibrate.step_ms(f, "panels", "prefill", 288) == pytest.approx(512.0)


def test_the_runs_own_steps_overturn_the_fixed_mix_at_a_recheck():
    """INTEL's figures: at the Workload's 5 prompt tokens a generated one oneDNN wins; a run of decode
    steps (the paper's long debates) wants the panels, and says so at the first recheck, not before."""
    cal = calibrate.Calibration("onednn", "test", INTEL, {}, Workload())
    mix = calibrate.RunMix(cal, "onednn")
    mix.add(0, 0)  # a step that ran nothing (every request rejected) is no step
    for step in range(1, calibrate.RECHECK[0] + 1):
        mix.add(0, 1 if step % 2 else 8)
        assert mix.better() == ("panels" if step == calibrate.RECHECK[0] else None), step
    record = mix.as_dict()
    assert record["steps"] == record["decode_steps"] == 32 and record["decode_rows"] == 16 * 9
    assert record["cost_ms"]["panels"] == pytest.approx(16 * 25 + 16 * 40)
    prefill_heavy = calibrate.RunMix(cal, "onednn")
    for _ in range(calibrate.RECHECK[0]):
        prefill_heavy.add(512, 0)
    assert prefill_heavy.better() is None  # the run agrees with the choice: nothing moves


@needs_both
def test_the_engine_moves_its_linears_when_its_steps_want_another_backend(cache, monkeypatch):
    """oneDNN chosen at build (prefill-heavy guess), a decode-heavy run: after the first recheck the engine
    repacks into panels between two steps, rebuilds our decoder forward, and stays token-exact against the
    cache-free reference on the same (now panel) linears."""
    from .model_zoo import loop_greedy, rand_prompt

    decode_cheap_on_panels = dict(PER_CALL, panels=lambda k, n, m: 0.2 + 0.1 * m, onednn=lambda k, n, m: 1.0 + 0.001 * m)
    monkeypatch.setattr(calibrate, "time_step", FakeTimer(decode_cheap_on_panels))
    model = make_zoo_model("llama")
    eng = Engine(model, None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4, max_num_seqs=8,
                                           max_num_batched_tokens=64))
    try:
        assert eng.info["linear"].startswith("oneDNN packed")
        params = SamplingParams(temperature=0, max_tokens=calibrate.RECHECK[0] + 4, ignore_eos=True)
        eng.generate_sync([rand_prompt(5, 1)], params)
        run = eng.info["linear_calibration"]["run"]
        assert [s["to"] for s in run["switches"]] == ["panels"] and run["switches"][0]["after_steps"] == 32
        from svrmad_local.kernels import cpu_stack

        if cpu_stack.available():  # the rebuilt decoder runs decode steps as one call over the new panels
            assert run["switches"][0]["decode_steps"] == "decode steps in one compiled call"
            assert eng.runner.decoder.stack is not None
        assert next(m for m in model.modules() if isinstance(m, PackedLinear)).layout is PANELS
        assert eng.runner.decoder is not None and eng.runner.lm_head is model.get_output_embeddings()
        prompts = [rand_prompt(n, 7 + n) for n in (3, 11)]
        out = eng.generate_sync(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        for p, o in zip(prompts, out):
            assert o.completions[0].token_ids == loop_greedy(model, p, 8)
        json.dumps(eng.info, allow_nan=False)
    finally:
        eng.close()
