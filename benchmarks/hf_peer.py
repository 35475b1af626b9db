"""The decode peer that needs no install: transformers' own `generate` with its static cache, the decode
forward under torch.compile, the way transformers documents fast generation.

`generate` over a static cache (the KV cache preallocated at a fixed length) compiles on CUDA the decode step's forward by itself (`generation_config.compile_config`, a `CompileConfig`; the
prefill stays eager). The peer sets that config: inductor, `fullgraph=True` and, on CUDA,
`mode="reduce-overhead"` (CUDA graphs), as the documentation's example compiles `model.forward`; elsewhere
`mode="default"` (there are no CUDA graphs on the CPU), with the flag transformers keeps for compiling on
other devices (`_compile_all_devices`, present from 5.17 to 5.24). `dynamic=False`: one graph per batch
size, as the engine captures one CUDA graph per batch size. Lengths are fixed as the engine's
`ignore_eos`: the peer's model (its own copy: the engine rewrites the one it runs) has no EOS in its
generation config, so nothing stops early; the returned ids' shape is checked. The same prompts as the
engine's; sampling is the engine's settings (temperature, top-p, top-k) from one seed a batch, or greedy.

The cache: one `StaticCache` per batch size, made once at the longest call's length and `reset()` before
each call, passed to `generate` as `past_key_values` (transformers' documented way to reuse a static
cache). Left to `cache_implementation="static"`, generate makes a new cache at every call (5.17 and 5.24
alike), and under CUDA graphs torch records a graph again whenever a static input's address changes, as a
new cache's does: the peer would pay a graph recording a call, which no one serving with it would."""

from __future__ import annotations

import inspect
import time

import torch


def describe(device: torch.device, mode: str | None = None, backend: str = "inductor") -> dict:
    """What the peer runs, for the benchmark's JSON."""
    import transformers

    return {"what": "transformers generate, static cache, decode forward under torch.compile",
            "transformers": transformers.__version__,
            "compile": {"backend": backend, "mode": mode or default_mode(device), "fullgraph": True, "dynamic": False}}


def default_mode(device: torch.device) -> str:
    return "reduce-overhead" if device.type == "cuda" else "default"


class HfPeer:
    """`generate(prompts, params)` with the benchmark's interface (params: the engine's sampling dicts);
    returns each row's generated length, read from the returned ids' shape (kept in `last_shape`)."""

    def __init__(self, model, max_len: int, mode: str | None = None, backend: str = "inductor"):
        from transformers.generation.configuration_utils import CompileConfig

        self.model, self.max_len = model, max_len
        model.generation_config.eos_token_id = None  # fixed lengths, as the engine's ignore_eos
        self.compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=backend,
                                            mode=mode or default_mode(model.device))
        self.compile_config._compile_all_devices = True  # generate compiles by itself on CUDA only
        self.caches: dict[int, object] = {}  # batch size -> its StaticCache, kept between calls
        # the models' forward takes `cache` where transformers renamed `past_key_values` (after 5.17; 5.24
        # warns at the old name)
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.last_ids: torch.Tensor | None = None  # the last call's prompts and generated tokens
        self.last_shape: tuple[int, int] | None = None

    def cache(self, batch: int):
        """The batch size's static cache, emptied: the same tensors at every call."""
        from transformers import StaticCache

        if batch not in self.caches:
            self.caches[batch] = StaticCache(config=self.model.config, max_cache_len=self.max_len)
        cache = self.caches[batch]
        cache.reset()
        return cache

    def generate(self, prompts: list[list[int]], params: list[dict]) -> list[int]:
        from transformers import GenerationConfig

        p = params[0]
        greedy = p["temperature"] == 0
        sampling = {} if greedy else {"temperature": p["temperature"], "top_p": p["top_p"], "top_k": p["top_k"]}
        config = GenerationConfig(max_new_tokens=p["max_tokens"], do_sample=not greedy, **sampling,
                                  pad_token_id=0, compile_config=self.compile_config)
        ids = torch.tensor(prompts, device=self.model.device)
        torch.manual_seed(p["seed"])
        cache = {self.cache_arg: self.cache(len(prompts))}
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **cache).cpu()
        if not hasattr(self.model, "_compiled_call"):
            raise RuntimeError("generate ran its forward uncompiled (transformers found the model not compilable)")
        self.last_ids, self.last_shape = out, tuple(out.shape)
        return [out.shape[1] - ids.shape[1]] * len(prompts)


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (a graph made while timing means a recompile)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def measure(peer: HfPeer, batches: list[int], timed, warm_gen, gen, repeat: int, new_tokens: int) -> list[dict]:
    """Decode tok/s of the peer at each batch size, as the benchmark measures the engine: `timed(generate,
    gen, B)` gives one (prefill-only, full) pair of seconds; the median over `repeat` pairs of B * new_tokens
    / (full - prefill-only). Each batch size is first warmed up with one untimed pair from `warm_gen` (its
    compile, not counted); the timed prompts come from `gen`, the engine's. A failure at one batch size is
    that row's one-line `hf_compile_error`, and the next batch size still runs."""
    import statistics

    rows = []
    for B in batches:
        row: dict = {"batch": B}
        try:
            t0, graphs = time.perf_counter(), compiled_graphs()
            timed(peer.generate, warm_gen, B)
            row["hf_compile_warmup_s"] = round(time.perf_counter() - t0, 1)
            graphs = compiled_graphs()
            pairs = [timed(peer.generate, gen, B) for _ in range(repeat)]
            row["hf_compile_tok_s"] = round(statistics.median(B * new_tokens / (full - pre) for pre, full in pairs), 1)
            row["hf_compile_new_graphs"] = compiled_graphs() - graphs  # 0: the warm-up compiled everything timed
            row["hf_compile_shape"] = list(peer.last_shape)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the peer failing must not lose the engine's figures
            row["hf_compile_error"] = one_line(e)
        rows.append(row)
    return rows


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__
