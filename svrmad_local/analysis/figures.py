"""The paper's figures, redrawn from a run folder (PNG, matplotlib's Agg canvas).

Each `figureN(run, out_dir)` returns `(path written, DataFrame plotted)`: the numbers go into the
report next to the picture and tests check them without looking at pixels. The plots use
`matplotlib.figure.Figure` directly rather than pyplot, so no global backend or state is touched.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from svrmad_local.analysis.metrics import Run, is_ablation, method_name, method_order, read_jsonl, summary

# Prior signals of Figure 1: trace key, label, higher is better.
PRIOR_SIGNALS = [("min_ll", "min-LL", True), ("ppl", "PPL", False), ("self_conf", "conf", True)]
DIFFICULTY = ["1", "2", "3", "4+"]  # number of agents correct before debate; 0 has no right agent
HARD = (1, 3)  # Figure 2: 1-3 correct agents before debate
SVR_METHOD = "svr-mad"
KV_COLUMNS = ["prompt_tokens", "computed_tokens", "kv_saved"]


def difficulty(n_correct) -> str | None:
    """Difficulty group of a question; None for 0 correct agents (excluded: nobody can be right)."""
    if pd.isna(n_correct) or int(n_correct) <= 0:
        return None
    return "4+" if int(n_correct) >= 4 else str(int(n_correct))


def top_agents(agents: pd.DataFrame, column: str, higher_better: bool) -> pd.DataFrame:
    """The top-ranked agent row of each question under `column`. Agents without a value rank last;
    ties go to the lowest agent index, so the choice is deterministic."""
    key = pd.to_numeric(agents[column], errors="coerce") if column in agents else math.nan
    ranked = agents.assign(_missing=pd.isna(key), _key=-key if higher_better else key)
    ranked = ranked.sort_values(["id", "_missing", "_key", "agent"], kind="stable")
    return ranked.groupby("id", sort=False).head(1).drop(columns=["_missing", "_key"])


def _svr_agents(run: Run, svr_method: str) -> pd.DataFrame:
    """Agents with the final SVR score the SVR-MAD row of their question gave them."""
    rows = run.results[run.results["method"] == svr_method]
    scores = [{"id": r.id, "agent": i, "svr": s}
              for r in rows.itertuples() if isinstance(r.scores, list) for i, s in enumerate(r.scores)]
    if not scores or run.agents.empty:
        return pd.DataFrame(columns=["id", "agent", "svr", "correct", "n_correct"])
    return pd.DataFrame(scores).merge(run.agents[["id", "agent", "correct", "n_correct"]], on=["id", "agent"])


def signal_ranking(run: Run, svr_method: str = SVR_METHOD) -> pd.DataFrame:
    """Figure 1's numbers: per difficulty group and signal, how many questions, how many with a
    correct top-ranked agent, and that share in %."""
    rows = []
    sources = [(run.agents, key, label, hb) for key, label, hb in PRIOR_SIGNALS]
    sources.append((_svr_agents(run, svr_method), "svr", "SVR", True))
    for frame, key, label, higher_better in sources:
        top = top_agents(frame, key, higher_better)
        groups = top["n_correct"].map(difficulty)
        for group in DIFFICULTY:
            hit = top.loc[groups == group, "correct"].astype(bool)
            rows.append({"difficulty": group, "signal": label, "questions": len(hit),
                         "top_correct": int(hit.sum()),
                         "share": 100 * hit.mean() if len(hit) else math.nan})
    return pd.DataFrame(rows)


def _n_correct_initial(run: Run) -> pd.Series:
    """Difficulty per results row: its own `n_correct_initial`, else counted from the trace."""
    own = pd.to_numeric(run.results["n_correct_initial"], errors="coerce")
    if run.agents.empty:
        return own
    from_trace = run.results["id"].map(run.agents.groupby("id")["n_correct"].first())
    return own.fillna(pd.to_numeric(from_trace, errors="coerce"))


def hard_accuracy(run: Run) -> pd.DataFrame:
    """Figure 2's numbers: per method (ablations left out), hard questions (1-3 correct agents
    before debate), how many it answered correctly, and accuracy in %."""
    n = _n_correct_initial(run)
    hard = run.results[(n >= HARD[0]) & (n <= HARD[1])]
    rows = []
    for method in [m for m in method_order(run.results["method"]) if not is_ablation(m)]:
        g = hard[hard["method"] == method]
        ok = g["correct"].map(lambda v: bool(v) if pd.notna(v) else False)
        rows.append({"method": method, "questions": len(g), "correct": int(ok.sum()),
                     "accuracy": 100 * ok.mean() if len(g) else math.nan})
    return pd.DataFrame(rows)


def _percent(series: pd.Series) -> pd.Series:
    """ablations.jsonl may hold fractions or percentages; all values <= 1 are read as fractions."""
    series = pd.to_numeric(series, errors="coerce")
    return series * 100 if series.dropna().le(1).all() else series


def ablation_points(run_dir: Path) -> pd.DataFrame:
    """Figure 3's numbers from `ablations.jsonl` (empty when absent): one row per (posterior, tau),
    accuracy and acceptance rate in %, tokens_k = tokens_mean / 1000."""
    df = pd.DataFrame(read_jsonl(Path(run_dir) / "ablations.jsonl"))
    if df.empty:
        return df
    df["accuracy"] = _percent(df["accuracy"])
    df["acceptance_rate"] = _percent(df["acceptance_rate"])
    df["tokens_k"] = pd.to_numeric(df["tokens_mean"], errors="coerce") / 1000
    order = {"svr": 0, "min_ll": 1, "ppl": 2, "self_conf": 3}  # SVR first, then Figure 1's order
    df["_order"] = df["posterior"].map(order).fillna(len(order))
    return df.sort_values(["_order", "posterior", "tokens_k"]).drop(columns="_order").reset_index(drop=True)


def kv_cache(run: Run) -> pd.DataFrame:
    """Prompt tokens an API would bill vs prompt tokens the engine computed (after KV-cache reuse),
    per method and question on average, and the share of billed prompt tokens the cache saved."""
    return summary(run.results)[KV_COLUMNS].rename_axis("method").reset_index()


# ---------------------------------------------------------------- drawing

def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


# A group of fewer questions than this is labelled "tiny" on the figure: its share is one or two answers.
TINY = 5


def say(ax, text: str) -> None:
    """Write `text` across the middle of the axes: what an empty chart shows instead of nothing."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=9, wrap=True,
            bbox={"boxstyle": "round", "facecolor": "lightyellow", "edgecolor": "gray"})


