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
from svrmad_local.methods import METHODS, accepted_params, run_method
from svrmad_local.methods.svr_mad import possible_debates
from svrmad_local.signals import PRIORS, prior_score

LIVE_DEFAULT = "svr-mad"
POST_HOC = {"sid-et"}  # needs every question's initial responses: runs from the trace afterwards


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="gsm8k", help="gsm8k | commonsenseqa | imo-answerbench | mmlu-pro | math | hle | PATH")
    g.add_argument("--data-dir", help="folder with the full datasets (default: $SVRMAD_DATA_DIR, else bundled samples)")
    g.add_argument("--limit", type=int, default=8, help="number of questions (default 8; 0 = all)")
    g.add_argument("--category", help="category filter (IMO-AnswerBench, MMLU-Pro, HLE)")
    g.add_argument("--shard", help="K/N: run every N-th question starting at K (one replica per GPU)")
    g.add_argument("--on-error", choices=["skip", "fail"], default="skip", help="malformed dataset rows")
    g = p.add_argument_group("model")
    g.add_argument("--model", help="local checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--cache-dir", help="where the embedded default is converted (default ~/.cache/svrmad-local)")
    g.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda if available)")
    g.add_argument("--device-map", help="accelerate device map, e.g. auto (a model larger than one GPU)")
    g.add_argument("--dtype", help="fp32 | bf16 | fp16 (default: fp32 on CPU, bf16 on GPU)")
    g.add_argument("--kv-cache-memory", help="KV-cache budget: bytes, a fraction, or e.g. 4GiB")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g = p.add_argument_group("sampling (paper defaults)")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-confidence", action="store_true", help="do not ask agents for a self-reported confidence")
    g = p.add_argument_group("methods")
    g.add_argument("--methods", default=LIVE_DEFAULT, help=f"comma list of {', '.join(METHODS)}; or 'all'")
    g.add_argument("--agents", type=int, default=6)
    g.add_argument("--S", type=int, default=2, help="SVR-MAD challengers per iteration")
    g.add_argument("--C", type=int, default=2, help="SVR-MAD challengers to survive before acceptance")
    g.add_argument("--budget", type=int, help="SVR-MAD budget (default S*(k+m))")
    g.add_argument("--prior", default="min_ll", choices=sorted(PRIORS), help="SVR-MAD's starting score")
    g.add_argument("--no-repeat-pairs", dest="repeat_pairs", action="store_false",
                   help="SVR-MAD debates each pair at most once (default: Algorithm 1 as written, pairs repeat)")
    g.add_argument("--groups", default="3-3", help="GroupDebate split: 3-3 or 2-2-2")
    g.add_argument("--skip-rate", type=float, help="SID-ET skip rate (default: tuned by Algorithm 2 against SVR-MAD)")
    g.add_argument("--ablations", action="store_true",
                   help="also debate every disagreeing pair, with the repeats the budget allows, and sweep Appendix B's "
                        "posterior ablations")
    p.add_argument("--out", help="run folder (default runs/<dataset>); rerun with the same folder to resume")
    p.add_argument("--concurrency", type=int, default=16, help="questions in flight at once")


