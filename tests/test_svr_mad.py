"""SVR-MAD's controller (Algorithm 1) on hand-worked scripted debates, and its invariants."""

import asyncio
import random

import pytest

from svrmad_local.debate.scripted import ScriptedBackend
from svrmad_local.debate.types import Question, Response
from svrmad_local.methods import run_method, svr_mad
from svrmad_local.methods.svr_mad import budget_for, fallback_vote

Q = Question(id="q", question="?", gold="A", answer_type="mc")


def play(answers, outcomes=None, signals=None, **params):
    backend = ScriptedBackend(answers, outcomes, signals)
    initial = asyncio.run(backend.initial(Q, len(answers)))
    return asyncio.run(svr_mad.run(Q, initial, backend, **params)), backend


def test_accepts_after_C_retains():
    res, b = play(["A", "B", "A", "C", "B", "A"], priors=[0.9, 0.5, 0.1, 0.4, 0.2, 0.0])
    # receiver 0 (highest prior); disagreeing: 1 (.5), 3 (.4), 4 (.2) -> top-2 = 1, 3; both retained
    assert b.calls == ["0<1", "0<3"]
    assert (res.answer, res.accepted, res.ncomm, res.correct) == ("A", True, 2, True)
    assert res.scores == [1.0, 0.5, 0.1, 0.4, 0.2, 0.0]
    # 6 initial x (100 + 50) + 2 debates x ((150 + 50) + 50)
    assert (res.tokens, res.prompt_tokens, res.computed_tokens) == (1400, 1000, 700)
    assert res.params["budget"] == 2 * (3 + 3)
    assert res.n_correct_initial == 3


def test_receiver_changes_then_next_receiver_holds():
    res, b = play(["A", "B", "A", "C", "B", "A"], {(1, 0): "B"},
                  priors=[0.9, 0.8, 0.1, 0.4, 0.2, 0.0])
    # receiver 0 hears 1 (changed) and 3 (retained): SVR (1-1)/2 = 0 < prior of agent 1 (.8);
    # receiver 1 (B): disagreeing 0 (now 0.0), 2 (.1), 3 (.4), 5 (0.0) -> 3, 2; both retained.
    assert b.calls == ["0<1", "0<3", "1<3", "1<2"]
    assert (res.answer, res.accepted, res.ncomm) == ("B", True, 4)
    assert res.scores == [0.0, 1.0, 0.1, 0.4, 0.2, 0.0]


def test_budget_exhaustion_falls_back_to_the_vote():
    res, b = play(["A", "B", "B", "C"], {(1, 0): "B", (3, 1): "C"},
                  priors=[0.9, 0.6, 0.3, 0.1], budget=4)
    # it 1: receiver 0 hears 1 (-> B, changed), 2 (retained): SVR 0.  it 2: receiver 1 (.6) hears
    # 3 (.1, -> C changed) and 0 (0.0, retained): SVR 0. Budget 4 spent.
    assert b.calls == ["0<1", "0<2", "1<3", "1<0"]
    # votes: agent 0 saw {B, A} -> tie, own A; agent 1 saw {C, B} -> own B; 2 -> B; 3 -> C
    assert (res.answer, res.accepted, res.ncomm) == ("B", False, 4)
    assert res.scores == [0.0, 0.0, 0.3, 0.1]


def _r(agent, answer, rid=None):
    return Response(id=rid or str(agent), agent=agent, answer=answer)


def test_fallback_vote_rules():
    initial = [_r(0, "A"), _r(1, "B"), _r(2, "B"), _r(3, "C")]
    post = [[_r(0, "C", "a")], [], [_r(2, "C", "b"), _r(2, "C", "c"), _r(2, "B", "d")],
            [_r(3, "B", "e")]]
    # votes C, B (never debated), C, B: a tie, broken by the pre-debate majority (B: 2, C: 1)
    assert fallback_vote(initial, post, "mc") == ("B", ["C", "B", "C", "B"])
    # equal pre-debate support too -> the lowest-indexed voter's answer
    two = [_r(0, "A"), _r(1, "B")]
    assert fallback_vote(two, [[_r(0, "B", "x")], [_r(1, "A", "y")]], "mc") == ("B", ["B", "A"])
    # an agent's own tie not involving its pre-debate answer -> the first observed; all-None -> own
    post = [[_r(0, "B", "x"), _r(0, "C", "y")], [_r(1, None, "z")]]
    assert fallback_vote(two, post, "mc")[1] == ["B", "B"]


