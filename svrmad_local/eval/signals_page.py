"""`svrmad signals RUN_DIR [RUN_DIR ...]`: the prior-signals study of run folders, no model.

A subcommand of its own rather than a section of `svrmad report`: the report describes one run,
while the study is read across runs (models, datasets, dtypes side by side), and it has knobs of
its own (bootstrap resamples, seed, bins). It writes PNG + CSV + one markdown page, signals.md, to
--out (default RUN_DIR/signals for one run). docs/signals.md says how each number is made.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from svrmad_local.errors import UserError
from svrmad_local.eval import signals_figures as draw
from svrmad_local.eval import signals_study as study
from svrmad_local.eval import token_stats
from svrmad_local.eval.metrics import markdown


def _f(v, fmt: str = "{:.1f}") -> str:
    return "-" if pd.isna(v) else fmt.format(v)


def labels_for(run_dirs: list[Path]) -> dict[str, Path]:
    """A short unique label per run: its folder name, or parent/name when names repeat."""
    names = [d.resolve().name for d in run_dirs]
    labels = [n if names.count(n) == 1 else f"{d.resolve().parent.name}/{n}" for n, d in zip(names, run_dirs)]
    if len(set(labels)) < len(labels):
        raise UserError("the same run folder is given twice: " + ", ".join(map(str, run_dirs)))
    return dict(zip(labels, run_dirs))


def _run_table(runs: dict[str, Path], df: pd.DataFrame) -> str:
    rows = []
    for label, d in runs.items():
        cfg = {}
        if (d / "run.json").is_file():
            cfg = json.loads((d / "run.json").read_text(encoding="utf-8")).get("config", {})
        g = df[df["run"] == label]
        rows.append([label, f"`{d}`", cfg.get("dataset", "?"), cfg.get("model") or "embedded default",
                     cfg.get("dtype") or "default", g["id"].nunique(), len(g), int(g["correct"].sum())])
    return markdown(["run", "folder", "dataset", "model", "dtype", "debated questions", "initial responses",
                     "correct"], rows)


def _auroc_table(data: pd.DataFrame) -> str:
    runs = list(dict.fromkeys(data["run"]))
    rows = []
    for s in study.SIGNALS:
        cells = [s.label]
        for run in runs:
            r = data[(data["run"] == run) & (data["signal"] == s.label)].iloc[0]
            cells.append(f"{_f(r.auroc, '{:.3f}')} [{_f(r.ci_low, '{:.2f}')}, {_f(r.ci_high, '{:.2f}')}] "
                         f"(n={r.n}, {r.correct} correct)")
        rows.append(cells)
    return markdown(["signal"] + [f"AUROC [95% CI] {run}" for run in runs], rows)


def _selective_table(data: pd.DataFrame, run: str) -> str:
    g = data[data["run"] == run]
    ks = sorted(g["k"].unique())
    rows = [[signal] + [_f(x) for x in s.sort_values("k")["accuracy"]] for signal, s in g.groupby("signal", sort=False)]
    n_agents = max(ks)
    return markdown(["signal"] + [f"top {k}/{n_agents}" for k in ks], rows)


def _tokens_section(runs: dict[str, Path], out: Path, track: str | None) -> list[str]:
    """The token-level part: where the lowest log-prob falls, and one response's track."""
    saved = {label: token_stats.read(d) for label, d in runs.items()}
    positions = pd.DataFrame([{"run": label, "id": qid, "response": rid,
                               "relative": int(np.argmin(lp)) / max(len(lp) - 1, 1), "tokens": len(lp)}
                              for label, tracks in saved.items() for (qid, rid), (lp, _) in tracks.items() if len(lp)],
                             columns=["run", "id", "response", "relative", "tokens"])
    positions.to_csv(out / "signals_min_position.csv", index=False)
    draw.min_position_figure(positions, out)
    parts = ["\n## Token level: where the lowest log-prob falls\n", "![min position](signals_min_position.png)\n"]
    if positions.empty:
        return parts + ["No run here saved its token statistics (`svrmad run --save-token-stats`), so this "
                        "figure is empty and there is no token track.\n"]
    rows = []
    for label, d in runs.items():
        size, tokens = token_stats.bytes_per_token(d)
        g = positions[positions["run"] == label]
        if tokens:
            rows.append([label, len(g), tokens, f"{size / tokens:.2f}", _f(g["relative"].median(), "{:.2f}")])
    parts += [markdown(["run", "responses", "tokens", "bytes per token on disk", "median relative position"], rows),
              "\nOver every saved response (initial and debate): the position of its lowest-log-prob token "
              "divided by (tokens - 1); 0 is the first token, 1 the last.\n"]
    label = next(label for label in saved if saved[label])
    key = tuple(track.split(":", 1)) if track else next(iter(saved[label]))
    if key not in saved[label]:
        raise UserError(f"--track {track}: no response {key[1]!r} of question {key[0]!r} in {runs[label]}/token_stats")
    lp, ent = saved[label][key]
    draw.track_figure(np.asarray(lp), np.asarray(ent), f"{label}, question {key[0]}, response {key[1]}", out)
    return parts + [f"\n### One response's track ({label}, question `{key[0]}`, response `{key[1]}`)\n",
                    "![token track](token_track.png)\n"]


