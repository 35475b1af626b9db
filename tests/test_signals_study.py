"""The signals study (`svrmad signals`) on a synthetic run whose numbers were worked by hand.

Two debated multiple-choice questions, three agents each (C = correct, W = wrong):

    q1 (gold A)  agent  answer  min_ll  self_conf  prior  SVR score  (SVR+1)/2
                 0      A  C    -0.5    0.95        0.2    0.5        0.75
                 1      B  W    -2.0    0.85       -0.6   -0.9        0.05
                 2      A  C    -1.5    0.35       -0.4    0.1        0.55
    q2 (gold C)  0      D  W    -0.8    0.65        0.1   -0.5        0.25
                 1      C  C    -0.6    0.62        0.0    0.9        0.95
                 2      D  W    -3.0    0.15       -0.9   -0.7        0.15

No other signal is recorded (ppl, entropy, DeepConf: n = 0 there).
"""

import argparse
import json
import math

import numpy as np
import pytest

from svrmad_local import cli
from svrmad_local.analysis import signals_page, signals_study as study, token_files
from svrmad_local.analysis import figures
from svrmad_local.analysis.figures import count_label
from svrmad_local.analysis.metrics import load_run, read_jsonl
from tests.test_run_e2e import run as run_e2e, setup  # noqa: F401  (a fixture)

AGENTS = {
    "q1": ("A", [("A", True, -0.5, 0.95, 0.2, 0.5), ("B", False, -2.0, 0.85, -0.6, -0.9),
                 ("A", True, -1.5, 0.35, -0.4, 0.1)]),
    "q2": ("C", [("D", False, -0.8, 0.65, 0.1, -0.5), ("C", True, -0.6, 0.62, 0.0, 0.9),
                 ("D", False, -3.0, 0.15, -0.9, -0.7)]),
}


def write_run(d, accepted=(True, False), all_wrong=False):
    d.mkdir(parents=True)
    with open(d / "trace.jsonl", "w") as t, open(d / "results.jsonl", "w") as r:
        for (qid, (gold, agents)), acc in zip(AGENTS.items(), accepted):
            t.write(json.dumps({"id": qid, "gold": gold, "answer_type": "mc", "question": "?", "debates": [],
                                "agents": [{"agent": i, "answer": a, "correct": c and not all_wrong, "prior": p,
                                            "signals": {"min_ll": m, "self_conf": s}}
                                           for i, (a, c, m, s, p, _) in enumerate(agents)]}) + "\n")
            r.write(json.dumps({"id": qid, "method": "svr-mad", "answer": gold if acc else "D", "gold": gold,
                                "correct": acc, "accepted": acc, "scores": [x[5] for x in agents]}) + "\n")
    (d / "run.json").write_text(json.dumps({"config": {"dataset": "commonsenseqa", "model": None}}))
    return d


@pytest.fixture
def df(tmp_path):
    return study.responses(write_run(tmp_path / "run"))


def test_responses_read_signals_prior_and_posterior(df):
    assert len(df) == 6 and set(df["run"]) == {"run"}
    assert df["posterior"].tolist() == [0.5, -0.9, 0.1, -0.5, 0.9, -0.7]
    assert df["ppl"].isna().all()


def test_auroc_by_hand(df):
    a = study.auroc(df, n_boot=200, seed=1).set_index("signal")
    # min-LL: correct {-0.5, -1.5, -0.6} vs wrong {-2.0, -0.8, -3.0}: of the 9 pairs the correct one is
    # higher in 8 (only -1.5 < -0.8 fails) -> 8/9
    assert a.at["min-LL", "auroc"] == pytest.approx(8 / 9)
    # self conf: correct {.95, .35, .62} vs wrong {.85, .65, .15}: .95 beats 3, .35 beats 1, .62 beats 1 -> 5/9
    assert a.at["self-reported conf", "auroc"] == pytest.approx(5 / 9)
    # the posterior separates perfectly: every resample of questions gives 1, so the CI is [1, 1]
    assert a.at["SVR posterior", "auroc"] == 1.0
    assert (a.at["SVR posterior", "ci_low"], a.at["SVR posterior", "ci_high"]) == (1.0, 1.0)
    assert a.at["min-LL", "n"] == 6 and a.at["min-LL", "correct"] == 3
    assert a.at["PPL", "n"] == 0 and math.isnan(a.at["PPL", "auroc"])  # no signal: undefined, not 0.5
    lo, hi = a.at["min-LL", "ci_low"], a.at["min-LL", "ci_high"]
    assert 0 <= lo <= 8 / 9 + 1e-12 and 8 / 9 - 1e-12 <= hi <= 1
    again = study.auroc(df, n_boot=200, seed=1).set_index("signal")  # seeded: the same CI
    assert (again.at["min-LL", "ci_low"], again.at["min-LL", "ci_high"]) == (lo, hi)


