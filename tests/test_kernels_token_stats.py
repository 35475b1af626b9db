"""kernels.token_stats: chunked torch path and triton kernel (numpy interpreter) vs full log_softmax."""
import os
import subprocess
import sys
from pathlib import Path

# Triton only runs kernels on CPU tensors in interpreter mode, which is read when triton is first
# imported: set it before `kernels` imports triton (if nothing imported triton earlier).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

import svrmad_local.kernels as kernels  # noqa: E402
from svrmad_local.kernels import reference_token_stats, token_stats  # noqa: E402
from svrmad_local.kernels._backend import interpreter_ready, resolve_impl  # noqa: E402
from svrmad_local.kernels.token_stats import _token_stats_triton  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(T, H, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.25).to(dtype)  # logits of a few units: peaked rows
    targets = torch.randint(0, V, (T,), generator=g)
    return hidden, weight, targets


def _check(got, ref, atol=2e-4):
    """Compare with the full-softmax reference; ``ref`` also carries its fp32 logits."""
    ref, logits = ref
    assert got.logprob is not None and ref.logprob is not None
    for name in ("logprob", "entropy", "lse", "topk_logprobs"):
        a, b = getattr(got, name), getattr(ref, name)
        assert a.dtype == torch.float32 and not torch.isnan(a).any(), name
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=name)
    assert got.topk_ids.dtype == torch.int64
    assert (got.topk_logprobs[:, :-1] >= got.topk_logprobs[:, 1:]).all()  # sorted descending
    # ids may swap on near-ties; require that each id really has the reported log-prob
    if got.topk_ids.numel():
        logp = torch.log_softmax(logits, dim=-1)
        torch.testing.assert_close(logp.gather(1, got.topk_ids), got.topk_logprobs, atol=atol, rtol=1e-4)


def _ref(hidden, weight, targets, topk, softcap=None):
    logits = hidden.to(weight.dtype).float() @ weight.float().T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return reference_token_stats(hidden, weight, targets, topk, softcap=softcap), logits


# ---------------------------------------------------------------------------------------------
# torch reference path
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_torch_chunked_matches_full_softmax(dtype, softcap):
    hidden, weight, targets = _inputs(T=50, H=32, V=301, dtype=dtype)
    got = token_stats(hidden, weight, targets, topk=7, kernel_impl="torch", chunk_tokens=16, softcap=softcap)
    _check(got, _ref(hidden, weight, targets, 7, softcap))


class _LargestFloatTensor(TorchDispatchMode):
    """Records the largest fp32 tensor any aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_torch_never_materialises_full_logits():
    T, H, V, chunk = 64, 16, 300, 16
    hidden, weight, targets = _inputs(T, H, V, torch.float32)
    with _LargestFloatTensor() as probe:
        got = token_stats(hidden, weight, targets, topk=5, kernel_impl="torch", chunk_tokens=chunk)
    assert probe.largest == chunk * V < T * V
    _check(got, _ref(hidden, weight, targets, 5))


def test_targets_none_and_ignored_targets():
    hidden, weight, targets = _inputs(T=9, H=16, V=40, dtype=torch.float32)
    assert token_stats(hidden, weight, None, topk=3, kernel_impl="torch").logprob is None
    assert token_stats(hidden[:0], weight, targets[:0], topk=3, kernel_impl="torch").topk_ids.shape == (0, 3)
    targets[2], targets[5] = -100, 40  # padding / out of range -> 0, never NaN
    lp = token_stats(hidden, weight, targets, topk=3, kernel_impl="torch").logprob
    assert lp[2] == 0 and lp[5] == 0 and not torch.isnan(lp).any() and (lp[[0, 1, 3]] < 0).all()


def test_auto_choice_and_force_env(monkeypatch):
    assert resolve_impl("auto", torch.device("cpu"), "token_stats") == "torch"
    cuda = torch.device("cuda")
    assert resolve_impl("auto", cuda, "token_stats") == ("triton" if kernels.HAS_TRITON else "torch")
    assert kernels.select_impl("auto", torch.zeros(1)) == "torch"
    assert kernels.select_impl("torch", "cuda") == "torch"
    monkeypatch.setenv("SVRMAD_KERNELS", "torch")
    assert resolve_impl("auto", cuda, "token_stats") == "torch"
    with pytest.raises(ValueError):
        resolve_impl("cuda", cuda, "token_stats")


def test_package_works_without_triton():
    """The engine must import and compute when triton is absent (import blocked here)."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\nimport svrmad_local.kernels as kernels\n"
        "assert not kernels.HAS_TRITON\n"
        "h, w = torch.randn(5, 8), torch.randn(30, 8)\n"
        "s = kernels.token_stats(h, w, torch.zeros(5, dtype=torch.long), topk=3)\n"
        "q, kc = torch.randn(2, 2, 8), torch.randn(4, 4, 1, 8)\n"
        "lv = [kernels.Level(torch.arange(2), torch.tensor([2, 0]), 6)]\n"
        "o = kernels.cascade_attention(q, kc, kc, lv, 0.3)\n"
        "assert o.shape == q.shape and s.topk_ids.shape == (5, 3)\n"
        "try:\n"
        "    kernels.token_stats(h, w, kernel_impl='triton')\n"
        "    raise SystemExit('expected RuntimeError')\n"
        "except RuntimeError:\n"
        "    pass\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(not kernels.HAS_TRITON or interpreter_ready(),
                    reason="triton missing, or the triton cases already run in this process")
