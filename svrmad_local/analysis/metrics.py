"""Per-method numbers of a run folder (see docs/formats.md), the paper's Table 1 and its friends.

Everything here reads saved files or in-memory rows and never needs a model, so `svrmad run` (its
final table), `svrmad report` and the tests share one definition of every number.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from svrmad_local.debate.trace import read_jsonl  # noqa: F401  (re-exported for eval modules)

# Paper order (Table 1); methods not listed here follow in order of first appearance.
METHOD_NAMES = {
    "self-consistency": "Self Consistency",
    "all-to-all": "All-to-All",
    "group-debate": "GroupDebate",
    "sid-et": "SID-ET",
    "s2-mad": "S2-MAD",
    "s2-mad:distinct": "S2-MAD (distinct peers)",
    "svr-mad": "SVR-MAD",
}
# No-debate reference: its NComm/Tok are not candidates for "best" (Table 1 caption).
REFERENCE_METHODS = {"self-consistency", "sc"}
# SVR-MAD with another posterior signal (Appendix B) is "svr-mad:<signal>": an ablation, not a row
# of Table 1 or a bar of Figure 2 (Figure 3 covers it); it stays in the full per-method table.
ABLATION_PREFIX = "svr-mad:"

RESULT_COLUMNS = ["id", "method", "answer", "gold", "correct", "ncomm", "tokens", "prompt_tokens",
                  "completion_tokens", "computed_tokens", "n_correct_initial", "accepted", "scores"]

# key -> (header, number format, lower is better?). The order is the order of the full table.
COLUMNS = {
    "questions": ("Questions", "{:.0f}", None),
    "ncomm": ("NComm", "{:.1f}", True),
    "tokens_k": ("Tok (x10^3)", "{:.1f}", True),
    "accuracy": ("Acc (%)", "{:.1f}", False),
    "prompt_tokens": ("Prompt tok billed", "{:.0f}", None),
    "computed_tokens": ("Prompt tok computed", "{:.0f}", None),
    "kv_saved": ("KV saved (%)", "{:.1f}", None),
    "acceptance": ("Accepted (%)", "{:.1f}", None),
}
TABLE1_COLUMNS = ["ncomm", "tokens_k", "accuracy"]


def _norm(method: str) -> str:
    return str(method).strip().lower().replace("_", "-")


def method_name(method: str) -> str:
    """The paper's name of a method id ("svr-mad" -> "SVR-MAD", "svr-mad:ppl" -> "SVR-MAD [ppl]");
    unknown ids are shown as they are."""
    if is_ablation(method):
        return f"{METHOD_NAMES['svr-mad']} [{str(method)[len(ABLATION_PREFIX):]}]"
    return METHOD_NAMES.get(_norm(method), str(method))


def is_ablation(method: str) -> bool:
    return _norm(method).startswith(ABLATION_PREFIX)


def is_reference(method: str) -> bool:
    return _norm(method) in REFERENCE_METHODS


def method_order(methods) -> list[str]:
    """Distinct methods in paper order, unknown ones after, in order of first appearance."""
    seen = list(dict.fromkeys(methods))
    rank = {m: i for i, m in enumerate(METHOD_NAMES)}
    return sorted(seen, key=lambda m: (rank.get(_norm(m), len(rank)), seen.index(m)))


# ---------------------------------------------------------------- reading a run folder

def results_frame(rows: list[dict]) -> pd.DataFrame:
    """results.jsonl rows as a DataFrame, one row per (id, method): a later row overrides an earlier
    one, because a resumed run may rewrite a question. Missing columns are added as NA."""
    df = pd.DataFrame(rows)
    for col in RESULT_COLUMNS:
        if col not in df.columns:
            df[col] = pd.NA
    if df.empty:
        return df
    df["id"] = df["id"].astype(str)
    return df.drop_duplicates(["id", "method"], keep="last").reset_index(drop=True)


def agents_frame(trace_rows: list[dict]) -> pd.DataFrame:
    """Initial responses of trace.jsonl, one row per (id, agent) with its signals as columns
    (min_ll, ppl, self_conf, ...), `correct` as bool and the question's `n_correct` (difficulty).
    The texts are left out: nothing here needs them. A later trace line for an id overrides."""
    latest = {str(r["id"]): r for r in trace_rows}
    flat = []
    for qid, row in latest.items():
        for i, a in enumerate(row.get("agents", [])):  # the minimal form indexes agents by position
            rec = {"id": qid, "agent": int(a.get("agent", i)), "correct": bool(a.get("correct")),
                   "answer": a.get("answer"), "prompt_tokens": a.get("prompt_tokens"),
                   "completion_tokens": a.get("completion_tokens"),
                   "computed_tokens": a.get("computed_tokens")}
            for name, value in (a.get("signals") or {}).items():
                rec[name] = value
            flat.append(rec)
    if not flat:
        return pd.DataFrame(columns=["id", "agent", "correct", "n_correct"])
    df = pd.DataFrame(flat)
    df["n_correct"] = df.groupby("id")["correct"].transform("sum").astype(int)
    return df


@dataclass
class Run:
    """The saved files of one run folder, already de-duplicated."""

    run_dir: Path
    results: pd.DataFrame  # one row per (id, method)
    agents: pd.DataFrame  # one row per (id, agent), see agents_frame
    skipped: pd.DataFrame  # one row per unanimous question
    config: dict  # run.json ({} when absent)


def load_run(run_dir) -> Run:
    """Read a run folder. Raises FileNotFoundError when it holds no results (nothing to report)."""
    run_dir = Path(run_dir)
    results_path = run_dir / "results.jsonl"
    if not results_path.exists():
        what = "does not exist" if not run_dir.exists() else "has no results.jsonl"
        raise FileNotFoundError(f"{run_dir} {what}: expected a run folder written by `svrmad run --out`")
    results = results_frame(read_jsonl(results_path))
    if results.empty:
        raise FileNotFoundError(f"{results_path} holds no result rows yet")
    skipped = pd.DataFrame(read_jsonl(run_dir / "skipped.jsonl"))
    if not skipped.empty and "id" in skipped.columns:
        skipped["id"] = skipped["id"].astype(str)
        skipped = skipped.drop_duplicates("id", keep="last").reset_index(drop=True)
    config_path = run_dir / "run.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    return Run(run_dir, results, agents_frame(read_jsonl(run_dir / "trace.jsonl")), skipped, config)


# ---------------------------------------------------------------- the numbers

def _share(series: pd.Series) -> float:
    """% of true values; NA (not reported, e.g. no answer parsed) counts as false."""
    return 100 * float(series.map(lambda v: bool(v) if pd.notna(v) else False).mean())


def _mean(series: pd.Series) -> float:
    values = pd.to_numeric(series, errors="coerce").dropna()
    return float(values.mean()) if len(values) else math.nan


def summary(results: pd.DataFrame) -> pd.DataFrame:
    """One row per method (index: method id, paper order) with the per-question means of the paper:
    questions, ncomm, tokens, tokens_k (= tokens / 1000), accuracy (% correct; an unparsed answer
    counts as wrong), prompt_tokens (billed) and computed_tokens (after KV-cache reuse), kv_saved
    (% of billed prompt tokens the cache spared), and acceptance (% of rows with `accepted` true,
    among rows that report it; NaN when none do)."""
    out = {}
    for method in method_order(results["method"]):
        g = results[results["method"] == method]
        accepted = g["accepted"].dropna()
        billed, computed = _mean(g["prompt_tokens"]), _mean(g["computed_tokens"])
        out[method] = {
            "questions": g["id"].nunique(),
            "ncomm": _mean(g["ncomm"]),
            "tokens": _mean(g["tokens"]),
            "tokens_k": _mean(g["tokens"]) / 1000,
            "accuracy": _share(g["correct"]),
            "prompt_tokens": billed,
            "computed_tokens": computed,
            "kv_saved": 100 * (1 - computed / billed) if billed > 0 else math.nan,
            "acceptance": _share(accepted) if len(accepted) else math.nan,
        }
    return pd.DataFrame.from_dict(out, orient="index")


def table1(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of a summary that Table 1 shows: every method but the SVR-MAD ablations."""
    return table[[not is_ablation(m) for m in table.index]]


