"""Programmatic dependent launch (kernels/pdl.py): the flag and the launch option go together, every kernel
waits before it touches memory, the decision is made once and said in the record, and off a GPU nothing
changes. (That the compiled kernels wait first is checked on their PTX: tests/test_triton_compile.py.)"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from types import SimpleNamespace

import pytest
import torch

from svrmad_local.engine import choices
from svrmad_local.engine.config import EngineConfig
from svrmad_local.errors import UserError
from svrmad_local.kernels import pdl, skinny

from .triton_compile import pdl_order

CUDA0 = SimpleNamespace(device=torch.device("cuda", 0))  # what launch() reads of a tensor on the first GPU


def test_off_a_gpu_no_kernel_launches_with_pdl_and_the_start_line_says_nothing(monkeypatch):
    monkeypatch.setitem(pdl._state, "on", True)
    assert pdl.launch(torch.zeros(2)) == {}
    assert pdl.why_not("cpu") == "tensors on cpu"
    c = choices.pdl_choice("auto", torch.device("cpu"))
    assert (c.value, c.reason, c.fell_back) == ("none", "tensors on cpu", False)
    with pytest.raises(ValueError, match="pdl='on' cannot run here: tensors on cpu"):
        choices.pdl_choice("on", torch.device("cpu"))
    choices.pdl_choice("off", torch.device("cpu"))
    assert pdl._state["on"]  # a CPU engine leaves the process's setting to the engines on a GPU
    with pytest.raises(UserError, match="pdl"):
        EngineConfig(pdl="always")


def test_the_flag_and_the_launch_option_go_together(monkeypatch):
    """A kernel launched with launch_pdl and without its PDL flag would read before the kernel before it
    finished: launch() gives both or neither, and neither once the run turned it off."""
    monkeypatch.setattr(pdl, "_decided", {0: None})
    monkeypatch.setitem(pdl._state, "on", True)
    assert pdl.launch(CUDA0) == {"PDL": True, "launch_pdl": True}
    assert pdl.use(False) is True  # the setting it replaced, for a caller to restore
    assert pdl.launch(CUDA0) == {}
    assert pdl.use(True) is False
    monkeypatch.setattr(pdl, "_decided", {0: "compute capability 8.0 (PDL needs 9.0 or later)"})
    assert pdl.launch(CUDA0) == {}


def test_the_choice_on_a_gpu(monkeypatch):
    """On: said. Off as asked: every kernel launched plainly. A capability below 9.0 is no news; a probe that
    fails where it should run is a fallback; "on" that cannot run is an error naming why."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setitem(pdl._state, "on", True)
    why = {"now": None}
    monkeypatch.setattr(pdl, "why_not", lambda device: why["now"])
    c = choices.pdl_choice("auto", gpu)
    assert c.value == "on" and not c.fell_back and pdl._state["on"]
    c = choices.pdl_choice("off", gpu)
    assert (c.value, c.reason) == ("off", "as asked") and not pdl._state["on"]
    why["now"] = "compute capability 8.0 (PDL needs 9.0 or later)"
    c = choices.pdl_choice("auto", gpu)
    assert (c.value, c.fell_back) == ("off", False)
    why["now"] = f"{pdl.PROBE_FAILED}: RuntimeError: no kernel image"
    assert choices.pdl_choice("auto", gpu).fell_back
    with pytest.raises(ValueError, match="pdl='on' cannot run here: the probe failed"):
        choices.pdl_choice("on", gpu)


def test_the_environment_turns_it_off_for_the_process(monkeypatch):
    """SVRMAD_PDL=0: off whatever asks (kernels called without an engine too), said as the reason; "on" is then
    an error naming it."""
    monkeypatch.setenv("SVRMAD_PDL", "0")
    monkeypatch.setitem(pdl._state, "on", True)
    assert pdl.why_not(torch.device("cuda", 0)) == "SVRMAD_PDL=0"
    assert pdl.launch(CUDA0) == {}
    with pytest.raises(ValueError, match="pdl='on' cannot run here: SVRMAD_PDL=0"):
        choices.pdl_choice("on", torch.device("cuda", 0))


def test_the_probe_says_why_not(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4")  # ROCm's torch says "cuda" too, and MI300 is capability 9.4
    assert pdl._probe_device(0) == "a ROCm GPU (programmatic dependent launch is NVIDIA's)"
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    assert pdl._probe_device(0) == "compute capability 8.0 (PDL needs 9.0 or later)"
    if not torch.cuda.is_available():  # a capable GPU that cannot run the probe's launches
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
        assert pdl._probe_device(0).startswith(pdl.PROBE_FAILED + ": ")


def _kernels():
    import svrmad_local.kernels as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"svrmad_local.kernels.{info.name}")
        for name, value in vars(module).items():
            if name.endswith("_kernel") and hasattr(value, "fn") and type(value).__name__ in ("JITFunction",
                                                                                             "InterpretedFunction"):
                yield module, name, value.fn


