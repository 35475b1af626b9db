"""One engine step (on the engine's worker thread), and what a finished request returns.

engine.py keeps the loop and the public API; the step is everything between "a batch is due" and
"these requests finished": the model's forward through the runner, the token accounting, sampling
with n>1 forks, the stop rules and scoring. `output` turns a finished request into what
`Engine.generate` or `Engine.score` returns. With `overlap` (EngineConfig.overlap) a decode step stays in
flight (`InFlight`) while the next one is scheduled and launched, so the host's work for a step runs while
the device computes the one before (docs/engine.md, "Overlap").
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

from svrmad_local import kernels
from svrmad_local.errors import UserError
from svrmad_local.kernels._backend import staged

from . import sampler
from .config import SignalConfig
from .graphs import Decoded
from .scheduler import Batch, Work
from .sequence import Completion, Request, RequestOutput, ScoreOutput, Sequence
from .stats import sequence_signals, stats_from_logits, unpack


def seed_for(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed`: each sample draws from its own stream,
    so its tokens do not depend on what else shares the batch."""
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


class NonFiniteLogits(UserError, RuntimeError):
    """The model's logits for a request's next token held NaN or infinity: no distribution to sample or to
    take statistics of. The request fails; the others in its steps go on."""


# the token a sequence holds between the step that samples it and the host's read of that step: the next step
# takes the real one on the device, the read puts it in place, and nothing indexes a position past the computed
PLACEHOLDER = 0


