"""What each logit-level prior signal says about correctness, from run folders alone (no model).

The unit is one **initial response** of a debated question (an agent of a trace.jsonl line): its
signals (min-LL, PPL, mean log-prob, mean entropy, the DeepConf confidences, self-reported
confidence), the prior SVR-MAD started from, and the posterior (the agent's final SVR score in the
question's `svr-mad` results row). Unanimous questions are not in the trace, so they are not here
(docs/signals.md says what that biases). Every function returns a DataFrame with a `run` column, so
several runs sit side by side; `svrmad signals` (analysis/signals_page.py) draws and writes them.

The statistics are scikit-learn's (roc_auc_score, calibration_curve) and pandas'/scipy's (Spearman,
Kendall); only the bootstrap loop and filtered voting are ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from scipy.stats import kendalltau
from sklearn.calibration import calibration_curve
from sklearn.metrics import roc_auc_score

from svrmad_local.analysis.metrics import read_jsonl, results_frame
from svrmad_local.debate.trace import read_trace
from svrmad_local.methods.base import majority


@dataclass(frozen=True)
class Signal:
    key: str  # column of the responses frame (a key of the trace's `signals`, or prior / posterior)
    label: str
    higher_better: bool
    probability: Callable[[np.ndarray], np.ndarray] | None = None  # into [0, 1], for calibration


SIGNALS = (
    Signal("min_ll", "min-LL", True),
    Signal("ppl", "PPL", False),
    Signal("mean_logprob", "mean log-prob", True),
    Signal("mean_entropy", "mean entropy", False),
    Signal("conf_mean", "DeepConf mean", True),
    Signal("conf_lowest_group", "DeepConf lowest group", True),
    Signal("conf_bottom10", "DeepConf bottom 10%", True),
    Signal("conf_tail", "DeepConf tail", True),
    Signal("self_conf", "self-reported conf", True, lambda v: v),
    Signal("prior", "SVR prior", True),
    # SVR = (r - c) / D in [-1, 1]; (SVR + 1) / 2 = r / D, the share of debates the receiver kept its answer
    Signal("posterior", "SVR posterior", True, lambda v: (v + 1) / 2),
)
BY_KEY = {s.key: s for s in SIGNALS}
SVR_METHOD = "svr-mad"


# ---------------------------------------------------------------- reading

def run_label(run_dir: Path) -> str:
    return Path(run_dir).name or str(run_dir)


def responses(run_dir, label: str | None = None, svr_method: str = SVR_METHOD) -> pd.DataFrame:
    """One row per initial response of `run_dir`'s trace: run, id, agent, answer, answer_type,
    correct, every signal of SIGNALS (NaN where absent); none for a run folder that debated nothing
    yet (no trace.jsonl beside its run.json). Raises FileNotFoundError for a folder that is no run's."""
    run_dir = Path(run_dir)
    trace = run_dir / "trace.jsonl"
    if not trace.exists() and not (run_dir / "run.json").is_file():
        what = "does not exist" if not run_dir.exists() else "has no trace.jsonl"
        raise FileNotFoundError(f"{run_dir} {what}: expected a run folder written by `svrmad run --out`")
    rows = []
    for q in read_trace(trace) if trace.exists() else []:
        for a in q["agents"]:
            sig = a.get("signals") or {}
            rec = {"id": q["id"], "agent": a["agent"], "answer": a.get("answer"),
                   "answer_type": q.get("answer_type", "math"), "correct": bool(a.get("correct")),
                   "prior": a.get("prior")}
            rec.update({s.key: sig.get(s.key) for s in SIGNALS if s.key not in ("prior", "posterior")})
            rows.append(rec)
    df = pd.DataFrame(rows, columns=["id", "agent", "answer", "answer_type", "correct"]
                      + [s.key for s in SIGNALS if s.key != "posterior"])
    results = results_frame(read_jsonl(run_dir / "results.jsonl"))
    post = {}
    if not results.empty:
        for r in results[results["method"] == svr_method].itertuples():
            if isinstance(r.scores, list):
                post.update({(str(r.id), i): s for i, s in enumerate(r.scores)})
    df["posterior"] = [post.get((i, a)) for i, a in zip(df["id"], df["agent"])]
    for s in SIGNALS:
        df[s.key] = pd.to_numeric(df[s.key], errors="coerce").astype(float)
    df.insert(0, "run", label or run_label(run_dir))
    return df


def oriented(df: pd.DataFrame, s: Signal) -> pd.Series:
    """The signal with higher = more likely correct (PPL and entropy negated)."""
    return df[s.key] if s.higher_better else -df[s.key]


