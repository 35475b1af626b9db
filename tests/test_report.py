"""`svrmad report` on the synthetic run of tests/test_metrics.py: files, figure data, errors."""

import argparse

import pytest

from svrmad_local.analysis import figures, report
from svrmad_local.analysis.metrics import load_run
from tests.test_metrics import FIG1, write_run


def _args(run_dir):
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    return parser.parse_args([str(run_dir)])


def test_build_report_writes_every_file(tmp_path):
    path = report.build_report(write_run(tmp_path / "run"))
    out = tmp_path / "run" / "report"
    assert path == out / "report.md"
    for name in ["table1.md", "table1.csv", "dataset_size.md", "kv_cache.md", "kv_cache.csv",
                 "figure1_signals.png", "figure2_hard.png", "figure3_ablation.png", "kv_cache.png"]:
        assert (out / name).stat().st_size > 0, name
    assert (out / "figure1_signals.png").read_bytes()[:4] == b"\x89PNG"
    page = path.read_text()
    for link in ["(figure1_signals.png)", "(figure2_hard.png)", "(figure3_ablation.png)", "(kv_cache.png)",
                 "| SVR-MAD | **4.0** | **3.0** | **66.7** |", '"model": "tiny"']:
        assert link in page
    assert "| SVR-MAD | 2500 | 500 | 80.0 |" in (out / "kv_cache.md").read_text()
    assert "Graders" not in page and not (out / "disagreements.md").exists()  # no row graded by both


def test_dataset_size(tmp_path):
    run = load_run(write_run(tmp_path / "run"))
    assert report.dataset_size(run) == {"total": 7, "skipped": 1, "kept": 6}


def test_figure1_shares_per_signal_and_difficulty(tmp_path):
    run = load_run(write_run(tmp_path / "run"))
    _, data = figures.figure1(run, tmp_path)
    got = {(r.difficulty, r.signal): r.share for r in data.itertuples()}
    assert got == pytest.approx(FIG1)
    questions = data.groupby("difficulty")["questions"].first().to_dict()
    assert questions == {"1": 2, "2": 1, "3": 1, "4+": 1}  # q5 (0 correct) is excluded


def test_figure2_hard_questions(tmp_path):
    run_dir = write_run(tmp_path / "run")
    with open(run_dir / "results.jsonl", "a") as f:  # an ablation: not a bar of Figure 2
        f.write('{"id": "q1", "method": "svr-mad:ppl", "correct": true, "n_correct_initial": 1}\n')
    run = load_run(run_dir)
    _, data = figures.figure2(run, tmp_path)
    # hard = q1, q2, q3, q6; self-consistency rows lack n_correct_initial and use the trace
    assert data.set_index("method")[["questions", "correct"]].to_dict("index") == {
        "self-consistency": {"questions": 4, "correct": 1},
        "s2-mad": {"questions": 4, "correct": 3},
        "svr-mad": {"questions": 4, "correct": 3}}
    assert list(data["accuracy"]) == pytest.approx([25.0, 75.0, 75.0])


def test_figure3_reads_ablations_and_notes_their_absence(tmp_path):
    run = load_run(write_run(tmp_path / "run"))
    path, data = figures.figure3(run, tmp_path)
    assert path.exists()
    assert list(zip(data["posterior"], data["tokens_k"])) == [("svr", 2.0), ("svr", 3.5),
                                                              ("min_ll", 2.5), ("min_ll", 4.0)]
    assert list(data["accuracy"]) == pytest.approx([55, 60, 40, 45])  # fractions read as %

    page = report.build_report(write_run(tmp_path / "bare", ablations=False)).read_text()
    assert not (tmp_path / "bare" / "report" / "figure3_ablation.png").exists()
    assert "No `ablations.jsonl`" in page


def test_main_prints_table_and_errors_on_missing_run(tmp_path, capsys):
    assert report.main(_args(write_run(tmp_path / "run"))) == 0
    printed = capsys.readouterr().out
    assert "SVR-MAD" in printed and "report.md" in printed

    assert report.main(_args(tmp_path / "nowhere")) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert report.main(_args(tmp_path / "empty")) == 2
    assert "no results.jsonl" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        report.build_report(tmp_path / "empty")
