"""`svrmad run`: the main job. Every method over one set of initial responses, resumable.

Questions run concurrently (one coroutine each, awaiting the one engine, which batches them).
Per question: the N initial responses (computed once, shared by every method); unanimous questions
are skipped as in the paper; otherwise every live method runs over a RecordingBackend, so a debate
two methods ask for is computed once, and the question's trace line and result lines are
appended and flushed together. A rerun with the same --out skips the questions already written.
After the live phase, the model-free parts run from the trace: SID-ET's skip-rate tuning
(Algorithm 2, against SVR-MAD) and, with --ablations, the Appendix B threshold sweeps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from svrmad_local.debate.answers import equivalent
from svrmad_local.debate.trace import RecordingBackend, read_trace
from svrmad_local.debate.types import Question, Response
from svrmad_local.eval.datasets import DatasetError, load_dataset
from svrmad_local.debate.trace import read_jsonl
from svrmad_local.eval.config import RunConfig, add_run_arguments, from_args, parse_shard
from svrmad_local.methods import run_method
from svrmad_local.signals import prior_score

POST_HOC = {"sid-et"}  # needs every question's initial responses: runs from the trace afterwards


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)


def shard(questions: list, spec: str) -> list:
    k, n = parse_shard(spec)
    return questions[k::n]


def unanimous(initial: list[Response], answer_type: str) -> bool:
    a0 = initial[0].answer
    return a0 is not None and all(equivalent(r.answer, a0, answer_type) for r in initial[1:])


def _drop_torn_tail(path: Path) -> None:
    """A run killed mid-write leaves a last line without its newline: cut it, so appends stay valid
    JSONL (that question is simply redone)."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


class RunFolder:
    """The run's files; every line is flushed as written so an interruption loses nothing done."""

    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.trace, self.results, self.skipped = out / "trace.jsonl", out / "results.jsonl", out / "skipped.jsonl"
        for path in (self.trace, self.results, self.skipped):
            _drop_torn_tail(path)

    def done_ids(self) -> set[str]:
        ids = {r["id"] for r in read_trace(self.trace)} if self.trace.exists() else set()
        ids |= {r["id"] for r in read_jsonl(self.skipped)}
        return ids

    def append(self, path: Path, rows: list[dict]) -> None:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
            f.flush()


async def run_question(q: Question, backend: RecordingBackend, cfg: RunConfig, folder: RunFolder) -> list[dict]:
    methods = cfg.methods
    initial = await backend.initial(q, cfg.agents)
    if unanimous(initial, q.answer_type):
        row = {"id": q.id, "gold": q.gold, "answer": initial[0].answer, "answers": [r.answer for r in initial],
               "tokens": sum(r.tokens_total for r in initial), "computed_tokens": sum(r.computed_tokens for r in initial)}
        folder.append(folder.skipped, [row])
        backend.forget(q.id)
        return []
    live = [m for m in methods if m not in POST_HOC]
    if "sid-et" in methods and "all-to-all" not in live:
        live.append("all-to-all")  # SID-ET debates all-to-all when it does not skip: record those rounds
    results = await asyncio.gather(*(run_method(m, q, initial, backend, **cfg.params_for(m)) for m in live))
    if cfg.ablations:  # every ordered pair, so any SVR-MAD variant can be replayed from the trace
        await asyncio.gather(*(backend.debate(q, initial[r], [initial[s]])
                               for r in range(len(initial)) for s in range(len(initial)) if r != s))
    priors = [prior_score(r.signals, cfg.prior) for r in initial]
    rows = [r.to_row(q) for r in results if r.method in methods]
    folder.append(folder.trace, [backend.trace_row(q, priors)])
    folder.append(folder.results, rows)
    backend.forget(q.id)
    return rows


def post_hoc(folder: RunFolder, cfg: RunConfig) -> list[dict]:
    """Model-free parts from the trace: SID-ET (Algorithm 2 tuning) and the ablation sweeps."""
    from svrmad_local.debate.trace import row_question
    from svrmad_local.eval.replay import sid_et

    trace = read_trace(folder.trace) if folder.trace.exists() else []
    out: list[dict] = []
    if "sid-et" in cfg.methods and trace:
        res, rate, thr = sid_et(trace, cfg.params_for("sid-et"), cfg.params_for("svr-mad"), cfg.skip_rate)
        rows = []
        for row, r in zip(trace, res):
            r.params.update(skip_rate=rate, threshold=thr)
            rows.append(r.to_row(row_question(row)))
        folder.append(folder.results, rows)
        out += rows
    if cfg.ablations and trace:
        from svrmad_local.eval.ablations import sweep

        points = sweep(trace, cfg.params_for("svr-mad"))
        with open(folder.out / "ablations.jsonl", "w") as f:
            for pt in points:
                f.write(json.dumps(pt) + "\n")
    return out


