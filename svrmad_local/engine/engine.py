"""The engine: continuous batching over a paged, prefix-shared KV-cache, with token statistics.

Many coroutines (one per question's controller) call `await engine.generate(...)` at once; a single
loop gathers every pending request into one batch per step, runs the step in a worker thread (so
the event loop keeps accepting requests while the model computes) and resolves each request's
future as it finishes. `generate_sync` wraps it for scripts.

This file is the loop and the public API; the engine's torch state is built by engine/build.py, which
returns it as one frozen record (`Engine.built`: the cache, the runner, the block manager, the execution
record, the KV budget...) that the engine reads and never assigns to; one
step (sampling, forks, stop rules, scoring, outputs) is engine/step.py, and its settings are
engine/config.py.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Union

from svrmad_local.dist import GroupLost
from svrmad_local.errors import UserError
from svrmad_local.kernels import _cpu_build

from .build import Built, build
from .config import EngineConfig, SamplingParams  # noqa: F401  (EngineConfig: public here too)
from .execution import runtime_fallbacks
from .relinear import RunLinears
from .memory import parse_memory  # noqa: F401  (public here too)
from .scheduler import RequestTooLarge, Scheduler  # noqa: F401  (RequestTooLarge: public)
from .sequence import Request, RequestOutput, ScoreOutput, Sequence
from .step import Step, output, seed_for
from .threads import release_team


Prompt = Union[list[int], str, list[dict]]

# One call to the worker thread runs steps back to back until a request finishes, the work runs out or this
# many seconds pass. Each hand-off between the event loop and the worker wakes a thread each way: 0.2-0.35 ms of
# a ~13 ms batch-1 decode step on a 2-core Xeon (docs/engine.md, "Steps back to back"). The loop needs the
# worker back only to resolve futures (a new request reaches the scheduler directly, at its next step) and,
# within this bound, to stop when the program is interrupted.
STEPS_FOR_S = 0.25


class EngineClosed(UserError, RuntimeError):
    """A request to an engine whose `close()` has run: its worker thread is gone."""


@dataclass
class EngineTotals:
    requests: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    overlapped_steps: int = 0  # launched before the previous step's tokens were read (EngineConfig.overlap)
    dropped_rows: int = 0  # rows such a step computed for a sequence the step before it ended
    busy_s: float = 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "cached_tokens": self.prompt_tokens - self.computed_tokens}


class Engine:
    """The public face: `generate` / `score` (async, many callers at once) and their `_sync` wrappers,
    `encode`, `info`, `close`; underneath, one loop that feeds `Step.run` to the worker thread."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None):
        self.cfg = cfg = config or EngineConfig()
        self.model = model.eval()
        self.tokenizer = tokenizer
        # Every torch op of the engine, its construction included (the oneDNN reorders, the probe,
        # the cache's zero fill), runs on its one worker thread: with the GNU OpenMP that torch uses,
        # each thread that runs a parallel op keeps its own team of threads, and once more threads are
        # kept than there are cores, every team stops spinning at its barriers and sleeps instead
        # (docs/engine.md, "One worker thread").
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="svrmad-engine")
        try:
            self._worker = self._executor.submit(threading.current_thread).result()
            self.built: Built = self._executor.submit(build, model, cfg).result()  # what build made (frozen)
        except BaseException:  # Ctrl-C during a kernel build: stop it, or the interpreter waits for it at exit
            self._release_worker()
            raise
        # The caller's own idle team (from loading the model, say) counts too: hand it back, here and
        # on each request (cheap when there is none; docs/engine.md has the measured cost).
        release_team()
        built = self.built
        self._max_model_len = built.max_model_len
        self.eos_ids = self._eos_ids()
        self.totals = EngineTotals()
        self.scheduler = Scheduler(built.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.stepper = Step(self.scheduler, built.runner, self.totals, block_bytes=built.budget.block_bytes,
                            eos_ids=self.eos_ids, tokenizer=tokenizer, max_model_len=self.max_model_len,
                            kernel_impl=cfg.kernel_impl, score_chunk=cfg.score_chunk, watch=built.watch,
                            overlap=built.execution.overlap.value == "on")
        # the run's own steps weigh the linear backend again (engine/relinear.py), where `auto` timed them
        cal = built.linear_calibration
        self._linears = RunLinears(self) if cal is not None and cal.figures and cal.choice in cal.figures["decode"] else None
        self._rng = random.Random(cfg.seed)
        self._next_id = 0
        self._loop_task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._live: dict[int, Request] = {}
        self._chat = None
        self.closed = False

    # what the build made, by the names callers know (read-only: `built` is frozen)
    @property
    def runner(self):
        return self.built.runner

    @property
    def execution(self):
        return self.built.execution

    @property
    def spec(self):
        return self.built.spec

    @property
    def blocks(self):
        return self.built.blocks

    @property
    def max_model_len(self) -> int:
        """The model's context: the prompt check here and the step's stop rule read the same one."""
        return self._max_model_len

    @max_model_len.setter
    def max_model_len(self, n: int) -> None:
        self._max_model_len = n
        if getattr(self, "stepper", None) is not None:
            self.stepper.max_model_len = n

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
        """Which paths the engine took (the build's record, `execution`, and the fallbacks since), its
        memory and its totals: for run records and benchmarks."""
        built, ex = self.built, self.built.execution
        static, budget = built.runner.static, built.budget
        return {
            "attention": ex.attention_paths.summary,
            "linear": ex.linear.reason,
            "linear_calibration": built.linear_calibration.as_dict() if built.linear_calibration else None,
            "decoder": str(ex.decoder),
            "cuda_graphs": _graphs_info(static, ex.graphs),
            "weight_bytes": built.weight_bytes,
            "stats": "kernels:" + ex.stats.value,
            "block_size": built.block_size,
            "kv_blocks": built.blocks.num_blocks,
            "kv_budget_bytes": budget.bytes,
            "kv_budget": budget.rule,
            "kv_devices": budget.devices,  # per device: what the pool takes there, and its budget there
            "kv_held": budget.held,  # per measured device: what the profiled forward took (engine/build.py)
            "graph_bytes": {"reserved": budget.graph_reserve, "taken": static.pool_bytes if static is not None else 0},
            "peak_kv_bytes": built.blocks.peak_used * budget.block_bytes,
            "evictions": built.blocks.evictions,
            "in_flight": len(self._live),
            **self.totals.as_dict(),
            "execution": ex.as_dict(),  # every choice made at build, with its reason (engine/execution.py)
            "fallbacks": runtime_fallbacks(),  # kernels that fell back to their torch reference since
            "threads": built.watch.team.info() if built.watch is not None else None,  # the CPU team now
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

        cfg = EngineConfig(**config)  # checked before the weights load
        lm = load_model(path, dtype=dtype, device=device, device_map=device_map, quantization=quantization)
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
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"a prompt is token ids, a string or chat messages, got {type(prompt).__name__}")
        return list(prompt)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestOutput:
        """One request: `params.n` samples of `prompt` (token ids, a string or chat messages)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"generate() takes its settings as a SamplingParams, got {type(params).__name__}")
        self._check_open()
        ids = self.encode(prompt)
        self._check_prompt(ids)
        return await self._submit(Request(self._new_id(), ids, params, None))

    async def score(self, prompt: Prompt, continuation: list[int] | str, topk: int = 20) -> ScoreOutput:
        """Teacher-forced statistics of `continuation` after `prompt` (the prompt's cached prefix is
        reused; the continuation's positions are always computed, in chunks)."""
        self._check_open()
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

    def on_worker(self, fn, *args):
        """fn(*args) on the engine's worker thread, where its forwards run (its result): a benchmark that
        times the model's own pieces beside the engine, without a second OpenMP team (see __init__)."""
        release_team()
        return self._executor.submit(fn, *args).result()

    def follow(self) -> None:
        """Tensor-parallel ranks other than the leader: run its steps until it calls `close()`. The steps run on
        the calling thread; the worker thread (the build's) is let go at the end, as the leader's `close()` lets
        its own go, so that it ends while the interpreter runs rather than at its exit."""
        if not self.built.sharded or self.built.rank == 0:
            raise RuntimeError("follow() is for tensor-parallel ranks other than 0")
        try:
            while (step := self.built.channel.recv()) is not None:
                self.runner.execute(step)
        finally:
            self.closed = True
            self._release_worker()

    def close(self) -> None:
        """Release the worker thread; with tensor parallelism, rank 0 also lets the followers go."""
        self.closed = True
        if self.built.sharded and self.built.rank == 0 and self.runner.tp is not None:
            channel, self.runner.tp = self.runner.tp, None
            try:
                channel.send(None)
            except GroupLost:  # a follower is gone: nobody is left to tell
                pass
        self._release_worker()

    def _release_worker(self) -> None:
        """Let the worker thread go: a kernel build it runs is stopped (the interpreter waits for the thread
        at exit), and it ends once its queue is empty."""
        worker = getattr(self, "_worker", None)
        if worker is not None:
            _cpu_build.cancel(worker)
        self._executor.shutdown(wait=False)

    # -- plumbing ---------------------------------------------------------------------------
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosed("this engine is closed (close() was called): build a new Engine to generate again")

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
        gen = random.Random(seed_for(seed, 0))
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
                done = await loop.run_in_executor(self._executor, self._steps)
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
                        req.future.set_result(output(req, self.tokenizer, self.cfg.signals))

    def _fail_all(self, exc: BaseException) -> None:
        self.stepper.inflight = None  # its sequences go with their requests
        self.scheduler.abort_all()
        for req in self._live.values():
            if not req.future.done():
                req.future.set_exception(exc)
        self._live.clear()

    def _steps(self) -> list[Request]:
        """Steps on the worker thread until one finishes a request, the work runs out or STEPS_FOR_S pass."""
        until = time.perf_counter() + STEPS_FOR_S
        while True:
            done = self._step()
            if done or not self.scheduler.has_work() or time.perf_counter() >= until:
                return done

    def _step(self) -> list[Request]:
        """One step on the worker thread (engine/step.py); then the run's own mix of steps weighs the linears."""
        done = self.stepper.run()
        if self._linears is not None:
            self._linears.after_step()
        return done


def _graphs_info(static, choice) -> str:
    """Engine.info["cuda_graphs"]: the record's graphs choice, with what the captured graphs did since."""
    if static is None:
        return f"off: {choice.reason}"
    head = ("; the step ends at the hidden states (a tensor-parallel follower: its leader samples)" if not static.leads
            else f"; the LM head and sampling after the step: {static.head_found[0]}" if static.head_found else "")
    if static.capture:
        failed = ""
        if static.failed:
            (p, w), why = next(iter(static.failed.items()))
            failed = f"; {len(static.failed)} failed, run eagerly (batch {p}, width {w}: {why})"
        return f"on ({len(static.graphs)} shapes captured, {static.replays} steps replayed{failed}{head})"
    return choice.value + head
