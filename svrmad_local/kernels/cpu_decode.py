"""Decode attention on the CPU that reads K/V in place from the paged cache.

Why: with SDPA, every layer of every decode step first gathers each sequence's whole context out of
the paged cache into a padded [B, L, heads, dim] buffer (KVCache.gather), then attends to it. At the
paper's lengths that copy is the largest cost after the linears (22% of a step at 700 tokens of
context in a profile of the CPU decode step), and it reads and writes every K/V byte twice more than attention needs.
This kernel walks each sequence's block table instead: one pass over its keys and values, in place.

It is a small C++ function (csrc/cpu_decode.cpp) compiled once on first use (torch.utils.cpp_extension, cached under
~/.cache/torch_extensions; nothing is downloaded), parallel on torch's own thread pool
(at::parallel_for: no second OpenMP team, see docs/engine.md) over chunks of 128 keys of a sequence
(all its KV heads where there are four chunks a thread, one KV head an item otherwise), each
thread taking a run of them in memory order that holds an equal share of the step's keys; the
chunks' partial softmaxes are joined in position order. A step's sequences differ in length, and
whole sequences a thread left one idle: 2-core Zen 3 EPYC, 30 layers' caches, 2 threads, one
sequence of 1,500 keys 10.7-11.2 -> 15.1-16.0 GB/s, nine of 150-3,000 keys 8.9-9.7 -> 13.6-14.8,
eight of 2,000 unchanged (~16); `benchmarks/bench_decode_read.py`. The chunks are fixed by
position, so the output does not depend on the thread count, and a context of up to 128 keys is
attended in one piece. An item of all heads reads each token's K/V
row of all heads as one contiguous run, and the heads of one KV group share each read (GQA without
copying heads); one table lookup per block. At 11 sequences x 1,000 tokens of the default's shape
this took a layer's decode attention from 6.3 ms to 2.4 ms on a 2-core AVX2 EPYC, and the fp32 AVX2
inner loops below (eight keys a reduction, vectorised exponentials, accumulators in registers) to
1.9 ms. The scattered blocks defeat the hardware's stream prefetch at every block edge, so the
loops prefetch the rows two blocks ahead into L2 (2-core AVX-512 EPYC, 30 layers' caches, so nothing
stays in cache: 12 x 1,000 tokens 1.3 -> 0.9 ms a layer, 8 x 2,000 1.8 -> 1.25, 2 x 1,000 2x), two blocks
ahead along each thread's own run of blocks, so across sequences too: a short sequence's first blocks are
fetched while the one before computes (bf16, 32 sequences of 48 keys, 1.8x). The prefetch is an asm
statement (simd.h's prefetch_l2): GCC had deleted the loops of __builtin_prefetch as loops without effect.
The query heads of one KV group share each row load (twelve FMA chains in flight, the same
arithmetic per output as one head at a time): in cache 20% fewer cycles a token on a Zen 3 EPYC;
from memory the kernel still reads at 40-52% of a plain sum there (docs/kernels.md, "Decode
attention on the CPU against the read bandwidth"). Where the CPU has AVX-512 the same loops run on
sixteen lanes (two keys' eight-lane chains in one vector, 64 value columns at a time), lane for lane the
same arithmetic, so the same bits: bf16 about a tenth faster on a Xeon with AMX. Sliding windows and GPT-OSS sinks are applied
exactly as the torch reference does. Where no compiler is found, `available()` is False and the
engine keeps the gather + SDPA path, saying why once.
"""

from __future__ import annotations

import torch

from ._backend import choose
from ._cpu_build import Kernel

NAME = "cpu_decode"  # its name for _backend.choose
_KERNEL = Kernel(NAME, "cpu_decode.cpp", "SVRMAD_CPU_DECODE", "CPU paged decode kernel")


def available() -> bool:
    """Compiles on first call (seconds; cached across processes). SVRMAD_CPU_DECODE=0 turns it off;
    without it decode attention gathers the context for SDPA."""
    return choose("auto", "cpu", NAME).impl == "cpp"


def unavailable_reason() -> str | None:
    """Why the torch path runs instead (None where the kernel does)."""
    return choose("auto", "cpu", NAME).why


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] (one query per sequence, at position context_len - 1), k_cache/v_cache [slots, KVH, D]
    flat slots of the paged cache, block_table [B, max_blocks], context_lens [B] (keys, the query's own
    included). Returns [B, H, Dv]; the query sees keys p > L - 1 - window."""
    return _KERNEL.module().paged_decode(q.contiguous(), k_cache, v_cache, block_table, context_lens, block_size, float(scale),
                            -1 if window is None else int(window), sinks)
