"""`svrmad run`: the main job. Every method over one set of initial responses, resumable.

Questions run concurrently (one coroutine each, awaiting the one engine, which batches them).
Per question: the N initial responses (computed once, shared by every method); unanimous questions
are skipped as in the paper; otherwise every live method runs over a RecordingBackend, so a debate
two methods ask for is computed once. The question is then committed (analysis/folder.py: its trace
line first, then its results rows). A question that fails is written to errors.jsonl and the run
goes on; a rerun with the same --out retries it and skips the committed ones. After the live
phase the model-free parts run from the trace (analysis/posthoc.py).

Once the start message is in, what this process is (its settings, device, checkpoint, group and the
folder it commits into) is settled in one `Job`, which every step reads.

Under torchrun or `accelerate launch` every process runs one engine (svrmad_local/job/launch.py): rank 0
checks the folder and publishes the RunConfig and the questions to run, each rank takes the next
question from a shared counter whenever it has a free slot and commits into its own part files,
and rank 0 merges them into one run folder at the end. With --tp T, each T consecutive processes are
one engine (a replica) and its first rank is the one that takes questions.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from tqdm import tqdm

from svrmad_local.analysis import token_files
from svrmad_local.analysis.folder import RunFolder, note, write_json
from svrmad_local.analysis.folder import rows as run_rows
from svrmad_local.analysis.posthoc import finalize, rebuild_results, recorded_methods
from svrmad_local.analysis.run_config import RunConfig
from svrmad_local.debate.trace import RecordingBackend
from svrmad_local.debate.types import Question, Response
from svrmad_local.dist import GroupLost
from svrmad_local.job.launch import Dist
from svrmad_local.grading import equivalent, set_grader
from svrmad_local.job.flags import add_run_arguments, from_args
from svrmad_local.job.preflight import check_settings, model_path, preflight, shard  # noqa: F401 (shard: tests)
from svrmad_local.methods import run_method
from svrmad_local.methods.svr_mad import possible_debates
from svrmad_local.signals import prior_score

if TYPE_CHECKING:
    from svrmad_local.dist import Group


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)


def unanimous(initial: list[Response], answer_type: str) -> bool:
    a0 = initial[0].answer
    return a0 is not None and all(equivalent(r.answer, a0, answer_type) for r in initial[1:])


@dataclass(frozen=True)
class Job:
    """This process's part of the run, settled once after the start message. The steps read it whole
    rather than each being handed the pieces it needs (the device and checkpoint down to the model
    load, the folder and the launch down to each question)."""

    cfg: RunConfig
    d: Dist  # this process in the launch; with --tp, the data-parallel view of the groups' leaders
    group: Group | None  # this rank's tensor-parallel group (None without --tp)
    device: str | None
    model: str | None  # the checkpoint folder; None when nothing is left to run
    writer: RunFolder | None  # where this process commits: the run folder, or its part under data parallel
    methods: tuple[str, ...]  # what a live question runs: those asked for and what the post-hoc parts replay
    settings: dict  # the settings fingerprint (run.json's), stamped on the token-stats files

    @property
    def follower(self) -> bool:
        """A tensor-parallel rank other than its group's first: it only follows its leader's steps."""
        return self.group is not None and self.group.rank != 0


# ---------------------------------------------------------------- one question


class QuestionFailed(Exception):
    """One question's failure, with the stage it happened in (errors.jsonl)."""

    def __init__(self, stage: str, cause: BaseException):
        self.stage = stage
        self.message = f"{type(cause).__name__}: {cause}"
        super().__init__(f"{stage}: {self.message}")


async def _stage(stage: str, aw):
    try:
        return await aw
    except Exception as exc:
        raise QuestionFailed(stage, exc) from exc


async def _all(aws) -> list:
    """Await all (none is left running when one fails), then raise the first failure."""
    outs = await asyncio.gather(*aws, return_exceptions=True)
    for o in outs:
        if isinstance(o, BaseException):
            raise o
    return outs


async def run_question(q: Question, backend: RecordingBackend, job: Job) -> list[dict]:
    cfg, folder = job.cfg, job.writer
    initial = await _stage("initial", backend.initial(q, cfg.agents))
    if unanimous(initial, q.answer_type):
        folder.commit_skipped({"id": q.id, "gold": q.gold, "answer": initial[0].answer,
                               "answers": [r.answer for r in initial], "tokens": sum(r.tokens_total for r in initial),
                               "computed_tokens": sum(r.computed_tokens for r in initial)})
        return []
    results = await _all(_stage(f"method {m}", run_method(m, q, initial, backend, **cfg.params_for(m)))
                         for m in job.methods)
    if cfg.ablations:  # every debate an SVR-MAD variant may ask for, so any (posterior, tau) replays
        svr = cfg.params_for("svr-mad")
        wanted = possible_debates([r.answer for r in initial], q.answer_type,
                                  **{k: svr[k] for k in ("S", "budget", "spend", "repeat_pairs") if k in svr})
        await _all(_stage("ablations", backend.debate(q, initial[r], [initial[s]], repeat=k)) for s, r, k in wanted)
    priors = [prior_score(r.signals, cfg.prior) for r in initial]
    rows = [r.to_row(q) for r in results if r.method in cfg.methods]
    if cfg.save_token_stats:  # before the commit record: a committed question always has its file
        token_files.write(cfg.out_dir, q.id, backend.recorded(q.id), job.settings)
    folder.commit_debated(backend.trace_row(q, priors), rows)
    return rows