def test_triton_cases_in_fresh_process():
    """When another test module imported triton before TRITON_INTERPRET=1 was set (collecting a
    module that imports torch._dynamo does), the interpreter cannot be switched on in this process
    and the triton cases skip: run both kernel test files in a fresh interpreter-mode process."""
    root = Path(__file__).resolve().parents[1]
    files = [str(root / "tests" / f) for f in ("test_kernels_token_stats.py", "test_kernels_prefix_attention.py")]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not fresh_process",
                          *files],
                         cwd=root, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " skipped" not in res.stdout.splitlines()[-1], res.stdout[-2000:]


# ---------------------------------------------------------------------------------------------
# triton kernel (interpreter) vs torch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_triton_matches_reference(interp, dtype):
    # T not a multiple of the row block, V not a multiple of the vocab tile, H of the k tile
    hidden, weight, targets = _inputs(T=37, H=40, V=203, dtype=dtype, seed=1)
    targets[4] = -100
    got = token_stats(hidden, weight, targets, topk=5, kernel_impl="triton")
    ref = _ref(hidden, weight, targets, 5)
    _check(got, ref)
    torch.testing.assert_close(got.logprob, token_stats(hidden, weight, targets, 5, kernel_impl="torch").logprob)
    assert got.logprob[4] == 0


@pytest.mark.parametrize("topk", [1, 20])
def test_triton_many_vocab_splits_and_softcap(interp, topk):
    # several vocab splits per row (the per-split partials and candidates are merged in torch)
    hidden, weight, targets = _inputs(T=20, H=16, V=250, dtype=torch.float32, seed=2)
    got = _token_stats_triton(hidden, weight, targets, topk, softcap=4.0, split_size=64)
    _check(got, _ref(hidden, weight, targets, topk, softcap=4.0))


def test_triton_no_targets_no_topk_noncontiguous(interp):
    hidden, weight, _ = _inputs(T=18, H=64, V=70, dtype=torch.float32, seed=3)
    hidden = hidden[:, ::2]  # strided rows are read in place
    weight = weight[:, ::2]
    got = token_stats(hidden, weight, None, topk=0, kernel_impl="triton")
    ref = reference_token_stats(hidden, weight, None, topk=0)
    assert got.logprob is None and got.topk_ids.shape == (18, 0)
    empty = token_stats(hidden[:0], weight, torch.zeros(0, dtype=torch.long), topk=3, kernel_impl="triton")
    assert empty.topk_ids.shape == (0, 3) and empty.logprob.shape == (0,)
    torch.testing.assert_close(got.entropy, ref.entropy, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got.lse, ref.lse, atol=2e-4, rtol=1e-4)
