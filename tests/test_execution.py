"""The one record of how an engine runs (engine/execution.py): built once, frozen, every aspect with a
value and a reason; what runs is what it says (the runner reads it, never recomputes); Engine.info and
run.json carry it; its one line names every fallback; a kernel that falls back after build shows up
beside it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from svrmad_local.engine import attention, choices, decoder, stack
from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.execution import Choice, Execution
from svrmad_local.engine.params import SamplingParams
from svrmad_local.job import run as run_mod
from svrmad_local.kernels import _backend, cpu_decode

from .model_zoo import loop_greedy, make_zoo_model, rand_prompt

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def engine(model, **kw):
    kw.setdefault("kv_cache_memory", 4 * 2**20)
    kw.setdefault("block_size", 4)
    return Engine(model, None, EngineConfig(**kw))


def test_the_record_is_frozen_and_every_aspect_has_a_value_and_a_reason():
    eng = engine(make_zoo_model("llama"))
    ex = eng.execution
    names = [f.name for f in dataclasses.fields(Execution) if f.name != "attention_paths"]
    assert [c.name for c in ex.choices()] == names
    assert {"attention", "decode", "prefill", "linear", "decoder", "graphs", "quantization", "tp", "cascade",
            "stats"} <= set(names)
    for c in ex.choices():
        assert isinstance(c, Choice) and c.value and c.reason, c
    for obj, attr in ((ex, "decode"), (ex.decode, "value"), (ex.attention_paths, "decode")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, attr, None)
    assert eng.runner.paths is ex.attention_paths  # the runner reads the record's switches
    info = eng.info
    assert info["execution"] == ex.as_dict() and set(info["execution"]) == set(names)
    # the keys older readers take (job/run.py, benchmarks, the tests) are the record's, said as before
    assert info["attention"] == ex.attention_paths.summary and info["linear"] == ex.linear.reason
    assert info["decoder"] == str(ex.decoder) and info["cuda_graphs"] == f"off: {ex.graphs.reason}"
    eng.close()


@pytest.mark.skipif(not cpu_decode.available(), reason=f"no CPU decode kernel: {cpu_decode.unavailable_reason()}")
def test_what_runs_is_what_the_record_says(monkeypatch):
    """A decode path forced into the record at build is the one the steps take: the runner does not
    choose again from the config or the machine."""
    calls = []
    real = attention.paged_decode_cpu
    for module in (attention, decoder):  # our decoder calls the kernel itself in decode-only steps
        monkeypatch.setattr(module, "paged_decode_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    stacked = stack.Stack.__call__  # or, its layers in one compiled call, the stack calls it (engine/stack.py)
    monkeypatch.setattr(stack.Stack, "__call__", lambda *a: calls.append(1) or stacked(*a))
    model = make_zoo_model("llama")
    prompt = rand_prompt(11, 3)
    want = loop_greedy(model, prompt, GREEDY.max_tokens)

    plain = engine(model)
    assert plain.execution.decode.value == "in place:cpu"
    assert plain.generate_sync(prompt, GREEDY)[0].completions[0].token_ids == want and calls
    plain.close()

    choose = choices.choose_attention

    def gather_instead(*args):
        paths, made = choose(*args)
        return (dataclasses.replace(paths, decode=None),
                {**made, "decode": Choice("decode", "gather", "forced by the test")})

    monkeypatch.setattr(choices, "choose_attention", gather_instead)
    calls.clear()
    forced = engine(model)
    assert forced.execution.decode.value == "gather" and forced.execution.attention_paths.inplace_decode == "cpu"
    assert forced.generate_sync(prompt, GREEDY)[0].completions[0].token_ids == want
    assert not calls  # the kernel exists and the config allows it, but the record said gather
    forced.close()


def test_the_start_line_names_a_missing_compiler(monkeypatch):
    """The CPU kernels fall back when they cannot be built (kernels/_cpu_build): the decode kernel's and
    the fused ops' reasons are in the record, flagged as fallbacks, and in its one line (our decoder then
    runs the fused ops' torch references)."""
    monkeypatch.setattr(cpu_decode, "available", lambda: False)
    monkeypatch.setattr(cpu_decode, "unavailable_reason", lambda: "no C++ compiler (c++ is not on PATH)")
    monkeypatch.setenv("SVRMAD_CPU_OPS", "0")
    eng = engine(make_zoo_model("llama"))
    ex = eng.execution
    assert ex.decode.value == "gather" and ex.decode.fell_back
    assert ex.decoder.value == "ours" and ex.decoder.fell_back
    line = ex.line()
    assert line.startswith("engine: cpu fp32 (") and "\n" not in line
    assert "decode gather: the compiled CPU decode kernel is unavailable: no C++ compiler (c++ is not on PATH)" in line
    assert "decoder ours: llama, engine/decoder.py; fused ops: torch reference (the fused CPU ops are unavailable: " \
           "SVRMAD_CPU_OPS=0)" in line
    assert eng.info["execution"]["decode"]["fell_back"] is True
    eng.close()
    asked = engine(make_zoo_model("llama"), attention="sdpa", decoder="modules")  # asked for: no fallback
    assert asked.execution.decode.value == "gather" and "fell back" not in asked.execution.line()
    asked.close()


