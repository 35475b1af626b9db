"""vLLM's side of bench_vs_vllm.py and bench_decode.py, run by the Python of a venv that has vllm.

It never imports svrmad_local (that venv need not have it): prompts arrive as token ids and
sampling settings as plain dicts. Protocol: argv[1] is a JSON object of LLM settings; the worker
answers {"ready": ...} once the model is loaded, then reads one JSON command per line on stdin and
writes one JSON answer per line on its original stdout (vLLM's own logs go to stderr):

    {"op": "generate", "prompts": [[ids]], "params": [{n, max_tokens, seed, ...}]}
        -> {"time_s", "outputs": [{"token_ids": [[ids] per sample], "prompt_len", "num_cached_tokens"}],
            "counters": {prompt/generation token counters of vLLM's metrics, cumulative}}
    {"op": "counters"} -> {"counters": {...}}
    {"op": "reset_prefix_cache"} -> {"ok": true}
    {"op": "quit"}
"""

from __future__ import annotations

import json
import os
import sys
import time

COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:num_preemptions")


def counters(llm) -> dict:
    """Cumulative token counters; prompt tokens split by source (local_compute = computed)."""
    out: dict = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] = out.get(m.name, 0) + int(m.value)
        elif m.name == "vllm:prompt_tokens_by_source":
            key = f"{m.name}:{m.labels.get('source')}"
            out[key] = out.get(key, 0) + int(m.value)
    return out


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # everything else printed (vLLM's logs, its engine process) goes to stderr

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")

    cfg = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=cfg["model"], dtype=cfg.get("dtype", "float32"), block_size=cfg.get("block_size", 32),
              enable_prefix_caching=True, hf_overrides=cfg.get("hf_overrides"), seed=cfg.get("seed", 0),
              max_num_seqs=cfg.get("max_num_seqs", 128), disable_log_stats=False)
    send({"ready": True, "load_s": round(time.perf_counter() - t0, 2), "vllm": vllm.__version__})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "counters":
            send({"counters": counters(llm)})
            continue
        if cmd["op"] == "reset_prefix_cache":
            send({"ok": bool(llm.reset_prefix_cache())})
            continue
        prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
        params = [SamplingParams(**p) for p in cmd["params"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        send({"time_s": dt, "counters": counters(llm), "outputs": [
            {"token_ids": [list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)],
             "prompt_len": len(o.prompt_token_ids), "num_cached_tokens": o.num_cached_tokens} for o in outs]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
