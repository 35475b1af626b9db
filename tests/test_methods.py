"""The baselines' answers and NComm on small hand-checked scripted cases, and the registry."""

import asyncio

import pytest

from svrmad_local.debate.scripted import ScriptedBackend
from svrmad_local.debate.trace import split_id
from svrmad_local.debate.types import Question, Response
from svrmad_local.methods import METHODS, accepted_params, run_method
from svrmad_local.methods.base import majority
from svrmad_local.methods.group_debate import make_groups
from svrmad_local.methods.sid_et import threshold_for_skip_rate, tune_skip_rate

Q = Question(id="q", question="?", gold="A", answer_type="mc")


def play(method, answers, outcomes=None, signals=None, **params):
    backend = ScriptedBackend(answers, outcomes, signals)
    initial = asyncio.run(backend.initial(Q, len(answers)))
    return asyncio.run(run_method(method, Q, initial, backend, **params)), backend


def by_round(answer_of_round):
    """Outcome callable: the receiver's new answer is answer_of_round[round][receiver]."""
    return lambda receiver, own, peers, brief: answer_of_round[own.round + 1][receiver]


def test_registry_names():
    assert {"svr-mad", "self-consistency", "all-to-all", "group-debate", "sid-et",
            "s2-mad"} <= set(METHODS)
    assert {"svr-mad:min_ll", "svr-mad:ppl", "svr-mad:self_conf", "s2-mad:distinct"} <= set(METHODS)
    assert {"S", "C", "budget", "priors"} <= accepted_params("svr-mad")
    with pytest.raises(KeyError):
        asyncio.run(run_method("nope", Q, [], None))


def test_majority_ties_and_none():
    assert majority(["B", "A", "A", "B", None, None], "mc") == "B"  # first seen; None abstains
    assert majority(["B", "A"], "mc", ["A", "A", "B"]) == "A"
    assert majority([None, None], "mc") is None


def test_self_consistency():
    res, b = play("self-consistency", ["A", "B", "A", None, "B", "A"])
    assert (res.answer, res.ncomm, res.tokens, b.calls, res.correct) == ("A", 0, 900, [], True)
    assert res.to_row(Q)["method"] == "self-consistency"


def test_all_to_all_two_rounds():
    res, b = play("all-to-all", ["A", "A", "A", "B", "B", "C"])
    assert res.ncomm == 60 and len(b.calls) == 12 and res.answer == "A"
    assert b.calls[0] == "0<1+2+3+4+5"
    assert "(0<1+2+3+4+5)<(1<0+2+3+4+5)+(2<0+1+3+4+5)+(3<0+1+2+4+5)+(4<0+1+2+3+5)+(5<0+1+2+3+4)" \
        in b.calls
    # round 1: 6 x ((150 + 5*50) + 50) = 2700 on top of 900 initial tokens
    assert res.params["rounds_run"] == 2


def test_all_to_all_consensus_stops_after_round_one():
    res, b = play("all-to-all", ["A", "A", "A", "B", "B", "C"], lambda *a: "A")
    assert (res.ncomm, len(b.calls), res.answer, res.tokens) == (30, 6, "A", 900 + 2700)
    res, _ = play("all-to-all", ["A", "A", "A", "B", "B", "C"], lambda *a: "A", consensus=7)
    assert res.ncomm == 60


def test_last_round_tie_goes_to_earlier_rounds():
    res, _ = play("all-to-all", ["A", "A", "A", "B"], by_round({1: ["B", "B", "A", "A"]}),
                  rounds=1)
    assert res.answer == "A"  # last round B, B, A, A: the initial majority (A) breaks the tie


def test_group_debate_groups_are_seeded():
    q2 = Question(id="other", question="?", gold="A")
    g = make_groups(Q, 6, "3-3", 0)
    assert g == make_groups(Q, 6, "3-3", 0) and sorted(sum(g, [])) == list(range(6))
    assert [len(x) for x in make_groups(Q, 6, "2-2-2", 0)] == [2, 2, 2]
    assert len({str(make_groups(q, 6, "3-3", s)) for q in (Q, q2) for s in range(6)}) > 1
    with pytest.raises(ValueError):
        make_groups(Q, 6, "3-2", 0)


@pytest.mark.parametrize("groups,count,per_round", [
    ("3-3", "each", 30), ("3-3", "none", 12), ("2-2-2", "none", 6)])
def test_group_debate_links(groups, count, per_round):
    res, b = play("group-debate", ["A", "A", "A", "B", "B", "C"], groups=groups,
                  ncomm_brief=count)
    assert res.ncomm == 2 * per_round and len(b.calls) == 12
    split = res.params["split"]
    for rid in b.calls[:6]:  # round 1: full responses of mates, answers of the others
        own, peers, brief = split_id(rid)
        mine = next(g for g in split if int(own) in g)
        assert sorted(map(int, peers)) == [j for j in mine if j != int(own)]
        assert sorted(map(int, brief)) == [j for j in range(6) if j not in mine]


def test_s2_mad_prunes_agreeing_links():
    # round 1: 0, 1, 2 each hear only 3; 3 hears 0, 1, 2 and joins A -> 6 links, 4 calls.
    # round 2: everyone agrees, nobody has anything to hear: no call.
    res, b = play("s2-mad", ["A", "A", "A", "B"], {"3<0+1+2": "A"})
    assert b.calls == ["0<3", "1<3", "2<3", "3<0+1+2"]
    assert (res.ncomm, res.answer, res.params["rounds_run"]) == (6, "A", 2)