@dataclass
class InFlight:
    """A static decode step launched whose tokens the host has not read (EngineConfig.overlap): each row's
    sequence holds a placeholder where the row's token goes (at `at`), the next step reads the tokens from
    `packed` on the device, and `host` receives them without blocking (`done` marks it on CUDA). A row
    whose sequence the step before ended (read after this one launched) holds no place (at -1) and is
    dropped. `ending`: the sequences that end by length here, whatever they sample (not scheduled again)."""

    seqs: list[Sequence]
    at: list[int]
    packed: torch.Tensor
    host: torch.Tensor
    done: object = None
    ending: frozenset = frozenset()

    @classmethod
    def start(cls, seqs: list[Sequence], packed: torch.Tensor, max_model_len: int) -> "InFlight":
        # copied out before anything later is queued: a replayed graph writes its rows into the same buffer
        # at its next replay, which the next step may be
        done = None
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host = packed.clone()
        at = []
        for seq in seqs:  # a row whose sequence has ended since its launch holds no place (-1)
            at.append(-1 if seq.finish_reason is not None else len(seq.tokens))
            if at[-1] >= 0:
                seq.tokens.append(PLACEHOLDER)
        ending = frozenset(s for s, a in zip(seqs, at)
                           if a >= 0 and (s.num_generated >= s.params.max_tokens or len(s.tokens) >= max_model_len))
        return cls(seqs, at, packed, host, done, ending)

    def read(self) -> list[list[float]]:
        """The rows, once the step has run (waits for this step alone, not for one launched after it)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class Step:
    """One engine step, run on the engine's worker thread: schedule a batch, run the model over it,
    count the computed prompt tokens and the KV held, then sample the rows that end a sequence's
    known tokens (forking the n-1 other samples of an n>1 request from its leader's prompt KV),
    apply the stop rules, and compute the teacher-forced statistics of scoring requests.

    It holds what a step reads and writes, and nothing of the event loop: the engine calls `run()`
    and resolves the futures of the requests it returns."""

    def __init__(self, scheduler, runner, totals, *, block_bytes: int, eos_ids: set[int], tokenizer,
                 max_model_len: int, kernel_impl: str, score_chunk: int, watch=None, overlap: bool = False):
        self.scheduler, self.runner, self.totals = scheduler, runner, totals
        self.block_bytes, self.eos_ids, self.tokenizer = block_bytes, eos_ids, tokenizer
        # kernel_impl goes to the statistics kernel as given: where it runs was chosen at build (the record's
        # stats choice, engine/choices.py); under "auto" the kernel only reacts to a Triton failure since
        self.max_model_len, self.kernel_impl, self.score_chunk = max_model_len, kernel_impl, score_chunk
        self.watch = watch  # threads.BarrierSleepWatch on the CPU: warns when other torch work slows the steps
        self.overlap = overlap  # launch each decode step before reading the last one's tokens (EngineConfig.overlap)
        self.inflight: InFlight | None = None

    @torch.inference_mode()
    def run(self) -> list[Request]:
        """Schedule, run the model once, account, sample or score; the requests that finished.

        With a step in flight (`overlap`), the next decode step is scheduled and launched first, its ids
        taken from the step in flight on the device; only then is the step in flight read (its tokens, stop
        rules), and the new step goes in flight. Where the next step cannot take its ids on the device (not
        a static decode step sampling inside, a sequence waiting to be admitted), the step in flight is read
        first and the next step runs as any other."""
        finished: list[Request] = []
        prev, self.inflight = self.inflight, None
        if prev is not None and self.scheduler.can_admit():  # admission reads every token: read the step first
            self._land(prev, finished)
            prev = None
        batch = self.scheduler.schedule() if prev is None else self.scheduler.schedule(admit=False, skip=prev.ending)
        for seq, exc in batch.rejected:
            seq.request.error = exc
            self.scheduler.abort(seq.request)
            finished.append(seq.request)
        if prev is not None:
            launched = self._launch_fed(batch, prev) if batch else None
            self._land(prev, finished)
            # rows whose sequence the read step ended (their blocks went back) are not kept
            batch.decode = [w for w in batch.decode if w.seq.finish_reason is None]
            batch.prefill = [w for w in batch.prefill if w.seq.finish_reason is None]
            if launched is not None:
                self._settle(batch)
                self.inflight = InFlight.start(*launched, self.max_model_len)
                return finished
        if not batch:
            return finished
        self.totals.steps += 1
        draws = self._draws(batch)
        out = self.runner.forward(batch, draws)
        hidden, packed = (out.hidden, out.packed) if isinstance(out, Decoded) else (out, None)
        self._settle(batch)
        if packed is not None and self.overlap:  # every row samples, inside the static step: read it next step
            self.inflight = InFlight.start([w.seq for w in batch.decode], packed, self.max_model_len)
            return finished
        self._sample_or_score(batch, hidden, finished, draws, packed)
        return finished

    def _launch_fed(self, batch: Batch, prev: InFlight) -> tuple[list[Sequence], torch.Tensor] | None:
        """Launch `batch`, scheduled before `prev`'s tokens were read, with its ids taken on the device from
        `prev`'s rows: where it is a static decode step that samples inside and each row continues a
        sequence of `prev`. Its rows' sequences and packed rows, or None (nothing ran, no stream moved)."""
        static, rows = self.runner.static, {s: i for i, s in enumerate(prev.seqs)}
        if batch.prefill or any(w.seq not in rows for w in batch.decode):
            return None
        step = self.runner.prepare(batch)
        seqs = [w.seq for w in batch.decode]
        if static.shape(step) is None or not static.fits(sampler.widths([s.params for s in seqs],
                                                                        self.runner.lm_head.out_features)):
            return None
        draws = self._draws(batch)  # the first thing here to move a stream: after every check that can say no
        if draws is None:
            return None
        self.totals.steps += 1
        self.totals.overlapped_steps += 1
        out = self.runner.forward(batch, draws, fed=(prev.packed, [rows[s] for s in seqs]), step=step)
        return seqs, out.packed

    def _land(self, prev: InFlight, finished: list[Request]) -> None:
        """Read a step in flight: each row's token takes its placeholder's place, with its statistics and
        the stop rules, as the step read at once would have; the rows of ended sequences are dropped."""
        read = prev.read()
        for i, (seq, at) in enumerate(zip(prev.seqs, prev.at)):
            if at < 0:  # its sequence ended at the step before, read after this one launched
                self.totals.dropped_rows += 1
                continue
            self._take(seq, read[i], finished, at)

    def _settle(self, batch: Batch) -> None:
        """After a step's forward: the prompt tokens it computed, the scheduler's postprocess (computed counts,
        newly filled blocks indexed), the KV its requests hold."""
        if self.watch is not None:
            self.watch.step()
        self._count_computed(batch.work)
        self.scheduler.postprocess(batch)
        self._note_peak_kv(batch.work)

    def _sample_or_score(self, batch: Batch, hidden: torch.Tensor, finished: list[Request], draws, packed) -> None:
        """The step's rows that end a sequence's known tokens sampled (or read from `packed`), scoring
        requests' rows scored; max_tokens=0 requests finished."""
        work = batch.work  # in row order
        to_sample: list[tuple[Sequence, int]] = []
        row = 0
        for w in work:
            seq, req = w.seq, w.seq.request
            if req.score_from is not None:
                self._score_rows(seq, hidden[row : row + w.num_tokens], w)
                if w.end == len(seq.tokens):
                    self._finish(seq, "stop", finished)
            elif w.end == len(seq.tokens):
                if req.params.max_tokens == 0:
                    self._finish(seq, "length", finished)
                else:
                    to_sample.append((seq, row + w.num_tokens - 1))
            row += w.num_tokens
        if to_sample:
            self._sample(hidden, to_sample, finished, draws, packed)

    def _draws(self, batch: Batch) -> sampler.Draws | None:
        """The sampling's host part of a step the static decode path may run, for it to sample inside
        (each non-greedy row draws its uniform number now, once): a step of one-token runs, each of which
        samples one token (not a prefill chunk that ends short, a scoring request, or a leader whose n>1
        first tokens fork). None for any other step: the Step samples after the forward."""
        if self.runner.static is None or batch.prefill:
            return None
        if not all(w.end == len(w.seq.tokens) and w.seq.request.score_from is None and w.seq.params.max_tokens > 0
                   and not w.seq.is_leader_prefill for w in batch.decode):
            return None
        seqs = [w.seq for w in batch.decode]
        return sampler.prepare([s.params for s in seqs], [s.generator for s in seqs], self.runner.lm_head.out_features)

    def _count_computed(self, work: list[Work]) -> None:
        """Prompt tokens run through the model (not the fed-back sampled tokens), per request and in all."""
        for w in work:
            counted = max(0, min(w.end, max(w.seq.num_prompt, len(w.seq.tokens) - 1)) - w.start)
            w.seq.request.usage.computed_tokens += counted
            self.totals.computed_tokens += counted

    def _note_peak_kv(self, work: list[Work]) -> None:
        """The most KV each request has held: its distinct blocks, so a shared prefix counts once (the
        scheduler keeps the count as blocks change: the same few operations at any context length)."""
        for req in {w.seq.request for w in work}:
            req.usage.peak_kv_bytes = max(req.usage.peak_kv_bytes, len(req.held_blocks) * self.block_bytes)

    def _sample(self, hidden: torch.Tensor, to_sample: list[tuple[Sequence, int]], finished: list[Request],
                draws: sampler.Draws | None = None, packed: torch.Tensor | None = None) -> None:
        """The sampled rows' tokens and statistics, read back in one `.tolist()`: the static step's `packed`
        rows, or computed here (sampling `draws` where the step prepared them); then forks and stop rules."""
        # a leader that just computed an n>1 prompt draws all n first tokens from the same row
        rows, samples = [], []
        for i, (seq, _) in enumerate(to_sample):
            if seq.is_leader_prefill:
                seq.is_leader_prefill = False
                for j in range(seq.params.n):
                    samples.append((seq, j))
                    rows.append(i)
            else:
                samples.append((seq, None))
                rows.append(i)
        gens = []
        for seq, j in samples:
            gens.append(seq.generator if not j else random.Random(seed_for(seq.request.seed, j)))
        if draws is not None and len(draws) != len(samples):
            raise RuntimeError(f"the step prepared {len(draws)} draws for {len(samples)} samples")
        if packed is None:
            # row indices reach the device pinned, without blocking (kernels._backend.staged); a decode step's
            # rows are already in order (the copy of [R, V] fp32 logits would cost a tenth of a step's sampling)
            at = [r for _, r in to_sample]
            if at != list(range(hidden.shape[0])):
                hidden = hidden[staged(at, torch.long, hidden.device)]
            logits = self.runner.logits(hidden)
            if rows != list(range(len(to_sample))):  # a leader's n first tokens draw from its one row
                logits = logits[staged(rows, torch.long, logits.device)]
            if draws is None:
                draws = sampler.prepare([s.params for s, _ in samples], gens, logits.shape[1])
            packed = sampler.sample_packed(logits, draws, self.runner.paths.kernel_impl, self.runner.sampling)
        read = packed.tolist()  # the step's one read back from the device
        for i, (seq, j) in enumerate(samples):
            if seq.request.error is not None:  # its first row's logits were not finite (`_take`): no forks
                continue
            target = seq
            if j:  # a new sample forks from the leader's prompt KV
                target = Sequence(seq.request, j, list(seq.tokens[: seq.num_prompt]), seq.num_prompt, gens[i])
                seq.request.sequences.append(target)
                self.scheduler.fork(seq, target)
            self._take(target, read[i], finished)

    def _take(self, seq: Sequence, row: list[float], finished: list[Request], at: int | None = None) -> None:
        """A sampled row (stats.pack's layout) into `seq`: its token appended (or put at `at`, the place a
        step in flight held for it), its statistics; then the stop rules."""
        req = seq.request
        if req.error is not None:  # a row of a request that failed earlier in this step (an n>1 sibling's)
            return
        tok, lp, ent, top_lp, top_ids = unpack(row, seq.params.topk_logprobs)
        if math.isnan(ent):  # the statistics of NaN or infinite logits (finite ones give a finite entropy)
            req.error = NonFiniteLogits(
                f"request {req.id}: the model's logits for its generated token {seq.num_generated + (at is None)} "
                f"hold NaN or infinity (a numerical overflow in the forward; --dtype fp32 avoids most); this request "
                f"stops here, the others go on")
            for s in req.sequences:  # ended: a step launched before this read drops their rows (`run`)
                s.finish_reason = s.finish_reason or "error"
            self.scheduler.abort(req)
            finished.append(req)
            return
        if at is None:
            seq.tokens.append(tok)
        else:
            seq.tokens[at] = tok
        seq.logprobs.append(lp)
        seq.entropies.append(ent)
        seq.topk_logprobs.append(top_lp)
        seq.topk_ids.append(top_ids)
        self.totals.generated_tokens += 1
        seq.request.usage.generated_tokens += 1
        reason = self._stop_reason(seq)
        if reason:
            self._finish(seq, reason, finished)

    def _stop_reason(self, seq: Sequence) -> str | None:
        """"stop" at an end-of-sequence token (unless ignored), a stop token or a stop string in the
        tail of the text; "length" at max_tokens or the model's context; else None."""
        p, tok = seq.params, seq.tokens[-1]
        if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:
            return "stop"
        if p.stop and self.tokenizer is not None:
            tail = self.tokenizer.decode(seq.tokens[max(seq.num_prompt, len(seq.tokens) - 32):], skip_special_tokens=True)
            if any(s in tail for s in p.stop):
                return "stop"
        if seq.num_generated >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, finished: list[Request]) -> None:
        if self.scheduler.finish(seq, reason):
            req = seq.request
            req.usage.time_s = time.perf_counter() - req.t0
            finished.append(req)

    def _score_rows(self, seq: Sequence, hidden: torch.Tensor, w: Work) -> None:
        """Statistics for the positions of this chunk that predict a continuation token."""
        lo = max(w.start, seq.request.score_from - 1)
        hi = min(w.end, len(seq.tokens) - 1)
        if lo >= hi:
            return
        h = hidden[lo - w.start : hi - w.start]
        targets = staged(seq.tokens[lo + 1 : hi + 1], torch.long, h.device)
        st = self._token_stats(h, targets, seq.params.topk_logprobs)
        seq.logprobs += st.logprob.tolist()
        seq.entropies += st.entropy.tolist()
        seq.topk_logprobs += st.topk_logprobs.tolist()
        seq.topk_ids += st.topk_ids.tolist()

    def _token_stats(self, h: torch.Tensor, targets: torch.Tensor, k: int):
        """Teacher-forced statistics without [tokens x vocab] fp32 logits: the fused kernel (or its
        chunked torch reference) of kernels/, else (an LM head with a bias, or one packed for oneDNN,
        whose weight only the module itself can multiply) chunks of the module's own logits."""
        w = self.runner.lm_head
        if getattr(w, "bias", None) is None and type(w) is torch.nn.Linear:
            return kernels.token_stats(h.to(w.weight.device), w.weight, targets.to(w.weight.device), k,
                                       kernel_impl=self.kernel_impl, chunk_tokens=self.score_chunk, softcap=self.runner.softcap)
        parts = [stats_from_logits(self.runner.logits(h[c : c + self.score_chunk]), targets[c : c + self.score_chunk], k)
                 for c in range(0, h.shape[0], self.score_chunk)]
        return type(parts[0])(*(torch.cat([getattr(p, f) for p in parts]) for f in ("logprob", "entropy", "topk_logprobs", "topk_ids")))


def output(req: Request, tokenizer, sig: SignalConfig) -> RequestOutput | ScoreOutput:
    """What a finished request returns (on the event loop's thread): its completions, their text cut
    at the first stop string, and the per-sequence signals; or a scoring request's statistics."""
    if req.score_from is not None:
        s = req.finished[0]
        return ScoreOutput(s.logprobs, s.entropies, s.topk_logprobs, s.topk_ids,
                           sequence_signals(s.logprobs, s.entropies, s.topk_logprobs, sig), req.usage)
    comps = []
    for s in sorted(req.finished, key=lambda s: s.index):
        gen = s.tokens[s.num_prompt :]
        text = tokenizer.decode(gen, skip_special_tokens=True) if tokenizer is not None else ""
        for stop in req.params.stop:
            if stop in text:
                text = text[: text.index(stop)]
        comps.append(Completion(s.index, gen, text, s.finish_reason, s.logprobs, s.entropies, s.topk_logprobs,
                                s.topk_ids, sequence_signals(s.logprobs, s.entropies, s.topk_logprobs, sig)))
    return RequestOutput(req.id, req.prompt, comps, req.usage)
