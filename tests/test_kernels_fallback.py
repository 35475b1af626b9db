"""What a kernel dispatcher does when its Triton path raises under kernel_impl="auto" (kernels/_backend.py,
`fall_back`): eagerly it serves the call from the torch reference and stops trying Triton for that kernel;
while a CUDA graph is being captured it re-raises and leaves the kernel on, so the capture fails (its
caller decides) instead of recording the slow reference into the graph and turning the fast kernel off
for every later eager step. The capture is simulated on the CPU by making `_backend.capturing` say so.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from svrmad_local.kernels import _backend, _quant_common

# the modules (the package exports functions of the same names)
paged_decode, paged_prefill, mla_decode, token_stats = (
    importlib.import_module(f"svrmad_local.kernels.{m}") for m in ("paged_decode", "paged_prefill", "mla_decode",
                                                                   "token_stats"))


class Injected(RuntimeError):
    pass


def _boom(*a, **k):
    raise Injected("compile error (injected)")


def _paged_decode_call():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=g)
    k = torch.randn(16, 2, 8, generator=g)
    v = torch.randn(16, 2, 8, generator=g)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    ref = paged_decode.reference_paged_decode(q, k, v, table, lens, 4, 0.3)
    return lambda: paged_decode.paged_decode(q, k, v, table, lens, 4, 0.3), ref


def _paged_prefill_call():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 8, generator=g)
    k = torch.randn(16, 2, 8, generator=g)
    v = torch.randn(16, 2, 8, generator=g)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    ref = paged_prefill.reference_paged_prefill(q, k, v, table, [0, 2, 5], [6, 3], 4, 0.3)
    return lambda: paged_prefill.paged_prefill(q, k, v, table, [0, 2, 5], [6, 3], 4, 0.3), ref


def _mla_call():
    g = torch.Generator().manual_seed(2)
    q_lat, q_rot = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 4, generator=g)
    c, kr = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    ref = mla_decode.reference_mla_decode(q_lat, q_rot, c, kr, table, lens, 4, 0.3)
    return lambda: mla_decode.mla_decode(q_lat, q_rot, c, kr, table, lens, 4, 0.3), ref


def _token_stats_call():
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(3, 8, generator=g), torch.randn(20, 8, generator=g)
    t = torch.tensor([1, 2, 3])
    ref = token_stats.reference_token_stats(h, w, t, topk=2).logprob
    return lambda: token_stats.token_stats(h, w, t, topk=2).logprob, ref


CASES = {  # kernel name -> (module whose resolve_impl picks the path, its Triton function, the call)
    "paged_decode": (paged_decode, "_paged_decode_triton", _paged_decode_call),
    "paged_prefill": (paged_prefill, "_paged_prefill_triton", _paged_prefill_call),
    "mla_decode": (mla_decode, "_mla_triton", _mla_call),
    "token_stats": (token_stats, "_token_stats_triton", _token_stats_call),
}


@pytest.fixture
def fresh(monkeypatch):
    """A clean record of disabled kernels (the real one is process-wide)."""
    monkeypatch.setattr(_backend, "_disabled", {})
    return _backend._disabled


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_failure_while_capturing_is_raised_and_leaves_the_kernel_on(name, monkeypatch, fresh):
    module, fn, make = CASES[name]
    monkeypatch.setattr(module, "resolve_impl", lambda impl, dev, n: "triton")  # as on a GPU under "auto"
    monkeypatch.setattr(module, fn, _boom)
    monkeypatch.setattr(_backend, "capturing", lambda: True)
    call, _ = make()
    with pytest.raises(Injected):
        call()
    assert name not in fresh


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_eager_failure_falls_back_to_the_reference_and_turns_the_kernel_off(name, monkeypatch, fresh):
    module, fn, make = CASES[name]
    monkeypatch.setattr(module, "resolve_impl", lambda impl, dev, n: "triton")
    monkeypatch.setattr(module, fn, _boom)
    call, ref = make()
    with pytest.warns(RuntimeWarning, match="triton path failed"):
        got = call()
    torch.testing.assert_close(got, ref)
    assert "Injected" in fresh[name]


def test_the_quantized_matmuls_follow_the_same_rule(monkeypatch, fresh):
    monkeypatch.setattr(_backend, "capturing", lambda: True)
    with pytest.raises(Injected):
        _quant_common.run_triton("mxfp4_grouped_matmul", "auto", _boom)
    assert fresh == {}
    monkeypatch.setattr(_backend, "capturing", lambda: False)
    with pytest.warns(RuntimeWarning):
        assert _quant_common.run_triton("mxfp4_grouped_matmul", "auto", _boom) is None
    assert "mxfp4_grouped_matmul" in fresh
    with pytest.raises(Injected):  # asked for Triton explicitly: always raised
        _quant_common.run_triton("fp8_grouped_matmul", "triton", _boom)


def test_the_sampling_kernels_follow_the_same_rule(monkeypatch, fresh):
    """engine/sampler.py's two Triton kernels (kernels/sample_pack.py, a GPU's sampling): a failure while
    capturing is raised, an eager one serves the step from the torch ops and turns them off."""
    import numpy as np

    from svrmad_local.engine import sampler
    from svrmad_local.kernels import cpu_ops, sample_pack

    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(4))
    draws = sampler.Draws(np.array([[1.0, 0.8], [40, 40], [1.0, 0.9], [0.0, 0.4], [1, 0]]), 40, 20)
    monkeypatch.setattr(cpu_ops, "samples", lambda t: False)
    ref = sampler.sample_packed(logits, draws, "torch")
    monkeypatch.setattr(sampler, "select_impl", lambda impl, t, n: "triton")  # as on a GPU under "auto"
    monkeypatch.setattr(sample_pack, "sample_pack", _boom)
    monkeypatch.setattr(_backend, "capturing", lambda: True)
    with pytest.raises(Injected):
        sampler.sample_packed(logits, draws)
    assert fresh == {}
    monkeypatch.setattr(_backend, "capturing", lambda: False)
    with pytest.warns(RuntimeWarning, match="triton path failed"):
        assert torch.equal(sampler.sample_packed(logits, draws), ref)
    assert "Injected" in fresh["sample_pack"]


def test_capturing_is_false_without_cuda():
    assert _backend.capturing() is (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def test_staged_host_values_keep_their_precision_and_land_on_the_device():
    """kernels._backend.staged builds the tensor in the asked dtype from the values themselves (the
    sampler's uniform draws are float64: a float32 detour would change which token a seed picks)."""
    import numpy as np

    u = 0.1234567890123456
    assert _backend.staged([u], torch.float64, "cpu").item() == u
    t = _backend.staged(np.array([[1, 2], [3, 4]]), torch.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [[1, 2], [3, 4]]
    assert _backend.staged(torch.tensor([5]), torch.long, "cpu").tolist() == [5]
