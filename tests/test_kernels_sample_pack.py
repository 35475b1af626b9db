"""kernels/sample_pack.py (Triton's interpreter) against the torch path it replaces on a GPU: engine/sampler.py
`draw` and engine/stats.py `stats_from_logits` + `pack`. Tokens equal (greedy and sampled rows, every
warp of the draw: temperature, the row's top-k, top-p, draws near 0 and 1), ids equal, log-probs and
entropies within float rounding (stats.disagreement); ties at the top take the first id; NaN and infinite
rows get a NaN entropy."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (see conftest)

import pytest  # noqa: E402
import torch  # noqa: E402

from svrmad_local.engine import sampler, stats  # noqa: E402
from svrmad_local.kernels.sample_pack import MAX_WIDTH, fits, sample_pack  # noqa: E402

pytestmark = pytest.mark.usefixtures("interp")

# temperature, top-k, top-p, uniform draw, greedy: one row each
ROWS = [(1.0, 40, 1.0, 0.0, 1), (0.7, 40, 0.95, 0.31, 0), (1.3, 5, 1.0, 0.999999, 0), (1.0, 40, 0.5, 0.0, 0),
        (0.2, 40, 0.9, 0.77, 0), (1.0, 1, 1.0, 0.5, 0), (2.0, 40, 1.0, 0.5, 0)]


def table(rows=ROWS) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).T.contiguous()


def reference(logits, tab, K, topk):
    toks = sampler.draw(logits, *sampler.columns(tab, logits.dtype), K)
    return stats.pack(toks, stats.stats_from_logits(logits, toks, topk))


@pytest.mark.parametrize("V,K,topk", [(5000, 40, 20), (20000, 40, 20), (50, 40, 20), (300, 7, 0), (3000, 64, 64)])
def test_the_rows_and_statistics_of_the_torch_path(V, K, topk):
    """One split and several (8192 entries a split: 20000 is three, its best logits in the last), a vocabulary
    barely wider than K, no statistics' top-k, the widest widths kept."""
    g = torch.Generator().manual_seed(V + K)
    logits = torch.randn(len(ROWS), V, generator=g) * 3
    logits[:, -1] += 12  # the last entry the best: the last split's keys must win the merge
    logits[3, -1] -= 12
    tab = table([(t, min(k, K), p, u, gr) for t, k, p, u, gr in ROWS])
    assert stats.disagreement(sample_pack(logits, tab, K, topk), reference(logits, tab, K, topk), logits, topk) is None


def test_a_strided_table_is_read_in_place():
    """The static decode step passes the first P columns of its wider draws buffer: read with its strides
    (no copy), the same rows as from a contiguous table."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(8)) * 3
    wide = torch.zeros(5, 9, dtype=torch.float64)
    wide[:, :4] = table(ROWS[:4])
    assert not wide[:, :4].is_contiguous()
    assert torch.equal(sample_pack(logits, wide[:, :4], 40, 20), sample_pack(logits, table(ROWS[:4]), 40, 20))


def test_many_draws_land_where_the_torch_draws_do():
    """Sixty-four rows of one distribution, their draws spread over [0, 1): every token the torch path's."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(1, 4000, generator=g) * 2).expand(64, -1).contiguous()
    u = torch.arange(64, dtype=torch.float64) / 64 + 1 / 128
    tab = torch.stack([torch.full((64,), 0.8), torch.full((64,), 40.0), torch.full((64,), 0.9), u, torch.zeros(64)]).double()
    got, ref = sample_pack(logits, tab, 40, 20), reference(logits, tab, 40, 20)
    assert stats.disagreement(got, ref, logits, 20) is None
    assert len(set(got[:, 0].tolist())) > 5  # the draws did spread over several tokens


def test_ties_at_the_top_take_the_first_id_and_order_by_id():
    """Equal logits (frequent where a bf16 head rounds them): the argmax is the first maximal id, as
    torch.argmax's, and the top ids list equal logits lower id first."""
    logits = torch.zeros(2, 1000)
    logits[:, [700, 30, 400]] = 5.0
    logits[:, 999] = 4.0
    tab = table([(1.0, 40, 1.0, 0.0, 1), (1.0, 40, 1.0, 0.0, 1)])
    got = sample_pack(logits, tab, 40, 5)
    assert got[:, 0].tolist() == [30, 30] == torch.argmax(logits, 1).tolist()
    assert got[0, 3 + 5:].tolist() == [30, 400, 700, 999, 0]


def test_nan_and_infinite_logits_give_a_nan_entropy():
    """The step fails a request whose statistics have a NaN entropy (engine/step.py `_take`), as the torch
    path's do for NaN, +inf or -inf in its logits; a finite row beside them is untouched."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(5))
    logits[0, 10] = float("nan")
    logits[1, 20] = float("inf")
    logits[2, 30] = float("-inf")
    tab = table(ROWS[:4])
    got, ref = sample_pack(logits, tab, 40, 20), reference(logits, tab, 40, 20)
    assert got[:3, 2].isnan().all() and ref[:3, 2].isnan().all()
    assert stats.disagreement(got[3:], ref[3:], logits[3:], 20) is None


def test_fits_and_bad_input():
    assert fits(40, 20, 151936) and fits(MAX_WIDTH, 0, 100) and not fits(MAX_WIDTH + 1, 20, 151936)
    assert not fits(40, 20, 30) and not fits(0, 20, 100)
    logits = torch.randn(2, 100)
    with pytest.raises(ValueError, match="float64 table"):
        sample_pack(logits, table(ROWS[:3]), 40, 20)
    with pytest.raises(ValueError, match="fp32 logits"):
        sample_pack(logits.double(), table(ROWS[:2]), 40, 20)
    with pytest.raises(ValueError, match="K=100"):
        sample_pack(logits, table(ROWS[:2]), 100, 20)
    assert sample_pack(logits[:0], torch.empty(5, 0, dtype=torch.float64), 40, 20).shape == (0, 43)
