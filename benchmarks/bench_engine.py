"""Engine vs a plain loop of `model.generate`, on one fixed debate-shaped workload.

Workload (identical for both, fixed lengths via ignore_eos / min_new_tokens): Q questions; per
question N initial samples of the question prompt, then R receivers x S pairwise debates
(prompt = [question + receiver's own answer] + DebateFormat(sender's answer)). The engine runs every
question concurrently (asyncio) with prefix reuse; the baseline is what one writes without an
engine: one `model.generate` call per agent response, in a loop, recomputing every prompt.
`DebateWorkload` and `run_engine` are shared with bench_vs_vllm.py, which runs the same workload
through vLLM.

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
from dataclasses import dataclass, field
from pathlib import Path

import torch

# this checkout's svrmad_local, not whichever one is installed (the other benchmarks import this first)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from svrmad_local.engine.engine import Engine, EngineConfig  # noqa: E402
from svrmad_local.engine.config import SamplingParams  # noqa: E402
from svrmad_local.job.datasets import load_dataset  # noqa: E402
from svrmad_local.models.chat import ChatFormat  # noqa: E402
from svrmad_local.models.default import ensure_default_model  # noqa: E402
from svrmad_local.models.loader import LoadedModel, load_model, load_tokenizer, parse_dtype  # noqa: E402


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


@dataclass
class DebateWorkload:
    """The workload, built the same way for every engine under test: prompts are token ids, and a
    question's debate prompts are built from the answers that engine itself gave (sampling settings
    are plain dicts, so a vLLM worker can take them as they are)."""

    chat: ChatFormat
    questions: list[str]
    n: int = 6
    receivers: int = 2
    S: int = 2
    initial_tokens: int = 64
    debate_tokens: int = 48

    @staticmethod
    def add_arguments(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--model", help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
        ap.add_argument("--questions", type=int, default=4)
        ap.add_argument("--n", type=int, default=6)
        ap.add_argument("--receivers", type=int, default=2)
        ap.add_argument("--S", type=int, default=2)
        ap.add_argument("--initial-tokens", type=int, default=64)
        ap.add_argument("--debate-tokens", type=int, default=48)

    @classmethod
    def from_args(cls, args, tokenizer) -> "DebateWorkload":
        if args.receivers > args.n or args.S >= args.n:
            raise SystemExit(f"--receivers ({args.receivers}) must be <= --n and --S ({args.S}) < --n ({args.n})")
        questions = [q.question for q in load_dataset("gsm8k", limit=args.questions)]
        return cls(ChatFormat(tokenizer), questions, args.n, args.receivers, args.S, args.initial_tokens, args.debate_tokens)

    def initial_prompt(self, qi: int) -> list[int]:
        return self.chat.encode([{"role": "user", "content": self.questions[qi]}])

    def initial_sampling(self, qi: int) -> dict:
        return dict(n=self.n, max_tokens=self.initial_tokens, ignore_eos=True, seed=qi,
                    temperature=1.0, top_p=0.95, top_k=40)

    def debate_prompts(self, qi: int, answers: list[list[int]]) -> list[list[int]]:
        """Receiver r is debated by senders (r + s) % n for s = 1..S."""
        q = self.questions[qi]
        return [self.chat.encode(debate_messages(q, answers[r], answers[(r + s) % self.n]))
                for r in range(self.receivers) for s in range(1, self.S + 1)]

    def debate_sampling(self, qi: int, j: int) -> dict:
        return dict(n=1, max_tokens=self.debate_tokens, ignore_eos=True, seed=1000 + qi * 100 + j,
                    temperature=1.0, top_p=0.95, top_k=40)

    @property
    def expected_generated(self) -> int:
        return len(self.questions) * (self.n * self.initial_tokens + self.receivers * self.S * self.debate_tokens)

    def describe(self) -> str:
        return (f"{len(self.questions)} questions x {self.n} samples of {self.initial_tokens} tokens, "
                f"{self.receivers} receivers x S={self.S} debates of {self.debate_tokens} tokens")


@dataclass
class QuestionRun:
    """What one engine did on one question: its prompt, answers, debate prompts and replies."""

    prompt: list[int]
    answers: list[list[int]] = field(default_factory=list)
    debate_prompts: list[list[int]] = field(default_factory=list)
    replies: list[list[int]] = field(default_factory=list)


def run_engine(engine: Engine, wl: DebateWorkload) -> tuple[float, list[QuestionRun]]:
    """Every question concurrently (one coroutine each, as the debate layer does); wall seconds."""
    runs = [QuestionRun(wl.initial_prompt(i)) for i in range(len(wl.questions))]

    async def one_question(qi: int) -> None:
        run = runs[qi]
        out = await engine.generate(run.prompt, SamplingParams(**wl.initial_sampling(qi)))
        run.answers = [c.token_ids for c in out.completions]
        run.debate_prompts = wl.debate_prompts(qi, run.answers)
        outs = await asyncio.gather(*(engine.generate(dp, SamplingParams(**wl.debate_sampling(qi, j)))
                                      for j, dp in enumerate(run.debate_prompts)))
        run.replies = [o.completions[0].token_ids for o in outs]

    async def run_all() -> None:
        await asyncio.gather(*(one_question(i) for i in range(len(runs))))

    t0 = time.perf_counter()
    asyncio.run(run_all())
    return time.perf_counter() - t0, runs


def check_runs(runs: list[QuestionRun], wl: DebateWorkload, who: str) -> int:
    """Generated tokens, after checking every response has its fixed length (ignore_eos)."""
    for qi, run in enumerate(runs):
        got = [len(a) for a in run.answers] + [len(r) for r in run.replies]
        want = [wl.initial_tokens] * wl.n + [wl.debate_tokens] * (wl.receivers * wl.S)
        if got != want:
            raise SystemExit(f"{who}: question {qi} produced response lengths {got}, expected {want}")
    return sum(len(a) for r in runs for a in r.answers + r.replies)


def prefill_lower_bound(runs: list[QuestionRun]) -> int:
    """Unique-prefix count: every initial prompt, then every debate prompt (at least its last token,
    whose logits are needed), with each answer's written KV (all but its last token) counted as cached."""
    trie, lower = Trie(), 0
    for run in runs:
        lower += trie.add(run.prompt)
        for a in run.answers:
            trie.add(run.prompt + a[:-1])
    for run in runs:
        for dp in run.debate_prompts:
            lower += max(1, trie.add(dp))
    return lower