def test_s2_mad_second_round_and_consensus():
    answers = ["A", "A", "B", "C", "C", "C"]
    res, b = play("s2-mad", answers)  # nobody moves: 30 - (2 + 6) same-answer links, twice
    assert res.ncomm == 2 * 22 and len(b.calls) == 12 and res.answer == "C"
    res, b = play("s2-mad", answers, lambda *a: "C")
    assert res.ncomm == 22 and len(b.calls) == 6  # 6 agree on C after round 1


def test_s2_mad_embedding_hook():
    vec = {"agent 0 says A": [1, 0], "agent 1 says B": [1, 0.01], "agent 2 says C": [0, 1]}
    res, b = play("s2-mad", ["A", "B", "C"], embed=lambda text: vec.get(text, [0.5, 0.5]),
                  rounds=1)
    assert res.params["mode"] == "embedding"
    assert b.calls == ["0<2", "1<2", "2<0+1"] and res.ncomm == 4


def test_s2_mad_distinct_hears_one_peer_per_answer():
    # 3 hears one A (the lowest-indexed, agent 0) instead of three: 4 links instead of 6
    res, b = play("s2-mad:distinct", ["A", "A", "A", "B"], {"3<0": "A"})
    assert b.calls == ["0<3", "1<3", "2<3", "3<0"]
    assert (res.ncomm, res.answer, res.method, res.params["peers"]) == (4, "A", "s2-mad:distinct",
                                                                         "distinct")
    answers = ["A", "A", "B", "C", "C", "C"]
    res, b = play("s2-mad", answers, peers="distinct")  # nobody moves: 2 links each, twice
    assert res.ncomm == 2 * 12 and b.calls[:6] == ["0<2+3", "1<2+3", "2<0+3", "3<0+2", "4<0+2",
                                                    "5<0+2"]
    all_peers, _ = play("s2-mad", answers)
    assert (all_peers.ncomm, all_peers.answer) == (2 * 22, res.answer)


def test_s2_mad_distinct_with_embeddings_and_bad_value():
    vec = {"agent 0 says A": [1, 0], "agent 1 says B": [1, 0.01], "agent 2 says C": [0, 1]}
    res, b = play("s2-mad", ["A", "B", "C"], embed=lambda text: vec.get(text, [0.5, 0.5]),
                  rounds=1, peers="distinct")
    assert b.calls == ["0<2", "1<2", "2<0"] and res.ncomm == 3  # 0 and 1 are one view for 2
    with pytest.raises(ValueError, match="peers"):
        play("s2-mad", ["A", "B"], peers="some")


def _initial(min_lls):
    return [Response(id=str(i), agent=i, answer="A", signals={"min_ll": v})
            for i, v in enumerate(min_lls)]


def test_sid_et_threshold_for_skip_rate():
    initials = [_initial([-float(k), -float(k) - 5, None]) for k in range(1, 11)]
    assert threshold_for_skip_rate(initials, 0.3) == -3.0
    assert threshold_for_skip_rate(initials, 1.0) == -10.0
    assert threshold_for_skip_rate(initials, 0.0) is None


def test_sid_et_skips_or_debates_like_all_to_all():
    sig = [{"min_ll": -2.0}, {"min_ll": -0.5}, {"min_ll": -3.0}, {"min_ll": None}]
    answers = ["A", "B", "A", "C"]
    res, b = play("sid-et", answers, signals=sig, threshold=-1.0)
    assert (res.answer, res.ncomm, res.accepted, b.calls, res.tokens) == ("B", 0, True, [], 600)
    res, _ = play("sid-et", answers, signals=sig, threshold=-1.0, skip_answer="majority")
    assert res.answer == "A"
    res, b = play("sid-et", answers, signals=sig, threshold=-0.1)
    ref, b_ref = play("all-to-all", answers, signals=sig)
    assert b.calls == b_ref.calls and not res.accepted and res.method == "sid-et"
    assert (res.answer, res.ncomm, res.tokens) == (ref.answer, ref.ncomm, ref.tokens)


def test_tune_skip_rate_algorithm_2():
    table = {0.9: (100, 0.30), 0.8: (120, 0.33), 0.7: (140, 0.36), 0.6: (160, 0.40),
             0.5: (180, 0.41), 0.4: (200, 0.42), 0.3: (220, 0.43), 0.2: (240, 0.44),
             0.1: (260, 0.45)}
    asked = []

    def evaluate(rate):
        asked.append(rate)
        return table[rate]

    assert tune_skip_rate(evaluate, tok_ref=500, acc_ref=0.40) == 0.6  # accuracy reached
    assert asked == [0.9, 0.8, 0.7, 0.6]
    assert tune_skip_rate(evaluate, tok_ref=150, acc_ref=0.50) == 0.6  # tokens exceeded first
    assert tune_skip_rate(evaluate, tok_ref=500, acc_ref=0.50) == 0.1  # neither: last rate


def test_votes_cluster_by_equivalence_not_string():
    q = Question(id="m", question="?", gold="0.5", answer_type="math")
    backend = ScriptedBackend(["3", "1/2", "\\frac{1}{2}", "0.5", "3"])
    initial = asyncio.run(backend.initial(q, 5))
    res = asyncio.run(run_method("self-consistency", q, initial, backend))
    assert res.answer == "1/2" and res.correct and res.n_correct_initial == 3
