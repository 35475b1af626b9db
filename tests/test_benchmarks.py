"""The benchmark scripts' own logic: the shared debate workload, the vLLM worker protocol (against a
fake vllm package), the decode-limit arithmetic and the bf16 drift summary."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_bf16_drift import drift  # noqa: E402
from bench_decode import kv_bytes_per_token, weight_bytes_per_step  # noqa: E402
from bench_engine import DebateWorkload, QuestionRun, check_runs, prefill_lower_bound, run_engine  # noqa: E402
from bench_vs_vllm import VllmWorker, engine_once, run_vllm, vllm_once, vllm_unavailable  # noqa: E402

from svrmad_local.engine.engine import Engine, EngineConfig  # noqa: E402
from svrmad_local.engine.sequence import ScoreOutput, Usage  # noqa: E402
from svrmad_local.engine.stats import sequence_signals  # noqa: E402
from svrmad_local.models.chat import ChatFormat  # noqa: E402

from .conftest import make_model  # noqa: E402

QUESTIONS = ["What is 2 + 3?", "Janet has 16 eggs and sells them for $2 each."]


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def workload(tok) -> DebateWorkload:
    return DebateWorkload(ChatFormat(tok), QUESTIONS, n=3, receivers=2, S=2, initial_tokens=6, debate_tokens=5)


def test_engine_runs_the_workload_at_the_prefill_lower_bound(tiny_model, tiny_tokenizer):
    wl = workload(tiny_tokenizer)
    engine = Engine(tiny_model, tiny_tokenizer, EngineConfig(block_size=4, max_num_seqs=64))
    _, runs = run_engine(engine, wl)
    assert check_runs(runs, wl, "engine") == wl.expected_generated == 2 * (3 * 6 + 4 * 5)
    assert [len(r.debate_prompts) for r in runs] == [4, 4]
    # receiver r's debates with senders r+1, r+2 carry both answers' tokens as generated
    run = runs[0]
    for j, (r, sender) in enumerate([(0, 1), (0, 2), (1, 2), (1, 0)]):
        assert contains(run.debate_prompts[j], run.answers[r][:-1]) and contains(run.debate_prompts[j], run.answers[sender][:-1])
    assert engine.totals.computed_tokens == prefill_lower_bound(runs)


def test_each_timed_engine_run_starts_cold_after_a_warm_up(tiny_model, tiny_tokenizer):
    wl = workload(tiny_tokenizer)
    lm = SimpleNamespace(model=tiny_model, tokenizer=tiny_tokenizer)
    first, second = engine_once(lm, wl, 4), engine_once(lm, wl, 4)
    assert first["computed"] == first["lower_bound"] == second["computed"]  # nothing reused across runs
    assert first["generated"] == wl.expected_generated


def test_check_runs_names_a_response_of_the_wrong_length(tiny_tokenizer):
    wl = workload(tiny_tokenizer)
    run = QuestionRun([1, 2], answers=[[5] * 6] * 3, replies=[[5] * 5] * 3 + [[5] * 4])
    with pytest.raises(SystemExit, match="vLLM: question 0 produced response lengths"):
        check_runs([run], wl, "vLLM")


def test_prefill_lower_bound_counts_unique_prefixes():
    run = QuestionRun([1, 2, 3], answers=[[4, 5, 6], [4, 7, 8]],
                      debate_prompts=[[1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 5, 9, 10], [1, 2, 3]])
    # 3 prompt tokens; the answers' KV covers [1,2,3,4,5] and [1,2,3,4,7]; debates add 9, then 10,
    # and a fully cached prompt still computes its last token
    assert prefill_lower_bound([run]) == 3 + 1 + 1 + 1


def test_vllm_unavailable_says_why(tmp_path, monkeypatch):
    assert vllm_unavailable(None) == "no --vllm-python given"
    assert "does not exist" in vllm_unavailable(str(tmp_path / "python"))
    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "vllm.py").write_text("raise ImportError('broken build')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    assert "cannot import vllm (ImportError: broken build)" in vllm_unavailable(sys.executable)


FAKE_VLLM = '''
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, n=1, max_tokens=16, ignore_eos=False, seed=None, temperature=1.0, top_p=1.0, top_k=0, logprobs=None):
        self.n, self.max_tokens, self.ignore_eos, self.seed = n, max_tokens, ignore_eos, seed

class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)

class LLM:
    def __init__(self, model, **kw):
        assert kw["enable_prefix_caching"] and kw["disable_log_stats"] is False
        self.prompt_tokens = self.generated = 0

    def generate(self, prompts, params, use_tqdm=True):
        outs = []
        for p, sp in zip(prompts, params):
            ids = p["prompt_token_ids"]
            # the full length only when asked to ignore EOS with a seed, as the benchmark does
            length = sp.max_tokens if sp.ignore_eos and sp.seed is not None else 1
            samples = [_Obj(index=j, token_ids=[(sum(ids) + 7 * j + k) % 50 + 10 for k in range(length)]) for j in range(sp.n)]
            self.prompt_tokens += len(ids) * sp.n
            self.generated += length * sp.n
            outs.append(_Obj(outputs=samples[::-1], prompt_token_ids=ids, num_cached_tokens=0))
        return outs

    def get_metrics(self):
        return [_Obj(name="vllm:prompt_tokens", value=self.prompt_tokens, labels={}),
                _Obj(name="vllm:prompt_tokens_by_source", value=self.prompt_tokens, labels={"source": "local_compute"}),
                _Obj(name="vllm:generation_tokens", value=self.generated, labels={})]

    def reset_prefix_cache(self):
        return True
'''


def test_vllm_worker_runs_both_phases_through_a_fake_vllm(tmp_path, tiny_tokenizer, monkeypatch):
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (pkg / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    wl = workload(tiny_tokenizer)
    worker = VllmWorker(sys.executable, {"model": "m"}, preload="none")
    try:
        assert worker.ready["vllm"] == "0.0-fake"
        _, runs, stats = run_vllm(worker, wl, seeded=True, logprobs=0)
        again = vllm_once(worker, wl, seeded=True, logprobs=0)  # resets the prefix cache, checks the counts
    finally:
        worker.close()
    assert worker.proc.returncode == 0
    assert check_runs(runs, wl, "vLLM") == stats["generated"] == again["generated"] == wl.expected_generated
    prompt_tokens = sum(3 * len(r.prompt) + sum(len(d) for d in r.debate_prompts) for r in runs)
    assert stats["prompt_tokens"] == stats["computed"] == again["computed"] == prompt_tokens
    assert again["lower_bound"] == prefill_lower_bound(runs)
    for qi, run in enumerate(runs):  # samples in index order; debates built from vLLM's own answers
        assert run.answers[1][0] == (sum(run.prompt) + 7) % 50 + 10
        assert run.debate_prompts == wl.debate_prompts(qi, run.answers)
    with pytest.raises(SystemExit, match="vLLM: question 0"):  # without seeds the fake stops early
        worker = VllmWorker(sys.executable, {"model": "m"}, preload="none")
        try:
            _, runs, _ = run_vllm(worker, wl, seeded=False, logprobs=0)
        finally:
            worker.close()
        check_runs(runs, wl, "vLLM")


def test_weight_bytes_read_per_decode_step(tiny_model):
    emb = tiny_model.get_input_embeddings().weight
    total = sum(p.numel() * 4 for p in tiny_model.parameters())
    assert weight_bytes_per_step(tiny_model) == total - emb.numel() * 4  # untied: B embedding rows only
    tied = make_model("llama", vocab=400)
    tied.lm_head.weight = tied.model.embed_tokens.weight  # one tensor: read in full as the LM head
    assert weight_bytes_per_step(tied) == sum(p.numel() * 4 for p in tied.parameters())
    cfg = tiny_model.config  # 2 layers, 2 KV heads of 16 dims
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 2 * 2 * 16 * 2


def test_host_share_counts_the_steps_that_sample_inside_and_what_runs_around_their_forward(tiny_model):
    from bench_decode import HostShare

    from svrmad_local.engine.params import SamplingParams

    engine = Engine(tiny_model, None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4, cuda_graphs="static"))
    try:
        host = HostShare(engine)
        t0 = time.perf_counter()
        engine.generate_sync([[5, 6, 7], [8, 9, 10, 11]], SamplingParams(max_tokens=6, seed=1, ignore_eos=True))
        wall_ms = 1e3 * (time.perf_counter() - t0)
        steps = host.steps
        ms = host.take()
    finally:
        engine.close()
    assert steps == 5  # the prefill step samples after its forward: left out; the five decode steps in
    assert 0 < ms * steps < wall_ms and host.take() is None


def test_linears_seconds_times_every_projection_and_the_lm_head(tiny_model, monkeypatch):
    import threading

    import bench_decode

    shapes, threads = [], []

    def fake_best_of(fn, repeat, device=None):
        threads.append(threading.current_thread().name)
        shapes.extend(tuple(y.shape) for y in fn())
        return 1.0

    monkeypatch.setattr(bench_decode, "best_of", fake_best_of)
    engine = Engine(tiny_model, None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4))
    try:
        assert bench_decode.linears_seconds(engine, rows=3) == 1.0
    finally:
        engine.close()
    assert threads and all(t.startswith("svrmad-engine") for t in threads)  # timed where the steps run
    # q k v o gate up down per layer, and the LM head: every output row once, as 15 GEMMs, or as 9 where
    # the engine packed the model with its siblings fused (q/k/v and gate/up one GEMM)
    c = tiny_model.config
    per_layer = 2 * c.hidden_size + 2 * c.num_key_value_heads * c.head_dim + 2 * c.intermediate_size + c.hidden_size
    assert sum(s[1] for s in shapes) == c.num_hidden_layers * per_layer + c.vocab_size
    assert len(shapes) in (2 * 7 + 1, 2 * 4 + 1)
    assert (3, 400) in shapes and all(s[0] == 3 for s in shapes)


def _scored(logprobs, entropies, top1):
    return ScoreOutput(logprobs, entropies, [[t] for t in logprobs], [[t] for t in top1],
                       sequence_signals(logprobs, entropies, [[t] for t in logprobs]), Usage())


def test_drift_summary():
    a = [_scored([-0.1, -2.0], [0.5, 1.0], [3, 4]), _scored([-0.5, -0.5], [0.2, 0.2], [5, 6])]
    assert drift(a, a, [[0, 1]])["token_logprob"]["max"] == 0.0
    b = [_scored([-0.1, -2.5], [0.5, 1.1], [3, 9]), _scored([-0.5, -0.5], [0.2, 0.2], [5, 6])]
    d = drift(a, b, [[0, 1]])
    assert d["tokens"] == 4 and d["responses"] == 2
    assert d["token_logprob"]["max"] == pytest.approx(0.5) and d["token_logprob"]["mean"] == pytest.approx(0.125)
    assert d["token_entropy"]["max"] == pytest.approx(0.1)
    assert d["top1_differs"] == 0.25
    assert d["min_ll"]["max"] == pytest.approx(0.5)
    # min-LL ranks response 1 (-0.5) above response 0 (-2.0, then -2.5): no change at the top
    assert d["priors"]["min_ll"]["top_response_changed"] == 0 and d["priors"]["min_ll"]["pair_order_flipped"] == 0
    c = [_scored([-0.1, -0.2], [0.5, 1.0], [3, 4]), a[1]]  # response 0 now the most likely
    assert drift(a, c, [[0, 1]])["priors"]["min_ll"]["top_response_changed"] == 1


def test_a_decode_step_dispatches_the_same_engine_ops_at_every_batch_size():
    """The eager path's bound: the ops outside the model body (the step's views,
    sampling, statistics) do not grow with the batch, and stay at most 100."""
    from bench_decode import host_ops

    from .model_zoo import make_zoo_model

    rows = host_ops(make_zoo_model("llama"), None, [1, 8, 32], block_size=4)
    assert [r["batch"] for r in rows] == [1, 8, 32]
    ops = {r["engine_ops"] for r in rows}
    assert len(ops) == 1 and 0 < ops.pop() <= 100, rows
    assert all(r["model_ops"] > 0 for r in rows)


def test_host_ops_counts_the_steps_overlap_schedules_ahead():
    """With overlap on (the static path, here run eagerly) the engine asks the scheduler for a step with
    arguments (admit, skip): the GPU check's host-ops step failed on them where overlap engages."""
    from bench_decode import host_ops

    from .model_zoo import make_zoo_model

    rows = host_ops(make_zoo_model("llama"), None, [1, 8], block_size=4,
                    overrides={"overlap": "on", "cuda_graphs": "static"})
    assert [r["batch"] for r in rows] == [1, 8] and all(r["engine_ops"] > 0 for r in rows), rows