def build_engine(cfg: RunConfig):
    from svrmad_local.engine.engine import Engine
    from svrmad_local.models.default import ensure_default_model
    from svrmad_local.models.loader import load_model

    path = cfg.model or ensure_default_model(cfg.cache_dir)
    lm = load_model(path, dtype=cfg.dtype, device=cfg.device, device_map=cfg.device_map)
    return Engine(lm.model, lm.tokenizer, cfg.engine), str(path)


def load_questions(cfg: RunConfig) -> list[Question]:
    questions = load_dataset(cfg.dataset, limit=cfg.limit or None, seed=cfg.seed, category=cfg.category,
                             on_error=cfg.on_error, data_dir=cfg.data_dir)
    return shard(questions, cfg.shard) if cfg.shard else questions


def main(args) -> int:
    try:
        cfg = from_args(args)
        cfg.validate()
        questions = load_questions(cfg)
    except (ValueError, DatasetError, FileNotFoundError) as exc:
        print(f"svrmad run: {exc}", file=sys.stderr)
        return 2
    return run(cfg, questions)


def run(cfg: RunConfig, questions: list[Question]) -> int:
    from svrmad_local.debate.engine_backend import EngineBackend
    from svrmad_local.eval.metrics import summary_table_text

    folder = RunFolder(cfg.out_dir)
    done = folder.done_ids()
    todo = [q for q in questions if q.id not in done]
    print(f"svrmad run: {len(questions)} questions from {cfg.dataset}, {len(done & {q.id for q in questions})} already "
          f"in {folder.out}, {len(todo)} to run; methods {', '.join(cfg.methods)}", file=sys.stderr)
    if cfg.reasoning_effort:
        print(f"svrmad run: --reasoning-effort {cfg.reasoning_effort} is recorded in run.json; the chat template "
              "does not receive it yet", file=sys.stderr)
    t0 = time.perf_counter()
    engine_info = {}
    if todo:
        engine, model_path = build_engine(cfg)
        backend = RecordingBackend(EngineBackend(engine, cfg.sampling, elicit_confidence=cfg.elicit_confidence,
                                                 seed=cfg.seed))
        (folder.out / "run.json").write_text(json.dumps({"config": cfg.to_dict(), "fingerprint": cfg.fingerprint(),
                                                          "model": model_path}, indent=2, default=str))

        async def all_questions():
            sem = asyncio.Semaphore(cfg.concurrency)
            bar = tqdm(total=len(todo), desc="questions", unit="q", file=sys.stderr)

            async def one(q):
                async with sem:
                    await run_question(q, backend, cfg, folder)
                    bar.update(1)

            try:
                await asyncio.gather(*(one(q) for q in todo))
            finally:
                bar.close()

        asyncio.run(all_questions())
        engine_info = engine.info
    post_hoc(folder, cfg)
    wall = time.perf_counter() - t0
    ids = {q.id for q in questions}
    rows = [r for r in read_jsonl(folder.results) if r["id"] in ids]
    skipped = [r for r in read_jsonl(folder.skipped) if r["id"] in ids]
    meta = json.loads((folder.out / "run.json").read_text()) if (folder.out / "run.json").exists() else {}
    meta.update(totals={"questions": len(questions), "skipped_unanimous": len(skipped),
                        "debated": len({r["id"] for r in rows}), "wall_s": round(wall, 1), "engine": engine_info})
    (folder.out / "run.json").write_text(json.dumps(meta, indent=2, default=str))
    print(f"\n{len(questions)} questions: {len(skipped)} skipped as unanimous before debate, "
          f"{len({r['id'] for r in rows})} debated. Wall time {wall:.1f} s.")
    if rows:
        print(summary_table_text(rows))
    if engine_info:
        print(f"engine: prompt tokens billed {engine_info['prompt_tokens']}, computed {engine_info['computed_tokens']} "
              f"({engine_info['cached_tokens']} reused from the KV-cache), generated {engine_info['generated_tokens']}, "
              f"peak KV {engine_info['peak_kv_bytes'] / 2**20:.1f} MiB, {engine_info['attention']} attention")
    print(f"trace: {folder.trace}\nresults: {folder.results}\nreport: svrmad report {folder.out}")
    return 0
