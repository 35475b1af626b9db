"""SVR-MAD's controller (Algorithm 1) on hand-worked scripted debates, and its invariants."""

import asyncio
import random

import pytest

from svrmad_local.debate.scripted import ScriptedBackend
from svrmad_local.debate.trace import split_repeat
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


def test_exhausted_receiver_passes_the_turn_without_repeats():
    answers, outcomes, priors = ["A", "A", "B"], {(0, 2): "A", (1, 2): "A"}, [0.9, 0.5, 0.1]
    res, b = play(answers, outcomes, priors=priors, repeat_pairs=False)
    # 0 hears 2 (only dissenter) and can never reach C=2; then 1 hears 2; then 2 hears 0, 1 and
    # changes twice; no receiver has an unheard dissenter left -> vote (budget 8 not spent).
    assert b.calls == ["0<2", "1<2", "2<0", "2<1"]
    assert (res.answer, res.accepted, res.ncomm) == ("A", False, 4)
    res, b = play(answers, outcomes, priors=priors, repeat_pairs=False, accept_exhausted=True)
    assert (b.calls, res.answer, res.accepted) == (["0<2"], "A", True)


def test_a_sole_dissenter_is_heard_again_with_repeats():
    answers, outcomes, priors = ["A", "A", "B"], {(0, 2): "A", (1, 2): "A"}, [0.9, 0.5, 0.1]
    # Algorithm 1 as written: 0 (SVR 1 after the first debate) stays the receiver and hears its
    # only dissenter again, a new debate "0<2#2": D = 2 = C, accepted.
    res, b = play(answers, outcomes, priors=priors)
    assert b.calls == ["0<2", "0<2#2"]
    assert (res.answer, res.accepted, res.ncomm, res.params["repeat_pairs"]) == ("A", True, 2, True)
    # accept_exhausted: having heard every dissenter once is enough
    res, b = play(answers, outcomes, priors=priors, accept_exhausted=True)
    assert (b.calls, res.answer, res.accepted) == (["0<2"], "A", True)


def test_check_each_vs_round():
    answers, priors = ["A", "B", "C", "D"], [0.9, 0.5, 0.4, 0.3]
    each, b1 = play(answers, priors=priors, S=3, C=2, check="each")
    rnd, b2 = play(answers, priors=priors, S=3, C=2, check="round")
    assert b1.calls == ["0<1", "0<2"] and each.ncomm == 2 and each.accepted
    assert b2.calls == ["0<1", "0<2", "0<3"] and rnd.ncomm == 3 and rnd.accepted


@pytest.mark.parametrize("repeat_pairs,second", [(True, "0<2#2"), (False, "1<2")])
def test_spend_S_vs_actual(repeat_pairs, second):
    answers, priors = ["A", "A", "B"], [0.9, 0.5, 0.1]
    res, b = play(answers, priors=priors, budget=2, spend="S", repeat_pairs=repeat_pairs)
    assert b.calls == ["0<2"] and not res.accepted  # a 1-debate iteration is charged S = 2
    res, b = play(answers, priors=priors, budget=2, spend="actual", repeat_pairs=repeat_pairs)
    assert b.calls == ["0<2", second] and res.accepted == repeat_pairs


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


@pytest.mark.parametrize("repeat_pairs", [True, False])
def test_random_scripts_stay_within_budget(repeat_pairs):
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
                      accept_exhausted=rng.random() < 0.3, repeat_pairs=repeat_pairs)
        if rng.random() < 0.5:
            params["budget"] = rng.randint(0, 12)
        res, b = play(answers, outcome, **params)
        # the budget bounds the loop, repeats or not: a failed receiver cannot be re-selected forever
        assert res.ncomm == len(b.calls) <= res.params["budget"]
        assert len(set(b.calls)) == len(b.calls)  # every debate is a distinct call
        possible = svr_mad.possible_debates(answers, "mc", S=S, budget=params.get("budget"),
                                            spend=params["spend"], repeat_pairs=repeat_pairs)
        seen: dict[tuple[int, int], int] = {}
        for rid in b.calls:
            base, k = split_repeat(rid)
            r, s = map(int, base.split("<"))
            assert answers[r] is not None and not (answers[s] == answers[r])
            seen[s, r] = seen.get((s, r), 0) + 1
            assert k == seen[s, r]  # "r<s", then "r<s#2", "r<s#3"... in order
            assert (s, r, k) in possible  # --ablations records everything a variant may ask
        if not repeat_pairs:
            assert set(seen.values()) <= {1}
        if res.accepted:
            assert res.answer is not None