def test_a_kernel_that_falls_back_after_build_shows_beside_the_record(monkeypatch):
    monkeypatch.setattr(_backend, "_disabled", {})  # the process's fallbacks, fresh for this test
    eng = engine(make_zoo_model("llama"))
    before = eng.execution
    assert eng.info["fallbacks"] == []
    with pytest.warns(RuntimeWarning, match="token_stats"):
        _backend.fall_back("token_stats", RuntimeError("compile error (injected)"), "auto")
    info = eng.info
    assert len(info["fallbacks"]) == 1 and info["fallbacks"][0].startswith("token_stats: Triton failed")
    assert "compile error (injected)" in info["fallbacks"][0]
    assert eng.execution is before and info["execution"] == before.as_dict()  # the build's record stays as built
    eng.close()


def test_run_json_keeps_every_ranks_fallbacks():
    ranks = [{"engine": {"steps": 2, "fallbacks": ["b"], "execution": {"tp": {"value": "off"}}}},
             {"engine": {"steps": 3, "fallbacks": ["a", "b"], "execution": {"tp": {"value": "off"}}}}]
    out = run_mod._sum_engines(ranks)
    assert out["steps"] == 5 and out["fallbacks"] == ["a", "b"] and out["execution"] == {"tp": {"value": "off"}}


def test_linear_fallback_is_said_by_select_linear_not_parsed():
    """select_linear says what it chose as a Selection: "auto" on a CPU that cannot pack fell back; an
    explicit aten did not; on a GPU F.linear is the path itself, not a fallback."""
    from svrmad_local.models import linear as linear_mod

    half = make_zoo_model("llama").half()  # neither panels nor oneDNN packs fp16: auto falls back
    off = linear_mod.select_linear(half, "auto")
    assert off.value == "aten" and off.fell_back and "packing is off: torch.float16 weights" in off.line
    asked = linear_mod.select_linear(make_zoo_model("llama"), "aten")
    assert asked.value == "aten" and not asked.fell_back
    gpu = linear_mod.select_linear(make_zoo_model("llama").to("meta"), "auto")  # off the CPU, as on cuda
    assert gpu.value == "aten" and not gpu.fell_back and gpu.line == "aten (F.linear): weights on meta"


def test_the_gpu_choices_and_their_reasons_are_decided_from_the_device(monkeypatch):
    """choose_attention for a CUDA device (no GPU needed: it reads the device type and what is installed):
    Triton reads decode and prefill in place; with its decode kernel turned off under "auto" (a runtime
    fallback in an earlier engine of the process) the gather is recorded as a fallback, saying why."""
    from svrmad_local import kernels
    from svrmad_local.engine.choices import choose_attention

    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    eng = engine(make_zoo_model("llama"))
    spec = eng.spec
    eng.close()
    cuda = torch.device("cuda")
    paths, choices = choose_attention("auto", "auto", "auto", "absorbed", cuda, torch.bfloat16, spec, 16)
    assert (paths.decode, paths.prefill_in_place, paths.flash) == ("triton", True, False)  # blocks of 16: ours, not flash-attn
    assert choices["decode"].value == "in place:triton" and choices["prefill"].value == "in place:triton"
    monkeypatch.setattr(_backend, "_disabled", {"paged_decode": "RuntimeError('injected')"})
    paths, choices = choose_attention("auto", "auto", "auto", "absorbed", cuda, torch.bfloat16, spec, 16)
    assert paths.decode is None and choices["decode"].fell_back and choices["prefill"].fell_back
    assert choices["decode"].reason.startswith("Triton's decode kernel failed earlier")
    paths, choices = choose_attention("auto", "auto", "torch", "absorbed", cuda, torch.bfloat16, spec, 16)
    assert paths.decode is None and not choices["decode"].fell_back  # kernel_impl='torch' asked for it
    monkeypatch.setenv(_backend.FORCE_ENV, "torch")
    paths, choices = choose_attention("auto", "auto", "auto", "absorbed", cuda, torch.bfloat16, spec, 16)
    assert paths.decode is None and choices["decode"].reason == f"{_backend.FORCE_ENV}=torch"
    assert not choices["decode"].fell_back


