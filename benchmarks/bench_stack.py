"""Decode tokens/s on the CPU with the decode layers in one compiled call (engine/stack.py) against the same
engine running them layer by layer from Python, side by side in one process.

    python benchmarks/bench_stack.py [--model PATH] [--dtype bf16|fp32] [--batches 1,8,32]
        [--prompt-tokens 32] [--new-tokens 64] [--rounds 5]

One engine (our decoder, linears as panels) on the model; each round times, at each batch size, a
bench_decode pair (1 new token, then 1 + --new-tokens, on fresh prompts) with the stack and then without
it, alternating, so both sides meet the machine's same moments. Prints the medians and their ratio
(> 1: the stack is faster); last line: one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from bench_decode import alternating_args, lengths_of, load, timed_pair, warm_up
from svrmad_local.engine.engine import Engine, EngineConfig


def main(argv: list[str] | None = None) -> int:
    args, batches = alternating_args(__doc__.splitlines()[0], argv)
    lm = load(args)
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(max_num_seqs=max(batches), linear="panels"))
    decoder = engine.runner.decoder
    stack = getattr(decoder, "stack", None)
    if stack is None:
        raise SystemExit(f"the stack does not run here: {engine.info['decoder']}")
    vocab = lm.model.get_output_embeddings().out_features

    generate = lengths_of(engine)

    warm_up(generate, args, vocab)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for B in batches:
        tok_s = {"stack": [], "loop": []}
        for _ in range(args.rounds):
            for side in ("stack", "loop"):
                decoder.stack = stack if side == "stack" else None
                prefill, full = timed_pair(generate, gen, B, args, vocab)
                tok_s[side].append(B * args.new_tokens / (full - prefill))
        decoder.stack = stack
        med = {k: round(statistics.median(v), 1) for k, v in tok_s.items()}
        rows.append({"batch": B, "stack_tok_s": med["stack"], "loop_tok_s": med["loop"],
                     "ratio": round(med["stack"] / med["loop"], 3),
                     "runs": {k: [round(x, 1) for x in v] for k, v in tok_s.items()}})
        print(f"batch {B:3d}: stack {med['stack']:8.1f} tok/s   layer by layer {med['loop']:8.1f} tok/s   "
              f"{rows[-1]['ratio']:.2f}x  (medians of {args.rounds}, alternating)", flush=True)
    print(json.dumps({"dtype": args.dtype, "decoder": engine.info["decoder"], "threads": torch.get_num_threads(),
                      "rows": rows}))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
