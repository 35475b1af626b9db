"""How much the engine's statistics move between fp32 and bf16 weights, on realistic responses.

    python benchmarks/bench_bf16_drift.py [--model PATH] [--questions 8] [--n 4] [--max-tokens 128]

Responses are generated in fp32 (GSM8K chat prompts, the paper's sampling, seeded, stopping at EOS),
then the same tokens are teacher-forced with `engine.score` under fp32 and under bf16 weights (the
bf16 engine keeps its KV in bf16 too; scoring computes the LM head in fp32 from the bf16 hidden
states and weights). Reported: mean / p99 / max absolute difference per token of the chosen
token's logprob and the entropy; per response of min-LL, perplexity (relative), mean entropy and of
the prior scores SVR-MAD compares (signals.py);
how often the top-1 (greedy) token differs; how often the top-ranked of a question's N responses
changes under each prior, and how often two responses of a question swap order. Then the generation
path alone: samples generated in bf16 against the same tokens scored in bf16. Self-check: fp32
scoring reproduces the fp32 generation's own logprobs. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch

from bench_engine import DebateWorkload
from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.config import SamplingParams
from svrmad_local.job.datasets import load_dataset
from svrmad_local.models.chat import ChatFormat
from svrmad_local.models.default import ensure_default_model
from svrmad_local.models.loader import load_model
from svrmad_local.signals import prior_score

PRIORS = ("min_ll", "ppl", "mean_entropy", "conf_mean")


def score_all(engine: Engine, pairs: list[tuple[list[int], list[int]]]) -> list:
    async def run():
        return await asyncio.gather(*(engine.score(p, c) for p, c in pairs))

    return asyncio.run(run())


def generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]):
    """(prompt, tokens) pairs of every non-empty sample, their Completions, and each question's indices."""
    pairs, completions, groups = [], [], []
    for p, o in zip(prompts, engine.generate_sync(prompts, params)):
        groups.append([])
        for c in o.completions:
            if c.token_ids:
                groups[-1].append(len(pairs))
                pairs.append((p, c.token_ids))
                completions.append(c)
    return pairs, completions, groups


def summary(x: torch.Tensor) -> dict:
    x = x.double().abs()
    return {"mean": float(x.mean()), "p99": float(x.quantile(0.99)), "max": float(x.max())}


