"""Self-reported confidence parsing and the [-1, 1] prior scale."""

import math

import pytest

from svrmad_local.signals import CONFIDENCE_INSTRUCTION, MISSING, PRIORS, parse_self_confidence, prior_score


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Confidence: 85%", 0.85),
        ("confidence: 0.85", 0.85),
        ("Confidence: 8/10", 0.8),
        ("**Confidence**: 9 out of 10", 0.9),
        ("**Confidence:** 95 %", 0.95),
        ("Confidence level: 70", 0.70),
        ("Confidence (0-100): 60%", 0.60),
        ("Confidence - 80%", 0.80),
        ("My confidence is 75 percent", 0.75),
        ("I am 90% confident.", 0.90),
        ("Confidence = 1.0", 1.0),
        ("Confidence: 0", 0.0),
        ("Answer: 42\nConfidence: 100%", 1.0),
        ("Confidence: 80%\n...on reflection...\nConfidence: 60%", 0.60),  # the last one counts
        ("Confidence: high", None),
        ("Confidence: 150%", None),
        ("confidence: 12/10", None),
        ("Confidence: -5%", None),
        ("I have confidence in 3 approaches", None),
        ("no statement", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_self_confidence(text, expected):
    value = parse_self_confidence(text)
    if expected is None:
        assert value is None
    else:
        assert value == pytest.approx(expected)


def test_instruction_round_trips():
    assert "Confidence: N%" in CONFIDENCE_INSTRUCTION
    assert parse_self_confidence("...\\boxed{3}\nConfidence: 73%") == pytest.approx(0.73)


def test_prior_names():
    for name in ("min_ll", "ppl", "mean_entropy", "self_conf", "conf_mean", "conf_lowest_group",
                 "conf_bottom10", "conf_tail", "none"):
        assert name in PRIORS
    with pytest.raises(ValueError, match="known"):
        prior_score({}, "bogus")


@pytest.mark.parametrize(
    "name,value,expected",
    [
        ("min_ll", 0.0, 1.0),
        ("min_ll", math.log(0.5), 0.0),
        ("min_ll", -1e9, -1.0),
        ("ppl", 1.0, 1.0),
        ("ppl", 2.0, 0.0),
        ("mean_logprob", math.log(0.5), 0.0),
        ("mean_entropy", 0.0, 1.0),
        ("mean_entropy", math.log(2), 0.0),
        ("self_conf", 1.0, 1.0),
        ("self_conf", 0.5, 0.0),
        ("self_conf", 0.0, -1.0),
        ("conf_mean", 0.0, -1.0),
        ("conf_mean", 10 * math.log(2), 0.0),
    ],
)
def test_prior_scale(name, value, expected):
    assert prior_score({PRIORS[name][0]: value}, name) == pytest.approx(expected)


@pytest.mark.parametrize("name", [n for n in PRIORS if n != "none"])
def test_priors_are_bounded_monotone_and_missing_is_lowest(name):
    key = PRIORS[name][0]
    # higher raw value = more trust, except ppl and entropy where lower is better
    raw = [-50, -5, -1, -0.1, 0] if name in ("min_ll", "mean_logprob") else [0, 0.1, 0.5, 0.9, 1] \
        if name == "self_conf" else [0.5, 1, 2, 10, 100]
    scores = [prior_score({key: v}, name) for v in raw]
    assert all(-1 <= s <= 1 for s in scores)
    if name in ("ppl", "mean_entropy"):
        scores = scores[::-1]
    assert scores == sorted(scores)
    for missing in ({}, {key: None}, {key: float("nan")}, {key: "garbled"}, None):
        assert prior_score(missing, name) == MISSING == -1.0


def test_none_prior_is_neutral():
    assert prior_score({}, "none") == 0.0
    assert prior_score({"min_ll": -0.1}, "none") == 0.0


def test_a_tokens_entropy_does_not_depend_on_the_rows_beside_it():
    """One row alone and the same row among others give bit-identical statistics (a lone row's sum is
    split over threads by torch, a batch's is not: engine.stats.row_sum), so a seeded run's signals
    do not change with the steps its timing made."""
    import torch

    from svrmad_local.engine.stats import stats_from_logits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 49_157, generator=g) * 4  # a vocabulary off the chunk width
    chosen = torch.randint(0, logits.shape[1], (8,), generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # the split needs threads to split over
    try:
        batch = stats_from_logits(logits, chosen, 5)
        for i in range(8):
            alone = stats_from_logits(logits[i:i + 1], chosen[i:i + 1], 5)
            assert torch.equal(alone.entropy, batch.entropy[i:i + 1]) and torch.equal(alone.logprob, batch.logprob[i:i + 1])
    finally:
        torch.set_num_threads(threads)
    p = logits.double().log_softmax(-1)
    assert torch.allclose(batch.entropy.double(), -(p.exp() * p).sum(-1), atol=1e-5)