def test_check_each_runs_the_debates_before_C_concurrently_and_the_rest_one_by_one():
    """Acceptance needs C debates, so those up to C can run at once without changing the result;
    after that each debate is checked before the next is asked for."""
    in_flight, peak = 0, []

    class Counting(ScriptedBackend):
        async def debate(self, q, own, peers, brief=(), *, repeat=1):
            nonlocal in_flight
            in_flight += 1
            peak.append(in_flight)
            await asyncio.sleep(0)
            try:
                return await super().debate(q, own, peers, brief, repeat=repeat)
            finally:
                in_flight -= 1

    answers = ["A", "B", "C", "D", "E", "F"]
    backend = Counting(answers)
    initial = asyncio.run(backend.initial(Q, 6))
    res = asyncio.run(svr_mad.run(Q, initial, backend, priors=[0.9, 0.5, 0.4, 0.3, 0.2, 0.1], S=3, C=2))
    assert backend.calls == ["0<1", "0<2"]  # both retained: accepted, the third challenger never asked
    assert res.accepted and res.ncomm == 2 and max(peak) == 2


# ---------------------------------------------------------------- Algorithm 1 as written (repeated pairs)
# Skewed splits where C exceeds the majority's number of disagreeing peers. Unscripted debates
# keep the receiver's answer: every agent holds its answer against everyone.

DESCENDING = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]


def test_5_1_split_accepts_the_majority_with_repeats():
    answers = ["A"] * 5 + ["B"]
    res, b = play(answers, priors=DESCENDING)  # S = C = 2
    # receiver 0 hears its only dissenter (D=1, SVR 1), stays the best and hears it again (D=2)
    assert b.calls == ["0<5", "0<5#2"]
    assert (res.answer, res.accepted, res.ncomm) == ("A", True, 2)


def test_5_1_split_without_repeats_accepts_the_minority():
    res, b = play(["A"] * 5 + ["B"], priors=DESCENDING, repeat_pairs=False)
    # each A-agent hears 5 once and cannot reach C; agent 5 then hears 0 and 1 and is accepted
    assert b.calls == ["0<5", "1<5", "2<5", "3<5", "4<5", "5<0", "5<1"]
    assert (res.answer, res.accepted, res.ncomm) == ("B", True, 7)


def test_4_2_split_deepseek_setting():
    answers = ["A"] * 4 + ["B"] * 2
    res, b = play(answers, priors=DESCENDING, S=3, C=3)
    # iteration 1: 0 hears 4 and 5 (D=2 < C); iteration 2: the top 3 of {4, 5} again, checked
    # after each: 0<4#2 makes D=3 with SVR 1
    assert b.calls == ["0<4", "0<5", "0<4#2"]
    assert (res.answer, res.accepted, res.ncomm) == ("A", True, 3)
    res, b = play(answers, priors=DESCENDING, S=3, C=3, repeat_pairs=False)
    assert b.calls[-3:] == ["4<0", "4<1", "4<2"]  # every A-agent exhausted at D=2
    assert (res.answer, res.accepted, res.ncomm) == ("B", True, 11)


