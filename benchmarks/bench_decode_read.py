"""How fast the CPU decode kernel reads the paged cache, against a plain read of the same bytes (a script).

    python benchmarks/bench_decode_read.py [--threads 1,2] [--repeat 7] [--dtype fp32|bf16] [--against OLD.cpp]

The default model's attention (9 query heads, 3 KV heads, 64 dims, fp32 or bf16, blocks of 16 at random places
in the cache), one cache per layer for 30 layers so that the K/V come from memory, as in a step. For
each case (the lengths of a step's sequences): the K/V bytes the kernel reads per second over the 30
calls (best of --repeat), the same bytes read by torch's sum over one tensor, and the ratio
(docs/kernels.md: what a read through 16-token paged blocks can reach). The sum is timed right after
the kernel in each case: a shared machine's bandwidth moves with its neighbours. --against builds another revision of csrc/cpu_decode.cpp
(`git show REV:svrmad_local/kernels/csrc/cpu_decode.cpp > old.cpp`) and times it in the same run, its
outputs checked within 1e-5 of ours (the line says where they are the same bits). On a CPU with AVX-512 the kernel also runs
capped at its eight-lane AVX2 loops ("avx2 loops"), whose bits its sixteen-lane ones must give. The last line is one JSON
object with every figure.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench_mla import best_of  # noqa: E402
from svrmad_local.kernels import cpu_decode  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK, SCALE = 9, 3, 64, 16, 0.125
CASES = {"one of 300": [300], "one of 1,500": [1500], "8 of 2,000": [2000] * 8, "12 of 500": [500] * 12,
         "9 of 150-3,000": [3000, 200, 300, 2500, 400, 1800, 600, 900, 150], "32 of 232": [232] * 32,
         "32 of 48": [48] * 32, "32 of 120": [120] * 32}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _against(src: str):
    """The other revision's kernel, built in a directory of its own: torch's build lock in a shared cache
    directory outlives a build that was killed, and the next build there waits on it for ever."""
    from torch.utils.cpp_extension import load

    from svrmad_local.kernels._cpu_build import cflags

    csrc = ROOT / "svrmad_local" / "kernels" / "csrc"
    build = tempfile.mkdtemp(prefix="bench_decode_read_")
    atexit.register(shutil.rmtree, build, ignore_errors=True)
    return load(name="bench_decode_read_against", sources=[src], extra_cflags=cflags(), build_directory=build,
                extra_include_paths=[str(csrc)], verbose=False).paged_decode


class AtLevel:
    """The kernel capped at ISA level `level` while a case runs it (`with`; the module's level restored after)."""

    def __init__(self, mod, level: int):
        self.mod, self.level, self.full = mod, level, None

    def __call__(self, *args):
        return self.mod.paged_decode(*args)

    def __enter__(self):
        self.full = self.mod.set_isa_level(self.level)

    def __exit__(self, *exc):
        self.mod.set_isa_level(self.full)


def _best(fn, repeat: int) -> float:
    fn()  # a first call compiles nothing here, but pages the inputs in
    return best_of(fn, repeat, torch.device("cpu"))


def case(lens: list[int], layers: int, repeat: int, kernels: dict, g: torch.Generator,
         dtype: torch.dtype = torch.float32) -> dict:
    width = -(-max(lens) // BLOCK)
    nblocks = width * len(lens)
    k = [torch.randn(nblocks * BLOCK, KV_HEADS, DIM, generator=g).to(dtype) for _ in range(layers)]
    v = [torch.randn(nblocks * BLOCK, KV_HEADS, DIM, generator=g).to(dtype) for _ in range(layers)]
    table = torch.randperm(nblocks, generator=g).view(len(lens), width)
    L, q = torch.tensor(lens), torch.randn(len(lens), HEADS, DIM, generator=g).to(dtype)
    nbytes = sum(lens) * KV_HEADS * DIM * k[0].element_size() * 2 * layers
    row, outs = {}, {}
    for name, fn in kernels.items():
        with fn if isinstance(fn, AtLevel) else contextlib.nullcontext():
            outs[name] = fn(q, k[0], v[0], table, L, BLOCK, SCALE, -1, None)
            row[name] = nbytes / _best(lambda: [fn(q, k[i], v[i], table, L, BLOCK, SCALE, -1, None)
                                                for i in range(layers)], repeat) / 1e9
    for name, out in outs.items():
        err = (out.float() - outs["kernel"].float()).abs().max().item()
        if err > 1e-5 * (1 if dtype == torch.float32 else 1e3):  # bf16: one rounding of the output apart
            raise SystemExit(f"bench_decode_read: {name} differs from the kernel by {err:.2e}")
    row["same_bits"] = all(torch.equal(out, outs["kernel"]) for out in outs.values())
    flat = torch.randn(nbytes // 4, generator=g)
    row["sum"] = nbytes / _best(flat.sum, repeat) / 1e9
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="thread counts to time (default 1,2)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--against", help="another revision's csrc/cpu_decode.cpp, timed in the same run")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="the cache's dtype (default fp32)")
    args = ap.parse_args()
    if not cpu_decode.available():
        raise SystemExit(f"bench_decode_read: the kernel is not built: {cpu_decode.unavailable_reason()}")
    mod = cpu_decode._KERNEL.module()
    kernels = {"kernel": mod.paged_decode}
    if mod.isa_level() >= 1:  # AVX-512 here: its eight-lane loops too, for the same bits at their speed
        kernels["avx2 loops"] = AtLevel(mod, 0)
    if args.against:
        kernels["against"] = _against(args.against)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.dtype}; GB/s of K/V read, "
          f"{args.layers} layers' caches, best of {args.repeat}")
    g = torch.Generator().manual_seed(0)
    rows, before = [], torch.get_num_threads()
    try:
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for label, lens in CASES.items():
                row = {"threads": threads, "case": label, **case(lens, args.layers, args.repeat, kernels, g, DTYPES[args.dtype])}
                rows.append(row)
                line = "  ".join(f"{n} {row[n]:5.1f} ({row[n] / row['sum']:4.0%})" for n in kernels)
                if len(kernels) > 1:
                    line += "  same bits" if row["same_bits"] else "  NOT the same bits"
                print(f"{threads} thread(s), {label:>15}: {line}  sum {row['sum']:5.1f}", flush=True)
    finally:  # a caller in the same process (the tests) keeps its thread count
        torch.set_num_threads(before)
    print(json.dumps({"shape": {"heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM, "block": BLOCK}, "dtype": args.dtype,
                      "layers": args.layers, "against": args.against, "rows": rows}))


if __name__ == "__main__":
    main()
