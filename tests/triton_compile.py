"""Every Triton kernel of the package compiled for a GPU's architecture, on a machine without one.

Triton's interpreter (the CPU tests) runs a kernel's Python, not its compiler: a kernel can pass every
test here and still fail to compile on a GPU (a global that is not a constexpr, a type the compiler
refuses, a shape it cannot lay out), which a machine with a GPU would find only when it runs. So:

    python tests/triton_compile.py record LAUNCHES.json TESTS...   # TRITON_INTERPRET=1: run tests, note launches
    python tests/triton_compile.py compile LAUNCHES.json [--arch 90]  # no interpreter: compile each for sm_ARCH

`record` runs the given pytest node ids with the interpreter's launcher watched, and writes each distinct
launch: the kernel (module and name), its signature as the compiler takes it (pointer dtypes, 32- or 64-bit
ints, floats) and its constexpr values, specialized as Triton's JIT specializes a launch on a GPU: an int
argument equal to 1 becomes a constant (a stride of 1: contiguous loads), and a pointer 16-byte aligned or an
int divisible by 16 is marked so (`tt.divisibility`). Without that the compiler could not vectorize a bf16
load, so it would neither pipeline loads into shared memory nor lay out the code the GPU runs. `compile`
builds each for a CUDA target of that architecture (Triton's own ptxas, no driver, no GPU), each kernel once
more as a programmatic dependent launch (sm_90+: its wait must come before any global memory access,
`pdl_order`), and prints one JSON line: the kernels compiled, each kernel's largest shared memory a program,
and the failures with their first error line. The interpreter's tile sizes are smaller than a GPU's, so this
checks the code, not the GPU's tilings; of the launches that compile the same code, the most specialized is
compiled. tests/test_triton_compile.py runs both.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys


def _specialized(value):
    """(type, mark) as Triton's JIT specializes a runtime argument on a CUDA GPU: ("constexpr", 1) for an int
    equal to 1, ("*bf16", "D") for a 16-byte aligned bf16 pointer, ("i32", "D") for an int divisible by 16,
    ("fp32", None) for a float."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    return native_specialize_impl(CUDABackend, value, False, True, True)


def _is_tl_dtype(value) -> bool:
    return type(value).__module__.startswith("triton.language") and hasattr(value, "primitive_bitwidth")


