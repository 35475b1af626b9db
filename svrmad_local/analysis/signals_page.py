"""`svrmad signals RUN_DIR [RUN_DIR ...]`: the prior-signals study of run folders, no model.

A subcommand of its own rather than a section of `svrmad report`: the report describes one run,
while the study is read across runs (models, datasets, dtypes side by side), and it has knobs of
its own (bootstrap resamples, seed, bins). It writes PNG + CSV + one markdown page, signals.md, to
--out (default RUN_DIR/signals for one run). docs/signals.md says how each number is made.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd

from svrmad_local.analysis import signals_figures as draw
from svrmad_local.analysis import signals_study as study
from svrmad_local.analysis import token_files
from svrmad_local.analysis.folder import RunFolder, note
from svrmad_local.analysis.metrics import markdown
from svrmad_local.errors import UserError

# What the page writes into --out: the outputs of an earlier study there are replaced as a whole.
OUTPUTS = ("signals.md", "signals_*.csv", "signals_*.png", "token_track.png")


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
        cfg = RunFolder(d, create=False).read_meta().get("config") or {}
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


def parse_track(track: str) -> tuple[str, str]:
    """--track QID:RID as (question id, response id); response ids hold no colon, question ids may."""
    qid, colon, rid = track.rpartition(":")
    if not colon or not qid or not rid:
        raise UserError(f"--track {track!r}: expected QID:RID, a question id and one of its response ids (e.g. q1:0)")
    return qid, rid


def saved_stats(runs: dict[str, Path]) -> dict[str, dict[str, token_files.Saved]]:
    """Each run's token-stats files that belong to it; the files left out are named on stderr."""
    saved = {}
    for label, d in runs.items():
        saved[label], left = token_files.belonging(d)
        if left:
            more = f"; and {len(left) - 3} more" if len(left) > 3 else ""
            note(f"left out {len(left)} file(s) of {d / token_files.FOLDER} that are not its run's own: "
                 + "; ".join(left[:3]) + more)
    return saved


def pick_track(runs: dict[str, Path], saved: dict, track: str | None) -> tuple[str, tuple[str, str]] | None:
    """(run label, (question, response)) of the response whose track is drawn: --track's, in the
    first run that has it, else the first saved; None when no run saved any."""
    if track is None:
        return next(((label, (qid, f.rids[0])) for label, files in saved.items() for qid, f in files.items()
                     if f.rids), None)
    qid, rid = parse_track(track)
    found = next((label for label, files in saved.items() if qid in files and rid in files[qid].rids), None)
    if found is None:
        where = ", ".join(str(runs[label] / token_files.FOLDER) for label in saved)
        raise UserError(f"--track {track}: no response {rid!r} of question {qid!r} in {where}")
    return found, (qid, rid)


def _tokens_section(runs: dict[str, Path], saved: dict, chosen, out: Path) -> list[str]:
    """The token-level part: where the lowest log-prob falls, and one response's track."""
    positions = pd.DataFrame([{"run": label, "id": qid, "response": rid,
                               "relative": int(np.argmin(lp)) / max(len(lp) - 1, 1), "tokens": len(lp)}
                              for label, files in saved.items() for qid, f in files.items()
                              for rid, (lp, _) in f.tracks().items() if len(lp)],
                             columns=["run", "id", "response", "relative", "tokens"])
    positions.to_csv(out / "signals_min_position.csv", index=False)
    draw.min_position_figure(positions, out)
    parts = ["\n## Token level: where the lowest log-prob falls\n", "![min position](signals_min_position.png)\n"]
    if positions.empty:
        return parts + ["No run here saved its token statistics (`svrmad run --save-token-stats`), so this "
                        "figure is empty and there is no token track.\n"]
    rows = []
    for label in runs:
        size, tokens = token_files.footprint(saved[label].values())
        g = positions[positions["run"] == label]
        if tokens:
            rows.append([label, len(g), tokens, f"{size / tokens:.2f}", _f(g["relative"].median(), "{:.2f}")])
    parts += [markdown(["run", "responses", "tokens", "bytes per token on disk", "median relative position"], rows),
              "\nOver every saved response (initial and debate) of the runs' committed questions: the position of "
              "its lowest-log-prob token divided by (tokens - 1); 0 is the first token, 1 the last.\n"]
    label, (qid, rid) = chosen
    lp, ent = saved[label][qid].tracks()[rid]
    draw.track_figure(np.asarray(lp), np.asarray(ent), f"{label}, question {qid}, response {rid}", out)
    return parts + [f"\n### One response's track ({label}, question `{qid}`, response `{rid}`)\n",
                    "![token track](token_track.png)\n"]


def _replace_outputs(staged: Path, out: Path) -> None:
    """Put a study written whole into `staged` in place of the one in `out`: an earlier study's
    files the new one does not write (a token track) go, so the folder never mixes two studies."""
    out.mkdir(parents=True, exist_ok=True)
    new = {p.name for p in staged.iterdir()}
    for pattern in OUTPUTS:
        for old in out.glob(pattern):
            if old.name not in new:
                old.unlink()
    for name in sorted(new, key=lambda n: n == "signals.md"):  # the page last: it names the others
        os.replace(staged / name, out / name)


def write_study(run_dirs: list[Path], out: Path, n_boot: int = 1000, seed: int = 0, n_bins: int = 10,
                track: str | None = None) -> Path:
    """Read and check the runs, then write every CSV, PNG and `out/signals.md`; returns the page's
    path. Every refusal comes before the first write, and the files are written aside and moved in
    together, so `out` holds one whole study: the new one, or the one it had."""
    runs = labels_for([Path(d) for d in run_dirs])
    frames = {label: study.responses(d, label) for label, d in runs.items()}
    empty = [str(runs[label]) for label, f in frames.items() if f.empty]
    if empty:
        raise UserError(f"no debated question in {', '.join(empty)}: nothing to study yet"
                        + (" (leave it out to study the others)" if len(empty) < len(runs) else ""))
    df = pd.concat(frames.values(), ignore_index=True)
    saved = saved_stats(runs)
    chosen = pick_track(runs, saved, track)
    staged = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    try:
        _write(runs, df, saved, chosen, staged, n_boot, seed, n_bins)
        _replace_outputs(staged, out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out / "signals.md"


def _write(runs: dict[str, Path], df: pd.DataFrame, saved: dict, chosen, out: Path, n_boot: int, seed: int,
           n_bins: int) -> None:
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
    parts += _tokens_section(runs, saved, chosen, out)
    (out / "signals.md").write_text("\n".join(parts))


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
    if args.seed < 0:
        raise UserError(f"--seed must be >= 0 (numpy's generators take no negative seed), got {args.seed}")
    if args.track is not None:
        parse_track(args.track)
    path = write_study(args.run_dirs, args.out or args.run_dirs[0] / "signals", args.bootstrap, args.seed,
                       args.bins, args.track)
    print(f"signals study written to {path}")
    return 0