def fake_svrmad_run(calls: list, computed: dict):
    """Stands in for bench_workload's `svrmad run` subprocess: writes the run.json a run would."""
    import json

    def run(cmd, env, capture_output, text, cwd):
        assert env["PYTHONPATH"].startswith(str(cwd))  # `python -m` puts cwd first: it must be the side's checkout
        calls.append((cmd, env["PYTHONPATH"]))
        kv = cmd[cmd.index("--kv-cache-memory") + 1] if "--kv-cache-memory" in cmd else "default"
        if kv == "bad":
            return SimpleNamespace(returncode=2, stdout="questions:  50%|#  | 1/2\rquestions: 100%|##| 2/2\ntrace: x\n",
                                   stderr="svrmad run: error: bad --kv-cache-memory\n")
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        engine = {"steps": 7, "prompt_tokens": 900, "computed_tokens": computed[kv], "evictions": 3}
        (out / "run.json").write_text(json.dumps({"totals": {"wall_s": 1.5, "engine": engine}}))
        return SimpleNamespace(returncode=0, stdout="", stderr="")
    return run


def test_bench_workload_runs_each_side_and_compares_it_with_the_first(tmp_path, monkeypatch, capsys):
    import json

    import bench_workload

    calls: list = []
    monkeypatch.setattr(bench_workload.subprocess, "run", fake_svrmad_run(calls, {"default": 400, "2GiB": 800}))
    ticks = iter([0.0, 10.0, 10.0, 30.0, 30.0, 35.0])  # the sides take 10, 20 and 5 s
    monkeypatch.setattr(bench_workload, "clock", lambda: next(ticks))
    ref = tmp_path / "ref"
    assert bench_workload.main(["--limit", "2", "--variant", "", "--variant", "--kv-cache-memory 2GiB",
                                "--ref", str(ref)]) == 0
    (a, pa), (b, pb), (c, pc) = calls
    assert "--kv-cache-memory" not in a and b[b.index("--kv-cache-memory") + 1] == "2GiB" and "--kv-cache-memory" not in c
    assert a[a.index("--limit") + 1] == "2" and a[a.index("--methods") + 1] == bench_workload.METHODS
    assert pa.startswith(str(bench_workload.HERE)) and pc.startswith(str(ref))  # each side imports its own checkout
    out = capsys.readouterr().out.splitlines()
    sides = json.loads(out[-1])["sides"]
    assert [s["wall_s"] for s in sides] == [10.0, 20.0, 5.0]
    assert [s["computed_tokens"] for s in sides] == [400, 800, 400] and sides[0]["evictions"] == 3
    assert out[3].endswith("| 1.00 |") and out[4].endswith("| 2.00 |") and out[5].endswith("| 0.50 |")


