"""The engine: continuous batching over a paged, prefix-shared KV-cache, with token statistics.

Many coroutines (one per question's controller) call `await engine.generate(...)` at once; a single
loop gathers every pending request into one batch per step, runs the step in a worker thread (so
the event loop keeps accepting requests while the model computes) and resolves each request's
future as it finishes. `generate_sync` wraps it for scripts.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Union

import torch

from svrmad_local import kernels
from svrmad_local.models.linear import select_linear, weight_bytes

from .attention import Attachment
from .kv_cache import BlockManager, KVCache
from .lean import select_decoder
from .memory import keep_freed_memory, kv_budget, parse_memory  # noqa: F401  (parse_memory: public)
from .params import SamplingParams
from .runner import ModelRunner
from .sampler import sample
from .scheduler import RequestTooLarge, Scheduler, Work  # noqa: F401  (RequestTooLarge: public)
from .sequence import Completion, Request, RequestOutput, ScoreOutput, Sequence
from .threads import BarrierSleepWatch, release_team
from .spec import inspect_model
from . import graphs, tp
from .stats import SignalConfig, sequence_signals, stats_from_logits


log = logging.getLogger("svrmad_local")

Prompt = Union[list[int], str, list[dict]]


@dataclass
class EngineConfig:
    """block_size: tokens per KV block. kv_cache_memory: the KV budget, as bytes (int), a fraction
    of the memory available after loading (float <= 1), or a string such as "2GiB"; None means
    90% of free GPU memory, or 2 GiB on the CPU. kernel_impl: "auto" | "torch" | "triton", the path of
    kernels/ (fused token statistics for scoring, cascade attention): "auto" takes Triton on a GPU,
    "torch" forces the references. cascade: "auto" (off: measured slower, see runner._cascade_enabled) | "on" | "off".
    linear: "auto" | "panels" | "onednn" | "aten", how the model's linears run (models/linear.py): "auto"
    packs fp32 weights into our kernel's panels on the CPU (else oneDNN's layout, else F.linear) and says
    why not where it cannot; the packing is done in place, once.

    decoder: "auto" | "lean" | "modules", how the layers run (engine/lean.py): "auto" takes the lean
    forward (fused norms, RoPE and cache writes; bitwise the modules' computation with those norms) for
    fp32 Llama/Mistral/Qwen2/Qwen3 on the CPU, else the model's own modules, saying why.

    mla: "absorbed" (decode rows of multi-head latent attention read the cached latent, engine/mla.py) |
    "expanded" (transformers' own expansion of the whole context at every step, the reference).

    cuda_graphs: "auto" | "on" | "static" | "off" (engine/graphs.py): decode-only steps at fixed batch
    sizes over static buffers, captured in CUDA graphs and replayed; "auto" takes them on a CUDA device
    when nothing rules them out and says why not in `info["cuda_graphs"]`, "on" makes a reason an
    error, "static" runs the same fixed-shape path eagerly on any device (what a graph would record)."""

    block_size: int = 16  # 256 (a flash-attn page) lets flash-attn read the cache in place
    kv_cache_memory: int | float | str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    attention: str = "auto"
    kernel_impl: str = "auto"
    cascade: str = "auto"
    linear: str = "auto"
    decoder: str = "auto"
    mla: str = "absorbed"
    cuda_graphs: str = "auto"
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


def _layer_device(model, layers, i: int) -> torch.device:
    """Where layer i's KV lives: its own device under an accelerate device map."""
    if layers is not None and i < len(layers):
        p = next(layers[i].parameters(), None)
        if p is not None:
            return p.device
    return model.base_model.get_input_embeddings().weight.device


def _seed_for(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


class Engine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None):
        self.cfg = cfg = config or EngineConfig()
        self.model = model.eval()
        self.tokenizer = tokenizer
        # Every torch op of the engine, its construction included (the oneDNN reorders, the probe,
        # the cache's zero fill), runs on its one worker thread: with the GNU OpenMP that torch uses,
        # each thread that runs a parallel op keeps its own team of threads, and once more threads are
        # kept than there are cores, every team stops spinning at its barriers and sleeps instead
        # (docs/engine.md, "One worker thread"). Built on the caller's thread, the engine's steps
        # slept ~50 times each and `svrmad run` left one of two cores mostly idle.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="svrmad-engine")
        try:
            self._executor.submit(self._build, model, cfg).result()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        # The caller's own idle team (from loading the model, say) counts too: hand it back, here and
        # on each request (cheap when there is none). Measured: one torch op on the caller before the
        # engine made batch-4 steps sleep 66 times each, 119.5 ms a step against 110.6 ms once handed back.
        release_team()
        self.scheduler = Scheduler(self.blocks, self.cache, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.eos_ids = self._eos_ids()
        self.totals = EngineTotals()
        self._rng = random.Random(cfg.seed)
        self._next_id = 0
        self._loop_task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._live: dict[int, Request] = {}
        self._chat = None

    def _build(self, model, cfg: EngineConfig) -> None:
        """The engine's torch state (worker thread): linears, probe, KV-cache, runner."""
        attached = Attachment(model)
        self.linear_path = select_linear(model, cfg.linear)
        self.weight_bytes = weight_bytes(model)
        self.spec = spec = inspect_model(model, attached)  # raises UnsupportedModel, naming the feature
        layers = model.base_model.layers if hasattr(model.base_model, "layers") else None
        devices = [_layer_device(model, layers, i) for i in range(len(spec.layers))]
        block_bytes = KVCache.bytes_per_block(spec.layers, cfg.block_size, spec.dtype)
        self.kv_budget_bytes = kv_budget(cfg.kv_cache_memory, devices[0])
        num_blocks = self.kv_budget_bytes // block_bytes
        self.tp_group = tp.group_of(model)
        self.sharded = self.tp_group is not None
        if self.sharded:
            num_blocks = tp.agree_on_blocks(num_blocks, devices[0], self.tp_group)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory={cfg.kv_cache_memory!r} holds {num_blocks} blocks of {block_bytes} bytes; need at least 2")
        self.block_bytes = block_bytes
        self._watch = None
        if devices[0].type == "cpu":
            keep_freed_memory()
            self._watch = BarrierSleepWatch()  # warns once if another thread's torch work slows the steps
        self.cache = KVCache(num_blocks, cfg.block_size, spec.layers, devices, spec.dtype)
        self.runner = ModelRunner(model, attached, self.cache, spec, cfg.block_size, cfg.attention, cfg.cascade,
                                  cfg.kernel_impl, cfg.mla)
        self.decoder_path = "the model's modules (tensor parallel)"
        if not self.sharded:
            self.runner.lean, self.decoder_path = select_decoder(model, spec, cfg.decoder)
        mc = model.config.get_text_config()
        self.max_model_len = getattr(mc, "max_position_embeddings", None) or 1 << 30
        self.runner.static, self.graphs_path = self._static_decode(cfg, num_blocks)
        # the static path's padding rows write a scratch block that no sequence may own: the last one
        self.blocks = BlockManager(num_blocks - (self.runner.static is not None), cfg.block_size)
        self.rank = 0
        if self.sharded:  # tensor parallel: the group's leader runs the engine, the others follow its steps
            self.rank = self.tp_group.rank
            self._channel = tp.StepChannel(self.tp_group)
            if self.rank == 0:
                self.runner.tp = self._channel
            else:
                self.cache.replay = True

    def _static_decode(self, cfg: EngineConfig, num_blocks: int):
        """engine/graphs.py's StaticDecode where cfg.cuda_graphs and the machine allow it, and one line
        saying what runs ("on", "static (eager)" or "off: why")."""
        why = graphs.why_off(cfg.cuda_graphs, self.runner, self.sharded)
        if why is None and num_blocks < 3:
            why = f"the KV budget holds {num_blocks} blocks: none to spare for the padding rows' scratch block"
        static = None
        if why is None:
            max_blocks = max(1, min(-(-self.max_model_len // cfg.block_size), num_blocks - 1))
            static = graphs.StaticDecode(self.runner, cfg.max_num_seqs, max_blocks, num_blocks - 1,
                                         capture=cfg.cuda_graphs != "static")
            if static.found and cfg.cuda_graphs != "static":
                why, static = "the decode step returns to the host: " + "; ".join(static.found[:3]), None
        if why is not None and cfg.cuda_graphs in ("on", "static"):
            raise ValueError(f"cuda_graphs={cfg.cuda_graphs!r} cannot run here: {why}")
        if why is not None:
            if cfg.cuda_graphs == "auto" and self.runner.device.type == "cuda":
                log.info("svrmad: CUDA graphs off (%s)", why)
            return None, f"off: {why}"
        return static, "static (eager)" if cfg.cuda_graphs == "static" else "on"

    def _graphs_info(self) -> str:
        static = self.runner.static
        if static is None:
            return self.graphs_path
        if static.off_reason is not None:
            return f"off: {static.off_reason}"
        if static.capture:
            return f"on ({len(static.graphs)} shapes captured, {static.replays} steps replayed)"
        return self.graphs_path

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
            "linear": self.linear_path,
            "decoder": self.decoder_path,
            "cuda_graphs": self._graphs_info(),
            "weight_bytes": self.weight_bytes,
            "stats": self._stats_path(),
            "block_size": self.cfg.block_size,
            "kv_blocks": self.blocks.num_blocks,
            "kv_budget_bytes": self.kv_budget_bytes,
            "peak_kv_bytes": self.blocks.peak_used * self.block_bytes,
            "evictions": self.blocks.evictions,
            "in_flight": len(self._live),
            **self.totals.as_dict(),
        }

    @classmethod
    def from_pretrained(cls, path, *, dtype=None, device=None, device_map=None, quantization="auto",
                        **config) -> "Engine":
        """Load a local checkpoint folder (`models.loader.load_model`) and build an engine on it;
        `config` holds EngineConfig fields (kv_cache_memory="40GiB", block_size=16, ...).
        `quantization` ("auto" | "native" | "dequantize"): how an MXFP4 / FP8 checkpoint is held."""
        from svrmad_local.models.loader import load_model

        fields = set(EngineConfig.__dataclass_fields__)
        unknown = sorted(set(config) - fields)
        if unknown:
            raise TypeError(f"Engine.from_pretrained: unknown option(s) {', '.join(unknown)}; "
                            f"EngineConfig has {', '.join(sorted(fields))}")
        from svrmad_local.models.quant import set_kernel_impl

        lm = load_model(path, dtype=dtype, device=device, device_map=device_map, quantization=quantization)
        cfg = EngineConfig(**config)
        set_kernel_impl(lm.model, cfg.kernel_impl)  # packed weights compute through the engine's kernel choice
        return cls(lm.model, lm.tokenizer, cfg)

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: token ids as given, a string tokenized as is, or chat messages
        ([{"role": ..., "content": ...}]) through the checkpoint's chat template."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; this engine has none (pass token ids)")
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            if self._chat is None:
                from svrmad_local.models.chat import ChatFormat

                self._chat = ChatFormat(self.tokenizer, self.eos_ids)
            return self._chat.encode(list(prompt))
        return list(prompt)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestOutput:
        """One request: `params.n` samples of `prompt` (token ids, a string or chat messages)."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        self._check_prompt(ids)
        return await self._submit(Request(self._new_id(), ids, params, None))

    async def score(self, prompt: Prompt, continuation: list[int] | str, topk: int = 20) -> ScoreOutput:
        """Teacher-forced statistics of `continuation` after `prompt` (the prompt's cached prefix is
        reused; the continuation's positions are always computed, in chunks)."""
        prompt = self.encode(prompt)
        continuation = self.tokenizer.encode(continuation, add_special_tokens=False) if isinstance(continuation, str) \
            else list(continuation)
        if not prompt or not continuation:
            raise ValueError("score() needs a non-empty prompt and continuation")
        self._check_prompt(prompt + continuation)
        params = SamplingParams(max_tokens=0, topk_logprobs=topk)
        return await self._submit(Request(self._new_id(), prompt + continuation, params, None, score_from=len(prompt)))

    def generate_sync(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Blocking wrapper: one prompt or a list of prompts (each token ids, a string or chat
        messages), and one SamplingParams or one per prompt. Returns one output per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")

        async def run():
            return await asyncio.gather(*(self.generate(p, sp) for p, sp in zip(prompts, plist)))

        return asyncio.run(run())

    def score_sync(self, prompt: Prompt, continuation: list[int] | str, topk: int = 20) -> ScoreOutput:
        return asyncio.run(self.score(prompt, continuation, topk))

    def follow(self) -> None:
        """Tensor-parallel ranks other than the leader: run its steps until it calls `close()`."""
        if not self.sharded or self.rank == 0:
            raise RuntimeError("follow() is for tensor-parallel ranks other than 0")
        while (step := self._channel.recv()) is not None:
            self.runner.execute(step)

    def close(self) -> None:
        """Release the worker thread; with tensor parallelism, rank 0 also lets the followers go."""
        if self.sharded and self.rank == 0 and self.runner.tp is not None:
            channel, self.runner.tp = self.runner.tp, None
            try:
                channel.send(None)
            except tp.GroupLost:  # a follower is gone: nobody is left to tell
                pass
        self._executor.shutdown(wait=False)

    # -- plumbing ---------------------------------------------------------------------------
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("empty prompt: a request needs at least one token")
        vocab = self.runner.lm_head.out_features
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt holds token ids outside [0, {vocab}): {bad[:5]}")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the model's context of {self.max_model_len}")

    async def _submit(self, req: Request) -> RequestOutput | ScoreOutput:
        loop = asyncio.get_running_loop()
        release_team()
        req.future = loop.create_future()
        seed = req.params.seed if req.params.seed is not None else self._rng.getrandbits(62)
        gen = random.Random(_seed_for(seed, 0))
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
        self.scheduler.abort_all()
        for req in self._live.values():
            if not req.future.done():
                req.future.set_exception(exc)
        self._live.clear()

    # -- one step (worker thread) -------------------------------------------------------------
    @torch.inference_mode()
    def _step(self) -> list[Request]:
        batch = self.scheduler.schedule()
        finished: list[Request] = []
        for seq, exc in batch.rejected:
            seq.request.error = exc
            self.scheduler.abort(seq.request)
            finished.append(seq.request)
        if not batch:
            return finished
        self.totals.steps += 1
        hidden = self.runner.forward(batch)
        if self._watch is not None:
            self._watch.step()
        work = batch.work  # in row order
        for w in work:  # prompt tokens run through the model (not the fed-back sampled tokens)
            counted = max(0, min(w.end, max(w.seq.num_prompt, len(w.seq.tokens) - 1)) - w.start)
            w.seq.request.usage.computed_tokens += counted
            self.totals.computed_tokens += counted
        self.scheduler.postprocess(batch)
        for req in {w.seq.request for w in work}:  # distinct blocks: a shared prefix counts once
            held = len({b for s in req.sequences for b in s.blocks})
            req.usage.peak_kv_bytes = max(req.usage.peak_kv_bytes, held * self.block_bytes)
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
            gens.append(seq.generator if not j else random.Random(_seed_for(seq.request.seed, j)))
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
                self.scheduler.fork(seq, target)
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
        if self.scheduler.finish(seq, reason):
            req = seq.request
            req.usage.time_s = time.perf_counter() - req.t0
            finished.append(req)

    def _stats_path(self) -> str:
        return "kernels:" + kernels.select_impl(self.cfg.kernel_impl, self.runner.lm_head.weight)

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
        chunked torch reference) of kernels/, else (an LM head with a bias, or one packed for oneDNN,
        whose weight only the module itself can multiply) chunks of the module's own logits."""
        w = self.runner.lm_head
        if getattr(w, "bias", None) is None and type(w) is torch.nn.Linear:
            return kernels.token_stats(h.to(w.weight.device), w.weight, targets.to(w.weight.device), k,
                                       kernel_impl=self.cfg.kernel_impl, chunk_tokens=self.cfg.score_chunk, softcap=self.runner.softcap)
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