def record(path: str, tests: list[str]) -> int:
    """Runs pytest on `tests` with every interpreted launch noted; writes the distinct launches to `path`."""
    import pytest
    from triton.runtime import interpreter

    launches: dict[str, dict] = {}
    inner = interpreter.GridExecutor.__call__

    def call(self, *args, **kwargs):
        fn = self.fn
        signature = inspect.signature(fn)
        bound = signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
        bound.apply_defaults()
        sig, consts, ones, aligned = {}, {}, [], []
        for name, value in bound.arguments.items():
            if name in self.constexprs:
                value = getattr(value, "value", value)  # a tl.constexpr wrapper
                sig[name], consts[name] = "constexpr", {"tl": str(value)} if _is_tl_dtype(value) else value
                continue
            try:
                sig[name], mark = _specialized(value)
            except Exception:  # noqa: BLE001 - a type the JIT does not take: named by compile
                sig[name], mark = None, None
            if sig[name] == "constexpr":
                ones.append(name)
            elif mark == "D":
                aligned.append(name)
        options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
        entry = {"module": fn.__module__, "name": fn.__name__, "signature": sig, "constexprs": consts,
                 "ones": ones, "aligned": aligned, "options": options}
        entry = launches.setdefault(json.dumps(entry, sort_keys=True, default=repr), entry)
        if os.environ.get("SVRMAD_TRITON_WHO"):  # which test launched it (for choosing the tests to record)
            entry.setdefault("tests", []).append(os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0])
        return inner(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = call
    code = pytest.main(["-q", "-p", "no:cacheprovider", *tests])
    with open(path, "w") as f:
        json.dump(list(launches.values()), f)
    return int(code)


def distinct(launches: list[dict]) -> list[dict]:
    """One launch for each kernel, argument types and set of its non-integer constexprs (flags, dtypes, None):
    the tile sizes' many values compile the same code. Of those, the most specialized (the most arguments
    equal to 1 or aligned: a real model's shapes, where a test's odd sizes are not)."""
    seen = {}
    for e in sorted(launches, key=lambda e: -len(e["ones"]) - len(e["aligned"])):
        flags = {k: v for k, v in e["constexprs"].items() if not (isinstance(v, int) and not isinstance(v, bool))}
        types = {k: t for k, t in e["signature"].items() if k not in e["ones"]}
        seen.setdefault(json.dumps([e["name"], types, flags], sort_keys=True), e)
    return list(seen.values())


# PTX that touches global memory: none may come before a PDL launch's wait (a read could see the kernel
# before's output unfinished, a write could change what it still reads); the bulk L2 prefetch may
MEMORY = re.compile(r"^\s*(?:@%p\d+\s+)?(?:ld\.global|st\.global|atom\.global|red\.global|cp\.async(?!\.bulk\.prefetch))",
                    re.M)


def pdl_order(ptx: str) -> str | None:
    """Why a kernel compiled with PDL is unsafe or does not overlap (None: neither): it must wait
    (griddepcontrol.wait) before its first global memory access and let the next kernel launch."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return "no griddepcontrol.wait"
    if "griddepcontrol.launch_dependents" not in ptx:
        return "no griddepcontrol.launch_dependents"
    first = MEMORY.search(ptx)
    if first is not None and first.start() < wait:
        return f"global memory before the wait: {ptx[first.start():].splitlines()[0].strip()}"
    return None


def _compile(fn, entry: dict, consts: dict, target, options: dict):
    """`entry` compiled as the JIT would: its ints equal to 1 as constants, its aligned arguments marked."""
    from triton.compiler import ASTSource
    import triton

    at = {name: (i,) for i, name in enumerate(fn.arg_names)}
    constexprs = {at[k]: v for k, v in {**consts, **dict.fromkeys(entry["ones"], 1)}.items()}
    attrs = {at[k]: [["tt.divisibility", 16]] for k in entry["aligned"]}
    return triton.compile(ASTSource(fn=fn, signature=entry["signature"], constexprs=constexprs, attrs=attrs),
                          target=target, options=options)


def compile_all(path: str, arch: int) -> int:
    """Compiles each launch of `path` for a CUDA target of `arch` (e.g. 90 for H100/H200), and each kernel's
    first launch once more as a PDL launch (kernels/pdl.py: PDL on, the skinny prefetch on), whose PTX
    `pdl_order` checks; prints one JSON line."""
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    done, failed, pdl, shared = set(), [], set(), {}
    for entry in distinct(json.load(open(path))):
        fn = getattr(importlib.import_module(entry["module"]), entry["name"])
        unknown = [n for n, t in entry["signature"].items() if t is None]
        if unknown:
            failed.append({"kernel": entry["name"], "error": f"arguments of an unknown type: {unknown}"})
            continue
        consts = {k: triton.language.dtype(v["tl"]) if isinstance(v, dict) else v
                  for k, v in entry["constexprs"].items()}
        try:
            made = _compile(fn, entry, consts, target, entry["options"])
            done.add(entry["name"])
            shared[entry["name"]] = max(shared.get(entry["name"], 0), made.metadata.shared)
            if arch >= 90 and "PDL" in consts and entry["name"] not in pdl:
                extra = {"PREFETCH": 1024} if "PREFETCH" in consts else {}
                ptx = _compile(fn, entry, {**consts, "PDL": True, **extra}, target,
                               {**entry["options"], "launch_pdl": True}).asm["ptx"]
                why = pdl_order(ptx)
                if why is not None:
                    failed.append({"kernel": entry["name"], "constexprs": entry["constexprs"], "error": f"PDL: {why}"})
                pdl.add(entry["name"])
        except Exception as err:  # the compiler's own errors: report each, go on with the others
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
            failed.append({"kernel": entry["name"], "constexprs": entry["constexprs"],
                           "error": " ... ".join(dict.fromkeys((lines[0], lines[-1])))[:300]})
    print(json.dumps({"arch": arch, "compiled": sorted(done), "pdl": sorted(pdl), "shared": shared, "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    mode, path, *rest = sys.argv[1:]
    if mode == "record":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("triton_compile.py record: set TRITON_INTERPRET=1 (the tests run in the interpreter)")
        sys.exit(record(path, rest))
    arch = int(rest[rest.index("--arch") + 1]) if "--arch" in rest else 90
    sys.exit(compile_all(path, arch))