def test_bench_workload_names_a_failed_side_in_one_line(monkeypatch):
    import bench_workload

    monkeypatch.setattr(bench_workload.subprocess, "run", fake_svrmad_run([], {}))
    with pytest.raises(SystemExit, match=r"bad failed \(exit 2\): svrmad run: error: bad --kv-cache-memory$"):
        bench_workload.main(["--variant", "--kv-cache-memory bad"])


def tiny_run_inputs(tmp_path, tokenizer):
    """A tiny checkpoint and a two-question math dataset for a real `svrmad run`."""
    import json

    ck = tmp_path / "model"
    make_model("llama", vocab=len(tokenizer), seed=3).save_pretrained(ck)
    tokenizer.save_pretrained(ck)
    data = tmp_path / "qs.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"What is {i} + {i + 1}?", "gold": str(2 * i + 1),
                                        "answer_type": "math"}) + "\n" for i in range(2)))
    return ck, data


def test_prompt_tokens_records_a_run_and_replays_it_at_other_budgets(tmp_path, tiny_tokenizer):
    """The replay through the real scheduler reproduces the engine's computed tokens at the run's own
    budget, computes more at a budget too small for the workload, and the bound is never above either."""
    import json

    import prompt_tokens

    ck, data = tiny_run_inputs(tmp_path, tiny_tokenizer)
    trace, out = tmp_path / "trace.jsonl", tmp_path / "run"
    assert prompt_tokens.main(["record", str(trace), "--", "run", "--model", str(ck), "--dataset", str(data),
                               "--out", str(out), "--max-tokens", "8", "--block-size", "4", "--device", "cpu",
                               "--methods", "svr-mad,group-debate,s2-mad", "--kv-cache-memory", "4MiB"]) == 0
    engine = json.loads((out / "run.json").read_text())["totals"]["engine"]
    reqs = prompt_tokens.load(trace)
    assert len(reqs) > 2 and any(r["n"] > 1 for r in reqs), "initial answers and debates are logged"
    b = prompt_tokens.bound(reqs)
    assert b["computed"] == engine["computed_tokens"] and b["billed"] == engine["prompt_tokens"]
    assert b["bound"] <= b["computed"]
    same = prompt_tokens.replay(reqs, engine["kv_blocks"], block_size=4)
    assert same["computed"] == engine["computed_tokens"] and same["evictions"] == engine["evictions"]
    tight = prompt_tokens.replay(reqs, same["peak_blocks"] // 3, block_size=4)
    assert tight["computed"] > same["computed"] and tight["evictions"] > 0


def test_bench_gemv_step_shapes_are_the_engines_gemms_in_step_order():
    from bench_gemv import step_shapes

    config = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 3, "vocab_size": 500}
    shapes = step_shapes(config)
    assert shapes[:4] == [("qkv", 128, 64), ("o_proj", 64, 64), ("gate_up", 192, 64), ("down", 64, 96)]
    assert shapes[4:8] == shapes[:4] and len(shapes) == 3 * 4 + 1 and shapes[-1] == ("lm_head", 500, 64)
    model = make_model("llama", vocab=500)  # the same count of weights as its unfused linears
    c = model.config
    same = {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "head_dim": c.head_dim,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "num_hidden_layers": c.num_hidden_layers, "vocab_size": c.vocab_size}
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert sum(n * k for _, n, k in step_shapes(same)) == sum(m.weight.numel() for m in linears)


