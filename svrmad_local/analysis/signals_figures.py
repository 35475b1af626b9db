"""The signals study's figures (PNG, matplotlib's Figure API as in analysis/figures.py).

Every figure states its n (responses, questions or bins) on the figure itself, and a panel with
nothing to show says why in words (`figures.say`) instead of staying blank. Several runs share one
figure: a bar, line or panel per run.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from svrmad_local.analysis.figures import TINY, _save, say
from svrmad_local.analysis.signals_study import SIGNALS


def _panels(n: int, width: float = 4.2, height: float = 3.6):
    fig = Figure(figsize=(width * n, height))
    return fig, fig.subplots(1, n, squeeze=False)[0]


def auroc_figure(data: pd.DataFrame, out: Path) -> Path:
    """Horizontal bars: AUROC per signal, one bar per run, its bootstrap CI, n on each bar."""
    runs = list(dict.fromkeys(data["run"]))
    labels = [s.label for s in SIGNALS]
    fig = Figure(figsize=(7.5, 1.2 + 0.45 * len(labels) * max(1, len(runs)) ** 0.5))
    ax = fig.add_subplot()
    height = 0.8 / len(runs)
    for i, run in enumerate(runs):
        g = data[data["run"] == run].set_index("signal").reindex(labels)
        ys = np.arange(len(labels)) + (i - (len(runs) - 1) / 2) * height
        value = g["auroc"].to_numpy(float)
        err = np.vstack([value - g["ci_low"].to_numpy(float), g["ci_high"].to_numpy(float) - value])
        ax.barh(ys, np.nan_to_num(value - 0.5), height, left=0.5, label=run,
                xerr=np.where(np.isfinite(err), err, 0), error_kw={"elinewidth": 0.8, "capsize": 2})
        for y, v, n, c in zip(ys, value, g["n"], g["correct"]):
            n, c = (0, 0) if pd.isna(n) else (int(n), int(c))
            text = ("n=0: not recorded" if n == 0 else f"n={n}" + ("" if 0 < c < n else
                    f", {'all' if c else 'none'} correct: undefined") + (" tiny" if n < TINY else ""))
            ax.text(1.02, y, text, va="center", fontsize=6, transform=ax.get_yaxis_transform())
    ax.axvline(0.5, color="gray", lw=0.8, ls="--")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("AUROC, correct vs wrong initial responses\n(0.5 = chance; whiskers: 95% bootstrap CI over questions)",
                  fontsize=8)
    if data["auroc"].isna().all():
        say(ax, "No run has both correct and wrong responses with a signal:\nAUROC is undefined everywhere.")
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, out / "signals_auroc.png")


def calibration_figure(bins: pd.DataFrame, summary: pd.DataFrame, out: Path) -> Path:
    """Reliability diagrams: one panel per probability signal, a line per run, n per bin."""
    signals = list(dict.fromkeys(summary["signal"]))
    fig, axes = _panels(len(signals))
    for ax, signal in zip(axes, signals):
        ax.plot([0, 1], [0, 1], color="gray", lw=0.8, ls="--")
        notes = []
        for run, g in bins[bins["signal"] == signal].groupby("run", sort=False):
            line, = ax.plot(g["confidence"], g["accuracy"], marker="o", label=run)
            for x, y, n in zip(g["confidence"], g["accuracy"], g["n"]):
                ax.annotate(str(n), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points",
                            color=line.get_color())
        for r in summary[summary["signal"] == signal].itertuples():
            notes.append(f"{r.run}: n={r.n}, ECE " + ("-" if pd.isna(r.ece) else f"{r.ece:.3f}"))
        ax.set_title(f"{signal}\n" + "; ".join(notes), fontsize=7)
        n = int(summary.loc[summary["signal"] == signal, "n"].sum())
        if n == 0:
            say(ax, f"No response has a {signal}\n(n = 0): nothing to calibrate.")
        elif n < TINY:
            say(ax, f"Only n = {n} responses have a {signal}:\ntoo few to read a calibration from.")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("stated probability (bin mean)", fontsize=8)
        ax.set_ylabel("share correct", fontsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    return _save(fig, out / "signals_calibration.png")


def selective_figure(data: pd.DataFrame, out: Path) -> Path:
    """Filtered voting: accuracy against coverage (top k of N agents kept), a line per signal, a
    panel per run."""
    runs = list(dict.fromkeys(data["run"]))
    fig, axes = _panels(len(runs), 5.0, 4.0)
    for ax, run in zip(axes, runs):
        g = data[data["run"] == run]
        for i, (signal, s) in enumerate(g.groupby("signal", sort=False)):  # styles tell apart lines that coincide
            ax.plot(s["coverage"], s["accuracy"], marker=".", lw=1, ls=["-", "--", ":", "-."][i % 4], label=signal)
        n = int(g["questions"].max())
        ax.set_title(f"{run}: n = {n} questions" + (" (tiny)" if n < TINY else ""), fontsize=8)
        ax.set_xlabel("coverage: top k of N agents kept, then majority vote", fontsize=8)
        ax.set_ylabel("accuracy (%)", fontsize=8)
        ax.set_ylim(-5, 105)
        ax.legend(fontsize=5, ncols=2)
    return _save(fig, out / "signals_selective.png")


def correlation_figure(matrices: dict[str, tuple[pd.DataFrame, int]], out: Path) -> Path:
    """Spearman heatmaps of the oriented signals, a panel per run, the value in each cell."""
    fig, axes = _panels(len(matrices), 5.6, 5.2)
    for ax, (run, (m, n)) in zip(axes, matrices.items()):
        ax.imshow(m.to_numpy(float), vmin=-1, vmax=1, cmap="RdBu")
        ax.set_xticks(range(len(m)), m.columns, rotation=90, fontsize=6)
        ax.set_yticks(range(len(m)), m.index, fontsize=6)
        for i in range(len(m)):
            for j in range(len(m)):
                v = m.iat[i, j]
                ax.text(j, i, "-" if pd.isna(v) else f"{v:.1f}", ha="center", va="center", fontsize=5)
        ax.set_title(f"{run}: Spearman over n = {n} responses\n(higher = more likely correct for every signal; "
                     "- : constant or too few)", fontsize=7)
    return _save(fig, out / "signals_correlation.png")


def track_figure(logprob: np.ndarray, entropy: np.ndarray, title: str, out: Path) -> Path:
    """One response's token track: log-prob and entropy per token, its minimum marked."""
    fig = Figure(figsize=(7.0, 3.2))
    ax = fig.add_subplot()
    pos = np.arange(len(logprob))
    ax.plot(pos, logprob, lw=0.8, label="log-prob of the chosen token")
    ax.plot(pos, -entropy, lw=0.8, label="-entropy (nats)")
    if len(logprob):
        i = int(np.argmin(logprob))
        ax.scatter([i], [logprob[i]], color="red", zorder=3, label=f"min-LL {logprob[i]:.2f} at token {i}")
    else:
        say(ax, "This response has no tokens (n = 0).")
    ax.set_title(f"{title}: n = {len(logprob)} tokens", fontsize=8)
    ax.set_xlabel("token position in the response")
    ax.legend(fontsize=7)
    return _save(fig, out / "token_track.png")


def min_position_figure(positions: pd.DataFrame, out: Path, bins: int = 10) -> Path:
    """Where along a response its lowest log-prob falls (0 = first token, 1 = last), per run."""
    fig = Figure(figsize=(6.4, 3.4))
    ax = fig.add_subplot()
    notes = []
    for run, g in positions.groupby("run", sort=False):
        ax.hist(g["relative"], bins=bins, range=(0, 1), histtype="step", label=run)
        notes.append(f"{run}: n={len(g)}")
    if positions.empty:
        say(ax, "No token statistics saved (n = 0): run with --save-token-stats.")
    ax.set_title("; ".join(notes) or "n = 0", fontsize=8)
    ax.set_xlabel("relative position of the lowest log-prob token (0 = first, 1 = last)")
    ax.set_ylabel("responses")
    if notes:
        ax.legend(fontsize=7)
    return _save(fig, out / "signals_min_position.png")


