"""The sampler's two parts (engine/sampler.py): the host part draws what it drew before, the device part
picks the tokens the sampler picked before, row by row.

* Default requests (and greedy, and other temperatures, mixed in one batch) get the tokens the sampler
  gave before it was split, from the same seeds, and leave each stream where it left it: `previous` below
  is that sampler, kept here as the reference.
* A row's token depends on its own row only: a batch gives each row what it gives alone.
"""

from __future__ import annotations

import random

import pytest
import torch

from svrmad_local.engine import sampler
from svrmad_local.engine.config import SamplingParams


def previous(logits, temperature, top_k, top_p, generators):
    """The sampler as it was before the split into a host part and a device part (one call, the top-k
    width the batch's largest, greedy rows set apart by index), the reference for the tokens it drew."""
    R, V = logits.shape
    greedy = [i for i, t in enumerate(temperature) if t == 0]
    if len(greedy) == R:
        return logits.argmax(-1)
    out = torch.empty(R, dtype=torch.long)
    if greedy:
        g = torch.tensor(greedy)
        out[g] = logits[g].argmax(-1)
    rows = [i for i, t in enumerate(temperature) if t != 0]
    every = len(rows) == R
    at = None if every else torch.tensor(rows)
    lg = (logits if every else logits[at]) / torch.tensor([temperature[i] for i in rows], dtype=logits.dtype).unsqueeze(1)
    ks = [top_k[i] if 0 < top_k[i] < V else V for i in rows]
    kmax = max(ks)
    vals, idx = lg.topk(kmax, dim=-1) if kmax < V else lg.sort(dim=-1, descending=True)
    ranks = torch.arange(vals.shape[1])
    vals = vals.masked_fill(ranks.unsqueeze(0) >= torch.tensor(ks).unsqueeze(1), float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    cum = probs.cumsum(-1)
    p = torch.tensor([top_p[i] for i in rows], dtype=torch.float32).unsqueeze(1)
    probs = probs.masked_fill((cum - probs) >= p, 0.0)
    cum = probs.cumsum(-1)
    u = torch.tensor([generators[i].random() for i in rows], dtype=torch.float64)
    target = (u * cum[:, -1].double()).to(cum.dtype).unsqueeze(1)
    pos = torch.searchsorted(cum, target, right=True).clamp(max=vals.shape[1] - 1)
    pos = torch.minimum(pos, (probs > 0).sum(-1, keepdim=True) - 1)
    picked = idx.gather(1, pos).squeeze(1)
    if every:
        return picked
    out[at] = picked
    return out


DEFAULT = SamplingParams()
CASES = {
    "default": [DEFAULT] * 6,
    "default and greedy": [DEFAULT, SamplingParams(temperature=0), DEFAULT, DEFAULT, SamplingParams(temperature=0)],
    "temperatures": [SamplingParams(temperature=t) for t in (0.3, 0.7, 1.0, 1.3)],
    "one row": [DEFAULT],
    "all greedy": [SamplingParams(temperature=0)] * 3,
}


@pytest.mark.parametrize("vocab", [400, 5000, 49152])  # 5000 and 49152: the compiled top-k (k * 64 <= V)
@pytest.mark.parametrize("case", CASES)
def test_default_requests_draw_the_tokens_they_drew_before(case, vocab):
    params = CASES[case]
    torch.manual_seed(vocab)
    now = [random.Random(1000 + i) for i in range(len(params))]
    before = [random.Random(1000 + i) for i in range(len(params))]
    for step in range(30):
        logits = torch.randn(len(params), vocab) * (1 + step % 4)  # flat and peaked distributions
        if vocab == 49152:  # as a bf16 LM head gives them: equal logits near the top, in torch's order or not
            logits = logits.bfloat16().float()
        got = sampler.sample_rows(logits, sampler.prepare(params, now, vocab))
        want = previous(logits, [p.temperature for p in params], [p.top_k for p in params],
                        [p.top_p for p in params], before)
        assert got.tolist() == want.tolist(), (case, step)
        assert [g.getstate() for g in now] == [g.getstate() for g in before], (case, step)  # one draw a sampled row


def test_a_rows_token_depends_on_its_own_row_only():
    """Whatever shares the batch (greedy rows, other settings): the device part is row by row."""
    torch.manual_seed(0)
    params = [DEFAULT, SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.5, top_k=7), DEFAULT]
    for step in range(20):
        logits = torch.randn(len(params), 1000) * 3
        seeds = [random.Random(step * 10 + i) for i in range(len(params))]
        table = sampler.prepare(params, seeds, 1000).table
        both = sampler.draw(logits, *sampler.columns(torch.from_numpy(table), logits.dtype), sampler.SAMPLE_TOP_K)
        alone = [sampler.draw(logits[i:i + 1], *sampler.columns(torch.from_numpy(table[:, i:i + 1]), logits.dtype),
                              sampler.SAMPLE_TOP_K).item() for i in range(len(params))]
        assert both.tolist() == alone
        assert both[1] == logits[1].argmax()


