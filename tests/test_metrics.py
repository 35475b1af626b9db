"""Per-method numbers of analysis/metrics.py against hand-computed values of a small synthetic run.

`write_run` builds that run folder; tests/test_report.py uses it too.
"""

import json
import math

import pytest

from svrmad_local.analysis.metrics import (agents_frame, best_cells, format_table, load_run, method_name,
                                       read_jsonl, results_frame, summary, summary_table_text, table1)

# Five agents per question: per agent (correct, min_ll, ppl, self_conf); SVR-MAD's final scores.
# Comments give the top agent per signal (ties -> lowest index, None -> last) and whether it is right.
AGENTS = {
    # n=1. min-LL a1 F, PPL a2 F, conf a0 T (tie a0/a3), SVR a0 T
    "q1": [(True, -5, 1.5, 0.9), (False, -1, 2.0, 0.5), (False, -3, 1.2, None),
           (False, -2, 3.0, 0.9), (False, -4, 1.3, 0.1)],
    # n=2. min-LL a0 F (tie a0/a3), PPL a2 T (others None), conf a0 F (all None), SVR a1 T (tie a1/a2)
    "q2": [(False, -2, None, None), (True, -4, None, None), (True, -6, 1.1, None),
           (False, -2, None, None), (False, -3, None, None)],
    # n=3. min-LL a3 F, PPL a1 T, conf a4 F, SVR a3 F
    "q3": [(True, -1, 1.1, 0.2), (True, -2, 1.0, 0.9), (True, -3, 1.3, 0.3),
           (False, -0.5, 1.05, 0.1), (False, -4, 2.0, 0.95)],
    # n=4 (group 4+). min-LL a4 F, PPL a2 T, conf a0 T (all tie but a4), SVR a0 T
    "q4": [(True, -3, 1.2, 0.8), (True, -2, 1.1, 0.8), (True, -1, 1.0, 0.8),
           (True, -2, 1.3, 0.8), (False, -0.1, 1.4, 0.7)],
    # n=0: excluded from Figures 1 and 2
    "q5": [(False, -1, 1.0, 0.5)] * 5,
    # n=1. min-LL a0 F (all tie), PPL a4 T, conf a4 T (others None), SVR a0 F (tie a0/a4)
    "q6": [(False, -1, 1.0, None), (False, -1, 1.0, None), (False, -1, 1.0, None),
           (False, -1, 1.0, None), (True, -1, 0.5, 0.3)],
}
SVR_SCORES = {"q1": [1.0, -1.0, 0.0, 0.5, 0.0], "q2": [0, 1, 1, 0, -1], "q3": [0.5, 0.5, 0.2, 1.0, -1],
              "q4": [1, 1, 1, 1, -1], "q5": [0, 0, 0, 0, 0], "q6": [0.5, 0, 0, 0, 0.5]}
# Figure 1 by hand: (difficulty, signal) -> share %
FIG1 = {("1", "min-LL"): 0, ("1", "PPL"): 50, ("1", "conf"): 100, ("1", "SVR"): 50,
        ("2", "min-LL"): 0, ("2", "PPL"): 100, ("2", "conf"): 0, ("2", "SVR"): 100,
        ("3", "min-LL"): 0, ("3", "PPL"): 100, ("3", "conf"): 0, ("3", "SVR"): 0,
        ("4+", "min-LL"): 0, ("4+", "PPL"): 100, ("4+", "conf"): 100, ("4+", "SVR"): 100}
QIDS = list(AGENTS)
# method -> per question (ncomm, tokens, correct), plus per-row prompt/computed tokens
METHODS = {
    "self-consistency": ([0] * 6, [1000] * 6, [False, False, True, True, False, False], 600, 200),
    "s2-mad": ([10, 12, 8, 6, 10, 14], [5000, 6000, 4000, 3000, 5000, 7000],
               [True, True, True, True, False, False], 4000, 1000),
    "svr-mad": ([4, 6, 2, 2, 5, 5], [3000, 3500, 2000, 1500, 3000, 5000],
                [True, True, False, True, False, True], 2500, 500),
}
ACCEPTED = [True, True, False, True, False, True]
# Table 1 by hand: method -> (NComm, Tok x10^3, Acc %)
TABLE1 = {"self-consistency": (0.0, 1.0, 100 * 2 / 6), "s2-mad": (10.0, 5.0, 100 * 4 / 6),
          "svr-mad": (4.0, 3.0, 100 * 4 / 6)}


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def trace_rows():
    rows = [{"id": "q1", "agents": [{"agent": i, "correct": False, "signals": {}} for i in range(5)]}]  # stale
    for qid, agents in AGENTS.items():
        rows.append({"id": qid, "gold": "1", "answer_type": "math", "question": "?", "debates": [],
                     "agents": [{"agent": i, "id": str(i), "answer": "1" if c else "2", "correct": c,
                                 "prompt_tokens": 100, "completion_tokens": 50, "computed_tokens": 40,
                                 "signals": {"min_ll": ll, "ppl": ppl, "self_conf": conf}, "text": "..."}
                                for i, (c, ll, ppl, conf) in enumerate(agents)]})
    return rows


def result_rows():
    rows = [{"id": "q1", "method": "svr-mad", "correct": False, "ncomm": 99, "tokens": 99999,  # stale,
             "prompt_tokens": 1, "computed_tokens": 1, "accepted": False, "scores": [0, 9, 0, 0, 0]}]  # resumed
    n_correct = {q: sum(a[0] for a in agents) for q, agents in AGENTS.items()}
    for method, (ncomm, tokens, correct, prompt, computed) in METHODS.items():
        for i, qid in enumerate(QIDS):
            row = {"id": qid, "method": method, "answer": "1", "gold": "1", "correct": correct[i],
                   "ncomm": ncomm[i], "tokens": tokens[i], "prompt_tokens": prompt,
                   "completion_tokens": tokens[i] - prompt, "computed_tokens": computed}
            if method != "self-consistency":  # Figure 2 must fall back to the trace for these
                row["n_correct_initial"] = n_correct[qid]
            if method == "svr-mad":
                row.update(accepted=ACCEPTED[i], scores=SVR_SCORES[qid], params={"S": 2, "C": 2})
            rows.append(row)
    return rows


