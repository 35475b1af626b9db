"""One engine step (on the engine's worker thread), and what a finished request returns.

Moved out of engine.py whole: each function takes the engine it serves.
"""

from __future__ import annotations

import random
import time

import torch

from svrmad_local import kernels

from .sampler import sample
from .scheduler import Work
from .sequence import Completion, Request, RequestOutput, ScoreOutput, Sequence
from .stats import sequence_signals, stats_from_logits


def seed_for(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


@torch.inference_mode()
def step(eng) -> list[Request]:
    batch = eng.scheduler.schedule()
    finished: list[Request] = []
    for seq, exc in batch.rejected:
        seq.request.error = exc
        eng.scheduler.abort(seq.request)
        finished.append(seq.request)
    if not batch:
        return finished
    eng.totals.steps += 1
    hidden = eng.runner.forward(batch)
    if eng._watch is not None:
        eng._watch.step()
    work = batch.work  # in row order
    for w in work:  # prompt tokens run through the model (not the fed-back sampled tokens)
        counted = max(0, min(w.end, max(w.seq.num_prompt, len(w.seq.tokens) - 1)) - w.start)
        w.seq.request.usage.computed_tokens += counted
        eng.totals.computed_tokens += counted
    eng.scheduler.postprocess(batch)
    for req in {w.seq.request for w in work}:  # distinct blocks: a shared prefix counts once
        held = len({b for s in req.sequences for b in s.blocks})
        req.usage.peak_kv_bytes = max(req.usage.peak_kv_bytes, held * eng.block_bytes)
    to_sample: list[tuple[Sequence, int]] = []
    row = 0
    for w in work:
        seq, req = w.seq, w.seq.request
        if req.score_from is not None:
            _score_rows(eng, seq, hidden[row : row + w.num_tokens], w)
            if w.end == len(seq.tokens):
                _finish(eng, seq, "stop", finished)
        elif w.end == len(seq.tokens):
            if req.params.max_tokens == 0:
                _finish(eng, seq, "length", finished)
            else:
                to_sample.append((seq, row + w.num_tokens - 1))
        row += w.num_tokens
    if to_sample:
        _sample(eng, hidden, to_sample, finished)
    return finished


def _sample(eng, hidden: torch.Tensor, to_sample: list[tuple[Sequence, int]], finished: list[Request]) -> None:
    logits = eng.runner.logits(hidden[[r for _, r in to_sample]])
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
    logits = logits[rows]
    gens = []
    for seq, j in samples:
        gens.append(seq.generator if not j else random.Random(seed_for(seq.request.seed, j)))
    ps = [s.params for s, _ in samples]
    toks = sample(logits, [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps], gens)
    k = max(p.topk_logprobs for p in ps)
    st = stats_from_logits(logits, toks, k)
    toks_l, lp, ent = toks.tolist(), st.logprob.tolist(), st.entropy.tolist()
    tkl, tki = st.topk_logprobs.tolist(), st.topk_ids.tolist()
    for i, (seq, j) in enumerate(samples):
        target = seq
        if j:  # a new sample forks from the leader's prompt KV
            target = Sequence(seq.request, j, list(seq.tokens[: seq.num_prompt]), seq.num_prompt, gens[i])
            seq.request.sequences.append(target)
            eng.scheduler.fork(seq, target)
        kk = seq.params.topk_logprobs
        target.tokens.append(toks_l[i])
        target.logprobs.append(lp[i])
        target.entropies.append(ent[i])
        target.topk_logprobs.append(tkl[i][:kk])
        target.topk_ids.append(tki[i][:kk])
        eng.totals.generated_tokens += 1
        target.request.usage.generated_tokens += 1
        reason = _stop_reason(eng, target)
        if reason:
            _finish(eng, target, reason, finished)


def _stop_reason(eng, seq: Sequence) -> str | None:
    p, tok = seq.params, seq.tokens[-1]
    if (not p.ignore_eos and tok in eng.eos_ids) or tok in p.stop_token_ids:
        return "stop"
    if p.stop and eng.tokenizer is not None:
        tail = eng.tokenizer.decode(seq.tokens[max(seq.num_prompt, len(seq.tokens) - 32):], skip_special_tokens=True)
        if any(s in tail for s in p.stop):
            return "stop"
    if seq.num_generated >= p.max_tokens or len(seq.tokens) >= eng.max_model_len:
        return "length"
    return None


def _finish(eng, seq: Sequence, reason: str, finished: list[Request]) -> None:
    if eng.scheduler.finish(seq, reason):
        req = seq.request
        req.usage.time_s = time.perf_counter() - req.t0
        finished.append(req)


def _stats_path(eng) -> str:
    return "kernels:" + kernels.select_impl(eng.cfg.kernel_impl, eng.runner.lm_head.weight)


def _score_rows(eng, seq: Sequence, hidden: torch.Tensor, w: Work) -> None:
    """Statistics for the positions of this chunk that predict a continuation token."""
    lo = max(w.start, seq.request.score_from - 1)
    hi = min(w.end, len(seq.tokens) - 1)
    if lo >= hi:
        return
    h = hidden[lo - w.start : hi - w.start]
    targets = torch.tensor(seq.tokens[lo + 1 : hi + 1], device=h.device)
    st = _token_stats(eng, h, targets, seq.params.topk_logprobs)
    seq.logprobs += st.logprob.tolist()
    seq.entropies += st.entropy.tolist()
    seq.topk_logprobs += st.topk_logprobs.tolist()
    seq.topk_ids += st.topk_ids.tolist()


def _token_stats(eng, h: torch.Tensor, targets: torch.Tensor, k: int):
    """Teacher-forced statistics without [tokens x vocab] fp32 logits: the fused kernel (or its
    chunked torch reference) of kernels/, else (an LM head with a bias, or one packed for oneDNN,
    whose weight only the module itself can multiply) chunks of the module's own logits."""
    w = eng.runner.lm_head
    if getattr(w, "bias", None) is None and type(w) is torch.nn.Linear:
        return kernels.token_stats(h.to(w.weight.device), w.weight, targets.to(w.weight.device), k,
                                   kernel_impl=eng.cfg.kernel_impl, chunk_tokens=eng.cfg.score_chunk, softcap=eng.runner.softcap)
    parts = [stats_from_logits(eng.runner.logits(h[c : c + eng.cfg.score_chunk]), targets[c : c + eng.cfg.score_chunk], k)
             for c in range(0, h.shape[0], eng.cfg.score_chunk)]
    return type(parts[0])(*(torch.cat([getattr(p, f) for p in parts]) for f in ("logprob", "entropy", "topk_logprobs", "topk_ids")))


def _output(eng, req: Request) -> RequestOutput | ScoreOutput:
    sig = eng.cfg.signals
    if req.score_from is not None:
        s = req.finished[0]
        return ScoreOutput(s.logprobs, s.entropies, s.topk_logprobs, s.topk_ids,
                           sequence_signals(s.logprobs, s.entropies, s.topk_logprobs, sig), req.usage)
    comps = []
    for s in sorted(req.finished, key=lambda s: s.index):
        gen = s.tokens[s.num_prompt :]
        text = eng.tokenizer.decode(gen, skip_special_tokens=True) if eng.tokenizer is not None else ""
        for stop in req.params.stop:
            if stop in text:
                text = text[: text.index(stop)]
        comps.append(Completion(s.index, gen, text, s.finish_reason, s.logprobs, s.entropies, s.topk_logprobs,
                                s.topk_ids, sequence_signals(s.logprobs, s.entropies, s.topk_logprobs, sig)))
    return RequestOutput(req.id, req.prompt, comps, req.usage)
