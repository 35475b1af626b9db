"""The linear backend weighed again against the run's own steps, and moved when they want another.

Why: `--linear auto` chooses at build from this machine's timings (models/calibrate.py) and a fixed
guess of the workload (the Workload's prompt tokens per generated one). A run's real mix of prefill
and decode steps can be far from that guess (the paper's long debates decode far more than the
all-methods GSM8K run the guess came from), and where the backends' ranking turns with the step size
the guess picks the wrong one for the whole run. So the engine counts its own steps (rows and kind)
and, after 32, 128, 512... steps (calibrate.RECHECK), weighs the cached figures by that count; where
another backend would have been faster over the steps so far by more than the margin, the weights
are repacked into its layout (models/linear.relayout: exact copies) between two steps, and our decoder
forward is rebuilt over them. Tokens stay exact against a reference on the same backend, as at build;
`engine.info["linear_calibration"]["run"]` holds the mix, each backend's cost over it, and the moves.
"""

from __future__ import annotations

import logging
import time

from svrmad_local.models import calibrate
from svrmad_local.models.linear import relayout

from .decoder import select_decoder

log = logging.getLogger("svrmad_local")


class RunLinears:
    """Attached to an engine whose linears `auto` calibrated: `after_step` after every step."""

    def __init__(self, eng):
        self.eng = eng
        cal = eng.built.linear_calibration
        self.mix = cal.run = calibrate.RunMix(cal, cal.choice)
        self._seen = (0, 0)

    def after_step(self) -> None:
        t = self.eng.totals
        prompt_rows, sampled = t.computed_tokens - self._seen[0], t.generated_tokens - self._seen[1]
        self._seen = (t.computed_tokens, t.generated_tokens)
        self.mix.add(prompt_rows, sampled)  # a decode row samples one token (forks add a few: a rough count)
        better = self.mix.better()
        if better is not None:
            self.move(better)

    def move(self, choice: str) -> None:
        """Repack the linears as `choice`, between steps (on the worker thread), and rebuild what holds them."""
        eng, t0, cost = self.eng, time.perf_counter(), self.mix.cost()
        ours = eng.runner.decoder is not None
        gemv = eng.runner.decoder.gemv if ours else None
        eng.runner.decoder = None  # its closures hold the old layout's weights: let them go first
        sel = relayout(eng.model, choice)
        eng.runner.lm_head = eng.model.get_output_embeddings()
        if ours:
            eng.runner.decoder, _ = select_decoder(eng.model, eng.spec, eng.cfg.decoder, eng.cfg.kernel_impl, gemv)
        self.mix.current = choice
        took = time.perf_counter() - t0
        decode_steps = getattr(eng.runner.decoder, "stack_note", None)  # the rebuilt decoder's (engine/stack.py)
        self.mix.switches.append({"after_steps": self.mix.steps, "to": choice, "cost_ms": cost, "seconds": round(took, 3),
                                  "linear": sel.line, "decode_steps": decode_steps})
        log.info("svrmad: after %d steps the run's own mix wants %s (ms of linears so far: %s); repacked in %.2f s",
                 self.mix.steps, sel.value, ", ".join(f"{calibrate.NAMES[b]} {v:.0f}" for b, v in cost.items()), took)