def count_label(hits: int, n: int) -> str:
    """A bar's label: "hits/n", "n=0" for an empty group, "hits/n tiny" below TINY."""
    if n == 0:
        return "n=0"
    return f"{hits}/{n}" + (" tiny" if n < TINY else "")


def _bars(ax, labels, series: dict[str, list[float]], counts: dict[str, list[str]] | None = None):
    """Grouped bars: one group per label, one bar per series; `counts` labels each bar (its n)."""
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        bars = ax.bar(xs, [0 if pd.isna(v) else v for v in values], width, label=name)
        if counts is not None:
            ax.bar_label(bars, counts[name], fontsize=6, rotation=90, padding=2)
    ax.set_xticks(range(len(labels)), labels)


def figure1(run: Run, out_dir, svr_method: str = SVR_METHOD) -> tuple[Path, pd.DataFrame]:
    """Each bar is labelled with its counts (correct top agents / questions), an empty group "n=0";
    a run with no question that has a correct agent says so across the chart."""
    data = signal_ranking(run, svr_method)
    fig = Figure(figsize=(6.4, 3.8))
    ax = fig.add_subplot()
    order = list(reversed(DIFFICULTY))  # easiest first, as difficulty increases to the right
    labels = [l for _, l, _ in PRIOR_SIGNALS] + ["SVR"]
    share = data.pivot(index="difficulty", columns="signal", values="share").reindex(order)
    cell = data.set_index(["signal", "difficulty"])
    counts = {s: [count_label(int(cell.at[(s, d), "top_correct"]), int(cell.at[(s, d), "questions"])) for d in order]
              for s in labels}
    _bars(ax, order, {s: share[s].tolist() for s in labels}, counts)
    per_group = data[data["signal"] == labels[0]].set_index("difficulty")["questions"]
    ranked = int(per_group.sum())
    traced = run.agents["id"].nunique() if not run.agents.empty else 0
    ax.set_title(f"n = {ranked} of {traced} debated questions have a correct agent "
                 f"(per group: {', '.join(f'{d}: {int(per_group[d])}' for d in order)})", fontsize=8)
    if ranked == 0:
        say(ax, f"No debated question has a correct agent before debate (n = {traced} questions),\n"
                "so there is no correct agent to rank: every bar is 0 by construction.")
    ax.set_xlabel("agents correct before debate (harder to the right)")
    ax.set_ylabel("top-ranked agent correct (%)")
    ax.set_ylim(0, 130)  # headroom for the legend and the bar labels
    ax.legend(fontsize=8, loc="upper center", ncols=4)
    return _save(fig, Path(out_dir) / "figure1_signals.png"), data