def test_build_returns_a_frozen_record_of_what_it_built():
    """The engine keeps what build made as one record and reads it: nothing of it is an attribute the build
    wrote onto the engine, and assigning to the record (or its KV budget) raises."""
    from svrmad_local.engine.build import Built

    eng = engine(make_zoo_model("llama"))
    built = eng.built
    assert isinstance(built, Built) and built.runner.cache is built.cache and built.execution is eng.execution
    for obj, attr in ((built, "runner"), (built, "cache"), (built, "execution"), (built, "max_model_len"),
                      (built.budget, "bytes"), (built.budget, "graph_reserve")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, attr, None)
    written = {"spec", "cache", "runner", "blocks", "execution", "kv_budget_bytes", "block_bytes", "graph_reserve",
               "tp_group", "sharded", "rank", "_channel", "_watch", "weight_bytes", "linear_calibration"}
    assert not written & set(vars(eng)), written & set(vars(eng))
    assert eng.runner.decoder is not None and eng.runner.static is None and eng.runner.tp is None  # from its constructor
    eng.close()


# every function that makes an execution choice, by the names modules call it under (today's and older ones)
CHOOSERS = ("choose_attention", "choose_flash", "_cascade_enabled", "flash_takes_block_table", "stats_choice",
            "quantization_choice", "graphs_choice", "static_decode", "record", "select_impl", "select_decoder",
            "select_linear", "why_off", "threads_choice")


def test_no_step_makes_an_execution_choice(monkeypatch):
    """After build every choosing function raises, and the steps still run: a prefill and decode steps of
    two samples attending through the cascade (whose plan once asked the kernel choice again in every
    step), the token statistics of a scoring request, and Engine.info (whose statistics path once did)."""
    import sys

    model = make_zoo_model("llama")
    prompt = rand_prompt(13, 5)
    want = loop_greedy(model, prompt, GREEDY.max_tokens)
    eng = engine(model, cascade="on", linear="aten")
    assert eng.execution.attention_paths.cascade == "torch"

    def chose(*args, **kwargs):
        raise AssertionError("an execution choice was made after build")

    for name, module in list(sys.modules.items()):
        if name.startswith("svrmad_local.") and module is not None:
            for attr in CHOOSERS:
                if callable(getattr(module, attr, None)):
                    monkeypatch.setattr(module, attr, chose)
    two = dataclasses.replace(GREEDY, n=2)
    out = eng.generate_sync(prompt, two)[0]
    assert [c.token_ids for c in out.completions] == [want, want]
    scored = eng.score_sync(prompt, want)
    assert len(scored.logprobs) == len(want) and scored.logprobs == pytest.approx(out.completions[0].logprobs, abs=1e-4)
    info = eng.info
    assert info["stats"] == "kernels:" + eng.execution.stats.value and info["execution"] == eng.execution.as_dict()
    eng.close()


def test_info_reads_the_record():
    """Engine.info says what the record holds, not what it would choose now: a record changed under the
    engine shows in info."""
    eng = engine(make_zoo_model("llama"))
    ex = eng.execution
    said = dataclasses.replace(ex, stats=Choice("stats", "recorded", "by the test"),
                               graphs=Choice("graphs", "off", "the record says so"))
    eng.built = dataclasses.replace(eng.built, execution=said)
    info = eng.info
    assert info["stats"] == "kernels:recorded" and info["cuda_graphs"] == "off: the record says so"
    assert info["execution"]["stats"] == {"value": "recorded", "reason": "by the test", "fell_back": False}
    eng.close()