def test_auroc_is_undefined_with_one_class(df):
    a = study.auroc(df.assign(correct=True), n_boot=10).set_index("signal")
    assert math.isnan(a.at["min-LL", "auroc"]) and math.isnan(a.at["min-LL", "ci_low"])


def test_calibration_ece_by_hand(df):
    bins, ece = study.calibration(df, n_bins=10)
    ece = ece.set_index("signal")["ece"]
    # self conf, bins of width 0.1: .95 (C) |1-.95|=.05; .85 (W) .85; .35 (C) .65; .15 (W) .15;
    # bin 6 holds .65 (W) and .62 (C): share correct .5, mean .635 -> .135 with weight 2/6
    # ECE = (.05 + .85 + .65 + .15) / 6 + 2/6 * .135 = 1.97 / 6
    assert ece["self-reported conf"] == pytest.approx(1.97 / 6)
    # posterior (SVR+1)/2: .75 C, .05 W, .55 C, .25 W, .95 C, .15 W, each alone in its bin:
    # (.25 + .05 + .45 + .25 + .05 + .15) / 6 = 1.2 / 6
    assert ece["SVR posterior"] == pytest.approx(0.2)
    six = bins[(bins["signal"] == "self-reported conf") & (bins["bin"] == 6)].iloc[0]
    assert (six["n"], six["accuracy"], six["confidence"]) == (2, 0.5, pytest.approx(0.635))
    assert bins.groupby("signal")["n"].sum().to_dict() == {"SVR posterior": 6, "self-reported conf": 6}


def test_selective_accuracy_by_hand(df):
    sel = study.selective_accuracy(df)
    by = {(r.signal, r.k): r.accuracy for r in sel.itertuples()}
    # min-LL: q1 ranks 0(A), 2(A), 1(B): A at every k (right); q2 ranks 1(C), 0(D), 2(D):
    # k=1 C (right), k=2 C vs D tie -> the better-ranked C (right), k=3 D wins 2-1 (wrong)
    assert [by["min-LL", k] for k in (1, 2, 3)] == [100.0, 100.0, 50.0]
    # self conf: q1 ranks 0(A), 1(B), 2(A): A, tie -> A, A (right); q2 ranks 0(D), 1(C), 2(D): D, D, D (wrong)
    assert [by["self-reported conf", k] for k in (1, 2, 3)] == [50.0, 50.0, 50.0]
    # k = N is the plain majority whatever the signal: q1 A (right), q2 D (wrong)
    assert {a for (s, k), a in by.items() if k == 3} == {50.0}
    assert ("PPL", 1) not in by  # no response has a PPL: it ranks nothing
    assert sorted(set(sel["coverage"])) == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_correlation_by_hand(df):
    m, n = study.correlations(df)["run"]
    # ranks of min-LL [6,2,3,4,5,1], of self conf [6,5,2,4,3,1]: sum d^2 = 9+1+4 = 14,
    # rho = 1 - 6*14 / (6*35) = 0.6
    assert n == 6 and m.at["min-LL", "self-reported conf"] == pytest.approx(0.6)
    assert math.isnan(m.at["PPL", "min-LL"])


def test_reordering_and_acceptance_by_hand(tmp_path, df):
    r = study.reordering(df).iloc[0]
    # q1: prior and posterior both rank 0 > 2 > 1 (tau 1); q2: prior 0 > 1 > 2, posterior 1 > 0 > 2:
    # one discordant pair of three, tau 1/3; mean 2/3. Top agent changes in q2 only; the prior's top is
    # right in q1 only, the posterior's in both.
    assert r.kendall_tau == pytest.approx(2 / 3)
    assert (r.questions, r.top_changed, r.top_correct_prior, r.top_correct_posterior) == (2, 50.0, 50.0, 100.0)
    acc = study.acceptance({"run": tmp_path / "run"}).set_index("receiver")
    assert acc.loc["accepted", ["questions", "correct"]].tolist() == [1, 1]
    assert acc.loc["fallback vote", ["questions", "correct"]].tolist() == [1, 0]


def test_count_labels_say_n():
    assert count_label(1, 1) == "1/1 tiny" and count_label(0, 0) == "n=0" and count_label(3, 7) == "3/7"


