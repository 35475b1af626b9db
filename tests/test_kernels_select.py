"""One selector for every kernel (kernels/_backend.choose): the Triton kernels and the compiled C++
CPU kernels both ask it whether their fast implementation runs or the torch reference, and why."""

from __future__ import annotations

import pytest
import torch

from svrmad_local.kernels import _backend, cpu_decode, cpu_linear, cpu_ops, cpu_stack

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def fake_cpu_kernel(monkeypatch):
    """A registered CPU kernel whose availability the test sets (nothing is compiled)."""
    state = {"why": None}
    monkeypatch.setitem(_backend._CPU, "fake_cpu", lambda: state["why"])
    return state


def test_a_cpu_kernel_runs_where_it_built_else_the_reference_says_why(fake_cpu_kernel):
    assert _backend.choose("auto", CPU, "fake_cpu") == _backend.KernelPick("cpp", None)
    assert _backend.resolve_impl("auto", CPU, "fake_cpu") == "cpp"
    fake_cpu_kernel["why"] = "no C++ compiler (c++ is not on PATH)"
    assert _backend.choose("auto", CPU, "fake_cpu") == _backend.KernelPick("torch", "no C++ compiler (c++ is not on PATH)")
    assert _backend.select_impl("auto", torch.zeros(1), "fake_cpu") == "torch"


def test_a_cpu_kernel_obeys_kernel_impl_and_the_device(fake_cpu_kernel):
    assert _backend.choose("torch", CPU, "fake_cpu") == _backend.KernelPick("torch", "kernel_impl='torch'")
    assert _backend.choose("auto", CUDA, "fake_cpu").impl == "torch"
    assert "cuda" in _backend.choose("auto", CUDA, "fake_cpu").why
    with pytest.raises(ValueError, match="C\\+\\+ CPU kernel"):
        _backend.choose("triton", CPU, "fake_cpu")


def test_a_triton_kernel_says_why_it_takes_the_reference(monkeypatch):
    assert _backend.choose("auto", CPU, "token_stats") == _backend.KernelPick("torch", "tensors on cpu")
    if _backend.HAS_TRITON:
        assert _backend.choose("auto", CUDA, "token_stats") == _backend.KernelPick("triton", None)
    monkeypatch.setenv(_backend.FORCE_ENV, "torch")
    assert _backend.choose("auto", CUDA, "token_stats") == _backend.KernelPick("torch", "SVRMAD_KERNELS=torch")
    monkeypatch.delenv(_backend.FORCE_ENV)
    monkeypatch.setitem(_backend._disabled, "token_stats", "RuntimeError('boom')")
    assert _backend.choose("auto", CUDA, "token_stats") == _backend.KernelPick(
        "torch", "its Triton path failed: RuntimeError('boom')")


@pytest.mark.parametrize("module,env", [(cpu_decode, "SVRMAD_CPU_DECODE"), (cpu_linear, "SVRMAD_CPU_LINEAR"),
                                        (cpu_ops, "SVRMAD_CPU_OPS"), (cpu_stack, "SVRMAD_CPU_STACK")])
def test_the_cpu_kernels_are_registered_and_answer_through_the_selector(module, env, monkeypatch):
    assert module.NAME in _backend._CPU
    monkeypatch.setenv(env, "0")  # off: nothing is built to answer
    assert _backend.choose("auto", CPU, module.NAME) == _backend.KernelPick("torch", f"{env}=0")
    assert not module.available() and module.unavailable_reason() == f"{env}=0"
    monkeypatch.setitem(_backend._CPU, module.NAME, lambda: "the selector's reason")  # the module asks it
    assert not module.available() and module.unavailable_reason() == "the selector's reason"