def test_4_1_1_split_after_the_first_receiver_fails():
    answers = ["A", "A", "A", "A", "B", "C"]
    priors = [0.5, 0.4, 0.3, 0.2, 0.9, 0.1]
    outcomes = {(0, 4): "A"}  # agent 4 (B) changes when it hears agent 0
    res, b = play(answers, outcomes, priors=priors, S=3, C=3)
    # 4 hears 0, 1, 2: SVR (1 - 1 + 1) / 3 = 1/3 < 0.5, so 0 receives: it hears 4 and 5 (D=2),
    # then 4 again as a repeat (D=3): accepted
    assert b.calls == ["4<0", "4<1", "4<2", "0<4", "0<5", "0<4#2"]
    assert (res.answer, res.accepted, res.ncomm) == ("A", True, 6)
    res, b = play(answers, outcomes, priors=priors, S=3, C=3, repeat_pairs=False)
    # without repeats every A-agent stops at D=2 and the lone C is accepted
    assert b.calls[-3:] == ["5<0", "5<1", "5<2"]
    assert (res.answer, res.accepted, res.ncomm) == ("C", True, 16)


def test_a_failed_receiver_is_reselected_while_its_svr_beats_every_prior():
    """Priors live on SVR's scale [-1, 1] (signals.prior_score); a min-LL prior of a long answer is
    close to -1. Agent 0 changes once (SVR can never again reach tau=1) yet its SVR stays above
    the others' priors, so Algorithm 1 keeps choosing it until the budget is spent."""
    answers, priors = ["A", "B", "C"], [0.9, -0.5, -0.6]
    outcomes = {(1, 0, 1): "B"}  # only the first 1 -> 0 debate changes agent 0's answer
    res, b = play(answers, outcomes, priors=priors)  # budget 2 * (3 + 1) = 8
    assert b.calls == ["0<1", "0<2", "0<1#2", "0<2#2", "0<1#3", "0<2#3", "0<1#4", "0<2#4"]
    assert res.scores == [0.75, -0.5, -0.6]  # (7 - 1) / 8
    # fallback: 0 votes A (7 of its 8 answers), 1 and 2 their own: a three-way tie -> agent 0's A
    assert (res.answer, res.accepted, res.ncomm) == ("A", False, 8)
    # a lower threshold accepts it once its SVR recovers: (3 - 1) / 4 = 0.5
    res, b = play(answers, outcomes, priors=priors, tau=0.5)
    assert (len(b.calls), res.answer, res.accepted) == (4, "A", True)
    # when the failure drops its SVR below another prior, the turn passes
    res, b = play(answers, outcomes, priors=[0.9, 0.5, -0.6])
    assert b.calls[:3] == ["0<1", "0<2", "1<0"]


def test_scripted_outcomes_can_differ_per_repeat():
    res, b = play(["A", "B"], {(1, 0, 2): "B", "0<1#3": "A"}, priors=[0.9, 0.0], C=3, S=1,
                  tau=-1.0)
    assert b.calls == ["0<1", "0<1#2", "0<1#3"]
    assert res.scores[0] == pytest.approx(1 / 3)  # retained, changed, retained


def test_posterior_ablations_run_with_repeats(monkeypatch):
    monkeypatch.setattr(svr_mad, "prior_score", lambda s, name: s.get(name, 0.0))
    sig = {"0<1": {"ppl": 0.2}, "0<1#2": {"ppl": 0.6}}
    res, b = play(["A", "B"], signals=sig, priors=[0.9, 0.0], posterior="ppl", tau=0.4)
    assert b.calls == ["0<1", "0<1#2"]  # mean 0.4 over both debates
    assert res.accepted and res.scores[0] == pytest.approx(0.4)


def test_possible_debates_bounds_what_any_variant_asks():
    answers = ["A"] * 5 + ["B"]
    every = svr_mad.possible_debates(answers, "mc", S=2)  # B = 2 * (2 + 5) = 14: 7 iterations
    assert len(every) == 10 * 7 and (5, 0, 7) in every and (0, 5, 1) in every
    assert (5, 0, 8) not in every and (1, 0, 1) not in every  # agreeing pairs never debate
    assert len(svr_mad.possible_debates(answers, "mc", S=2, spend="actual")) == 10 * 14
    assert svr_mad.possible_debates(answers, "mc", S=2, repeat_pairs=False) == [
        (5, r, 1) for r in range(5)] + [(s, 5, 1) for s in range(5)]
    assert svr_mad.possible_debates([None, "A"], "mc", S=1) == [(0, 1, k) for k in (1, 2, 3)]
    assert svr_mad.possible_debates(answers, "mc", S=2, budget=0) == []