def test_the_widths_a_step_needs():
    """The top-k width is the default top_k at least (a batch of default requests: topk(40)), a row's own
    where it asks more, the vocabulary where it asks none; the statistics' top-k likewise from 20."""
    draws = sampler.prepare([DEFAULT, SamplingParams(top_k=5)], [random.Random(0)] * 2, 1000)
    assert (draws.K, draws.topk) == (40, 20)
    assert sampler.prepare([SamplingParams(top_k=100)], [random.Random(0)], 1000).K == 100
    assert sampler.prepare([SamplingParams(top_k=0)], [random.Random(0)], 1000).K == 1000
    assert sampler.prepare([SamplingParams(top_k=0, temperature=0)], [random.Random(0)], 1000).K == 40  # greedy: no draw
    assert sampler.prepare([DEFAULT], [random.Random(0)], 30).K == 30  # a vocabulary narrower than 40: a full sort
    assert sampler.prepare([SamplingParams(topk_logprobs=30)], [random.Random(0)], 1000).topk == 30


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_of_non_finite_logits_draws_an_index_and_leaves_the_other_rows_alone(bad):
    """Torch's ops (the path on a GPU) and the compiled step alike: such a row once gathered position -1, an
    IndexError on the CPU and a device assert inside a CUDA graph. It takes its first place now; its
    statistics (NaN) tell the step to fail its request, and the other rows draw what they draw alone."""
    from svrmad_local.kernels import cpu_ops

    torch.manual_seed(0)
    logits = torch.randn(3, 500)
    logits[1, 7] = bad
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * 3
    draws = sampler.prepare(params, [random.Random(i) for i in range(3)], 500)
    toks = sampler.sample_rows(logits, draws)
    assert 0 <= int(toks[1]) < 500
    for r in (0, 2):
        alone = sampler.prepare(params[:1], [random.Random(r)], 500)
        assert int(sampler.sample_rows(logits[r : r + 1], alone)[0]) == int(toks[r])
    if cpu_ops.samples(logits):
        packed = sampler.sample_packed(logits, sampler.prepare(params, [random.Random(i) for i in range(3)], 500))
        assert packed[:, 0].tolist() == toks.double().tolist() and packed[1, 2].isnan() and not packed[0, 2].isnan()


def _timed_choice(tmp_path, monkeypatch, timer, kernel_impl="auto", max_num_seqs=32, vocab=1000):
    """choices.sampling_choice over a head on the CPU, as on a GPU with Triton (select_impl says "triton")."""
    from svrmad_local.engine import choices

    monkeypatch.setattr(choices.kernels, "select_impl", lambda *a: "triton")
    return choices.sampling_choice(torch.zeros(vocab, 8), kernel_impl, max_num_seqs, cache=tmp_path, timer=timer)


