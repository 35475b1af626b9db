"""A decode step's host work does not grow with the context: at 1k and 16k tokens of context the engine's
step runs the same Python (bytecode instructions counted) and sends the device the same number of values
(every `staged` upload counted). Block tables are kept on the device and appended to (kv_cache.DeviceTables),
the peak KV a request held is counted as blocks change (scheduler), not over every block every step."""

from __future__ import annotations

import sys

import pytest
import torch

from svrmad_local.engine.config import EngineConfig, SamplingParams
from svrmad_local.engine.engine import Engine
from svrmad_local.kernels import _backend

from .model_zoo import rand_prompt

BATCH, NEW = 2, 6


def long_model(positions: int = 17_000):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=positions, eos_token_id=2, bos_token_id=0,
                      pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


class StepWork:
    """Per engine step on its worker thread: (decode rows, rows, Python bytecode instructions run, values
    staged to the device)."""

    current = None  # the counter the patched `staged` adds to

    @classmethod
    def patch_staged(cls, monkeypatch) -> None:
        real = _backend.staged

        def counted(values, dtype, device):
            out = real(values, dtype, device)
            cls.current.staged += out.numel()
            return out

        for name, mod in list(sys.modules.items()):
            if name.startswith("svrmad_local") and getattr(mod, "staged", None) is real:
                monkeypatch.setattr(mod, "staged", counted)

    def __init__(self, engine, monkeypatch):
        self.steps: list[tuple[int, int, int, int]] = []
        self.staged = 0
        StepWork.current = self
        schedule, step, shape = engine.scheduler.schedule, engine._step, []

        def counted_schedule():
            batch = schedule()
            shape[:] = [len(batch.decode), len(batch.work)]
            return batch

        def counted_step():
            ops = [0]

            def local(frame, event, arg):
                if event == "opcode":
                    ops[0] += 1
                return local

            def tracer(frame, event, arg):
                frame.f_trace_opcodes = True
                return local

            self.staged = 0
            sys.settrace(tracer)
            try:
                return step()
            finally:
                sys.settrace(None)
                if shape:
                    self.steps.append((*shape, ops[0], self.staged))

        monkeypatch.setattr(engine.scheduler, "schedule", counted_schedule)
        monkeypatch.setattr(engine, "_step", counted_step)

    def decode_steps(self) -> list[tuple[int, int]]:
        return [(ops, staged) for nd, nw, ops, staged in self.steps if nd == nw == BATCH]


@pytest.mark.parametrize("cfg", [dict(), dict(cuda_graphs="static")], ids=["dynamic", "static"])
def test_a_decode_steps_host_work_does_not_grow_with_the_context(monkeypatch, cfg):
    model = long_model()
    StepWork.patch_staged(monkeypatch)
    work = {}
    for context in (1024, 16_384):
        # every prompt in one prefill step: then every later step decodes all of them
        eng = Engine(model, None, EngineConfig(block_size=16, max_num_seqs=BATCH, max_num_batched_tokens=BATCH * context,
                                               kv_cache_memory=BATCH * 17_000 * 4 * 2 * 2 * 16 * 2, **cfg))
        counter = StepWork(eng, monkeypatch)
        prompts = [rand_prompt(context, 40 + i) for i in range(BATCH)]  # each ends on a block boundary
        eng.generate_sync(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
        work[context] = counter.decode_steps()
        assert len(work[context]) == NEW - 1, counter.steps
        eng.close()
    # the first decode step writes each sequence's whole table to the device once, later ones append to
    # it; the last frees the finished sequences' blocks (once a sequence, not once a step)
    assert work[1024][1:-1] == work[16_384][1:-1], work


def test_the_blocks_a_request_holds_are_counted_as_they_change(monkeypatch):
    """The scheduler's running count of each request's distinct blocks equals a walk over its sequences'
    blocks after every step: through forks sharing a prefix, greedy forks whose identical full blocks are
    adopted from the cache, preemptions under a small budget, and finishes; and every decoding row's table
    on the device is its sequence's blocks."""
    from tests.conftest import make_model

    model = make_model("llama")
    eng = Engine(model, None, EngineConfig(block_size=4, max_num_seqs=6, kv_cache_memory=12 * 2048))  # 12 blocks
    checked = []
    run = eng.stepper.run

    def checking():
        out = run()
        live = {s.request for s in eng.scheduler.running + list(eng.scheduler.waiting)}
        for req in live:
            assert len(req.held_blocks) == len({b for s in req.sequences for b in s.blocks})
            assert sum(req.held_blocks.values()) == sum(len(s.blocks) for s in req.sequences)
        tables = eng.runner.tables
        for s in eng.scheduler.running:
            r = tables.row_of.get(s.uid)
            if r is not None and tables.meta[r][:2] == (s.uid, s.blocks_epoch):
                n = tables.meta[r][2]
                assert tables.table[r, :n].tolist() == s.blocks[:n]
        checked.append(len(live))
        return out

    monkeypatch.setattr(eng.stepper, "run", checking)
    prompt = rand_prompt(10, 1)
    params = [SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, max_tokens=20, ignore_eos=True, seed=3)]
    out = eng.generate_sync([prompt, prompt + [5, 6]], params)
    assert [len(c.token_ids) for o in out for c in o.completions] == [20] * 6
    assert sum(o.usage.preemptions for o in out) > 0 and max(checked) == 2
    for o in out:
        assert o.usage.peak_kv_bytes > 0
