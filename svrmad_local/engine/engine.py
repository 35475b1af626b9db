"""The engine: continuous batching over a paged, prefix-shared KV-cache, with token statistics.

Many coroutines (one per question's controller) call `await engine.generate(...)` at once; a single
loop gathers every pending request into one batch per step, runs the step in a worker thread (so
the event loop keeps accepting requests while the model computes) and resolves each request's
future as it finishes. `generate_sync` wraps it for scripts.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .attention import ATTN_NAME
from .kv_cache import BlockManager, CacheFull, KVCache
from .params import SamplingParams
from .runner import ModelRunner, Work
from .sampler import sample
from .scheduler import RequestTooLarge, Scheduler
from .sequence import Completion, Request, RequestOutput, ScoreOutput, Sequence
from .stats import SignalConfig, sequence_signals, stats_from_logits


@dataclass
class EngineConfig:
    """block_size: tokens per KV block. kv_cache_memory: the KV budget, as bytes (int), a fraction
    of the memory available after loading (float <= 1), or a string such as "2GiB"; None means
    90% of free GPU memory, or 2 GiB on the CPU. kernels: "auto" | "torch" | "triton", the path of
    kernels/ (fused token statistics for scoring, cascade attention): "auto" takes Triton on a GPU,
    "torch" forces the references. cascade: "auto" (on where Triton runs) | "on" | "off"."""

    block_size: int = 16
    kv_cache_memory: int | float | str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    attention: str = "auto"
    kernels: str = "auto"
    cascade: str = "auto"
    score_chunk: int = 1024
    signals: SignalConfig = field(default_factory=SignalConfig)
    seed: int = 0


@dataclass
class EngineTotals:
    requests: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "cached_tokens": self.prompt_tokens - self.computed_tokens}


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(value: int | float | str | None, available: int, default: int) -> int:
    """Bytes from an int, a fraction of `available` (a float in (0, 1], also as a string: "0.9"),
    or a "2GiB"-style string. A bare "1.5" is neither a fraction nor a whole number of bytes: error."""
    if value is None:
        return default
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmg]i?b|b)?\s*", value.lower())
        if not m:
            raise ValueError(f"kv_cache_memory {value!r}: expected bytes, a fraction or e.g. '2GiB'")
        if m.group(2):
            value = int(float(m.group(1)) * _UNITS[m.group(2)])
        else:
            value = float(m.group(1)) if "." in m.group(1) else int(m.group(1))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"kv_cache_memory {value!r}: expected bytes, a fraction or e.g. '2GiB'")
    if value <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value}")
    if isinstance(value, float):
        if value > 1:
            raise ValueError(f"kv_cache_memory {value}: a fraction must be at most 1 and bytes a whole number "
                             "(for gibibytes write e.g. '1.5GiB')")
        return int(value * available)
    return int(value)


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _keep_freed_memory() -> None:
    """glibc returns large freed blocks to the OS and page-faults them back on the next step; on a
    CPU that costs more than the attention itself. Keep them in the heap (Linux/glibc only)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX: no mmap-backed allocations
        libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of free heap
    except (OSError, AttributeError):
        pass