def test_the_sampling_choice_follows_the_timings_and_keeps_them(tmp_path, monkeypatch):
    """Timed at powers of two up to max_num_seqs (and it), both sides; the kernels taken where faster, a step
    of r rows going by the smallest timed count >= r; the figures kept, so a later build times nothing and
    chooses the same."""
    asked = []

    def timer(rows, side):
        asked.append((rows, side))
        return (1.0 if rows <= 4 else 3.0) if side == "triton" else 2.0

    rule, said = _timed_choice(tmp_path, monkeypatch, timer, max_num_seqs=24)
    assert sorted({r for r, _ in asked}) == [1, 2, 4, 8, 16, 24] and {s for _, s in asked} == {"triton", "torch"}
    assert [rule(r) for r in (1, 3, 4, 5, 8, 24, 100)] == [True, True, True, False, False, False, False]
    assert said.value == "Triton kernels at 1-4 rows, torch's ops at 5+ rows" == str(rule)
    assert "at build" in said.reason and "4: 1000000 / 2000000 us" in said.reason

    def untimed(rows, side):
        raise AssertionError("timed again")

    again, said_again = _timed_choice(tmp_path, monkeypatch, untimed, max_num_seqs=24)
    assert again == rule and "kept from an earlier build" in said_again.reason
    logits = torch.randn(8, 1000)
    assert sampler.fuses(logits[:4], 40, 20, "triton", rule) and not sampler.fuses(logits, 40, 20, "triton", rule)


def test_where_the_kernels_cannot_compile_torch_samples(tmp_path, monkeypatch):
    def timer(rows, side):
        if side == "triton":
            raise RuntimeError("out of resource")
        return 1.0

    rule, said = _timed_choice(tmp_path, monkeypatch, timer, max_num_seqs=2)
    assert not rule(1) and not rule(2) and said.value == "torch's ops at every row count"
    assert "the kernels did not run" in said.reason


def test_the_sampling_choice_times_nothing_where_there_is_no_choice(tmp_path, monkeypatch):
    """Off a GPU: "none" (the CPU's compiled ops sample); asked for a path: that path, untimed; widths over
    the kernels': torch's ops."""
    from svrmad_local.engine import choices

    head = torch.zeros(1000, 8)
    rule, said = choices.sampling_choice(head, "auto", 8, cache=tmp_path)
    assert rule is None and said.value == "none" and said.reason == "tensors on cpu"

    def untimed(rows, side):
        raise AssertionError("timed")

    rule, said = _timed_choice(tmp_path, monkeypatch, untimed, kernel_impl="triton")
    assert rule is None and said.value == "triton"
    monkeypatch.setattr(choices.kernels, "select_impl", lambda *a: "torch")
    rule, said = choices.sampling_choice(head, "torch", 8, cache=tmp_path, timer=untimed)
    assert rule is None and said.value == "torch"
    monkeypatch.setattr(choices.sample_pack, "MAX_WIDTH", 16)
    rule, said = _timed_choice(tmp_path, monkeypatch, untimed)
    assert rule is None and said.value == "torch" and "over the kernels' 16" in said.reason


def test_the_sampling_contract_names_what_breaks_it():
    """stats.disagreement, the rule every faster sampling path is held to against the torch ops' rows: it
    passes rows within rounding (NaN and infinite log-probs where torch's are) and names each way to fail it."""
    from svrmad_local.engine import stats

    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * 3
    tokens = logits.argmax(-1)
    ref = stats.pack(tokens, stats.stats_from_logits(logits, tokens, 4))
    assert stats.disagreement(ref.clone(), ref, logits, 4) is None
    near = ref.clone()
    near[:, 1] += 1e-5  # log-probs within rounding
    near[:, 2] += 5e-5  # an entropy within 1e-4 of the truth
    assert stats.disagreement(near, ref, logits, 4) is None
    ref_inf, got_inf = ref.clone(), ref.clone()
    ref_inf[0, 3], got_inf[0, 3] = float("-inf"), float("-inf")
    assert stats.disagreement(got_inf, ref_inf, logits, 4) is None
    for col, delta, what in ((0, 1, "tokens"), (3 + 4, 1, "top ids"), (1, 1e-4, "log-probs"), (3, 1e-3, "log-probs"),
                             (2, 1e-3, "entropy")):
        bad = ref.clone()
        bad[1, col] += delta
        assert what in stats.disagreement(bad, ref, logits, 4)
    bad = ref.clone()
    bad[2, 2] = float("nan")
    assert "NaN entropies" in stats.disagreement(bad, ref, logits, 4)
    assert "expected" in stats.disagreement(ref[:, :-1], ref, logits, 4)