# ---------------------------------------------------------------- separation: AUROC

def bootstrap_auroc(y: np.ndarray, score: np.ndarray, groups: np.ndarray, n_boot: int, seed: int,
                    level: float = 0.95) -> tuple[float, float]:
    """Percentile CI of AUROC, resampling whole questions (`groups`) with replacement: the
    responses of one question share it, so they are not independent draws. Resamples with one
    class only are dropped; (nan, nan) when none is left or n_boot is 0."""
    if n_boot <= 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    ids, inverse = np.unique(groups, return_inverse=True)
    members = [np.flatnonzero(inverse == g) for g in range(len(ids))]
    stats = []
    for _ in range(n_boot):
        take = np.concatenate([members[g] for g in rng.integers(0, len(ids), len(ids))])
        yb = y[take]
        if yb.min() != yb.max():
            stats.append(roc_auc_score(yb, score[take]))
    if not stats:
        return math.nan, math.nan
    lo, hi = np.percentile(stats, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return float(lo), float(hi)


def auroc(df: pd.DataFrame, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per run and signal: n responses with the signal, how many correct, AUROC of the oriented
    signal for correct vs wrong (sklearn; ties count half), and a bootstrap CI over questions.
    AUROC is NaN when the responses are all correct or all wrong."""
    rows = []
    for run, g in df.groupby("run", sort=False):
        for s in SIGNALS:
            x = oriented(g, s)
            keep = x.notna()
            y, score = g.loc[keep, "correct"].to_numpy(int), x[keep].to_numpy(float)
            both = len(y) > 0 and y.min() != y.max()
            value = roc_auc_score(y, score) if both else math.nan
            lo, hi = (bootstrap_auroc(y, score, g.loc[keep, "id"].to_numpy(), n_boot, seed) if both
                      else (math.nan, math.nan))
            rows.append({"run": run, "signal": s.label, "n": int(keep.sum()), "correct": int(y.sum()),
                         "auroc": value, "ci_low": lo, "ci_high": hi})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- calibration: reliability, ECE

def calibration(df: pd.DataFrame, n_bins: int = 10) -> tuple[pd.DataFrame, pd.DataFrame]:
    """For the signals that claim to be probabilities (self-reported confidence; the posterior as
    (SVR + 1) / 2): the reliability diagram's bins (run, signal, bin, n, confidence = mean stated
    probability, accuracy; empty bins left out, as calibration_curve does) and per (run, signal)
    n and ECE = sum over bins of n_bin / n * |accuracy - confidence|. Bins are [0, 1] cut in
    `n_bins` equal parts with calibration_curve's edges (a value on an edge goes to the lower bin)."""
    bins, summary = [], []
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    for run, g in df.groupby("run", sort=False):
        for s in (s for s in SIGNALS if s.probability is not None):
            keep = g[s.key].notna()
            p = np.clip(s.probability(g.loc[keep, s.key].to_numpy(float)), 0.0, 1.0)
            y = g.loc[keep, "correct"].to_numpy(int)
            if len(y) == 0:
                summary.append({"run": run, "signal": s.label, "n": 0, "ece": math.nan})
                continue
            accuracy, confidence = calibration_curve(y, p, n_bins=n_bins, strategy="uniform")
            counts = np.bincount(np.searchsorted(edges[1:-1], p), minlength=n_bins)
            used = np.flatnonzero(counts)
            for b, acc, conf in zip(used, accuracy, confidence):
                bins.append({"run": run, "signal": s.label, "bin": int(b), "n": int(counts[b]),
                             "confidence": float(conf), "accuracy": float(acc)})
            ece = float(np.sum(counts[used] / len(y) * np.abs(accuracy - confidence)))
            summary.append({"run": run, "signal": s.label, "n": len(y), "ece": ece})
    cols = ["run", "signal", "bin", "n", "confidence", "accuracy"]
    return pd.DataFrame(bins, columns=cols), pd.DataFrame(summary, columns=["run", "signal", "n", "ece"])


# ---------------------------------------------------------------- selective accuracy: filtered voting

def ranked(g: pd.DataFrame, s: Signal) -> pd.DataFrame:
    """One question's agents, best first under `s`: missing values last, ties by agent index."""
    key = oriented(g, s)
    return g.assign(_missing=key.isna(), _key=-key).sort_values(["_missing", "_key", "agent"], kind="stable")


def filtered_vote(g: pd.DataFrame, s: Signal, k: int) -> bool:
    """Whether the majority answer of the question's top-k agents under `s` is correct (DeepConf's
    filtered voting). A tie goes to the tied answer of the better-ranked agent; no answer at all is
    wrong. Correctness comes from an agent giving the voted answer, as graded by the run."""
    top = ranked(g, s).head(k)
    answers = [None if a is None or (isinstance(a, float) and math.isnan(a)) else str(a) for a in top["answer"]]
    voted = majority(answers, str(top["answer_type"].iloc[0]))
    if voted is None:
        return False
    return bool(top["correct"].iloc[answers.index(voted)])


def selective_accuracy(df: pd.DataFrame) -> pd.DataFrame:
    """Per run, signal and k = 1..N (N = agents per question): accuracy (%) over the run's questions
    of the vote among each question's top-k agents, coverage = k / N. At k = N every signal gives
    the plain majority vote. Signals no response of the run has are left out."""
    rows = []
    for run, g in df.groupby("run", sort=False):
        questions = [q for _, q in g.groupby("id", sort=False)]
        n_agents = max(len(q) for q in questions)
        for s in (s for s in SIGNALS if g[s.key].notna().any()):  # a signal no response has ranks nothing
            for k in range(1, n_agents + 1):
                hits = [filtered_vote(q, s, k) for q in questions]
                rows.append({"run": run, "signal": s.label, "k": k, "coverage": k / n_agents,
                             "questions": len(hits), "correct": int(sum(hits)),
                             "accuracy": 100 * sum(hits) / len(hits)})
    return pd.DataFrame(rows, columns=["run", "signal", "k", "coverage", "questions", "correct", "accuracy"])


# ---------------------------------------------------------------- how signals relate, how debates reorder

def correlations(df: pd.DataFrame, min_periods: int = 3) -> dict[str, tuple[pd.DataFrame, int]]:
    """Per run: the Spearman correlation matrix of the oriented signals over its responses (pairwise
    complete; NaN below `min_periods` common values or for a constant signal) and n responses."""
    out = {}
    for run, g in df.groupby("run", sort=False):
        frame = pd.DataFrame({s.label: oriented(g, s) for s in SIGNALS})
        out[run] = (frame.corr(method="spearman", min_periods=min_periods), len(g))
    return out


def reordering(df: pd.DataFrame) -> pd.DataFrame:
    """Per run, over the questions with a posterior: Kendall's tau between the agents' prior and
    posterior (mean over questions where both vary), how often the top agent changes, and how
    often the top agent is correct under the prior and under the posterior."""
    rows = []
    for run, g in df.groupby("run", sort=False):
        taus, changed, prior_ok, post_ok = [], 0, 0, 0
        questions = [q for _, q in g[g["posterior"].notna()].groupby("id", sort=False)]
        for q in questions:
            top_prior, top_post = ranked(q, BY_KEY["prior"]).iloc[0], ranked(q, BY_KEY["posterior"]).iloc[0]
            changed += int(top_prior["agent"] != top_post["agent"])
            prior_ok += bool(top_prior["correct"])
            post_ok += bool(top_post["correct"])
            if q["prior"].nunique() > 1 and q["posterior"].nunique() > 1:
                taus.append(kendalltau(q["prior"], q["posterior"]).statistic)
        n = len(questions)
        rows.append({"run": run, "questions": n, "tau_questions": len(taus),
                     "kendall_tau": float(np.mean(taus)) if taus else math.nan,
                     "top_changed": 100 * changed / n if n else math.nan,
                     "top_correct_prior": 100 * prior_ok / n if n else math.nan,
                     "top_correct_posterior": 100 * post_ok / n if n else math.nan})
    return pd.DataFrame(rows)


def acceptance(run_dirs: dict[str, Path], svr_method: str = SVR_METHOD) -> pd.DataFrame:
    """Per run: SVR-MAD's questions whose receiver was accepted and those that fell back to the
    vote, each with how many were answered correctly and that share in %."""
    rows = []
    for run, run_dir in run_dirs.items():
        res = results_frame(read_jsonl(Path(run_dir) / "results.jsonl"))
        res = res[res["method"] == svr_method] if not res.empty else res
        flag = res["accepted"].map(lambda v: None if v is None or pd.isna(v) else bool(v)) if len(res) else None
        for name, accepted in (("accepted", True), ("fallback vote", False)):
            g = res[flag == accepted] if len(res) else res
            ok = int(g["correct"].map(lambda v: bool(v) if pd.notna(v) else False).sum()) if len(g) else 0
            rows.append({"run": run, "receiver": name, "questions": len(g), "correct": ok,
                         "accuracy": 100 * ok / len(g) if len(g) else math.nan})
    return pd.DataFrame(rows, columns=["run", "receiver", "questions", "correct", "accuracy"])