def test_ties_in_corr_go_to_the_lowest_index():
    res, b = play(["A", "B", "A", "C"], priors=[0.5] * 4)
    assert b.calls == ["0<1", "0<3"]
    assert res.answer == "A" and res.accepted


def test_unanimous_needs_no_debate():
    res, b = play(["A", "A", "A"], priors=[0.1, 0.2, 0.3])
    assert (b.calls, res.answer, res.ncomm, res.accepted) == ([], "A", 0, False)


def test_exhausted_receiver_passes_the_turn():
    answers, outcomes, priors = ["A", "A", "B"], {(0, 2): "A", (1, 2): "A"}, [0.9, 0.5, 0.1]
    res, b = play(answers, outcomes, priors=priors)
    # 0 hears 2 (only dissenter) and can never reach C=2; then 1 hears 2; then 2 hears 0, 1 and
    # changes twice; no receiver has an unheard dissenter left -> vote (budget 8 not spent).
    assert b.calls == ["0<2", "1<2", "2<0", "2<1"]
    assert (res.answer, res.accepted, res.ncomm) == ("A", False, 4)
    res, b = play(answers, outcomes, priors=priors, accept_exhausted=True)
    assert (b.calls, res.answer, res.accepted) == (["0<2"], "A", True)


def test_check_each_vs_round():
    answers, priors = ["A", "B", "C", "D"], [0.9, 0.5, 0.4, 0.3]
    each, b1 = play(answers, priors=priors, S=3, C=2, check="each")
    rnd, b2 = play(answers, priors=priors, S=3, C=2, check="round")
    assert b1.calls == ["0<1", "0<2"] and each.ncomm == 2 and each.accepted
    assert b2.calls == ["0<1", "0<2", "0<3"] and rnd.ncomm == 3 and rnd.accepted


def test_spend_S_vs_actual():
    answers, priors = ["A", "A", "B"], [0.9, 0.5, 0.1]
    res, b = play(answers, priors=priors, budget=2, spend="S")
    assert b.calls == ["0<2"] and not res.accepted  # a 1-debate iteration is charged S = 2
    res, b = play(answers, priors=priors, budget=2, spend="actual")
    assert b.calls == ["0<2", "1<2"]


@pytest.mark.parametrize("answers,S,expected", [
    (["A", "A", "A", "B", "B", "C"], 2, 2 * (3 + 3)),
    (["A"] * 6, 2, 2 * (1 + 6)),
    (["A", "B", "C", "D", "E", "F"], 3, 3 * (6 + 1)),
    (["A", "A", "B", "C", None, None], 2, 2 * (5 + 2)),  # each None answer is its own cluster
])
def test_budget_rule(answers, S, expected):
    assert budget_for(answers, "mc", S) == expected


def test_none_answer_is_never_receiver_but_challenges():
    res, b = play([None, "A", "B"], priors=[0.9, 0.5, 0.1])
    assert b.calls == ["1<0", "1<2"] and res.answer == "A"