# ---------------------------------------------------------------- the job


def _prepare(cfg: RunConfig, questions: list[Question], held: list) -> tuple[RunFolder, list[Question]]:
    """Rank 0 / the only process: lock and repair the folder, check its settings, pick the work."""
    folder = RunFolder(cfg.out_dir)
    folder.lock()
    held.append(folder)
    torn = folder.cut_torn_tails()
    if torn:
        note(f"cut an incomplete last line (a run stopped mid-write) from {', '.join(torn)} in {folder.out}")
    merged = folder.merge_parts()
    if merged:
        note(f"merged {merged} questions from the part files of an unfinished data-parallel run")
    meta = folder.read_meta()
    done = folder.committed_ids()
    if "fingerprint" in meta:
        check_settings(folder, cfg, done)  # again, under the lock
    elif done:
        note(f"{folder.out}/run.json records no settings (an older run): cannot check that they match")
    rebuilt = rebuild_results(folder, cfg)
    if rebuilt:
        note(f"rebuilt {rebuilt} results rows from trace.jsonl (a run stopped between the two writes)")
    meta.update(config=cfg.to_dict(), fingerprint=cfg.fingerprint(), paper_settings=cfg.paper_settings)
    folder.write_meta(meta)
    return folder, [q for q in questions if q.id not in done]