def figure2(run: Run, out_dir) -> tuple[Path, pd.DataFrame]:
    data = hard_accuracy(run)
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    labels = [method_name(m) for m in data["method"]]
    bars = ax.bar(labels, data["accuracy"].fillna(0))
    ax.bar_label(bars, [f"{c}/{n}" for c, n in zip(data["correct"], data["questions"])], fontsize=8)
    ax.set_ylabel(f"accuracy on hard questions (%)\n({HARD[0]}-{HARD[1]} agents correct before debate)")
    n_hard = int(data["questions"].max()) if len(data) else 0
    ax.set_title(f"n = {n_hard} hard questions (bar labels: correct/questions)", fontsize=8)
    if n_hard == 0:
        say(ax, f"No hard question ({HARD[0]}-{HARD[1]} agents correct before debate) in this run:\n"
                "no method can be compared here.")
    ax.set_ylim(0, 115)
    ax.tick_params(axis="x", labelsize=8)
    return _save(fig, Path(out_dir) / "figure2_hard.png"), data


def figure3(run: Run, out_dir) -> tuple[Path | None, pd.DataFrame]:
    """None and an empty frame when the run folder has no ablations.jsonl."""
    data = ablation_points(run.run_dir)
    if data.empty:
        return None, data
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    for posterior, g in data.groupby("posterior", sort=False):
        g = g.sort_values("tokens_k")  # a trade-off curve: cheapest point first
        ax.plot(g["tokens_k"], g["accuracy"], marker="o", label=posterior)
    ax.set_xlabel("tokens per question (x10^3)")
    ax.set_ylabel("accuracy (%)")
    n = pd.to_numeric(data.get("questions"), errors="coerce").max() if "questions" in data else math.nan
    ax.set_title(f"n = {'?' if pd.isna(n) else int(n)} questions per point", fontsize=8)
    ax.legend(title="posterior", fontsize=8)
    return _save(fig, Path(out_dir) / "figure3_ablation.png"), data


def figure_kv_cache(run: Run, out_dir) -> tuple[Path, pd.DataFrame]:
    data = kv_cache(run)
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    _bars(ax, [method_name(m) for m in data["method"]],
          {"billed": data["prompt_tokens"].tolist(), "computed": data["computed_tokens"].tolist()})
    ax.set_ylabel("prompt tokens per question")
    ax.set_title(f"n = {run.results['id'].nunique()} questions (means per question and method)", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8)
    return _save(fig, Path(out_dir) / "kv_cache.png"), data