def _seed_for(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


class Engine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None):
        self.cfg = cfg = config or EngineConfig()
        self.model = model.eval()
        self.tokenizer = tokenizer
        mc = model.config
        if mc.model_type == "gemma2" or getattr(mc, "attn_logit_softcapping", None):
            raise ValueError("attention logit soft-capping (Gemma-2) is not supported by the paged attention")
        model.set_attn_implementation(ATTN_NAME)
        attn_modules = {m.layer_idx: m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")}
        num_layers = mc.num_hidden_layers
        if sorted(attn_modules) != list(range(num_layers)):
            raise ValueError(f"could not find the {num_layers} attention layers of {type(model).__name__}")
        devices = [next(attn_modules[i].parameters()).device for i in range(num_layers)]
        kv_heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        dtype = next(model.parameters()).dtype
        block_bytes = KVCache.bytes_per_block(num_layers, cfg.block_size, kv_heads, head_dim, dtype)
        avail = _available_memory(devices[0])
        default = int(0.9 * avail) if devices[0].type == "cuda" else min(2 * 2**30, avail // 2)
        self.kv_budget_bytes = parse_memory(cfg.kv_cache_memory, avail, default)
        num_blocks = self.kv_budget_bytes // block_bytes
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory={cfg.kv_cache_memory!r} holds {num_blocks} blocks of {block_bytes} bytes; need at least 2")
        self.block_bytes = block_bytes
        if devices[0].type == "cpu":
            _keep_freed_memory()
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        self.cache = KVCache(num_blocks, cfg.block_size, devices, kv_heads, head_dim, dtype)
        self.runner = ModelRunner(model, self.cache, cfg.block_size, cfg.attention, cfg.cascade, cfg.kernels)
        self.scheduler = Scheduler(self.blocks, self.cache, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.max_model_len = getattr(mc, "max_position_embeddings", None) or 1 << 30
        self.eos_ids = self._eos_ids()
        self.totals = EngineTotals()
        self._rng = random.Random(cfg.seed)
        self._next_id = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="svrmad-engine")
        self._loop_task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._live: dict[int, Request] = {}

    def _eos_ids(self) -> set[int]:
        ids = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            e = getattr(src, "eos_token_id", None)
            if e is not None:
                ids.update(e if isinstance(e, (list, tuple)) else [e])
        return ids

    # -- public API -------------------------------------------------------------------------
    @property
    def info(self) -> dict:
        """Which paths the engine took, for run records and benchmarks."""
        return {
            "attention": self.runner.attention_path,
            "stats": self._stats_path(),
            "block_size": self.cfg.block_size,
            "kv_blocks": self.blocks.num_blocks,
            "kv_budget_bytes": self.kv_budget_bytes,
            "peak_kv_bytes": self.blocks.peak_used * self.block_bytes,
            "evictions": self.blocks.evictions,
            **self.totals.as_dict(),
        }

    async def generate(self, prompt: list[int], params: SamplingParams | None = None) -> RequestOutput:
        params = params or SamplingParams()
        self._check_prompt(prompt)
        return await self._submit(Request(self._new_id(), prompt, params, None))

    async def score(self, prompt: list[int], continuation: list[int], topk: int = 20) -> ScoreOutput:
        """Teacher-forced statistics of `continuation` after `prompt` (the prompt's cached prefix is
        reused; the continuation's positions are always computed, in chunks)."""
        if not prompt or not continuation:
            raise ValueError("score() needs a non-empty prompt and continuation")
        self._check_prompt(prompt + continuation)
        params = SamplingParams(max_tokens=0, topk_logprobs=topk)
        return await self._submit(Request(self._new_id(), prompt + continuation, params, None, score_from=len(prompt)))

    def generate_sync(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Blocking wrapper: a list of token lists (or one list) and one or per-prompt params."""
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params] * len(prompts)

        async def run():
            return await asyncio.gather(*(self.generate(p, sp) for p, sp in zip(prompts, plist)))

        return asyncio.run(run())

    def score_sync(self, prompt: list[int], continuation: list[int], topk: int = 20) -> ScoreOutput:
        return asyncio.run(self.score(prompt, continuation, topk))

    # -- plumbing ---------------------------------------------------------------------------
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("empty prompt: a request needs at least one token")
        vocab = self.runner.lm_head.weight.shape[0]
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt holds token ids outside [0, {vocab}): {bad[:5]}")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the model's context of {self.max_model_len}")

    async def _submit(self, req: Request) -> RequestOutput | ScoreOutput:
        loop = asyncio.get_running_loop()
        req.future = loop.create_future()
        seed = req.params.seed if req.params.seed is not None else self._rng.getrandbits(62)
        gen = torch.Generator().manual_seed(_seed_for(seed, 0))
        leader = Sequence(req, 0, list(req.prompt), len(req.prompt), gen, is_leader_prefill=req.params.n > 1)
        req.seed = seed
        req.sequences.append(leader)
        self.scheduler.add(leader)  # raises RequestTooLarge before anything is queued
        self._live[req.id] = req
        self.totals.requests += 1
        self.totals.prompt_tokens += req.usage.prompt_tokens
        if self._loop_task is None or self._loop_task.done() or self._loop_task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._loop_task = loop.create_task(self._run_loop())
        self._wake.set()
        return await req.future

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
            try:
                t0 = time.perf_counter()
                done = await loop.run_in_executor(self._executor, self._step)
                self.totals.busy_s += time.perf_counter() - t0
            except Exception as exc:  # a bug or an OOM: fail every request rather than hang them
                self._fail_all(exc)
                continue
            for req in done:
                self._live.pop(req.id, None)
                if not req.future.done():
                    if req.error is not None:
                        req.future.set_exception(req.error)
                    else:
                        req.future.set_result(self._output(req))

    def _fail_all(self, exc: BaseException) -> None:
        for seq in list(self.scheduler.running):
            self.scheduler.running.remove(seq)
            self.scheduler.free(seq)
        self.scheduler.waiting.clear()
        for req in self._live.values():
            if not req.future.done():
                req.future.set_exception(exc)
        self._live.clear()

    # -- one step (worker thread) -------------------------------------------------------------
    @torch.inference_mode()
    def _step(self) -> list[Request]:
        try:
            work = self.scheduler.schedule()
        except RequestTooLarge as exc:
            seq = self.scheduler.waiting.popleft()
            seq.request.error = exc
            return [seq.request]
        if not work:
            return []
        self.totals.steps += 1
        hidden = self.runner.forward(work)
        for req in {w.seq.request for w in work}:  # distinct blocks: a shared prefix counts once
            held = len({b for s in req.sequences for b in s.blocks})
            req.usage.peak_kv_bytes = max(req.usage.peak_kv_bytes, held * self.block_bytes)
        finished: list[Request] = []
        to_sample: list[tuple[Sequence, int]] = []
        row = 0
        for w in work:
            seq, req, n = w.seq, w.seq.request, w.end - w.start
            counted = max(0, min(w.end, max(seq.num_prompt, len(seq.tokens) - 1)) - w.start)
            req.usage.computed_tokens += counted
            self.totals.computed_tokens += counted
            seq.num_computed = w.end
            if req.score_from is not None:
                self._score_rows(seq, hidden[row : row + n], w)
                if w.end == len(seq.tokens):
                    self._finish(seq, "stop", finished)
            elif w.end == len(seq.tokens):
                if req.params.max_tokens == 0:
                    self._finish(seq, "length", finished)
                else:
                    to_sample.append((seq, row + n - 1))
            row += n
        for w in work:
            if w.seq.blocks:
                self.scheduler.index_full_blocks(w.seq)
        if to_sample:
            self._sample(hidden, to_sample, finished)
        return finished

    def _sample(self, hidden: torch.Tensor, to_sample: list[tuple[Sequence, int]], finished: list[Request]) -> None:
        logits = self.runner.logits(hidden[[r for _, r in to_sample]])
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
            gens.append(seq.generator if not j else torch.Generator().manual_seed(_seed_for(seq.request.seed, j)))
        ps = [s.params for s, _ in samples]
        toks = sample(logits, [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps], gens)
        k = max(p.topk_logprobs for p in ps)
        st = stats_from_logits(logits, toks, k)
        toks_l, lp, ent = toks.tolist(), st.logprob.tolist(), st.entropy.tolist()
        tkl, tki = st.topk_logprobs.tolist(), st.topk_ids.tolist()
        for i, (seq, j) in enumerate(samples):
            target = seq
            if j:  # a new sample forks from the leader's prompt KV
                target = self._fork(seq, j, gens[i])
            kk = seq.params.topk_logprobs
            target.tokens.append(toks_l[i])
            target.logprobs.append(lp[i])
            target.entropies.append(ent[i])
            target.topk_logprobs.append(tkl[i][:kk])
            target.topk_ids.append(tki[i][:kk])
            self.totals.generated_tokens += 1
            target.request.usage.generated_tokens += 1
            reason = self._stop_reason(target)
            if reason:
                self._finish(target, reason, finished)

    def _fork(self, leader: Sequence, index: int, gen: torch.Generator) -> Sequence:
        req = leader.request
        child = Sequence(req, index, list(leader.tokens[: leader.num_prompt]), leader.num_prompt, gen)
        req.sequences.append(child)
        bs = self.cfg.block_size
        full = leader.num_computed // bs
        for b in leader.blocks[:full]:
            self.blocks.incref(b)
        child.blocks, child.num_indexed, child.num_computed = list(leader.blocks[:full]), min(full, leader.num_indexed), full * bs
        rows = leader.num_computed - full * bs
        if rows:
            try:
                self.scheduler.reserve(child, full * bs + 1)
                self.cache.copy_rows(leader.blocks[full], child.blocks[-1], rows)
                child.num_computed += rows
            except CacheFull:
                self.scheduler.free(child)  # no room now: it waits and recomputes from the cache
        if child.blocks and len(self.scheduler.running) < self.cfg.max_num_seqs:
            self.scheduler.running.append(child)
        else:
            if child.blocks:
                self.scheduler.free(child)
            self.scheduler.waiting.appendleft(child)
        return child

    def _stop_reason(self, seq: Sequence) -> str | None:
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
        seq.finish_reason = reason
        if seq in self.scheduler.running:
            self.scheduler.running.remove(seq)
        elif seq in self.scheduler.waiting:  # a fork that found no room and stopped on its first token
            self.scheduler.waiting.remove(seq)
        self.scheduler.free(seq)
        req = seq.request
        req.finished.append(seq)
        expected = 1 if req.score_from is not None or req.params.max_tokens == 0 else req.params.n
        if len(req.finished) == expected:
            req.usage.time_s = time.perf_counter() - req.t0
            finished.append(req)

    def _stats_path(self) -> str:
        try:
            import svrmad_local.kernels as kernels
        except ImportError:
            return "torch (kernels/ not importable)"
        return "kernels:" + kernels.select_impl(self.cfg.kernels, self.runner.lm_head.weight)

    def _score_rows(self, seq: Sequence, hidden: torch.Tensor, w: Work) -> None:
        """Statistics for the positions of this chunk that predict a continuation token."""
        lo = max(w.start, seq.request.score_from - 1)
        hi = min(w.end, len(seq.tokens) - 1)
        if lo >= hi:
            return
        h = hidden[lo - w.start : hi - w.start]
        targets = torch.tensor(seq.tokens[lo + 1 : hi + 1], device=h.device)
        st = self._token_stats(h, targets, seq.params.topk_logprobs)
        seq.logprobs += st.logprob.tolist()
        seq.entropies += st.entropy.tolist()
        seq.topk_logprobs += st.topk_logprobs.tolist()
        seq.topk_ids += st.topk_ids.tolist()

    def _token_stats(self, h: torch.Tensor, targets: torch.Tensor, k: int):
        """Teacher-forced statistics without [tokens x vocab] fp32 logits: the fused kernel (or its
        chunked torch reference) of kernels/, else chunks of plain logits."""
        try:
            import svrmad_local.kernels as kernels
        except ImportError:
            kernels = None
        w = self.runner.lm_head
        if kernels is not None and getattr(w, "bias", None) is None:
            return kernels.token_stats(h.to(w.weight.device), w.weight, targets.to(w.weight.device), k,
                                       impl=self.cfg.kernels, chunk_tokens=self.cfg.score_chunk, softcap=self.runner.softcap)
        parts = [stats_from_logits(self.runner.logits(h[c : c + self.cfg.score_chunk]), targets[c : c + self.cfg.score_chunk], k)
                 for c in range(0, h.shape[0], self.cfg.score_chunk)]
        return type(parts[0])(*(torch.cat([getattr(p, f) for p in parts]) for f in ("logprob", "entropy", "topk_logprobs", "topk_ids")))

    # -- outputs ----------------------------------------------------------------------------
    def _output(self, req: Request) -> RequestOutput | ScoreOutput:
        sig = self.cfg.signals
        if req.score_from is not None:
            s = req.finished[0]
            return ScoreOutput(s.logprobs, s.entropies, s.topk_logprobs, s.topk_ids,
                               sequence_signals(s.logprobs, s.entropies, s.topk_logprobs, sig), req.usage)
        comps = []
        for s in sorted(req.finished, key=lambda s: s.index):
            gen = s.tokens[s.num_prompt :]
            text = self.tokenizer.decode(gen, skip_special_tokens=True) if self.tokenizer is not None else ""
            for stop in req.params.stop:
                if stop in text:
                    text = text[: text.index(stop)]
            comps.append(Completion(s.index, gen, text, s.finish_reason, s.logprobs, s.entropies, s.topk_logprobs,
                                    s.topk_ids, sequence_signals(s.logprobs, s.entropies, s.topk_logprobs, sig)))
        return RequestOutput(req.id, req.prompt, comps, req.usage)