class Progress:
    """One bar on rank 0 counting the questions every rank has finished, refreshed every 2 s with
    the engine's live counters (tokens/s, requests in flight), so it moves inside a long question."""

    def __init__(self, total: int, d: Dist, counters=None):
        self.d = d
        self.counters = counters  # () -> engine.info of this process
        self.bar = tqdm(total=total, desc="questions", unit="q", file=sys.stderr) if d.is_main else None
        self._last: tuple[float, int] | None = None

    def done_one(self) -> None:
        if self.d.enabled:
            self.d.store.add("completed", 1)
        self.refresh(1)

    def refresh(self, own: int = 0) -> None:
        if self.bar is None:
            return
        if self.d.enabled:
            self.bar.n = self.d.count("completed")
        else:
            self.bar.n += own
        info = self.counters() if self.counters is not None else {}
        if "generated_tokens" in info:
            now = time.perf_counter()
            last, self._last = self._last, (now, info["generated_tokens"])
            rate = (info["generated_tokens"] - last[1]) / max(now - last[0], 1e-9) if last else 0.0
            where = " on rank 0" if self.d.enabled else ""
            self.bar.set_postfix_str(f"{rate:.0f} tok/s{where}, {info['in_flight']} requests in flight, "
                                     f"{info['generated_tokens']} tokens", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.refresh()
            self.bar.close()


async def work(job: Job, todo: list[Question], backend: RecordingBackend, progress: Progress) -> dict[str, int]:
    """Run questions until the shared queue is empty: each of `concurrency` slots takes the next
    question index (across all ranks) when it frees up. Returns counts of done / failed."""
    d = job.d
    local = itertools.count()
    take = (lambda: d.take("next")) if d.enabled else (lambda: next(local))
    counts = {"done": 0, "failed": 0}

    async def slot():
        while (i := take()) < len(todo):
            q = todo[i]
            try:
                await run_question(q, backend, job)
                counts["done"] += 1
            except QuestionFailed as exc:
                if GroupLost.behind(exc):  # not the question's failure: the run stops
                    raise GroupLost.behind(exc) from None
                job.writer.record_error(q.id, exc.stage, exc.message, rank=d.rank)
                counts["failed"] += 1
            finally:
                backend.forget(q.id)
            progress.done_one()

    async def refresher():
        while True:
            await asyncio.sleep(2)
            progress.refresh()

    ticker = asyncio.create_task(refresher()) if d.is_main else None
    try:
        await asyncio.gather(*(slot() for _ in range(max(1, min(job.cfg.concurrency, len(todo))))))
    finally:
        if ticker:
            ticker.cancel()
    return counts


def build_engine(job: Job):
    """The engine over the loaded model; with --tp > 1 every rank of the job's group calls this (the
    model is split over the group)."""
    from svrmad_local.engine.engine import Engine
    from svrmad_local.models.loader import load_model

    cfg = job.cfg
    lm = load_model(job.model, dtype=cfg.dtype, device=job.device, device_map=cfg.device_map, tp=job.group or False,
                    quantization=cfg.quantization)
    quant = getattr(lm.model, "svrmad_quantization", None)
    if quant:
        print(f"svrmad run: {quant['summary']}", file=sys.stderr)
    engine = Engine(lm.model, lm.tokenizer, cfg.engine)
    if not job.follower:  # what runs, and why anything fell back (engine/execution.py)
        print(f"svrmad run: {engine.execution.line()}", file=sys.stderr)
    return engine


def make_backend(job: Job):
    """The live backend, a callable giving the engine's counters, and one releasing the engine."""
    from svrmad_local.debate.engine_backend import EngineBackend

    engine, cfg = build_engine(job), job.cfg
    try:
        backend = EngineBackend(engine, cfg.sampling, elicit_confidence=cfg.elicit_confidence, seed=cfg.seed,
                                reasoning_effort=cfg.reasoning_effort, keep_token_stats=cfg.save_token_stats)
    except BaseException:
        engine.close()
        raise
    return backend, lambda: engine.info, engine.close


def main(args) -> int:
    d = Dist.from_env()
    held: list[RunFolder] = []
    try:
        return _main(args, d, held)
    finally:
        for folder in held:  # the OS would release it at exit; a caller in the same process needs it now
            folder.unlock()
        d.close()


def _main(args, d: Dist, held: list) -> int:
    t0 = time.perf_counter()
    folder = questions = cfg = todo = None

    def start() -> dict:  # rank 0: the run's settings and work, checked before any write, for every rank
        nonlocal folder, questions, cfg, todo
        cfg = from_args(args)
        checked = preflight(cfg, d)  # everything that reads no weight, before any write
        questions = checked.questions
        folder, todo = _prepare(cfg, questions, held)
        model = checked.model or (model_path(cfg) if todo else None)
        print(f"svrmad run: {len(questions)} questions from {cfg.dataset}, {len(questions) - len(todo)} already in "
              f"{folder.out}, {len(todo)} to run; methods {', '.join(cfg.methods)}"
              + (f"; {d.world_size} processes" if d.enabled else ""), file=sys.stderr)
        return {"config": cfg.to_dict(), "todo": [asdict(q) for q in todo], "model": model}

    message = d.announce(start)
    if message is None:  # rank 0 failed and said why
        return 2
    if not d.is_main:
        cfg, todo = RunConfig.from_dict(message["config"]), [Question(**q) for q in message["todo"]]
        set_grader(cfg.grader)
    job = settle(cfg, d, message["model"], folder)
    d = job.d
    if job.follower:  # its leader runs the questions
        if job.model:
            build_engine(job).follow()
        return 0
    rank_info = {"rank": d.rank, "host": socket.gethostname(), "pid": os.getpid(), "device": job.device}
    if d.enabled:
        write_json(job.writer.dir / "rank.json", rank_info)  # who writes this part (and whose pid to signal)
    counts, engine_info = {"done": 0, "failed": 0}, {}
    try:
        if todo:
            inner, engine_counters, release = make_backend(job)
            try:
                backend = RecordingBackend(inner, run_ahead=cfg.run_ahead)
                if d.enabled:  # nobody takes work before every engine is up, so early ranks do not take it all
                    d.barrier("ready")
                progress = Progress(len(todo), d, engine_counters)
                try:
                    counts = asyncio.run(work(job, todo, backend, progress))
                finally:
                    progress.close()
                engine_info = engine_counters()
                if cfg.run_ahead:  # the extra compute, beside (never inside) what was billed
                    engine_info.update({f"ahead_{k}": v for k, v in backend.ahead.items()})
            finally:
                release()
    except KeyboardInterrupt:
        if d.is_main:
            saved = len(folder.committed_ids() | {i for p in folder.part_dirs() for i in RunFolder(p).committed_ids()})
            print(f"\nsvrmad run: interrupted. {saved} questions are saved in {folder.out} (the ones in flight are "
                  "not); run the same command again to resume: saved questions are not redone.", file=sys.stderr)
        return 130
    rank_info.update(questions=counts["done"], failed=counts["failed"], engine=engine_info)
    if d.enabled:
        ranks = d.gather(rank_info)
        if ranks is None:
            return 0
        folder.merge_parts()
    else:
        ranks = [rank_info]
    return _finish(job, folder, questions, ranks, time.perf_counter() - t0)


def settle(cfg: RunConfig, d: Dist, model: str | None, folder: RunFolder | None) -> Job:
    """This process's Job: its device, its tensor-parallel group (every rank takes part in making the
    groups), and, unless it only follows its group's leader, the folder it commits into."""
    device = d.device(cfg.device)
    group, d = d.split(cfg.tp)  # with --tp: this rank's group, and the replicas' data-parallel view
    job = Job(cfg, d, group, device, model, None, tuple(recorded_methods(cfg)), cfg.fingerprint())
    if job.follower:
        return job
    return replace(job, writer=RunFolder(cfg.out_dir, part=f"rank-{d.rank}") if d.enabled else folder)


def _sum_engines(ranks: list[dict]) -> dict:
    infos = [r["engine"] for r in ranks if r.get("engine")]
    if not infos:
        return {}
    out = dict(infos[0])
    for k, v in out.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = (max if k in ("peak_kv_bytes", "kv_blocks", "kv_budget_bytes", "block_size") else sum)(
                i.get(k, 0) for i in infos)
    out["fallbacks"] = sorted({f for i in infos for f in i.get("fallbacks", [])})  # any rank's
    return out


def tally(folder: RunFolder, ids: set[str] | None = None) -> tuple[dict, list[dict], dict[str, dict]]:
    """(totals, results rows, failed questions) of the folder, restricted to `ids` if given."""
    def keep(r: dict) -> bool:
        return ids is None or str(r["id"]) in ids

    rows = [r for r in run_rows(folder.results) if keep(r)]
    skipped = {str(r["id"]) for r in run_rows(folder.skipped) if keep(r)}
    failed = {k: e for k, e in folder.failed().items() if keep({"id": k})}
    debated = {str(r["id"]) for r in rows}
    total = len(ids) if ids is not None else len(skipped | debated | set(failed))
    return ({"questions": total, "skipped_unanimous": len(skipped), "debated": len(debated), "failed": len(failed)},
            rows, failed)


def print_summary(folder: RunFolder, totals: dict, rows: list[dict], failed: dict[str, dict], wall: float | None,
                  engine_info: dict, world_size: int = 1) -> None:
    from svrmad_local.analysis.metrics import summary_table_text

    print(f"\n{totals['questions']} questions: {totals['skipped_unanimous']} skipped as unanimous before debate, "
          f"{totals['debated']} debated, {totals['failed']} failed." + (f" Wall time {wall:.1f} s." if wall else ""))
    if rows:
        print(summary_table_text(rows))
    if "prompt_tokens" in engine_info:
        print(f"engine: prompt tokens billed {engine_info['prompt_tokens']}, computed {engine_info['computed_tokens']} "
              f"({engine_info['cached_tokens']} reused from the KV-cache), generated {engine_info['generated_tokens']}, "
              f"peak KV {engine_info['peak_kv_bytes'] / 2**20:.1f} MiB, {engine_info['attention']} attention"
              + (f"; {world_size} processes" if world_size > 1 else ""))
        steps = engine_info.get("steps", 0)
        print(f"engine: {steps} steps ({engine_info['generated_tokens'] / max(steps, 1):.1f} tokens generated a step), "
              f"{engine_info.get('evictions', 0)} cached blocks evicted, KV budget "
              f"{engine_info.get('kv_budget_bytes', 0) / 2**30:.2f} GiB ({engine_info.get('kv_budget', '?')})")
    if "ahead_started" in engine_info:
        print(f"run-ahead: {engine_info['ahead_started']} debates started ahead, {engine_info['ahead_used']} of them "
              f"asked for; {engine_info['ahead_unused']} never asked for ({engine_info['ahead_unused_tokens']} tokens "
              "computed, not billed)")
    if failed:
        first = next(iter(failed.values()))
        print(f"{len(failed)} questions failed (e.g. {first['id']} at {first.get('stage')}: {first.get('message')}); "
              f"all are in {folder.errors}. Run the same command again to retry them.")
    print(f"trace: {folder.trace}\nresults: {folder.results}\nreport: svrmad report {folder.out}\n"
          f"signals: svrmad signals {folder.out}")


def _finish(job: Job, folder: RunFolder, questions: list[Question], ranks: list[dict], wall: float) -> int:
    """Rank 0, after every rank is done: the post-hoc parts, run.json's totals, the summary."""
    cfg, world_size = job.cfg, job.d.world_size
    finalize(folder, cfg)
    totals, rows, failed = tally(folder, {q.id for q in questions})
    engine_info = _sum_engines(ranks)
    meta = folder.read_meta()
    meta.update(world_size=world_size, ranks=ranks, totals={**totals, "wall_s": round(wall, 1), "engine": engine_info})
    meta.setdefault("launches", []).append({"world_size": world_size, "questions_run": sum(r["questions"] for r in ranks),
                                            "failed": sum(r["failed"] for r in ranks), "wall_s": round(wall, 1)})
    folder.write_meta(meta)
    print_summary(folder, totals, rows, failed, wall, engine_info, world_size)
    return 1 if failed else 0