def drift(a: list, b: list, groups: list[list[int]]) -> dict:
    """Differences between two lists of results (ScoreOutput or Completion: logprobs, entropies,
    topk_ids, signals) for the same (prompt, continuation) pairs;
    `groups` lists the response indices of each question, for top-ranked-response changes."""
    lp = torch.tensor([x for s in a for x in s.logprobs]) - torch.tensor([x for s in b for x in s.logprobs])
    ent = torch.tensor([x for s in a for x in s.entropies]) - torch.tensor([x for s in b for x in s.entropies])
    top1 = [(x[0] if x else None, y[0] if y else None) for s, t in zip(a, b) for x, y in zip(s.topk_ids, t.topk_ids)]

    def per_response(key: str, relative: bool = False) -> dict:
        va = torch.tensor([s.signals[key] for s in a], dtype=torch.float64)
        vb = torch.tensor([s.signals[key] for s in b], dtype=torch.float64)
        return summary((va - vb) / va if relative else va - vb)

    priors = {}
    for name in PRIORS:
        pa = [prior_score(s.signals, name) for s in a]
        pb = [prior_score(s.signals, name) for s in b]
        top_a = [max(g, key=lambda i: (pa[i], -i)) for g in groups]
        top_b = [max(g, key=lambda i: (pb[i], -i)) for g in groups]
        pairs = [(i, j) for g in groups for i in g for j in g if i < j]
        flips = sum((pa[i] > pa[j]) != (pb[i] > pb[j]) for i, j in pairs)
        priors[name] = {"abs_diff": summary(torch.tensor(pa) - torch.tensor(pb)),
                        "top_response_changed": sum(x != y for x, y in zip(top_a, top_b)), "questions": len(groups),
                        "pair_order_flipped": flips / max(1, len(pairs))}
    return {
        "tokens": len(lp), "responses": len(a),
        "token_logprob": summary(lp), "token_entropy": summary(ent),
        "top1_differs": sum(x != y for x, y in top1) / max(1, len(top1)),
        "min_ll": per_response("min_ll"), "ppl_relative": per_response("ppl", relative=True),
        "mean_entropy": per_response("mean_entropy"), "priors": priors,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--gen-questions", type=int, default=2,
                    help="questions whose samples are also generated in bf16, to compare with scoring them")
    args = ap.parse_args()
    path = str(args.model or ensure_default_model())

    t0 = time.perf_counter()
    lm = load_model(path, dtype="fp32")
    questions = [q.question for q in load_dataset("gsm8k", limit=args.questions)]
    wl = DebateWorkload(ChatFormat(lm.tokenizer), questions, n=args.n, initial_tokens=args.max_tokens)
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_num_seqs=128))
    prompts = [wl.initial_prompt(i) for i in range(len(wl.questions))]
    params = [SamplingParams(**{**wl.initial_sampling(i), "ignore_eos": False}) for i in range(len(prompts))]
    pairs, generated, groups = generate(engine, prompts, params)
    fp32 = score_all(engine, pairs)
    replay = max(abs(x - y) for g, sc in zip(generated, fp32) for x, y in zip(g.logprobs, sc.logprobs))
    if replay > 1e-3:
        raise SystemExit(f"fp32 scoring does not reproduce the generation's logprobs (max difference {replay:.2e})")
    del engine, lm
    lm16 = load_model(path, dtype="bf16")
    engine16 = Engine(lm16.model, lm16.tokenizer, EngineConfig(max_num_seqs=128))
    bf16 = score_all(engine16, pairs)
    d = drift(fp32, bf16, groups)
    # the generation path on its own: bf16 samples' statistics vs the same tokens scored in bf16
    k = min(args.gen_questions, len(prompts))
    pairs16, generated16, groups16 = generate(engine16, prompts[:k], params[:k])
    head = drift(generated16, score_all(engine16, pairs16), groups16)
    d.update(bf16_generation_vs_scoring={key: head[key] for key in ("tokens", "token_logprob", "token_entropy", "min_ll")},
             replay_max_abs_logprob=replay, seconds=round(time.perf_counter() - t0, 1), model=path)

    def line(name: str, s: dict, fmt: str = ".4f") -> str:
        return f"  {name:32s} mean {s['mean']:{fmt}}   p99 {s['p99']:{fmt}}   max {s['max']:{fmt}}"

    print(f"{d['responses']} responses, {d['tokens']} tokens ({len(groups)} questions x {args.n}, up to "
          f"{args.max_tokens} tokens); fp32 scoring reproduces generation to {replay:.1e}")
    print("per token |fp32 - bf16|:")
    print(line("logprob (nats)", d["token_logprob"]))
    print(line("entropy (nats)", d["token_entropy"]))
    print(f"  top-1 token differs at {d['top1_differs']:.2%} of positions")
    print("per response |fp32 - bf16|:")
    print(line("min-LL (nats)", d["min_ll"]))
    print(line("perplexity (relative)", d["ppl_relative"]))
    print(line("mean entropy (nats)", d["mean_entropy"]))
    for name, p in d["priors"].items():
        print(line(f"prior {name} (in [-1, 1])", p["abs_diff"]) +
              f"   top response changed in {p['top_response_changed']}/{p['questions']} questions, "
              f"pair order flipped {p['pair_order_flipped']:.1%}")
    h = d["bf16_generation_vs_scoring"]
    print(f"bf16 generation vs bf16 scoring of the same {h['tokens']} tokens (the generation path's own rounding):")
    print(line("logprob (nats)", h["token_logprob"]))
    print(line("entropy (nats)", h["token_entropy"]))
    print(json.dumps(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