def test_posterior_ablation_uses_the_signal(monkeypatch):
    monkeypatch.setattr(svr_mad, "prior_score", lambda s, name: s.get(name, 0.0))
    sig = {"0<1": {"min_ll": 0.8}, "0<2": {"min_ll": 0.6}}
    # the receiver changed once, but its post-debate min-LL mean (0.7) clears tau=0.5
    res, _ = play(["A", "B", "C"], {(1, 0): "B"}, sig, priors=[0.9, 0.5, 0.1],
                  posterior="min_ll", tau=0.5)
    assert (res.answer, res.accepted, res.method) == ("A", True, "svr-mad:min_ll")
    assert res.scores[0] == pytest.approx(0.7)
    res, b = play(["A", "B", "C"], {(1, 0): "B"}, sig, priors=[0.9, 0.5, 0.1],
                  posterior="min_ll", tau=0.75)
    assert not res.accepted and b.calls[:2] == ["0<1", "0<2"]


def test_priors_default_to_the_prior_signal(monkeypatch):
    monkeypatch.setattr(svr_mad, "prior_score", lambda s, name: s.get(name, 0.0))
    sig = [{"ppl": 0.1}, {"ppl": 0.2}, {"ppl": 0.9}]
    _, b = play(["A", "B", "C"], signals=sig, prior="ppl")
    assert b.calls == ["2<1", "2<0"]


def test_registry_ablation_name():
    backend = ScriptedBackend(["A", "B", "C"])
    initial = asyncio.run(backend.initial(Q, 3))
    res = asyncio.run(run_method("svr-mad:ppl", Q, initial, backend, priors=[0, 0, 0]))
    assert res.method == "svr-mad:ppl" and res.params["posterior"] == "ppl"


@pytest.mark.parametrize("bad", [{"check": "sometimes"}, {"spend": "all"}, {"posterior": "x"},
                                 {"S": 0}])
def test_bad_parameters(bad):
    with pytest.raises(ValueError):
        play(["A", "B"], priors=[0, 0], **bad)


def test_priors_must_match_agents():
    with pytest.raises(ValueError):
        play(["A", "B"], priors=[0.0])


def test_random_scripts_stay_within_budget():
    letters = ["A", "B", "C", None]
    for seed in range(300):
        rng = random.Random(seed)
        n = rng.randint(2, 7)
        answers = [rng.choice(letters) for _ in range(n)]

        def outcome(receiver, own, peers, brief, rng_seed=seed):
            return random.Random(f"{rng_seed}:{own.id}<{peers[0].id}").choice(letters)

        S, C = rng.randint(1, 3), rng.randint(1, 3)
        params = dict(priors=[rng.uniform(-1, 1) for _ in range(n)], S=S, C=C,
                      check=rng.choice(["each", "round"]), spend=rng.choice(["S", "actual"]),
                      accept_exhausted=rng.random() < 0.3)
        if rng.random() < 0.5:
            params["budget"] = rng.randint(0, 12)
        res, b = play(answers, outcome, **params)
        assert res.ncomm == len(b.calls) <= res.params["budget"]
        assert len(set(b.calls)) == len(b.calls)  # each (sender, receiver) pair at most once
        for rid in b.calls:
            r, s = map(int, rid.split("<"))
            assert answers[r] is not None and not (answers[s] == answers[r])
        if res.accepted:
            assert res.answer is not None


def test_check_each_runs_the_debates_before_C_concurrently_and_the_rest_one_by_one():
    """Acceptance needs C debates, so those up to C can run at once without changing the result;
    after that each debate is checked before the next is asked for."""
    in_flight, peak = 0, []

    class Counting(ScriptedBackend):
        async def debate(self, q, own, peers, brief=()):
            nonlocal in_flight
            in_flight += 1
            peak.append(in_flight)
            await asyncio.sleep(0)
            try:
                return await super().debate(q, own, peers, brief)
            finally:
                in_flight -= 1

    answers = ["A", "B", "C", "D", "E", "F"]
    backend = Counting(answers)
    initial = asyncio.run(backend.initial(Q, 6))
    res = asyncio.run(svr_mad.run(Q, initial, backend, priors=[0.9, 0.5, 0.4, 0.3, 0.2, 0.1], S=3, C=2))
    assert backend.calls == ["0<1", "0<2"]  # both retained: accepted, the third challenger never asked
    assert res.accepted and res.ncomm == 2 and max(peak) == 2