def _calls(node) -> set[str]:
    return {ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}


@pytest.mark.skipif(not pdl.HAS_TRITON, reason="Triton is not installed")
def test_every_kernel_enters_before_it_touches_memory():
    """Each kernel's body calls enter(PDL) at its top level, and before it nothing loads, stores or calls a
    helper but the weight prefetch (the weights are no kernel's output)."""
    seen = 0
    for module, name, fn in _kernels():
        body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
        assert "PDL" in inspect.signature(fn).parameters, f"{name} has no PDL flag"
        first = next((i for i, s in enumerate(body) if ast.unparse(s) == "enter(PDL)"), None)
        assert first is not None, f"{name} never calls enter(PDL) at its top level"
        before = set().union(*[_calls(s) for s in body[:first]])
        touching = {c for c in before if c.startswith(("tl.load", "tl.store", "tl.atomic"))
                    or not (c.startswith("tl.") or c.endswith(".to") or c == "_prefetch_rows")}
        assert not touching, f"{name} calls {sorted(touching)} before enter(PDL)"
        seen += 1
    assert seen >= 19


def test_every_launch_takes_the_pdl_keywords():
    """Each `*_kernel[grid](...)` of the package passes **launch(...) (or a name bound to it): a kernel
    launched without them is exact but starts only when the one before ends."""
    import svrmad_local.kernels as pkg

    sites = 0
    for info in pkgutil.iter_modules(pkg.__path__):
        source = importlib.import_module(f"svrmad_local.kernels.{info.name}").__file__
        tree = ast.parse(open(source).read())
        bound = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                 and ast.unparse(n.value.func) == "launch" for t in n.targets if isinstance(t, ast.Name)}
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript) \
                    and ast.unparse(call.func.value).endswith("_kernel"):
                stars = [k.value for k in call.keywords if k.arg is None]
                ok = [v for v in stars if (isinstance(v, ast.Call) and ast.unparse(v.func) == "launch")
                      or (isinstance(v, ast.Name) and v.id in bound)]
                assert ok, f"{info.name}: {ast.unparse(call.func)} launched without **launch(...)"
                sites += 1
    assert sites >= 19


def test_the_ptx_check_finds_memory_before_the_wait():
    good = ("cp.async.bulk.prefetch.L2.global [%rd1], %r2;\ngriddepcontrol.wait ;\ngriddepcontrol.launch_dependents ;\n"
            "\t@%p1 ld.global.b16 { %rs1 }, [ %rd2 + 0 ];\n")
    assert pdl_order(good) is None
    assert pdl_order("\tld.global.b32 %r1, [%rd1];\ngriddepcontrol.wait ;\ngriddepcontrol.launch_dependents ;\n") \
        == "global memory before the wait: ld.global.b32 %r1, [%rd1];"
    assert pdl_order("\t@%p2 st.global.b32 [%rd1], %r1;\ngriddepcontrol.wait ;\ngriddepcontrol.launch_dependents ;") \
        .startswith("global memory before the wait: @%p2 st.global")
    assert pdl_order("ld.global.b32 %r1, [%rd1];") == "no griddepcontrol.wait"
    assert pdl_order("griddepcontrol.wait ;") == "no griddepcontrol.launch_dependents"


def test_the_skinny_prefetch_stays_inside_each_rows_share_and_aligned():
    w = torch.zeros(64, 4096, dtype=torch.bfloat16)
    assert skinny.prefetch_bytes(w, 4096, 1) == skinny.PREFETCH_BYTES == 1024
    w = torch.zeros(64, 100, dtype=torch.float32)  # two shares of 64 and 36 columns: the last is 144 bytes
    assert skinny.prefetch_bytes(w, 64, 2) == 144
    assert skinny.prefetch_bytes(torch.zeros(64, 101, dtype=torch.float32)[:, :100], 64, 2) == 0  # rows 404 bytes
    assert skinny.prefetch_bytes(torch.zeros(64, 129, dtype=torch.bfloat16)[:, 1:], 128, 1) == 0  # 2-byte offset
    assert skinny.prefetch_bytes(torch.zeros(100, 64, dtype=torch.float32).t(), 64, 1) == 0  # K not contiguous
    assert skinny.prefetch_bytes(torch.zeros(8, 24, dtype=torch.float32), 24, 1) == 96
