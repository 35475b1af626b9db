"""A decode step's dense layers as one compiled call on the CPU (engine/stack.py, kernels/cpu_stack.py): the
same tokens, log-probs and entropies, bit for bit, as our decoder's loop over the same kernels and as the
model's own modules, fp32 and bf16, over prefill chunks (which run the loop), decode steps (which take the
stack), sliding windows, Qwen3's q/k norms, Qwen2's biases and Phi-3's one-projection q/k/v and gate/up;
and the record says where it does not run and why."""

from __future__ import annotations

import pytest
import torch

from svrmad_local.engine import stack as stack_mod
from svrmad_local.engine.params import SamplingParams
from svrmad_local.kernels import cpu_stack

from .model_zoo import WINDOW, make_zoo_model, rand_prompt
from .test_decoder import engine

DENSE = ["llama", "qwen2", "qwen2-sliding", "qwen3", "mistral-sliding", "phi3-sliding"]
SAMPLED = SamplingParams(temperature=0.9, top_k=50, max_tokens=12, ignore_eos=True, seed=5, n=2)
PROMPTS = [rand_prompt(n, 40 + n) for n in (3, 17, 2 * WINDOW + 7)]

pytestmark = pytest.mark.skipif(cpu_stack.unavailable_reason() is not None,
                                reason=f"the compiled kernels did not build: {cpu_stack.unavailable_reason()}")


def run(model, monkeypatch, off: bool = False, **kw):
    """(tokens, log-probs, entropies of every completion; decode steps the stack computed; the decoder choice)."""
    eng = engine(model, max_num_batched_tokens=16, linear="panels", **kw)
    taken = []
    if eng.runner.decoder is not None and eng.runner.decoder.stack is not None:
        if off:
            eng.runner.decoder.stack = None
        else:
            call = stack_mod.Stack.__call__

            def counted(self, *args):
                out = call(self, *args)
                taken.append(out is not None)
                return out

            monkeypatch.setattr(stack_mod.Stack, "__call__", counted)
    try:
        out = [(c.token_ids, c.logprobs, c.entropies) for o in eng.generate_sync(PROMPTS, SAMPLED) for c in o.completions]
        return out, sum(taken), eng.execution.decoder
    finally:
        eng.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", DENSE)
def test_the_stack_computes_the_loops_and_the_modules_bits(name, dtype, monkeypatch):
    model = make_zoo_model(name).to(dtype)
    ours, taken, choice = run(model, monkeypatch)
    assert "decode steps in one compiled call" in choice.reason
    assert taken >= SAMPLED.max_tokens - 1  # every decode-only step took it
    loop, none, _ = run(model, monkeypatch, off=True)
    assert none == 0
    modules, _, choice = run(model, monkeypatch, decoder="modules")
    assert choice.value == "the model's modules"
    assert ours == loop == modules, name


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss", "qwen3-moe", "deepseek-v3"])
def test_other_layers_run_the_loop_and_the_record_says_why(name):
    eng = engine(make_zoo_model(name), linear="panels")
    try:
        assert eng.runner.decoder.stack is None
        assert "layer by layer (layer 0: " in eng.execution.decoder.reason
    finally:
        eng.close()


def test_linears_not_held_as_panels_run_the_loop():
    eng = engine(make_zoo_model("llama"), linear="aten")
    try:
        assert eng.runner.decoder.stack is None
        assert "layer by layer (layer 0: linears not held as panels)" in eng.execution.decoder.reason
    finally:
        eng.close()


def test_a_step_the_stack_cannot_take_runs_the_loop(monkeypatch):
    """A cache of another dtype than the activations (or cos/sin narrower than the head, or a SiLU split torch
    would walk differently): the step runs the loop, and the tokens are the loop's."""
    model = make_zoo_model("llama")
    loop, _, _ = run(model, monkeypatch, off=True)
    monkeypatch.setattr(stack_mod.cpu_ops, "silu_mul_fits", lambda *a: False)
    ours, taken, _ = run(model, monkeypatch)
    assert taken == 0 and ours == loop


@pytest.mark.parametrize("layers", [2, 6])
def test_a_decode_step_makes_one_tensor_whatever_its_layers(layers, monkeypatch):
    """Every kernel of the compiled step writes into the stack's kept activations (made again only when the
    step's row count changes): a decode step makes its output and nothing else, at any depth (each layer made
    and freed ~11 tensors before); its bits are the loop's (above)."""
    from torch.profiler import ProfilerActivity, profile

    from .conftest import make_model

    eng = engine(make_model("llama", layers=layers), linear="panels")
    made: list[int] = []
    call = stack_mod.Stack.__call__

    def counted(self, *args):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = call(self, *args)
        made.append(sum(1 for e in prof.events() if e.name in ("aten::empty", "aten::empty_strided")))
        return out

    monkeypatch.setattr(stack_mod.Stack, "__call__", counted)
    try:
        eng.generate_sync([rand_prompt(5, 1)], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finally:
        eng.close()
    assert len(made) == 5 and made[1:] == [1] * 4, made  # the first decode step makes the buffers too
