"""Decode tokens/s with the engine's steps run back to back on its worker thread (engine.py `STEPS_FOR_S`)
against one step a hand-off from the event loop, side by side in one process.

    python benchmarks/bench_handoff.py [--model PATH] [--dtype bf16|fp32] [--batches 1,8,32]
        [--prompt-tokens 32] [--new-tokens 64] [--rounds 5]

One engine on the model; each round times, at each batch size, a bench_decode pair (1 new token, then
1 + --new-tokens, on fresh prompts) with steps back to back and then with STEPS_FOR_S = 0 (the worker
returns to the loop after every step, as it once did), alternating, so both sides meet the machine's same
moments. Also the mean time between one step's end and the next one's start on the worker thread, the
part a hand-off costs. Prints the medians and their ratio (> 1: back to back is faster); last line: one
JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from bench_decode import alternating_args, lengths_of, load, timed_pair, warm_up
from svrmad_local.engine import engine as engine_mod
from svrmad_local.engine.engine import Engine, EngineConfig

SIDES = {"back to back": engine_mod.STEPS_FOR_S, "one a hand-off": 0.0}


def main(argv: list[str] | None = None) -> int:
    args, batches = alternating_args(__doc__.splitlines()[0], argv)
    lm = load(args)
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_num_seqs=max(batches)))
    vocab = lm.model.get_output_embeddings().out_features
    marks: list[tuple[float, float]] = []  # (start, end) of each step on the worker thread
    step = engine._step

    def marked():
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            marks.append((t0, time.perf_counter()))

    engine._step = marked

    generate = lengths_of(engine)

    warm_up(generate, args, vocab)
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for B in batches:
            tok_s, gaps = {s: [] for s in SIDES}, {s: [] for s in SIDES}
            for _ in range(args.rounds):
                for side, seconds in SIDES.items():
                    engine_mod.STEPS_FOR_S = seconds
                    prefill, full = timed_pair(generate, gen, B, args, vocab)
                    tok_s[side].append(B * args.new_tokens / (full - prefill))
                    steps = marks[-args.new_tokens:]  # the full run's decode steps
                    gaps[side] += [b[0] - a[1] for a, b in zip(steps, steps[1:])]
                    marks.clear()
            med = {s: round(statistics.median(v), 1) for s, v in tok_s.items()}
            gap = {s: 1e3 * statistics.fmean(v) for s, v in gaps.items()}
            a, b = SIDES
            rows.append({"batch": B, "back_to_back_tok_s": med[a], "one_a_handoff_tok_s": med[b],
                         "ratio": round(med[a] / med[b], 3), "gap_ms": {s: round(g, 3) for s, g in gap.items()},
                         "runs": {s: [round(x, 1) for x in v] for s, v in tok_s.items()}})
            print(f"batch {B:3d}: back to back {med[a]:8.1f} tok/s ({gap[a]:.3f} ms between steps)   one a hand-off "
                  f"{med[b]:8.1f} tok/s ({gap[b]:.3f} ms)   {rows[-1]['ratio']:.3f}x  (medians of {args.rounds}, "
                  f"alternating)", flush=True)
    finally:
        engine_mod.STEPS_FOR_S = SIDES["back to back"]
    print(json.dumps({"dtype": args.dtype, "steps_for_s": SIDES["back to back"], "threads": torch.get_num_threads(),
                      "rows": rows}))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