def test_step_profile_logs_every_engine_step_of_a_run(tmp_path, tiny_tokenizer, capsys):
    """Each engine step of the run is one line: their prompt tokens add up to what the engine computed
    and their count to its steps; the report splits prefill from decode-only steps and fits the latter."""
    import json

    import step_profile

    from svrmad_local.engine.runner import ModelRunner

    ck, data = tiny_run_inputs(tmp_path, tiny_tokenizer)
    log, out = tmp_path / "steps.jsonl", tmp_path / "run"
    execute = ModelRunner.execute
    assert step_profile.main(["--log", str(log), "--", "run", "--model", str(ck), "--dataset", str(data),
                              "--out", str(out), "--max-tokens", "8", "--block-size", "4", "--device", "cpu",
                              "--methods", "svr-mad,group-debate", "--kv-cache-memory", "4MiB",
                                  "--dtype", "fp32"]) == 0
    assert ModelRunner.execute is execute  # the runner is left as it was
    engine = json.loads((out / "run.json").read_text())["totals"]["engine"]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == engine["steps"]
    assert sum(r[1] for r in rows) == engine["computed_tokens"]
    assert all(r[6] >= r[5] for r in rows) and any(r[0] for r in rows)
    text = capsys.readouterr().out
    assert f"{len(rows)} steps over" in text and "decode-only steps:" in text and "steps with a prefill chunk:" in text


def test_profile_decode_reports_the_steps_it_profiled_and_the_host_ops_of_the_worker():
    """bench_decode --profile: the profiler starts on the engine's worker (started on the caller's
    thread it would record none of the step's ops); on the CPU no kernel is reported."""
    from bench_decode import profile_decode

    from .model_zoo import make_zoo_model

    engine = Engine(make_zoo_model("llama"), None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4))
    args = SimpleNamespace(new_tokens=5, prompt_tokens=6, greedy=True)
    prof = profile_decode(engine, 2, args, vocab=engine.model.get_output_embeddings().out_features)
    assert prof["batch"] == 2 and prof["steps"] == 6 and prof["wall_ms_per_step"] > 0
    assert prof["kernels_per_step"] == 0 and prof["top_kernels_ms_per_step"] == []
    assert prof["device_busy_ms_per_step"] == prof["kernel_ms_per_step"] == 0 and prof["skinny_linears"] == []
    names = [name for name, _, _ in prof["top_host_ms_per_step"]]
    assert any(n.startswith("aten::") for n in names), names


