"""Where a run's prompt tokens go: log every engine request of a `svrmad run`, compare what the engine
computed with an infinite cache's lower bound, and replay the requests at other KV budgets.

    python benchmarks/prompt_tokens.py record TRACE.jsonl -- run --dataset gsm8k --limit 1 ...
    python benchmarks/prompt_tokens.py bound TRACE.jsonl
    python benchmarks/prompt_tokens.py replay TRACE.jsonl BLOCKS [BLOCKS ...] [--block-size 16]

`record` runs `svrmad` in this process with `Engine._submit` wrapped, writing one line per request
(prompt tokens, n, each sample's generated tokens, prompt tokens computed, the engine steps at
submission and at the end). `bound`: each prompt less its longest prefix among the prompts submitted
before it and the prompt + generated tokens of requests finished before it (the last token is always
computed), against what the engine computed. `replay`: the real Scheduler and BlockManager (no model,
no tensors) over a pool of BLOCKS blocks, each request entering at its logged step and each sample
emitting its logged tokens: computed prompt tokens, evictions, preemptions and peak blocks, in seconds,
for budgets the machine never ran (the requests' order follows the logged run, not the replayed one).
docs/engine.md ("Where the prompt tokens go") has what it found.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from svrmad_local.engine.config import SamplingParams  # noqa: E402
from svrmad_local.engine.block_manager import BlockManager  # noqa: E402
from svrmad_local.engine.scheduler import Scheduler  # noqa: E402
from svrmad_local.engine.sequence import Request, Sequence  # noqa: E402


def record(trace: Path, argv: list[str]) -> int:
    from svrmad_local.cli import main
    from svrmad_local.engine.engine import Engine

    submit = Engine._submit
    with open(trace, "w") as f:
        async def logged(self, req):
            s0 = self.totals.steps
            out = await submit(self, req)
            f.write(json.dumps({"id": req.id, "s0": s0, "s1": self.totals.steps, "prompt": req.prompt,
                                "n": req.params.n, "computed": req.usage.computed_tokens,
                                "outs": [s.tokens[len(req.prompt):] for s in req.sequences]}) + "\n")
            return out

        Engine._submit = logged
        try:
            return main(argv)
        finally:
            Engine._submit = submit


def load(trace: Path) -> list[dict]:
    return [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]


def bound(reqs: list[dict]) -> dict:
    """Computed prompt tokens against the infinite-cache lower bound, in all."""
    trie: dict = {}

    def add(tokens):
        node = trie
        for t in tokens:
            node = node.setdefault(t, {})

    def common(tokens) -> int:
        node, k = trie, 0
        for t in tokens:
            if t not in node:
                break
            node, k = node[t], k + 1
        return k

    done = sorted(reqs, key=lambda r: r["s1"])
    i, out = 0, {"billed": 0, "computed": 0, "bound": 0}
    for r in sorted(reqs, key=lambda r: r["id"]):
        while i < len(done) and done[i]["s1"] <= r["s0"]:
            for o in done[i]["outs"]:
                add(done[i]["prompt"] + o[:-1])  # the last sampled token is never fed back
            i += 1
        n = len(r["prompt"])
        out["bound"] += n - min(common(r["prompt"]), n - 1)
        out["billed"] += n * r["n"]
        out["computed"] += r["computed"]
        add(r["prompt"])  # computed in its step: a prompt arriving with it may share it
    return out


def replay(reqs: list[dict], num_blocks: int, block_size: int = 16, max_num_seqs: int = 64,
           max_num_batched_tokens: int = 2048, blocks_class=BlockManager) -> dict:
    bm = blocks_class(num_blocks, block_size)
    sch = Scheduler(bm, max_num_seqs, max_num_batched_tokens)
    pending = sorted(reqs, key=lambda r: (r["s0"], r["id"]))[::-1]
    outs, step, computed, requests = {}, 0, 0, []
    while pending or sch.has_work():
        while pending and (pending[-1]["s0"] <= step or not sch.has_work()):
            r = pending.pop()
            req = Request(r["id"], r["prompt"], SamplingParams(n=r["n"], max_tokens=1 << 30), None)
            requests.append(req)
            outs[r["id"]] = r["outs"]
            lead = Sequence(req, 0, list(r["prompt"]), len(r["prompt"]), None, is_leader_prefill=r["n"] > 1)
            req.sequences.append(lead)
            sch.add(lead)
        batch = sch.schedule()
        if batch.rejected:
            raise ValueError(f"{num_blocks} blocks cannot hold request {batch.rejected[0][0].request.id}")
        if not batch:
            continue
        step += 1
        for w in batch.work:  # as engine/step.py counts them: fed-back sampled tokens are not prompt tokens
            computed += max(0, min(w.end, max(w.seq.num_prompt, len(w.seq.tokens) - 1)) - w.start)
        sch.postprocess(batch)
        for w in batch.work:
            seq = w.seq
            if w.end != len(seq.tokens):
                continue
            samples = [seq]
            if seq.is_leader_prefill:  # the n - 1 other samples fork from the leader's prompt KV
                seq.is_leader_prefill = False
                for j in range(1, seq.params.n):
                    samples.append(Sequence(seq.request, j, list(seq.tokens[: seq.num_prompt]), seq.num_prompt, None))
                    seq.request.sequences.append(samples[-1])
                    sch.fork(seq, samples[-1])
            for s in samples:
                logged = outs[s.request.id][s.index]
                s.tokens.append(logged[s.num_generated])
                if s.num_generated >= len(logged):
                    sch.finish(s, "stop")
    return {"blocks": num_blocks, "steps": step, "computed": computed, "evictions": bm.evictions,
            "preemptions": sum(q.usage.preemptions for q in requests), "peak_blocks": bm.peak_used}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["record"]:
        if len(argv) < 3 or argv[2] != "--":
            raise SystemExit("usage: prompt_tokens.py record TRACE.jsonl -- run ARGS...")
        return record(Path(argv[1]), argv[3:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bound")
    b.add_argument("trace", type=Path)
    r = sub.add_parser("replay")
    r.add_argument("trace", type=Path)
    r.add_argument("blocks", type=int, nargs="+")
    r.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    reqs = load(args.trace)
    if args.cmd == "bound":
        print(json.dumps(bound(reqs)))
    else:
        for n in args.blocks:
            print(json.dumps(replay(reqs, n, args.block_size)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