def best_cells(table: pd.DataFrame, columns=TABLE1_COLUMNS) -> dict[str, set[str]]:
    """Methods to bold per column, as Table 1 does: lowest NComm/Tok among the debate methods (Self
    Consistency excluded) and highest accuracy among all. Compared at the shown precision, so
    methods that display the same best number are all bold."""
    best = {}
    for col in columns:
        lower = COLUMNS[col][2]
        cand = table[col]
        if lower:
            cand = cand[[not is_reference(m) for m in cand.index]]
        shown = cand.map(lambda v: float(COLUMNS[col][1].format(v)) if pd.notna(v) else math.nan).dropna()
        if shown.empty:
            best[col] = set()
            continue
        target = shown.min() if lower else shown.max()
        best[col] = set(shown.index[shown == target])
    return best


def format_table(table: pd.DataFrame, fmt: str = "markdown", columns=None, bold=None) -> str:
    """Render a summary table as "markdown", "csv" or "text". `columns` picks summary keys (default:
    every known column present); `bold` maps a column to the methods to bold (Markdown only).
    CSV keeps full precision; the others show the paper's precision."""
    columns = [c for c in (columns or COLUMNS) if c in table.columns]
    headers = ["Method"] + [COLUMNS[c][0] for c in columns]
    if fmt == "csv":
        frame = table[columns].copy()
        frame.insert(0, "method", [method_name(m) for m in table.index])
        frame.columns = headers
        return frame.to_csv(index=False, float_format="%.6g")
    bold = bold if fmt == "markdown" else None
    rows = []
    for method, rec in table.iterrows():
        cells = [method_name(method)]
        for c in columns:
            text = COLUMNS[c][1].format(rec[c]) if pd.notna(rec[c]) else "-"
            cells.append(f"**{text}**" if bold and method in bold.get(c, ()) else text)
        rows.append(cells)
    if fmt == "markdown":
        return markdown(headers, rows)
    if fmt == "text":
        widths = [max(len(r[i]) for r in [headers] + rows) for i in range(len(headers))]
        just = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(r, widths)))
        return "\n".join([just(headers), "  ".join("-" * w for w in widths)] + [just(r) for r in rows]) + "\n"
    raise ValueError(f"unknown table format {fmt!r} (markdown, csv or text)")


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; the first column left-aligned, the others (numbers) right-aligned."""
    lines = [headers, ["---"] + ["---:"] * (len(headers) - 1)] + rows
    return "\n".join("| " + " | ".join(str(c) for c in r) + " |" for r in lines) + "\n"


def grader_agreement(results: pd.DataFrame) -> tuple[dict[str, int], pd.DataFrame] | None:
    """Rows graded by both graders (`--grader both`): the counts (rows, agree, ours only correct,
    math-verify only correct) and the rows where the two disagree (id, method, answer, gold, ours,
    math_verify). None when no row carries both verdicts."""
    if "grades" not in results.columns:
        return None
    both = results[results["grades"].map(lambda g: isinstance(g, dict) and {"ours", "math-verify"} <= set(g))]
    if both.empty:
        return None
    rows = both[["id", "method", "answer", "gold"]].copy()
    rows["ours"] = both["grades"].map(lambda g: bool(g["ours"]))
    rows["math_verify"] = both["grades"].map(lambda g: bool(g["math-verify"]))
    differ = rows[rows["ours"] != rows["math_verify"]].reset_index(drop=True)
    counts = {"rows": len(rows), "agree": len(rows) - len(differ), "ours_only": int(differ["ours"].sum()),
              "math_verify_only": int(differ["math_verify"].sum())}
    return counts, differ


def summary_table_text(rows: list[dict]) -> str:
    """The per-method table of in-memory results rows, as plain text (what `svrmad run` prints)."""
    if not rows:
        return "(no results)\n"
    return format_table(summary(results_frame(rows)), fmt="text")