ABLATIONS = [
    {"posterior": "min_ll", "tau": 0.5, "acceptance_rate": 0.5, "tokens_mean": 2500.0, "accuracy": 0.40},
    {"posterior": "svr", "tau": 1.0, "acceptance_rate": 0.3, "tokens_mean": 3500.0, "accuracy": 0.60},
    {"posterior": "svr", "tau": 0.5, "acceptance_rate": 0.7, "tokens_mean": 2000.0, "accuracy": 0.55},
    {"posterior": "min_ll", "tau": 1.0, "acceptance_rate": 0.2, "tokens_mean": 4000.0, "accuracy": 0.45},
]


def write_run(path, ablations=True):
    """A small run folder: 6 debated questions, 3 methods, one skipped question, a run.json."""
    path.mkdir(parents=True, exist_ok=True)
    _write_jsonl(path / "trace.jsonl", trace_rows())
    _write_jsonl(path / "results.jsonl", result_rows())
    _write_jsonl(path / "skipped.jsonl", [{"id": "q7", "answer": "3", "correct": True}])
    (path / "run.json").write_text(json.dumps({"model": "tiny", "methods": list(METHODS)}))
    if ablations:
        _write_jsonl(path / "ablations.jsonl", ABLATIONS)
    return path


def test_summary_matches_hand_computed_means(tmp_path):
    table = summary(load_run(write_run(tmp_path / "run")).results)
    assert list(table.index) == ["self-consistency", "s2-mad", "svr-mad"]  # paper order
    for method, (ncomm, tok_k, acc) in TABLE1.items():
        row = table.loc[method]
        assert row["questions"] == 6
        assert row["ncomm"] == pytest.approx(ncomm)
        assert row["tokens_k"] == pytest.approx(tok_k)
        assert row["tokens"] == pytest.approx(1000 * tok_k)
        assert row["accuracy"] == pytest.approx(acc)
        assert row["prompt_tokens"] == METHODS[method][3]
        assert row["computed_tokens"] == METHODS[method][4]
    assert table.loc["svr-mad", "kv_saved"] == pytest.approx(80.0)
    assert table.loc["svr-mad", "acceptance"] == pytest.approx(100 * 4 / 6)
    assert math.isnan(table.loc["s2-mad", "acceptance"])


def test_resumed_row_overrides_earlier_one():
    df = results_frame(result_rows())
    assert len(df) == 18
    q1 = df[(df["id"] == "q1") & (df["method"] == "svr-mad")].iloc[0]
    assert q1["ncomm"] == 4 and bool(q1["correct"]) and q1["scores"] == SVR_SCORES["q1"]


def test_trace_later_line_overrides_and_counts_difficulty():
    agents = agents_frame(trace_rows())
    assert len(agents) == 30
    n = agents.groupby("id")["n_correct"].first()
    assert n.to_dict() == {"q1": 1, "q2": 2, "q3": 3, "q4": 4, "q5": 0, "q6": 1}


def test_best_cells_exclude_self_consistency_for_cost_and_bold_ties():
    table = summary(results_frame(result_rows()))
    best = best_cells(table)
    assert best == {"ncomm": {"svr-mad"}, "tokens_k": {"svr-mad"}, "accuracy": {"s2-mad", "svr-mad"}}
    md = format_table(table, "markdown", ["ncomm", "tokens_k", "accuracy"], bold=best)
    lines = md.splitlines()
    assert lines[0] == "| Method | NComm | Tok (x10^3) | Acc (%) |"
    assert lines[2] == "| Self Consistency | 0.0 | 1.0 | 33.3 |"
    assert lines[3] == "| S2-MAD | 10.0 | 5.0 | **66.7** |"
    assert lines[4] == "| SVR-MAD | **4.0** | **3.0** | **66.7** |"


def test_ablation_rows_stay_out_of_table1():
    ablation = [{"id": q, "method": "svr-mad:ppl", "correct": True, "ncomm": 1, "tokens": 100} for q in QIDS]
    table = summary(results_frame(result_rows() + ablation))
    assert list(table.index) == ["self-consistency", "s2-mad", "svr-mad", "svr-mad:ppl"]
    assert list(table1(table).index) == ["self-consistency", "s2-mad", "svr-mad"]
    assert best_cells(table1(table))["ncomm"] == {"svr-mad"}
    assert method_name("svr-mad:ppl") == "SVR-MAD [ppl]"


def test_csv_and_text_formats():
    table = summary(results_frame(result_rows()))
    csv = format_table(table, "csv", ["ncomm", "tokens_k", "accuracy"]).splitlines()
    assert csv[0] == "Method,NComm,Tok (x10^3),Acc (%)"
    assert csv[3] == "SVR-MAD,4,3,66.6667"
    text = summary_table_text(result_rows())
    assert text.splitlines()[0].split()[:3] == ["Method", "Questions", "NComm"]
    assert "SVR-MAD" in text and "**" not in text
    with pytest.raises(ValueError):
        format_table(table, "html")
    assert summary_table_text([]) == "(no results)\n"


def test_read_jsonl_drops_only_a_torn_last_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": ')
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
    path.write_text('{"a": \n{"a": 2}\n')
    with pytest.raises(ValueError):
        read_jsonl(path)
    assert read_jsonl(tmp_path / "absent.jsonl") == []
