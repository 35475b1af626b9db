"""Engine vs a plain loop of `model.generate`, on one fixed debate-shaped workload.

Workload (identical for both, fixed lengths via ignore_eos / min_new_tokens): Q questions; per
question N initial samples of the question prompt, then R receivers x S pairwise debates
(prompt = [question + receiver's own answer] + DebateFormat(sender's answer)). The engine runs every
question concurrently (asyncio) with prefix reuse; the baseline is what one writes without an
engine: one `model.generate` call per agent response, in a loop, recomputing every prompt.

Prints both times, their ratio, the prompt tokens each computed and the lower bound on computed
prompt tokens (the unique-prefix count: tokens of every prompt not already a prefix of something
computed before, with the KV a generation writes counted as computed). Last line: one JSON object.

    python benchmarks/bench_engine.py [--model PATH] [--questions 4] [--n 6] [--receivers 2] [--S 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch

from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.params import SamplingParams
from svrmad_local.eval.datasets import load_dataset
from svrmad_local.models.chat import ChatFormat
from svrmad_local.models.default import ensure_default_model
from svrmad_local.models.loader import load_model


class Trie:
    """Counts tokens of a sequence not yet in the trie, and inserts it."""

    def __init__(self):
        self.root: dict = {}

    def add(self, tokens: list[int]) -> int:
        node, new = self.root, 0
        for t in tokens:
            if t not in node:
                node[t] = {}
                new += 1
            node = node[t]
        return new


def debate_messages(question: str, own: list[int], peer: list[int]) -> list[dict]:
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": own},
        {"role": "user", "content": ["These are the solutions to the problem from other agents:\n\nOne agent solution: ```",
                                     peer, "```\n\nUsing the solutions from other agents as additional information, "
                                     "can you provide your answer to the problem?"]},
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--S", type=int, default=2)
    ap.add_argument("--initial-tokens", type=int, default=64)
    ap.add_argument("--debate-tokens", type=int, default=48)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--skip-naive", action="store_true", help="engine only (no baseline timing)")
    ap.add_argument("--batched-baseline", action="store_true",
                    help="also time a kinder baseline: each question's N initial samples in one generate call")
    args = ap.parse_args()
    torch.manual_seed(0)
    lm = load_model(args.model or ensure_default_model())
    chat = ChatFormat(lm.tokenizer)
    questions = [q.question for q in load_dataset("gsm8k", limit=args.questions)]
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(block_size=args.block_size, max_num_seqs=128))
    init_p = lambda i: SamplingParams(n=args.n, max_tokens=args.initial_tokens, ignore_eos=True, seed=i)  # noqa: E731
    deb_p = lambda i: SamplingParams(max_tokens=args.debate_tokens, ignore_eos=True, seed=1000 + i)  # noqa: E731
    calls: list[tuple[str, list[int], int]] = []  # (kind, prompt, new tokens) in issue order
    trie, lower = Trie(), 0

    async def one_question(qi: int, q: str):
        nonlocal lower
        prompt = chat.encode([{"role": "user", "content": q}])
        out = await engine.generate(prompt, init_p(qi))
        answers = [c.token_ids for c in out.completions]
        lower += trie.add(prompt)
        for a in answers:
            trie.add(prompt + a[:-1])  # the KV written while generating it
            calls.append(("initial", prompt, len(a)))
        jobs = []
        for r in range(args.receivers):
            for s in range(1, args.S + 1):
                sender = (r + s) % args.n
                dp = chat.encode(debate_messages(q, answers[r], answers[sender]))
                jobs.append(dp)
        outs = await asyncio.gather(*(engine.generate(dp, deb_p(qi * 100 + j)) for j, dp in enumerate(jobs)))
        for dp, o in zip(jobs, outs):
            lower += max(1, trie.add(dp))
            calls.append(("debate", dp, len(o.completions[0].token_ids)))

    async def run_all():
        await asyncio.gather(*(one_question(i, q) for i, q in enumerate(questions)))

    t0 = time.perf_counter()
    asyncio.run(run_all())
    t_engine = time.perf_counter() - t0
    prefill_engine = engine.totals.computed_tokens
    prefill_naive = sum(len(p) for _, p, _ in calls)
    gen_tokens = sum(n for _, _, n in calls)
    print(f"workload: {len(questions)} questions x {args.n} samples of {args.initial_tokens} tokens, "
          f"{args.receivers} receivers x S={args.S} debates of {args.debate_tokens} tokens; {len(calls)} responses, "
          f"{gen_tokens} generated tokens")
    print(f"engine:      {t_engine:8.1f} s   prompt tokens computed {prefill_engine:7d}   ({engine.info['attention']} attention)")
    t_naive = float("nan")
    if not args.skip_naive:
        t0 = time.perf_counter()
        model = lm.model
        with torch.inference_mode():
            for i, (_, prompt, n) in enumerate(calls):
                torch.manual_seed(i)
                model.generate(torch.tensor([prompt]), do_sample=True, temperature=1.0, top_p=0.95, top_k=40,
                               max_new_tokens=n, min_new_tokens=n, pad_token_id=lm.tokenizer.pad_token_id or 0)
        t_naive = time.perf_counter() - t0
        print(f"plain loop:  {t_naive:8.1f} s   prompt tokens computed {prefill_naive:7d}   (one model.generate per response)")
    t_batched = float("nan")
    if args.batched_baseline:
        t0 = time.perf_counter()
        with torch.inference_mode():
            i = 0
            while i < len(calls):
                kind, prompt, n = calls[i]
                k = args.n if kind == "initial" else 1  # a question's N initial calls are consecutive
                torch.manual_seed(i)
                lm.model.generate(torch.tensor([prompt]), do_sample=True, temperature=1.0, top_p=0.95, top_k=40,
                                  num_return_sequences=k, max_new_tokens=n, min_new_tokens=n,
                                  pad_token_id=lm.tokenizer.pad_token_id or 0)
                i += k
        t_batched = time.perf_counter() - t0
        print(f"batched loop:{t_batched:8.1f} s   (N initial samples per generate call, debates one call each)"
              f"   speedup {t_batched / t_engine:.2f}x")
    speedup = t_naive / t_engine
    print(f"speedup {speedup:.2f}x   prompt tokens computed: engine {prefill_engine}, lower bound {lower} "
          f"(ratio {prefill_engine / lower:.3f}), plain loop {prefill_naive} ({prefill_naive / prefill_engine:.1f}x the engine)")
    print(json.dumps({
        "speedup": round(speedup, 3), "engine_s": round(t_engine, 2), "naive_s": round(t_naive, 2),
        "batched_naive_s": round(t_batched, 2), "speedup_vs_batched": round(t_batched / t_engine, 3),
        "prefill_computed": prefill_engine, "prefill_lower_bound": lower, "prefill_naive": prefill_naive,
        "prefill_ratio_to_bound": round(prefill_engine / lower, 4), "generated_tokens": gen_tokens,
        "responses": len(calls), "peak_kv_bytes": engine.info["peak_kv_bytes"], "device": str(engine.runner.device),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
