"""`svrmad report RUN_DIR`: rebuild a run's tables and figures from its saved files, no model.

Writes RUN_DIR/report/: table1.md/.csv (the paper's Table 1 layout), dataset_size.md (Table 3),
kv_cache.md/.csv, the PNG figures and report.md, one page that shows them all with a sentence on
how each number is made (docs/report.md says the same at length). Because every number comes from
results.jsonl / trace.jsonl / skipped.jsonl / ablations.jsonl, a report can be rebuilt at any
time, also while a run is still going or after it was interrupted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from svrmad_local import grading
from svrmad_local.analysis import figures
from svrmad_local.analysis.metrics import (TABLE1_COLUMNS, Run, best_cells, format_table, grader_agreement,
                                           load_run, markdown, method_name, read_jsonl, summary, table1)


def _num(value, fmt: str = "{:.1f}") -> str:
    return "-" if pd.isna(value) else fmt.format(value)


def dataset_size(run: Run) -> dict[str, int]:
    """Questions seen so far: skipped as unanimous before debate, kept (debated and scored)."""
    kept = set(run.results["id"]) | set(run.agents["id"])
    skipped = set(run.skipped["id"]) if "id" in run.skipped else set()
    return {"total": len(kept | skipped), "skipped": len(skipped - kept), "kept": len(kept)}


def _dataset_md(size: dict[str, int]) -> str:
    return markdown(["", "questions"], [["total", size["total"]],
                                        ["skipped (unanimous before debate)", size["skipped"]],
                                        ["kept (debated, in Table 1)", size["kept"]]])


def _figure1_md(data: pd.DataFrame) -> str:
    """Difficulty rows (easiest first) x signal columns, each cell "share% (correct/questions)"."""
    signals = list(dict.fromkeys(data["signal"]))
    rows = []
    for group in reversed(figures.DIFFICULTY):
        g = data[data["difficulty"] == group].set_index("signal")
        rows.append([group] + [f"{_num(g.at[s, 'share'])} ({g.at[s, 'top_correct']}/{g.at[s, 'questions']})"
                               for s in signals])
    return markdown(["agents correct before debate"] + signals, rows)


def _figure2_md(data: pd.DataFrame) -> str:
    return markdown(["Method", "hard questions", "correct", "Acc (%)"],
                    [[method_name(r.method), r.questions, r.correct, _num(r.accuracy)] for r in data.itertuples()])


def _figure3_md(data: pd.DataFrame) -> str:
    return markdown(["posterior", "tau", "accepted (%)", "Tok (x10^3)", "Acc (%)"],
                    [[r.posterior, r.tau, _num(r.acceptance_rate), _num(r.tokens_k), _num(r.accuracy)]
                     for r in data.itertuples()])


def regrade(run: Run, grader: str) -> None:
    """Grade every result row again under `grader` (its answer against its gold; the answer type
    from the run's trace, "math" when absent); with "both", record both verdicts in `grades`."""
    grading.set_grader(grader)
    types = {str(r["id"]): r.get("answer_type", "math") for r in read_jsonl(run.run_dir / "trace.jsonl")}
    rows = run.results
    at = [types.get(i, "math") for i in rows["id"]]
    rows["correct"] = [grading.is_correct(a, g, t) for a, g, t in zip(rows["answer"], rows["gold"], at)]
    if grader == "both":
        rows["grades"] = [grading.grades(a, g, t) for a, g, t in zip(rows["answer"], rows["gold"], at)]
    run.config = {**run.config, "regraded_by": grader}


def _graders_md(out: Path, run: Run) -> list[str]:
    """The graders section, and disagreements.md/.csv, when rows carry both graders' verdicts."""
    agreement = grader_agreement(run.results)
    if agreement is None:
        return []
    counts, differ = agreement
    table = markdown(["id", "method", "answer", "gold", "ours", "math-verify"],
                     [[r.id, method_name(r.method), f"`{r.answer}`", f"`{r.gold}`", r.ours, r.math_verify]
                      for r in differ.itertuples()])
    (out / "disagreements.md").write_text(table)
    (out / "disagreements.csv").write_text(differ.to_csv(index=False))
    return ["\n## Graders: ours vs math-verify\n",
            f"{counts['rows']} result rows graded by both: {counts['agree']} agree; {counts['ours_only']} "
            f"correct by ours only, {counts['math_verify_only']} by math-verify only. `correct` (and so every "
            "table above) is ours. Rows where they disagree, also in [disagreements.csv](disagreements.csv):\n",
            table if len(differ) else "(none)\n"]


def write_report(run: Run) -> Path:
    """Write run.run_dir/report/ and return the path of its report.md."""
    out = run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    table = summary(run.results)
    t1 = table1(table)
    t1_md = format_table(t1, "markdown", TABLE1_COLUMNS, bold=best_cells(t1))
    (out / "table1.md").write_text(t1_md)
    (out / "table1.csv").write_text(format_table(t1, "csv", TABLE1_COLUMNS))
    size = dataset_size(run)
    (out / "dataset_size.md").write_text(_dataset_md(size))
    kv_md = format_table(table, "markdown", figures.KV_COLUMNS)
    (out / "kv_cache.md").write_text(kv_md)
    (out / "kv_cache.csv").write_text(format_table(table, "csv", figures.KV_COLUMNS))
    fig1, data1 = figures.figure1(run, out)
    fig2, data2 = figures.figure2(run, out)
    fig3, data3 = figures.figure3(run, out)
    kv_png, _ = figures.figure_kv_cache(run, out)

    lo, hi = figures.HARD
    parts = [
        f"# Run report: {run.run_dir.name}\n",
        f"Rebuilt by `svrmad report` from the saved files of `{run.run_dir}`; no model was loaded.\n",
        "## Table 1: communication, tokens and accuracy\n",
        t1_md,
        "\nPer method, means over its questions: NComm = pairwise context transfers, Tok = prompt + "
        "completion tokens of every call (initial responses included), Acc = % answered correctly. "
        "Bold marks the best value: lowest NComm/Tok among the debate methods (Self Consistency is a "
        "no-debate reference) and highest Acc. Also as [table1.csv](table1.csv).\n",
        "All per-method numbers (billed vs computed prompt tokens, SVR-MAD acceptance rate; "
        "SVR-MAD ablations, if run, appear here only):\n",
        format_table(table, "markdown"),
        "\n## Dataset size\n",
        _dataset_md(size),
        "\nQuestions whose initial answers were unanimous are skipped, not debated, as in the paper "
        "(Appendix A); Table 1 covers the kept ones.\n",
        "## Figure 1: which signal finds a correct agent\n",
        f"![Figure 1]({fig1.name})\n",
        "Share of questions (%) whose top-ranked agent is correct, under three prior signals of the "
        "initial responses (higher min-LL, lower PPL, higher self-reported confidence) and under the "
        "final SVR scores of SVR-MAD, grouped by how many agents were correct before debate "
        "(0 excluded: no agent can be right there). Each bar is labelled correct/questions (\"n=0\": an empty "
        "group; \"tiny\": fewer than 5). How well every signal of the trace separates correct from wrong "
        "responses (AUROC, calibration, filtered voting): `svrmad signals`, docs/signals.md.\n",
        _figure1_md(data1),
        "\n## Figure 2: accuracy on hard questions\n",
        f"![Figure 2]({fig2.name})\n",
        f"Accuracy of each method on the questions where {lo}-{hi} agents were correct before debate.\n",
        _figure2_md(data2),
        "\n## Figure 3: posterior-signal ablation\n",
    ]
    if fig3 is None:
        parts.append("No `ablations.jsonl` in this run folder, so there is no ablation figure.\n")
    else:
        parts += [f"![Figure 3]({fig3.name})\n",
                  "Token-accuracy trade-off of SVR-MAD when SVR is replaced by another posterior signal, "
                  "one line per signal, one point per acceptance threshold tau.\n",
                  _figure3_md(data3)]
    parts += [
        "\n## KV-cache: prompt tokens billed vs computed\n",
        f"![KV cache]({kv_png.name})\n",
        "Mean prompt tokens per question an API would bill (the whole prompt on every call) against "
        "those the engine computed after reusing cached prefixes; KV saved = 1 - computed/billed.\n",
        kv_md,
    ]
    parts += _graders_md(out, run)
    if run.config:
        parts += ["\n## Run configuration (run.json)\n", "```json", json.dumps(run.config, indent=2), "```\n"]
    path = out / "report.md"
    path.write_text("\n".join(parts))
    return path


def build_report(run_dir) -> Path:
    """Read RUN_DIR's saved files and write RUN_DIR/report/; returns the path of report.md.
    Raises FileNotFoundError when RUN_DIR has no results.jsonl."""
    return write_report(load_run(run_dir))


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a folder written by `svrmad run --out`")
    parser.add_argument("--grader", choices=grading.GRADERS,
                        help="grade the answers again with this grader (default: the verdicts saved by the run)")


def main(args) -> int:
    from svrmad_local.analysis.posthoc import refresh

    try:
        if (args.run_dir / "run.json").is_file():
            refresh(args.run_dir)
        run = load_run(args.run_dir)
        if args.grader:
            regrade(run, args.grader)
    except (FileNotFoundError, ValueError) as exc:
        print(f"svrmad report: {exc}", file=sys.stderr)
        return 2
    path = write_report(run)
    print(format_table(summary(run.results), "text"))
    print(f"report written to {path}")
    return 0