def calls(runs: list[QuestionRun]) -> list[tuple[str, list[int], int]]:
    """(kind, prompt, new tokens) of every response; a question's initial calls are consecutive."""
    out = []
    for run in runs:
        out += [("initial", run.prompt, len(a)) for a in run.answers]
    for run in runs:
        out += [("debate", dp, len(r)) for dp, r in zip(run.debate_prompts, run.replies)]
    return out


def engine_overrides(text: str | None) -> dict:
    """EngineConfig fields from "linear=aten,attention=sdpa" (a variant to time beside the default)."""
    out = {}
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        if key not in EngineConfig.__dataclass_fields__ or not value:
            raise SystemExit(f"engine option {part!r}: expected FIELD=VALUE with FIELD one of "
                             f"{', '.join(sorted(EngineConfig.__dataclass_fields__))}")
        out[key] = int(value) if value.isdigit() else value
    return out


def load_bench_model(args) -> LoadedModel:
    path = args.model or ensure_default_model()
    if not args.random_weights:
        return load_model(path, dtype=args.dtype, device=args.device)
    from transformers import AutoConfig, AutoModelForCausalLM

    device = args.device or "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=parse_dtype(args.dtype, device))
    return LoadedModel(model.eval(), load_tokenizer(Path(path)), Path(path))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    DebateWorkload.add_arguments(ap)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", help="cpu, cuda... (default: load_model's choice)")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="weights (default: load_model's choice)")
    ap.add_argument("--cascade", choices=["auto", "on", "off"], default="auto", help="EngineConfig.cascade")
    ap.add_argument("--engine", help="EngineConfig overrides for the engine, e.g. linear=aten,attention=sdpa")
    ap.add_argument("--random-weights", action="store_true",
                    help="random weights from --model's config (a checkpoint's shape without its weights: timing only)")
    ap.add_argument("--skip-naive", action="store_true", help="engine only (no baseline timing)")
    ap.add_argument("--batched-baseline", action="store_true",
                    help="also time a kinder baseline: each question's N initial samples in one generate call")
    args = ap.parse_args()
    torch.manual_seed(0)
    lm = load_bench_model(args)
    wl = DebateWorkload.from_args(args, lm.tokenizer)
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(**{"block_size": args.block_size, "max_num_seqs": 128,
                                                            "cascade": args.cascade, **engine_overrides(args.engine)}))
    t_engine, runs = run_engine(engine, wl)
    gen_tokens = check_runs(runs, wl, "engine")
    prefill_engine = engine.totals.computed_tokens
    lower = prefill_lower_bound(runs)
    work = calls(runs)
    prefill_naive = sum(len(p) for _, p, _ in work)
    print(f"workload: {wl.describe()}; {len(work)} responses, {gen_tokens} generated tokens")
    print(f"engine:      {t_engine:8.1f} s   prompt tokens computed {prefill_engine:7d}   ({engine.info['attention']} "
          f"attention; linear {engine.info['linear']})")
    t_naive = float("nan")
    if not args.skip_naive:
        t0 = time.perf_counter()
        model = lm.model
        with torch.inference_mode():
            for i, (_, prompt, n) in enumerate(work):
                torch.manual_seed(i)
                model.generate(torch.tensor([prompt], device=model.device), do_sample=True, temperature=1.0, top_p=0.95, top_k=40,
                               max_new_tokens=n, min_new_tokens=n, pad_token_id=lm.tokenizer.pad_token_id or 0)
        t_naive = time.perf_counter() - t0
        print(f"plain loop:  {t_naive:8.1f} s   prompt tokens computed {prefill_naive:7d}   (one model.generate per response)")
    t_batched = float("nan")
    if args.batched_baseline:
        t0 = time.perf_counter()
        with torch.inference_mode():
            i = 0
            while i < len(work):
                kind, prompt, n = work[i]
                k = args.n if kind == "initial" else 1  # a question's N initial calls are consecutive
                torch.manual_seed(i)
                lm.model.generate(torch.tensor([prompt], device=lm.model.device), do_sample=True, temperature=1.0, top_p=0.95, top_k=40,
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
        "responses": len(work), "peak_kv_bytes": engine.info["peak_kv_bytes"], "device": str(engine.runner.device),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