def write_study(run_dirs: list[Path], out: Path, n_boot: int = 1000, seed: int = 0, n_bins: int = 10,
                track: str | None = None) -> Path:
    """Read the runs, write every CSV, PNG and `out/signals.md`; returns the page's path."""
    runs = labels_for([Path(d) for d in run_dirs])
    df = pd.concat([study.responses(d, label) for label, d in runs.items()], ignore_index=True)
    if df.empty:
        raise UserError(f"no debated question in {', '.join(map(str, runs.values()))}: nothing to study yet")
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "signals_responses.csv", index=False)
    auroc = study.auroc(df, n_boot, seed)
    auroc.to_csv(out / "signals_auroc.csv", index=False)
    bins, ece = study.calibration(df, n_bins)
    bins.to_csv(out / "signals_calibration.csv", index=False)
    ece.to_csv(out / "signals_ece.csv", index=False)
    selective = study.selective_accuracy(df)
    selective.to_csv(out / "signals_selective.csv", index=False)
    corr = study.correlations(df)
    pd.concat([m.assign(run=run, n=n) for run, (m, n) in corr.items()]).to_csv(out / "signals_correlation.csv")
    reorder = study.reordering(df)
    reorder.to_csv(out / "signals_reordering.csv", index=False)
    accepted = study.acceptance(runs)
    accepted.to_csv(out / "signals_acceptance.csv", index=False)
    draw.auroc_figure(auroc, out)
    draw.calibration_figure(bins, ece, out)
    draw.selective_figure(selective, out)
    draw.correlation_figure(corr, out)

    parts = [
        "# Prior signals: what each says about correctness\n",
        f"Rebuilt by `svrmad signals` from the saved files of {len(runs)} run(s); no model was loaded. The unit is "
        "an initial response of a debated question (unanimous questions are not in the trace). "
        "docs/signals.md says how each number is made. Every table is also a CSV here.\n",
        _run_table(runs, df),
        "\n## Separation: AUROC of each signal, correct vs wrong\n",
        "![AUROC](signals_auroc.png)\n",
        "The signal oriented so that higher means more likely correct (PPL and mean entropy negated); "
        f"scikit-learn's roc_auc_score, ties counted half; 95% CI: {n_boot} bootstrap resamples of whole "
        f"questions (seed {seed}), percentile. n = responses that have the signal.\n",
        _auroc_table(auroc),
        "\n## Calibration of the signals that claim to be probabilities\n",
        "![calibration](signals_calibration.png)\n",
        f"Self-reported confidence as stated; the SVR posterior as (SVR + 1) / 2 (the share of its debates in "
        f"which the receiver kept its answer; the prior's scale for an agent never debated). {n_bins} equal bins "
        "(scikit-learn's calibration_curve); ECE = sum over bins of (n_bin / n) x |share correct - mean stated|.\n",
        markdown(["run", "signal", "n", "ECE"], [[r.run, r.signal, r.n, _f(r.ece, "{:.3f}")] for r in ece.itertuples()]),
        "\n## Selective accuracy: keep the top k agents by a signal, then vote\n",
        "![selective](signals_selective.png)\n",
        "DeepConf's filtered voting: per question, the k agents ranked highest by the signal (missing values "
        "last, ties by agent index) vote; a tie goes to the answer of the better-ranked agent. Accuracy (%) over "
        "the run's debated questions; top N/N is the plain majority for every signal. Signals the run did not "
        "record are left out.\n",
    ]
    for run in runs:
        n = int(selective.loc[selective["run"] == run, "questions"].max())
        parts += [f"\n{run} (n = {n} questions):\n", _selective_table(selective, run)]
    parts += [
        "\n## How the signals correlate\n",
        "![correlation](signals_correlation.png)\n",
        "Spearman's rank correlation of the oriented signals over the run's initial responses (pairwise "
        "complete; `-` where a signal is constant or fewer than 3 responses have both), in "
        "[signals_correlation.csv](signals_correlation.csv).\n",
        "\n## How debates reorder the agents (SVR-MAD)\n",
        "Over questions with an SVR-MAD row: Kendall's tau between each question's prior and posterior "
        "(mean over questions where both vary), how often the top agent changed, and how often the top agent "
        "was correct under each.\n",
        markdown(["run", "questions", "tau over", "mean Kendall tau", "top changed (%)", "top correct: prior (%)",
                  "top correct: posterior (%)"],
                 [[r.run, r.questions, r.tau_questions, _f(r.kendall_tau, "{:.2f}"), _f(r.top_changed),
                   _f(r.top_correct_prior), _f(r.top_correct_posterior)] for r in reorder.itertuples()]),
        "\nSVR-MAD's answer when a receiver was accepted, against the fallback vote:\n",
        markdown(["run", "answer from", "questions", "correct", "Acc (%)"],
                 [[r.run, r.receiver, r.questions, r.correct, _f(r.accuracy)] for r in accepted.itertuples()]),
    ]
    parts += _tokens_section(runs, out, track)
    path = out / "signals.md"
    path.write_text("\n".join(parts))
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", type=Path, help="folders written by `svrmad run --out`")
    p.add_argument("--out", type=Path, help="where to write (default RUN_DIR/signals; required for several runs)")
    p.add_argument("--bootstrap", type=int, default=1000, help="resamples for the AUROC CIs (0: none; default 1000)")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0)")
    p.add_argument("--bins", type=int, default=10, help="calibration bins (default 10)")
    p.add_argument("--track", metavar="QID:RID", help="the response whose token track is drawn "
                                                      "(default: the first saved)")


def main(args) -> int:
    if args.out is None and len(args.run_dirs) > 1:
        raise UserError("several runs need --out (where the comparison goes)")
    if args.bins < 1 or args.bootstrap < 0:
        raise UserError(f"--bins must be >= 1 and --bootstrap >= 0, got {args.bins} and {args.bootstrap}")
    path = write_study(args.run_dirs, args.out or args.run_dirs[0] / "signals", args.bootstrap, args.seed,
                       args.bins, args.track)
    print(f"signals study written to {path}")
    return 0
