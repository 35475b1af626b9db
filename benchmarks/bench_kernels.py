"""Benchmark of the kernels package (a script, not a test).

    python benchmarks/bench_kernels.py [--quick] [--device cpu|cuda]

(a) token statistics: peak memory and time of the chunked (torch) / fused (triton, GPU only)
    paths vs log_softmax over the full [T, V] logits (``reference_token_stats``: logits,
    log_softmax, exp and p*logp all [T, V]), vocab 32k and 152k, hidden 1024, 4k tokens (1k
    with --quick on CPU).
    Peak memory: on CUDA torch.cuda.max_memory_allocated; on CPU the growth of the process's peak
    RSS (getrusage ru_maxrss) while the call runs, each measurement in a fresh subprocess so
    earlier peaks cannot hide it. The theoretical size of the largest intermediate is printed too.
(b) shared-prefix attention: cascade attention (prefix attended once for all queries, merged with
    each query's own suffix) vs the same attention over the prefix copied per query (batched
    scaled_dot_product_attention over [Nq, prefix + suffix] K/V, copies made before timing).
    Decode-style: one token per query. GPU: triton path; CPU: torch reference (never the
    interpreter), single-threaded by default (--attn-threads): decode-size ops are too small to
    parallelise, and on a shared 2-core machine multi-threaded BLAS on many small ops stalls
    (measured 40 ms vs 2.3 s for the same call), which would time the neighbours, not the code.
(c) sliding-window decode (Mistral / Gemma 3 / GPT-OSS layers): the same cascade call with
    ``window`` W (each query at the end of its own sequence) vs without, so the cost (or saving)
    of a window is visible: the torch path gathers only what some query can see, the triton kernel
    starts each program at its rows' first visible token. Checked against attention over each
    query's last W tokens (scaled_dot_product_attention on copies).
(d) attention that reads the paged cache in place, at 1k / 4k / 16k contexts (Hq 32, Hkv 8, D 128,
    blocks of 16 scattered at random): decode (one query per sequence, batches 1 / 8 / 32) with
    ``paged_decode`` (Triton on a GPU; on the CPU the compiled kernel the engine uses, kernels/cpu_decode)
    vs the gather path it replaced (each context copied out of the cache, then SDPA), and vs
    flash-attn's ``flash_attn_with_kvcache`` over 256-token pages where flash-attn is installed; and on
    a GPU, prefill (a 512-token chunk per sequence at the end of its context) with ``paged_prefill`` vs
    gather + masked SDPA as the engine called it before.

CPU timings on a shared machine are only indicative (the header prints the load); memory is
reliable. Ratios are printed; the last line is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)  # timings must never come from the numpy interpreter

import torch  # noqa: E402

import svrmad_local.kernels as kernels  # noqa: E402
from svrmad_local.kernels import (Level, cascade_attention, cascade_plan, reference_token_stats, select_impl,  # noqa: E402
                                  token_stats)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, dev, reps):
    """Fastest of ``reps`` calls (after one warm-up call when reps > 1): the least disturbed by
    other work on a shared machine."""
    if reps > 1:
        fn()
    times = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return min(times)


# ----------------------------------------------------------------------------------------------
# (a) token statistics, one (vocab, method) per child process
# ----------------------------------------------------------------------------------------------

def _token_stats_child(cfg: dict) -> dict:
    dev = torch.device(cfg["device"])
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    T, H, V = cfg["T"], cfg["H"], cfg["V"]
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(T, H, generator=g, device=dev, dtype=dtype)
    weight = torch.randn(V, H, generator=g, device=dev, dtype=dtype).mul_(H**-0.5)  # in place: no temp
    targets = torch.randint(0, V, (T,), generator=g, device=dev)
    method = cfg["method"]
    if method == "full":
        fn = lambda: reference_token_stats(hidden, weight, targets, topk=20)  # noqa: E731
    else:
        kernel_impl = "triton" if method == "fused" else "torch"
        fn = lambda: token_stats(hidden, weight, targets, topk=20, kernel_impl=kernel_impl, chunk_tokens=cfg["chunk"])  # noqa: E731
    if dev.type == "cuda":
        fn()  # compile / warm up, then measure a clean peak
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        seconds = _time(fn, dev, 3)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        seconds = _time(fn, dev, 1)  # one call: a second one could reuse freed pages unseen
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"seconds": seconds, "peak_bytes": peak}


def _largest_intermediate(method, T, V, chunk, H):
    """Bytes of the biggest temporary buffer each path needs (fp32)."""
    if method == "full":
        return T * V * 4
    if method == "chunked":
        return min(T, chunk) * V * 4
    n_split = -(-V // 8192)  # fused: per-split partials + int64 top-k candidates
    return T * n_split * (4 * 4 + 32 * 8)


def bench_token_stats(dev, quick):
    T, H, chunk = (1024, 1024, 256) if quick and dev.type == "cpu" else (4096, 1024, 1024)
    methods = ["full", "chunked"] + (["fused"] if dev.type == "cuda" and kernels.HAS_TRITON else [])
    rows = []
    for V in (32000, 152064):
        row = {"T": T, "H": H, "V": V, "chunk_tokens": chunk}
        for method in methods:
            cfg = {"device": str(dev), "T": T, "H": H, "V": V, "method": method, "chunk": chunk}
            res = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)],
                                 capture_output=True, text=True, check=True)
            out = json.loads(res.stdout.strip().splitlines()[-1])
            out["largest_intermediate_bytes"] = _largest_intermediate(method, T, V, chunk, H)
            row[method] = out
        best = "fused" if "fused" in row else "chunked"
        row["time_ratio_full_over_" + best] = row["full"]["seconds"] / row[best]["seconds"]
        row["peak_ratio_full_over_" + best] = row["full"]["peak_bytes"] / max(1, row[best]["peak_bytes"])
        rows.append(row)
        line = f"  T={T} H={H} V={V:>6}:"
        for method in methods:
            r = row[method]
            line += (f"  {method} {r['seconds']:7.3f}s peak {r['peak_bytes'] / 2**20:8.1f} MiB"
                     f" (largest buffer {r['largest_intermediate_bytes'] / 2**20:7.1f} MiB) |")
        line += (f"  full/{best}: time x{row['time_ratio_full_over_' + best]:.2f},"
                 f" peak x{row['peak_ratio_full_over_' + best]:.1f}")
        print(line, flush=True)
    return rows


# ----------------------------------------------------------------------------------------------
# (b) shared-prefix attention
# ----------------------------------------------------------------------------------------------

ATTN_SHAPE = dict(hq=32, hkv=8, d=128, bs=16, suffix=64)


def _decode_batch(dev, dtype, g, prefix, nq):
    """A paged cache holding one shared prefix then each query's own suffix (incl. its current
    token), scattered over the blocks; returns (q, k_cache, v_cache, levels, q_pos)."""
    hq, hkv, d, bs, suffix = (ATTN_SHAPE[k] for k in ("hq", "hkv", "d", "bs", "suffix"))
    p_blocks, s_blocks = -(-prefix // bs), -(-(suffix + 1) // bs)
    nblocks = p_blocks + nq * s_blocks
    k_cache = torch.randn(nblocks, bs, hkv, d, generator=g, device=dev, dtype=dtype)
    v_cache = torch.randn(nblocks, bs, hkv, d, generator=g, device=dev, dtype=dtype)
    perm = torch.randperm(nblocks, generator=g, device=dev)
    q = torch.randn(nq, hq, d, generator=g, device=dev, dtype=dtype)
    levels = [Level(torch.arange(nq, device=dev), perm[:p_blocks], prefix, 0)]
    for i in range(nq):
        start = p_blocks + i * s_blocks
        levels.append(Level(torch.tensor([i], device=dev), perm[start:start + s_blocks], suffix + 1, p_blocks * bs))
    q_pos = torch.full((nq,), p_blocks * bs + suffix, device=dev)  # each query's own (last) token
    return q, k_cache, v_cache, levels, q_pos


def _copies(k_cache, v_cache, levels, nq, last=None):
    """Each query's whole sequence (prefix + own suffix), or its ``last`` tokens, copied out of the
    paged cache as [Nq, Hkv, L, D] (what a non-sharing engine would hold)."""
    def seq(cache, i):
        return torch.cat([cache[lv.block_table].flatten(0, 1)[:lv.kv_len] for lv in (levels[0], levels[1 + i])])
    k = torch.stack([seq(k_cache, i)[-last if last else 0:].transpose(0, 1) for i in range(nq)])
    v = torch.stack([seq(v_cache, i)[-last if last else 0:].transpose(0, 1) for i in range(nq)])
    return k, v


def _sdpa(q, k, v, scale):
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None, :], k, v, scale=scale,
                                                            enable_gqa=True)[:, :, 0]


def bench_attention(dev, quick):
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    prefixes = (1024, 4096) if quick and dev.type == "cpu" else (1024, 4096, 16384)
    nqs = (2, 8, 32)
    reps = 3 if dev.type == "cpu" else 20
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    scale = ATTN_SHAPE["d"]**-0.5
    for prefix in prefixes:
        for nq in nqs:
            q, k_cache, v_cache, levels, _ = _decode_batch(dev, dtype, g, prefix, nq)
            k_copy, v_copy = _copies(k_cache, v_cache, levels, nq)  # copies made before timing

            def copied():
                return _sdpa(q, k_copy, v_copy, scale)

            def shared():
                return cascade_attention(q, k_cache, v_cache, levels, scale)

            plan = cascade_plan(q, k_cache, levels) if select_impl("auto", dev, "cascade_attention") == "triton" else None

            def planned():  # as the engine calls it: the plan built once per step, shared by the layers
                return cascade_attention(q, k_cache, v_cache, levels, scale, plan=plan)

            err = (shared().float() - copied().float()).abs().max().item()
            t_shared = _time(shared, dev, reps)
            t_planned = _time(planned, dev, reps)
            t_copied = _time(copied, dev, reps)
            row = {"prefix": prefix, "suffix": ATTN_SHAPE["suffix"] + 1, "nq": nq, "shared_s": t_shared,
                   "shared_planned_s": t_planned, "copied_s": t_copied, "speedup": t_copied / t_shared,
                   "speedup_planned": t_copied / t_planned, "max_abs_diff": err}
            rows.append(row)
            print(f"  prefix {prefix:>5} x {nq:>2} queries: shared {t_shared * 1e3:8.2f} ms, with a step's plan "
                  f"{t_planned * 1e3:8.2f} ms | copied per query {t_copied * 1e3:8.2f} ms | speedup "
                  f"x{row['speedup']:.2f}, x{row['speedup_planned']:.2f} | max |diff| {err:.1e}", flush=True)
            del k_copy, v_copy, k_cache, v_cache
    return rows


def bench_window(dev, quick):
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    prefixes = (4096,) if quick and dev.type == "cpu" else (4096, 16384)
    reps = 3 if dev.type == "cpu" else 20
    nq, rows = 8, []
    g = torch.Generator(device=dev).manual_seed(1)
    scale = ATTN_SHAPE["d"]**-0.5
    for prefix in prefixes:
        q, k_cache, v_cache, levels, q_pos = _decode_batch(dev, dtype, g, prefix, nq)
        t_full = _time(lambda: cascade_attention(q, k_cache, v_cache, levels, scale), dev, reps)
        for window in (128, 1024):
            def windowed():
                return cascade_attention(q, k_cache, v_cache, levels, scale, q_pos=q_pos, window=window)

            err = (windowed().float() - _sdpa(q, *_copies(k_cache, v_cache, levels, nq, window), scale).float())
            t_win = _time(windowed, dev, reps)
            row = {"prefix": prefix, "suffix": ATTN_SHAPE["suffix"] + 1, "nq": nq, "window": window,
                   "windowed_s": t_win, "full_s": t_full, "full_over_windowed": t_full / t_win,
                   "max_abs_diff": err.abs().max().item()}
            rows.append(row)
            print(f"  prefix {prefix:>5} x {nq} queries, window {window:>4}: windowed {t_win * 1e3:8.2f} ms | "
                  f"no window {t_full * 1e3:8.2f} ms | no-window/windowed x{row['full_over_windowed']:.2f} | "
                  f"max |diff| vs last-W attention {row['max_abs_diff']:.1e}", flush=True)
        del k_cache, v_cache
    return rows


# ----------------------------------------------------------------------------------------------
# (d) paged attention in place vs gathered
# ----------------------------------------------------------------------------------------------

def _paged_case(dev, dtype, g, B, L, hq=32, hkv=8, d=128, bs=16):
    nb = -(-L // bs)
    k = torch.randn(B * nb * bs, hkv, d, generator=g, device=dev, dtype=dtype)
    v = torch.randn(B * nb * bs, hkv, d, generator=g, device=dev, dtype=dtype)
    table = torch.randperm(B * nb, generator=g, device=dev).view(B, nb).to(torch.int32)
    slots = (table.long()[:, :, None] * bs + torch.arange(bs, device=dev)).flatten(1)[:, :L]  # [B, L]
    return k, v, table, slots


def bench_paged(dev, quick):
    from svrmad_local.engine.attention import _sdpa as engine_sdpa
    from svrmad_local.kernels import paged_decode, paged_prefill
    from svrmad_local.kernels.cpu_decode import available as cpu_decode_available, paged_decode_cpu

    on_gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    contexts = (1024, 4096) if quick and not on_gpu else (1024, 4096, 16384)
    reps = 3 if not on_gpu else 20
    g = torch.Generator(device=dev).manual_seed(2)
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # type: ignore
    except Exception:
        flash_attn_varlen_func = flash_attn_with_kvcache = None
    if not on_gpu and not cpu_decode_available():
        print("  skipped: the CPU decode kernel is not built")
        return []
    rows, scale = [], 128 ** -0.5
    for L in contexts:
        for B in (1, 8, 32):
            if not on_gpu and B * L > 65536:
                continue
            k, v, table, slots = _paged_case(dev, dtype, g, B, L)
            q = torch.randn(B, 32, 128, generator=g, device=dev, dtype=dtype)
            lens = torch.full((B,), L, dtype=torch.int32, device=dev)

            def in_place():
                if on_gpu:
                    return paged_decode(q, k, v, table, lens, 16, scale)
                return paged_decode_cpu(q, k, v, table, lens, 16, scale)

            def gathered():
                kk, vv = k[slots].transpose(1, 2), v[slots].transpose(1, 2)  # [B, Hkv, L, D]
                return engine_sdpa(q[:, :, None], kk, vv, None, scale, None)[:, :, 0]

            err = (in_place().float() - gathered().float()).abs().max().item()
            row = {"kind": "decode", "context": L, "batch": B, "in_place_s": _time(in_place, dev, reps),
                   "gathered_s": _time(gathered, dev, reps), "max_abs_diff": err}
            row["gathered_over_in_place"] = row["gathered_s"] / row["in_place_s"]
            line = (f"  decode  {L:>5} x {B:>2}: in place {row['in_place_s'] * 1e3:8.3f} ms | gathered + SDPA "
                    f"{row['gathered_s'] * 1e3:8.3f} ms (x{row['gathered_over_in_place']:.2f})")
            if flash_attn_with_kvcache is not None and on_gpu and L % 256 == 0:
                pages = torch.randperm(B * L // 256, generator=g, device=dev).view(B, -1).to(torch.int32)
                kp, vp = k.view(-1, 256, 8, 128), v.view(-1, 256, 8, 128)
                row["flash_attn_s"] = _time(lambda: flash_attn_with_kvcache(
                    q[:, None], kp, vp, cache_seqlens=lens, block_table=pages, softmax_scale=scale), dev, reps)
                line += f" | flash-attn {row['flash_attn_s'] * 1e3:8.3f} ms"
            rows.append(row)
            print(line + f" | max |diff| {err:.1e}", flush=True)
            if on_gpu:
                chunk = 512
                qp = torch.randn(B * chunk, 32, 128, generator=g, device=dev, dtype=dtype)
                cu = [i * chunk for i in range(B + 1)]

                def prefill_in_place():
                    return paged_prefill(qp, k, v, table, cu, [L] * B, 16, scale)

                mask = torch.ones(chunk, L, dtype=torch.bool, device=dev).tril(L - chunk)

                def prefill_gathered():
                    out = []
                    for b in range(B):
                        kk, vv = k[slots[b]].transpose(0, 1)[None], v[slots[b]].transpose(0, 1)[None]
                        qb = qp[b * chunk:(b + 1) * chunk].transpose(0, 1)[None]
                        out.append(engine_sdpa(qb, kk, vv, mask, scale, None)[0].transpose(0, 1))
                    return torch.cat(out)

                err = (prefill_in_place().float() - prefill_gathered().float()).abs().max().item()
                prow = {"kind": "prefill", "context": L, "batch": B, "chunk": chunk,
                        "in_place_s": _time(prefill_in_place, dev, reps),
                        "gathered_s": _time(prefill_gathered, dev, reps), "max_abs_diff": err}
                prow["gathered_over_in_place"] = prow["gathered_s"] / prow["in_place_s"]
                line = (f"  prefill {L:>5} x {B:>2} (chunks of {chunk}): in place {prow['in_place_s'] * 1e3:8.3f} ms | "
                        f"gathered + masked SDPA {prow['gathered_s'] * 1e3:8.3f} ms (x{prow['gathered_over_in_place']:.2f})")
                if flash_attn_varlen_func is not None:  # what the engine's flash path does with 16-token blocks
                    cu_q = torch.tensor(cu, dtype=torch.int32, device=dev)
                    cu_k = torch.arange(B + 1, dtype=torch.int32, device=dev) * L
                    flat = slots.flatten()
                    prow["flash_gathered_s"] = _time(lambda: flash_attn_varlen_func(
                        qp, k[flat], v[flat], cu_q, cu_k, chunk, L, softmax_scale=scale, causal=True), dev, reps)
                    line += f" | flash-attn over the gather {prow['flash_gathered_s'] * 1e3:8.3f} ms"
                rows.append(prow)
                print(line + f" | max |diff| {err:.1e}", flush=True)
            del k, v
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller CPU sizes (about 2 minutes)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--attn-threads", type=int, default=1, help="CPU threads for (b) (default 1)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_token_stats_child(json.loads(args.child))))
        return
    dev = torch.device(args.device)
    on_gpu = dev.type == "cuda"
    path = "triton" if on_gpu and kernels.HAS_TRITON else "torch reference"
    mem = "torch.cuda.max_memory_allocated" if on_gpu else "peak RSS growth (getrusage, fresh subprocess)"
    print(f"device={dev} torch={torch.__version__} threads={torch.get_num_threads()} kernels path={path}"
          f" load(1 min)={os.getloadavg()[0]:.1f}")
    if not on_gpu:
        print("    CPU timings on a shared machine are only indicative; memory figures are reliable")
    print(f"(a) token statistics (top-20 + target logprob + entropy + lse); memory = {mem}")
    ts = bench_token_stats(dev, args.quick)
    shape = "Hq={hq}, Hkv={hkv}, D={d}, block {bs}, own suffix {n} tokens".format(n=ATTN_SHAPE["suffix"] + 1,
                                                                                   **ATTN_SHAPE)
    print(f"(b) decode attention, shared prefix (cascade) vs prefix copied per query ({shape})")
    if not on_gpu:
        torch.set_num_threads(args.attn_threads)
        print(f"    (CPU threads for this part: {torch.get_num_threads()})")
    at = bench_attention(dev, args.quick)
    print(f"(c) sliding-window decode: cascade with window W vs without ({shape}, 8 queries)")
    wi = bench_window(dev, args.quick)
    if not on_gpu:
        torch.set_num_threads(os.cpu_count() or 1)
    print("(d) attention reading the paged cache in place vs gathering each context (Hq 32, Hkv 8, D 128)")
    pg = bench_paged(dev, args.quick)
    # a Triton kernel that failed (a compile error past the device's resources, say) fell back to its
    # reference under "auto" and was timed as such: name it and fail instead of reporting its timings
    fell_back = dict(kernels._backend._disabled)
    for name, why in fell_back.items():
        print(f"FAIL: Triton kernel {name} failed and fell back to its torch reference: {why[:300]}")
    print(json.dumps({"device": str(dev), "path": path, "quick": args.quick, "memory_measure": mem,
                      "attention_threads": torch.get_num_threads(), "load_avg_1min": os.getloadavg()[0],
                      "token_stats": ts, "attention": at, "window": wi, "paged": pg, "fell_back": fell_back}))
    if on_gpu and fell_back:
        sys.exit(1)


if __name__ == "__main__":
    main()