def parse_methods(text: str) -> list[str]:
    names = list(METHODS) if text == "all" else [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    return names


def shard(questions: list, spec: str) -> list:
    try:
        k, n = (int(x) for x in spec.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        raise ValueError(f"--shard {spec!r}: expected K/N with 0 <= K < N, e.g. 0/4") from None
    return questions[k::n]


def method_params(name: str, args) -> dict:
    given = {"S": args.S, "C": args.C, "budget": args.budget, "prior": args.prior, "groups": args.groups,
             "seed": args.seed, "repeat_pairs": getattr(args, "repeat_pairs", True)}
    taken = accepted_params(name)
    return {k: v for k, v in given.items() if k in taken and v is not None}


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


async def run_question(q: Question, backend: RecordingBackend, methods: list[str], args, folder: RunFolder) -> list[dict]:
    initial = await backend.initial(q, args.agents)
    if unanimous(initial, q.answer_type):
        row = {"id": q.id, "gold": q.gold, "answer": initial[0].answer, "answers": [r.answer for r in initial],
               "tokens": sum(r.tokens_total for r in initial), "computed_tokens": sum(r.computed_tokens for r in initial)}
        folder.append(folder.skipped, [row])
        backend.forget(q.id)
        return []
    live = [m for m in methods if m not in POST_HOC]
    if "sid-et" in methods and "all-to-all" not in live:
        live.append("all-to-all")  # SID-ET debates all-to-all when it does not skip: record those rounds
    results = await asyncio.gather(*(run_method(m, q, initial, backend, **method_params(m, args)) for m in live))
    if args.ablations:  # every debate an SVR-MAD variant may ask for, so any (posterior, tau) replays
        svr = method_params("svr-mad", args)
        wanted = possible_debates([r.answer for r in initial], q.answer_type,
                                  **{k: svr[k] for k in ("S", "budget", "spend", "repeat_pairs") if k in svr})
        await asyncio.gather(*(backend.debate(q, initial[r], [initial[s]], repeat=k) for s, r, k in wanted))
    priors = [prior_score(r.signals, args.prior) for r in initial]
    rows = [r.to_row(q) for r in results if r.method in methods]
    folder.append(folder.trace, [backend.trace_row(q, priors)])
    folder.append(folder.results, rows)
    backend.forget(q.id)
    return rows


def post_hoc(folder: RunFolder, methods: list[str], args) -> list[dict]:
    """Model-free parts from the trace: SID-ET (Algorithm 2 tuning) and the ablation sweeps."""
    from svrmad_local.eval.replay import replay_all, totals
    from svrmad_local.debate.trace import row_initial, row_question
    from svrmad_local.methods.sid_et import threshold_for_skip_rate, tune_skip_rate

    trace = read_trace(folder.trace) if folder.trace.exists() else []
    out: list[dict] = []
    if "sid-et" in methods and trace:
        initials = [row_initial(r) for r in trace]

        def sid(rate: float):
            thr = threshold_for_skip_rate(initials, rate)
            res = asyncio.run(replay_all(trace, "sid-et", {"threshold": thr}))
            return res, thr

        rate = args.skip_rate
        if rate is None:
            ref = asyncio.run(replay_all(trace, "svr-mad", method_params("svr-mad", args)))
            t = totals(ref)

            def evaluate(r: float):
                tt = totals(sid(r)[0])
                return tt["tokens_mean"], tt["accuracy"]

            rate = tune_skip_rate(evaluate, t["tokens_mean"], t["accuracy"])
        res, thr = sid(rate)
        rows = []
        for row, r in zip(trace, res):
            r.params.update(skip_rate=rate, threshold=thr)
            rows.append(r.to_row(row_question(row)))
        folder.append(folder.results, rows)
        out += rows
    if args.ablations and trace:
        from svrmad_local.eval.ablations import sweep

        points = sweep(trace, method_params("svr-mad", args))
        with open(folder.out / "ablations.jsonl", "w") as f:
            for pt in points:
                f.write(json.dumps(pt) + "\n")
    return out


def build_engine(args):
    from svrmad_local.engine.engine import Engine, EngineConfig
    from svrmad_local.models.default import ensure_default_model
    from svrmad_local.models.loader import load_model

    path = args.model or ensure_default_model(args.cache_dir)
    lm = load_model(path, dtype=args.dtype, device=args.device, device_map=args.device_map)
    cfg = EngineConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                       seed=args.seed)
    return Engine(lm.model, lm.tokenizer, cfg), str(path)


def main(args) -> int:
    from svrmad_local.debate.engine_backend import EngineBackend
    from svrmad_local.engine.params import SamplingParams
    from svrmad_local.eval.metrics import summary_table_text

    try:
        methods = parse_methods(args.methods)
        questions = load_dataset(args.dataset, limit=args.limit or None, seed=args.seed, category=args.category,
                                 on_error=args.on_error, data_dir=args.data_dir)
        if args.shard:
            questions = shard(questions, args.shard)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens)
    except (ValueError, DatasetError, FileNotFoundError) as exc:
        print(f"svrmad run: {exc}", file=sys.stderr)
        return 2
    folder = RunFolder(Path(args.out or f"runs/{Path(args.dataset).stem}"))
    done = folder.done_ids()
    todo = [q for q in questions if q.id not in done]
    print(f"svrmad run: {len(questions)} questions from {args.dataset}, {len(done & {q.id for q in questions})} already "
          f"in {folder.out}, {len(todo)} to run; methods {', '.join(methods)}", file=sys.stderr)
    t0 = time.perf_counter()
    engine_info = {}
    if todo:
        engine, model_path = build_engine(args)
        backend = RecordingBackend(EngineBackend(engine, params, elicit_confidence=not args.no_confidence, seed=args.seed))
        (folder.out / "run.json").write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                                                          "model": model_path}, indent=2))

        async def all_questions():
            sem = asyncio.Semaphore(max(1, args.concurrency))
            bar = tqdm(total=len(todo), desc="questions", unit="q", file=sys.stderr)

            async def one(q):
                async with sem:
                    await run_question(q, backend, methods, args, folder)
                    bar.update(1)

            try:
                await asyncio.gather(*(one(q) for q in todo))
            finally:
                bar.close()

        asyncio.run(all_questions())
        engine_info = engine.info
    post_hoc(folder, methods, args)
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
