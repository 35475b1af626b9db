"""The linear calibration `--linear auto` runs (models/calibrate.py), timed afresh and printed as a table:
ms of one step's linears per backend, per decode size and prefill chunk, the expected ms per generated
token and the choice. Run it on a quiet machine to read what `auto` picks there; it does not touch the
engine's cached figures unless --save. Last line one JSON object.

    python benchmarks/bench_calibrate.py [--model PATH] [--dtype fp32] [--budget 3] [--prompt-per-generated 5]
                                         [--max-num-seqs 64] [--max-num-batched-tokens 2048] [--save]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from svrmad_local.engine.config import EngineConfig  # noqa: E402
from svrmad_local.models import calibrate  # noqa: E402
from svrmad_local.models.default import ensure_default_model  # noqa: E402
from svrmad_local.models.linear import _why_not_onednn, _why_not_panels  # noqa: E402
from svrmad_local.models.loader import load_model  # noqa: E402


def main() -> int:
    ec = EngineConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--budget", type=float, default=3.0, help="seconds of timed calls (setup comes on top)")
    ap.add_argument("--prompt-per-generated", type=float, default=calibrate.Workload.prompt_per_generated)
    ap.add_argument("--max-num-seqs", type=int, default=ec.max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=int, default=ec.max_num_batched_tokens)
    ap.add_argument("--save", action="store_true", help="store the figures as the engine's cached calibration")
    args = ap.parse_args()
    model = load_model(args.model or ensure_default_model(), device="cpu", dtype=args.dtype).model
    w = next(m.weight for m in model.modules() if type(m) is torch.nn.Linear)
    why = {"panels": _why_not_panels(model, w.device, w.dtype), "onednn": _why_not_onednn(model, w.device, w.dtype),
           "aten": None}
    for b, reason in why.items():
        if reason:
            print(f"{b}: cannot run here: {reason}")
    wl = calibrate.Workload.for_engine(args.max_num_seqs, args.max_num_batched_tokens,
                                       prompt_per_generated=args.prompt_per_generated)
    os.environ["SVRMAD_CALIBRATE"] = "again"
    with tempfile.TemporaryDirectory(prefix="svrmad-calibrate-") as scratch:
        if not args.save:  # time afresh into a scratch cache: the engine's cached figures stay as they are
            os.environ["SVRMAD_CACHE"] = scratch
        t0 = time.perf_counter()
        cal = calibrate.calibrate(model, [b for b, r in why.items() if r is None], wl, budget_s=args.budget)
        took = time.perf_counter() - t0
    cpu = calibrate.cpu_id()
    print(f"{cpu['model']} ({' '.join(cpu['flags'])}), {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{args.dtype}; ms of one step's linears (prefill: the head on 1 row); calibration took {took:.1f} s")
    print(calibrate.table(cal))
    print(json.dumps({"cpu": cpu, "threads": torch.get_num_threads(), "seconds": round(took, 2), **cal.as_dict()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
