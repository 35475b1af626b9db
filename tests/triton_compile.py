"""Every Triton kernel of the package compiled for a GPU's architecture, on a machine without one.

Triton's interpreter (the CPU tests) runs a kernel's Python, not its compiler: a kernel can pass every
test here and still fail to compile on a GPU (a global that is not a constexpr, a type the compiler
refuses, a shape it cannot lay out), which a machine with a GPU would find only when it runs. So:

    python tests/triton_compile.py record LAUNCHES.json TESTS...   # TRITON_INTERPRET=1: run tests, note launches
    python tests/triton_compile.py compile LAUNCHES.json [--arch 90]  # no interpreter: compile each for sm_ARCH

`record` runs the given pytest node ids with the interpreter's launcher watched, and writes each distinct
launch: the kernel (module and name), its signature as the compiler takes it (pointer dtypes, 32- or
64-bit ints, floats) and its constexpr values. `compile` builds each for a CUDA target of that
architecture (Triton's own ptxas, no driver, no GPU), each kernel once more as a programmatic dependent
launch (sm_90+: its wait must come before any global memory access, `pdl_order`), and prints one JSON
line: the kernels compiled and the failures with their first error line. The interpreter's tile sizes are
smaller than a GPU's, so this checks the code, not the GPU's tilings. tests/test_triton_compile.py runs both.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys

DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
          "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1", "float8_e4m3fn": "fp8e4nv"}


def _type(value) -> str | None:
    """The compiler's name for a runtime argument's type (None: not one a launch here passes)."""
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return "*" + DTYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


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
        sig, consts = {}, {}
        for name, value in bound.arguments.items():
            if name in self.constexprs:
                value = getattr(value, "value", value)  # a tl.constexpr wrapper
                sig[name], consts[name] = "constexpr", {"tl": str(value)} if _is_tl_dtype(value) else value
            else:
                sig[name] = _type(value)
        options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
        entry = {"module": fn.__module__, "name": fn.__name__, "signature": sig, "constexprs": consts,
                 "options": options}
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
    """One launch for each kernel, signature and set of its non-integer constexprs (flags, dtypes, None):
    the tile sizes' many values compile the same code."""
    seen = {}
    for e in launches:
        flags = {k: v for k, v in e["constexprs"].items() if not (isinstance(v, int) and not isinstance(v, bool))}
        seen.setdefault(json.dumps([e["name"], e["signature"], flags], sort_keys=True), e)
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
    from triton.compiler import ASTSource
    import triton

    return triton.compile(ASTSource(fn=fn, signature=entry["signature"], constexprs=consts), target=target,
                          options=options)


def compile_all(path: str, arch: int) -> int:
    """Compiles each launch of `path` for a CUDA target of `arch` (e.g. 90 for H100/H200), and each kernel's
    first launch once more as a PDL launch (kernels/pdl.py: PDL on, the skinny prefetch on), whose PTX
    `pdl_order` checks; prints one JSON line."""
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    done, failed, pdl = set(), [], set()
    for entry in distinct(json.load(open(path))):
        fn = getattr(importlib.import_module(entry["module"]), entry["name"])
        unknown = [n for n, t in entry["signature"].items() if t is None]
        if unknown:
            failed.append({"kernel": entry["name"], "error": f"arguments of an unknown type: {unknown}"})
            continue
        consts = {k: triton.language.dtype(v["tl"]) if isinstance(v, dict) else v
                  for k, v in entry["constexprs"].items()}
        try:
            _compile(fn, entry, consts, target, entry["options"])
            done.add(entry["name"])
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
    print(json.dumps({"arch": arch, "compiled": sorted(done), "pdl": sorted(pdl), "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    mode, path, *rest = sys.argv[1:]
    if mode == "record":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("triton_compile.py record: set TRITON_INTERPRET=1 (the tests run in the interpreter)")
        sys.exit(record(path, rest))
    arch = int(rest[rest.index("--arch") + 1]) if "--arch" in rest else 90
    sys.exit(compile_all(path, arch))