def test_the_profiles_skinny_kernels_are_told_apart_by_their_place_in_the_captured_step():
    """bench_decode --profile: a decode graph replays its captured launches in order, so the i-th skinny kernel
    of a step is the i-th call noted at capture; the window's last steps x calls kernels are the decode steps
    (a prefill's before them are left out), grouped by linear with their GB/s. Where a row count was captured
    twice (the build's probe, then the runner), the last capture's calls."""
    from bench_decode import CapturedLinears, per_linear

    qkv, o, down = (4096, 2048, "n32k256s1w4p5dot", "norm"), (2048, 2048, "n16k256s0w4p3", ""), \
        (2048, 6144, "n16k256s0w4p3", "silu")
    step = [qkv, o, down, qkv, o, down]
    captured = CapturedLinears()
    captured.captures = [[(1, *c) for c in step], [(8, *qkv)], [(1, *c) for c in step], []]  # 1 row: probe, runner
    assert captured.sequence(1) == step and captured.sequence(5) == [qkv] and captured.sequence(9) == []
    prefill = [99.0, 99.0]  # before the decode steps: not theirs
    steps = [10.0, 4.0, 16.0, 12.0, 6.0, 20.0]
    rows = per_linear(prefill + steps * 3, step, steps=3, itemsize=2)
    assert [(r["linear"], r["config"], r["launches_per_step"]) for r in rows] == [
        ("4096x2048 norm", qkv[2], 2), ("2048x2048", o[2], 2), ("2048x6144 silu", down[2], 2)]
    assert [r["us_per_launch"] for r in rows] == [11.0, 5.0, 18.0]
    assert rows[0]["gb_s"] == round(4096 * 2048 * 2 / 11.0 / 1e3, 1)
    assert per_linear(steps, [], steps=3, itemsize=2) == [] and per_linear([], [qkv], steps=3, itemsize=2) == []


def test_the_profiles_noted_call_passes_every_keyword_through(monkeypatch):
    """While the profile notes the skinny calls, the decoder's calls keep their keywords (the split-K shares
    left unsummed, the folded norm and its residual): the noted call is the kernel's own."""
    from bench_decode import CapturedLinears

    from svrmad_local.kernels import skinny

    seen = []
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a, **kw: seen.append((a, kw)) or "out")
    with CapturedLinears():
        assert skinny.skinny_linear("x", "w", None, "cfg", None, unsummed=True, norm="n", residual="r") == "out"
    assert seen == [(("x", "w", None, "cfg", None), {"unsummed": True, "norm": "n", "residual": "r"})]


def test_the_device_is_busy_while_some_kernel_runs_however_they_overlap():
    """With programmatic dependent launch a kernel starts, and waits, while the one before runs: the busy
    time is the union of the kernels' spans, not their sum; gaps between them count for nothing."""
    from bench_decode import covered

    assert covered([]) == 0
    assert covered([(0, 4), (2, 6), (3, 5)]) == 6  # overlapping: 0..6
    assert covered([(10, 12), (0, 4), (5, 6)]) == 7  # apart, in any order
    assert covered([(0, 10), (2, 3), (11, 12)]) == 11  # one inside another


def test_bench_decode_read_times_the_kernel_against_a_plain_read_and_another_revision(tmp_path, capsys, monkeypatch):
    import json

    import bench_decode_read

    from svrmad_local.kernels import cpu_decode

    if not cpu_decode.available():
        pytest.skip(f"no kernel: {cpu_decode.unavailable_reason()}")
    monkeypatch.setattr(bench_decode_read, "CASES", {"two": [40, 300]})
    same = tmp_path / "cpu_decode.cpp"
    same.write_text((Path(cpu_decode.__file__).parent / "csrc" / "cpu_decode.cpp").read_text())
    monkeypatch.setattr(sys, "argv", ["bench_decode_read.py", "--threads", "1", "--repeat", "1", "--layers", "2",
                                      "--against", str(same)])
    threads = torch.get_num_threads()
    bench_decode_read.main()
    assert torch.get_num_threads() == threads  # the tests after it keep theirs
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [(r["threads"], r["case"]) for r in rows] == [(1, "two")]
    assert all(rows[0][k] > 0 for k in ("kernel", "against", "sum"))
    assert rows[0]["same_bits"] is True  # the same source: the same bits


def test_bench_decode_read_reads_a_bf16_cache(capsys, monkeypatch):
    import json

    import bench_decode_read

    from svrmad_local.kernels import cpu_decode

    if not cpu_decode.available():
        pytest.skip(f"no kernel: {cpu_decode.unavailable_reason()}")
    monkeypatch.setattr(bench_decode_read, "CASES", {"one": [300]})
    monkeypatch.setattr(sys, "argv", ["bench_decode_read.py", "--threads", "1", "--repeat", "1", "--layers", "2",
                                      "--dtype", "bf16"])
    bench_decode_read.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["dtype"] == "bf16" and out["rows"][0]["kernel"] > 0