def test_report_figure1_says_n_and_why_it_is_empty(tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(figures, "say", lambda ax, text: said.append(text))
    path, data = figures.figure1(load_run(write_run(tmp_path / "wrong", all_wrong=True)), tmp_path)
    assert path.exists() and data["questions"].sum() == 0
    assert len(said) == 1 and "No debated question has a correct agent" in said[0] and "n = 2" in said[0]
    said.clear()
    figures.figure1(load_run(write_run(tmp_path / "run")), tmp_path)
    assert said == []  # q1 has 2 correct agents, q2 one: nothing to excuse


class _R:
    def __init__(self, rid, lp):
        self.id, self.token_stats = rid, (lp, [0.5] * len(lp))


def test_token_stats_round_trip_and_page(tmp_path):
    run = write_run(tmp_path / "run")
    token_files.write(run, "q1", [_R("0", [-0.1, -2.5, -0.3]), _R("1", [-1.0]), _R("2", [])], None)
    got = token_files.read(run)
    assert got["q1", "0"][0].tolist() == pytest.approx([-0.1, -2.5, -0.3])
    assert got["q1", "1"][1].tolist() == [0.5] and len(got["q1", "2"][0]) == 0
    size, tokens = token_files.bytes_per_token(run)
    assert tokens == 4 and size > 0
    page = signals_page.write_study([run], tmp_path / "out", n_boot=20, track="q1:0").read_text()
    assert "response `0`" in page and (tmp_path / "out" / "token_track.png").exists()
    positions = (tmp_path / "out" / "signals_min_position.csv").read_text()
    assert "0.5" in positions  # response 0: min at token 1 of 0..2 -> 1/2


def test_cli_two_runs_side_by_side(tmp_path, capsys):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", accepted=(True, True))
    assert cli.main(["signals", str(a), str(b), "--out", str(tmp_path / "cmp"), "--bootstrap", "50"]) == 0
    out = tmp_path / "cmp"
    page = (out / "signals.md").read_text()
    assert "AUROC [95% CI] a" in page and "AUROC [95% CI] b" in page
    assert "0.889 [" in page and "(n=6, 3 correct)" in page
    assert "No run here saved its token statistics" in page
    for name in ["signals_auroc.png", "signals_calibration.png", "signals_selective.png", "signals_correlation.png",
                 "signals_min_position.png", "signals_auroc.csv", "signals_ece.csv", "signals_selective.csv"]:
        assert (out / name).stat().st_size > 0, name
    assert "token_track.png" not in {p.name for p in out.iterdir()}
    # one run: written beside it; errors are one line, exit 2
    assert cli.main(["signals", str(a), "--bootstrap", "0"]) == 0 and (a / "signals" / "signals.md").exists()
    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "trace.jsonl").write_text("")
    assert cli.main(["signals", str(a), str(b)]) == 2
    assert cli.main(["signals", str(tmp_path / "nowhere")]) == 2
    assert cli.main(["signals", str(tmp_path / "empty")]) == 2
    assert cli.main(["signals", str(a), "--bins", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and "--out" in err[0] and "does not exist" in err[1]
    assert "no debated question" in err[2] and "--bins" in err[3]


def test_run_saves_token_stats_that_match_the_trace(setup):
    """`svrmad run --save-token-stats` on a tiny random model: one file per debated question holding
    every response of its trace line, as many tokens as it generated, whose min and mean give the
    trace's min-LL and mean entropy; without the flag there is no folder."""
    ck, data, out = setup
    assert run_e2e(ck, data, out, "--limit", "2", "--methods", "svr-mad", "--save-token-stats") == 0
    trace = read_jsonl(out / "trace.jsonl")
    assert trace, "a random model should disagree with itself"
    saved = token_files.read(out)
    assert len(list((out / token_files.FOLDER).glob("*.npz"))) == len(trace)
    for row in trace:
        for r in row["agents"] + row["debates"]:
            lp, ent = saved[row["id"], r["id"]]
            assert len(lp) == len(ent) == r["completion_tokens"]
            if r in row["agents"]:
                assert float(lp.min()) == pytest.approx(r["signals"]["min_ll"], abs=1e-5)
                assert float(ent.mean()) == pytest.approx(r["signals"]["mean_entropy"], abs=1e-5)
    size, tokens = token_files.bytes_per_token(out)
    assert tokens == sum(r["completion_tokens"] for row in trace for r in row["agents"] + row["debates"])
    page = signals_page.write_study([out], out / "signals", n_boot=10).read_text()
    assert "bytes per token on disk" in page and (out / "signals" / "token_track.png").exists()
    assert run_e2e(ck, data, tmp := out.with_name("plain"), "--limit", "1", "--methods", "svr-mad") == 0
    assert not (tmp / token_files.FOLDER).exists()