def test_bench_sampling_times_both_sides_and_checks_they_agree(capsys):
    """bench_sampling: each row's medians are of the alternating runs, and the two sides' bits agree (it
    exits otherwise)."""
    import json

    import bench_sampling

    from svrmad_local.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip(f"the compiled ops did not build: {cpu_ops.unavailable_reason()}")
    assert bench_sampling.main(["--batches", "1,3", "--vocabs", "5000", "--rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["vocab"], r["batch"]) for r in out["rows"]] == [(5000, 1), (5000, 3)]
    for r in out["rows"]:
        assert r["ratio"] == round(r["torch_ms"] / r["compiled_ms"], 2)
    assert os.environ.get("SVRMAD_CPU_OPS") is None  # the torch side's switch does not outlive it


def test_bench_sampling_on_a_gpu_is_refused_in_one_line_without_one():
    import bench_sampling

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(SystemExit, match="--device cuda needs a CUDA device"):
        bench_sampling.main(["--device", "cuda"])


def test_bench_memory_reports_the_pool_and_the_plans_estimate_on_the_cpu():
    """benchmarks/bench_memory.py (the GPU check's memory step) runs on the CPU over a tiny model: every
    sequence completes and the report carries the budget, the pool per device and the plan's estimate."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_memory

    from tests.conftest import make_model

    row = bench_memory.measure(make_model("llama"), None, sequences=3, prompt_tokens=40, new_tokens=4,
                               kv_cache_memory="1MiB", block_size=8)
    assert row["failures"] == [] and row["generated"] == [4, 4, 4]
    assert row["kv_budget_bytes"] == 2**20 and list(row["kv_devices"]) == ["cpu"]
    assert row["plan_forward_bytes"] > 0 and row["peak_kv_bytes"] > 0


def test_bench_fused_checks_each_op_against_its_reference_or_says_it_needs_cuda(interp, capsys, monkeypatch):
    """Without CUDA the script says so and exits 0; --dry-run runs every op and batch through Triton's
    interpreter, checked against the torch reference (within one bf16 rounding of the largest value)."""
    import json

    import bench_fused

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_fused.main([]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out
    assert bench_fused.main(["--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["op"], r["batch"]) for r in out["rows"]] == [
        (op, b) for b in (1, 3) for op in ("rms_norm", "add_rms_norm", "rope_store", "act_mul")]
    for r in out["rows"]:
        assert r["bytes"] > 0 and r["triton_eager_us"] > 0 and r["torch_eager_us"] > 0
        assert 0 <= r["max_diff"] <= 2**-8, r
    assert [s["batch"] for s in out["steps"]] == [1, 3]



def test_bench_skinny_times_every_config_against_f_linear_or_says_it_needs_cuda(interp, capsys, monkeypatch):
    """Without CUDA the script says so and exits 0; --dry-run runs every shape, row count and config through
    Triton's interpreter, each config checked against F.linear (within a bf16 rounding of the largest value)."""
    import json

    import bench_skinny

    from svrmad_local.kernels import skinny

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_skinny.main([]) == 0
    assert "needs CUDA" in capsys.readouterr().out
    assert bench_skinny.main(["--dry-run", "--json", "--rows", "1,8,16", "--chain", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    chain = out["chain"]  # off a GPU PDL does not run: the chain once, plainly, its configs the timed ones
    assert chain["layers"] == 2 and chain["pdl"] == "tensors on cpu" and chain["same_bits"]
    assert list(chain["arms"]) == ["off"] and chain["arms"]["off"]["us_per_layer"] > 0
    assert chain["configs"]["qkv"] == out["shapes"]["qkv"]["rows"]["1"]["best"]
    assert chain["configs"]["gate_up"] == str(skinny.DEFAULT)  # a shape not timed here
    assert set(out["shapes"]) == set(bench_skinny.TINY)
    for shape in out["shapes"].values():
        assert set(shape["checks"]) == {str(c) for c in skinny.CONFIGS}
        assert all(0 <= c["max_diff"] <= 2**-7 for c in shape["checks"].values()), shape["checks"]
        assert set(shape["rows"]) == {"1", "8", "16"}
        for m, row in shape["rows"].items():  # above 8 rows only the tl.dot configs
            ran = [c for c in skinny.CONFIGS if skinny.runs(c, int(m))]
            assert row["torch_us"] > 0 and set(row["configs_us"]) == set(map(str, ran))
            assert row["best"] in shape["checks"]
            assert len(ran) == (len(skinny.CONFIGS) if m != "16" else sum(c.dot for c in skinny.CONFIGS))


def test_the_bare_read_reads_every_element_once_in_each_launch_shape(interp):
    """benchmarks/read_floor.py: each program sums its own contiguous stretch of the weight, the stretches
    cover it exactly once, whatever the launch (programs an SM, block, warps) and however unevenly the size
    divides; integer values, so every sum is exact in fp32."""
    import read_floor

    from svrmad_local.kernels import skinny

    for n, k in ((7, 13), (48, 40), (160, 32), (3, 4096 + 5)):
        w = torch.randint(-3, 4, (n, k)).to(torch.bfloat16)
        for launch in read_floor.FLOOR_LAUNCHES:
            sums = read_floor.read_weight(w, launch)
            per_sm, block, _ = launch
            programs = min(skinny._sms(w.device) * per_sm, -(-w.numel() // block))
            chunk = -(-(-(-w.numel() // programs)) // block) * block
            expected = torch.stack([c.float().sum() for c in w.reshape(-1).split(chunk)])
            assert torch.equal(sums, expected), (n, k, launch)
    with pytest.raises(ValueError, match="read_weight: 0 elements"):
        read_floor.read_weight(torch.empty(0, 8, dtype=torch.bfloat16), read_floor.FLOOR_LAUNCHES[0])


def test_bench_skinny_floor_times_a_bare_read_per_shape_and_a_step_of_them(interp, capsys):
    """--floor (dry run): every shape gets its bare read (the fastest launch named, each launch timed) and each
    row how near its best config comes to it; the step of bare reads holds a layer's four linears per layer
    and the LM head, PDL off only on the CPU, and its share of the weight-streaming limit."""
    import json

    import bench_skinny
    import read_floor

    assert bench_skinny.main(["--dry-run", "--json", "--rows", "1", "--floor"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    names = {read_floor.launch_name(x) for x in read_floor.FLOOR_LAUNCHES}
    for shape in out["shapes"].values():
        f = shape["read_floor"]
        assert set(f["launches_us"]) == names and f["us"] == min(f["launches_us"].values())
        assert f["launches_us"][f["launch"]] == f["us"]
        row = shape["rows"]["1"]
        assert row["of_floor"] == round(f["us"] / row["best_us"], 3)
    step = out["read_step"]
    assert step["layers"] == 2 and step["launches"] == 2 * len(read_floor.STEP) + 1
    dims = bench_skinny.TINY_STEP
    assert step["gb"] == round((2 * sum(dims[s][0] * dims[s][1] for s in read_floor.STEP) + dims["lm_head"][0]
                                * dims["lm_head"][1]) * 2 / 1e9, 3)
    assert list(step["arms"]) == ["off"] and step["pdl"] == "tensors on cpu" and step["read_gbps"] > 0
    off = step["arms"]["off"]
    assert off["ms"] > 0 and 0 <= off["of_limit"] <= 1


def test_bench_skinny_keeps_the_configs_figures_where_the_floor_fails(interp, capsys, monkeypatch):
    """A failure in --floor's step of bare reads is one line and a failed exit; the JSON still holds every
    config's figures and each shape's bare read."""
    import json

    import bench_skinny
    import read_floor

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(read_floor, "read_step", broken)
    assert bench_skinny.main(["--dry-run", "--json", "--rows", "1", "--floor"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["floor_error"] == "RuntimeError: out of memory" and "bench_skinny --floor: RuntimeError" in lines[-2]
    for shape in out["shapes"].values():
        assert shape["rows"]["1"]["best_us"] > 0 and shape["read_floor"]["us"] > 0


def test_bench_step_broadcast_sends_a_long_context_step_in_the_bytes_of_a_short_one(capsys):
    """benchmarks/bench_step_broadcast.py over gloo, two processes: the follower gets every step equal to
    the leader's in each of the three ways, and the channel's steps (each run's new blocks only) weigh the
    same at 64 and 4096 tokens of context while the whole tables grow with it."""
    import socket

    import bench_step_broadcast

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rows = bench_step_broadcast.main(["--batch", "2", "--context", "64,4096", "--steps", "20", "--port", str(port)])
    short, long = rows
    assert (short["context"], long["context"]) == (64, 4096)
    assert short["delta_bytes"] == long["delta_bytes"] < short["whole_bytes"]
    assert long["whole_bytes"] > 10 * long["delta_bytes"] and long["pickle_bytes"] > 5 * long["delta_bytes"]
    assert all(r[f"{w}_us"] > 0 for r in rows for w in bench_step_broadcast.WAYS)
    assert "whole/delta" in capsys.readouterr().out


def peer_args(model, **kw) -> SimpleNamespace:
    """bench_decode's arguments for the peer: a tiny checkpoint, a few tokens, greedy."""
    return SimpleNamespace(**{"model": str(model), "random_weights": False, "dtype": "fp32", "prompt_tokens": 5,
                              "new_tokens": 3, "repeat": 2, "greedy": True, "hf_compile_mode": None, **kw})


def test_hf_peer_decodes_beside_the_engine_at_batch_1_and_2(tmp_path, tiny_tokenizer):
    """bench_decode --hf-compile's peer (transformers' generate, static cache, forward under torch.compile;
    dynamo's eager backend here, inductor's C++ build being minutes on this CPU): each batch size warmed up,
    then tok/s from the tokens it really generated (the returned ids' shape), nothing compiled while timed,
    and the engine's tok/s over the peer's beside them."""
    import bench_decode

    ck, _ = tiny_run_inputs(tmp_path, tiny_tokenizer)
    rows = [{"batch": 1, "engine_tok_s": 50.0}, {"batch": 2, "engine_tok_s": 80.0}]
    info = bench_decode.run_peer(peer_args(ck), rows, vocab=len(tiny_tokenizer), backend="eager")
    assert info["compile"] == {"backend": "eager", "mode": "default", "fullgraph": True, "dynamic": False}
    assert info["sampling"] == "greedy" and info["transformers"]
    for row in rows:
        assert "hf_compile_error" not in row, row
        assert row["hf_compile_shape"] == [row["batch"], 5 + 1 + 3]  # the prompt, then 1 + new_tokens tokens
        assert row["hf_compile_tok_s"] > 0 and row["hf_compile_new_graphs"] == 0
        assert row["engine_over_hf_compile"] == round(row["engine_tok_s"] / row["hf_compile_tok_s"], 2)


def test_hf_peer_ignores_eos_and_runs_the_forward_inductor_compiled(monkeypatch):
    """A model whose every token is its EOS still gives every token asked for (the engine's ignore_eos), and
    generate's decode steps go through torch.compile with inductor, as the benchmark runs it (the suite's one
    inductor build: about 40 s on a busy 2-core CPU, for one layer)."""
    from hf_peer import HfPeer

    model = make_model("llama", vocab=400, layers=1)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit equal: greedy takes token 0 ...
    model.generation_config.eos_token_id = 0  # ... which is the EOS
    compiled = []
    real = torch.compile

    def counting(fn, **kw):
        compiled.append(kw)
        return real(fn, **kw)

    monkeypatch.setattr(torch, "compile", counting)
    peer = HfPeer(model, max_len=4 + 6)
    params = [{"max_tokens": 6, "temperature": 0.0, "top_p": 0.95, "top_k": 40, "seed": 0}] * 2
    assert peer.generate([[5, 6, 7, 8], [9, 10, 11, 12]], params) == [6, 6]
    assert peer.last_shape == (2, 4 + 6)
    assert compiled == [{"fullgraph": True, "dynamic": False, "backend": "inductor", "mode": "default", "options": None}]


def test_hf_peer_keeps_one_static_cache_a_batch_size_and_gives_plain_generates_tokens():
    """The peer's static cache is made once per batch size and emptied before each call (a new cache a call
    would move the tensors CUDA graphs read, so each call would record its graph again), and its greedy
    tokens are those of a plain, uncompiled `generate`, at every call."""
    from hf_peer import HfPeer

    model = make_model("llama", vocab=400, layers=2)
    peer = HfPeer(model, max_len=4 + 6, backend="eager")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    params = [{"max_tokens": 6, "temperature": 0.0, "top_p": 0.95, "top_k": 40, "seed": 0}] * 2
    seen = []
    for _ in range(3):
        assert peer.generate(ids.tolist(), params) == [6, 6]
        assert torch.equal(peer.last_ids, plain)
        seen.append(peer.caches[2].layers[0].keys.data_ptr())
    assert list(peer.caches) == [2] and len(set(seen)) == 1
    peer.generate(ids[:1].tolist(), params[:1])
    assert torch.equal(peer.last_ids, plain[:1]) and sorted(peer.caches) == [1, 2]


def test_a_failing_hf_peer_is_one_line_in_the_table_and_the_json(tmp_path, tiny_tokenizer, monkeypatch, capsys):
    """torch.compile raising (a machine without a compiler, say) costs the peer's figures only: bench_decode
    still prints the engine's, and the peer's error in one line, in its table and its JSON line."""
    import json

    import bench_decode

    def broken(*a, **kw):
        raise RuntimeError("no C++ compiler\nfound on this machine")

    monkeypatch.setattr(torch, "compile", broken)
    ck, _ = tiny_run_inputs(tmp_path, tiny_tokenizer)
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--model", str(ck), "--batches", "1,2", "--prompt-tokens", "5",
                                      "--new-tokens", "3", "--repeat", "1", "--greedy", "--hf-compile"])
    assert bench_decode.main() == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    why = "RuntimeError: no C++ compiler found on this machine"
    assert [r["hf_compile_error"] for r in result["rows"]] == [why, why]
    assert all("engine_tok_s" in r and "hf_compile_tok_s" not in r for r in result["rows"])  # the engine's stand
    assert result["hf_peer"]["compile"]["mode"] == "default"
    assert result["pdl"] == "none" and "; pdl none (tensors on cpu); " in next(x for x in out if x.startswith("engine:"))
    table = [line for line in out if line.lstrip().startswith(("1 ", "2 "))]
    assert len(table) == 2 and all(line.endswith(f"failed: {why}") for line in table), out


def test_bench_stack_times_both_sides_at_each_batch_size(tmp_path, tiny_tokenizer, capsys):
    """bench_stack on a tiny checkpoint: each round times the stack and the loop at each batch size,
    and the row's medians and ratio are those runs'."""
    import json

    import bench_stack

    from svrmad_local.kernels import cpu_stack

    if not cpu_stack.available():
        pytest.skip(f"the compiled kernels did not build: {cpu_stack.unavailable_reason()}")
    ck, _ = tiny_run_inputs(tmp_path, tiny_tokenizer)
    assert bench_stack.main(["--model", str(ck), "--dtype", "fp32", "--batches", "1,2", "--new-tokens", "3",
                             "--rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "decode steps in one compiled call" in out["decoder"]
    assert [r["batch"] for r in out["rows"]] == [1, 2]
    for r in out["rows"]:
        assert len(r["runs"]["stack"]) == len(r["runs"]["loop"]) == 2
        assert r["ratio"] == round(r["stack_tok_s"] / r["loop_tok_s"], 3)


def test_bench_handoff_times_both_sides_and_restores_the_setting(tmp_path, tiny_tokenizer, capsys):
    """bench_handoff on a tiny checkpoint: each round times steps back to back and one step a hand-off, the
    row's medians and ratio are those runs', the gaps between steps are measured on both sides, and the
    engine's setting is back where it was."""
    import json

    import bench_handoff

    from svrmad_local.engine import engine as engine_mod

    before = engine_mod.STEPS_FOR_S
    ck, _ = tiny_run_inputs(tmp_path, tiny_tokenizer)
    assert bench_handoff.main(["--model", str(ck), "--dtype", "fp32", "--batches", "1,2", "--new-tokens", "3",
                               "--rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["batch"] for r in out["rows"]] == [1, 2] and engine_mod.STEPS_FOR_S == before == out["steps_for_s"]
    for r in out["rows"]:
        assert len(r["runs"]["back to back"]) == len(r["runs"]["one a hand-off"]) == 2
        assert r["ratio"] == round(r["back_to_back_tok_s"] / r["one_a_handoff_tok_s"], 3)
        assert all(g >= 0 for g in r["gap_ms"].values())


def test_bench_silu_mul_times_both_loop_widths_and_torch(capsys):
    """bench_silu_mul's rows: each batch timed at this CPU's level, on the AVX2 loop and in torch, the two
    compiled widths' outputs checked equal inside (the run stops otherwise)."""
    import json

    from bench_silu_mul import main

    from svrmad_local.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip(cpu_ops.unavailable_reason())
    assert main(["--batches", "1,3", "--inter", "40", "--repeat", "3"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["batch"] for r in out["rows"]] == [1, 3] and out["inter"] == 40
    assert all(r["level_us"] > 0 and r["avx2_loop_us"] > 0 and r["torch_us"] > 0 for r in out["rows"])


def test_batch_sizes_are_positive_integers_or_refused_in_one_line():
    """bench_decode's --batches and --profile: a list of positive sizes; anything else argparse refuses in its own
    line (exit 2), not a traceback."""
    import argparse

    from bench_decode import batch_sizes

    assert batch_sizes("1,8,32") == [1, 8, 32] and batch_sizes("4") == [4]
    for bad in ("", "1,x", "0,8", "-1", "1,,2"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integers separated by commas"):
            batch_sizes(bad)
