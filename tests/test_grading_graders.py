"""The grader choice (ours | math-verify | both): the API, `svrmad run/report --grader`, the report's
disagreements. Tests that need math-verify skip when it is not installed (CI does not install it)."""

import argparse
import json

import pytest

from svrmad_local import grading
from svrmad_local.debate.types import Question
from svrmad_local.analysis import report
from svrmad_local.job import run as run_mod
from svrmad_local.grading import mathverify
from svrmad_local.methods.base import finish
from tests.test_metrics import write_run

needs_math_verify = pytest.mark.skipif(not mathverify.available(), reason="math-verify not installed")


@pytest.fixture(autouse=True)
def ours_again():
    yield
    grading.set_grader("ours")


@pytest.fixture
def no_math_verify(monkeypatch):
    monkeypatch.setattr(mathverify, "available", lambda: False)


def test_unknown_grader_is_refused():
    with pytest.raises(ValueError, match="unknown grader 'sympy'"):
        grading.set_grader("sympy")


@pytest.mark.parametrize("name", ["math-verify", "both"])
def test_missing_math_verify_fails_in_one_line_naming_the_extra(no_math_verify, name):
    with pytest.raises(mathverify.GraderUnavailable, match=r'pip install -e "\.\[mathverify\]"'):
        grading.set_grader(name)
    assert grading.get_grader() == "ours"
    with pytest.raises(mathverify.GraderUnavailable):
        grading.grade("1/2", "0.5", "math", grader="math-verify")


def test_svrmad_run_with_missing_math_verify_exits_2_with_one_line(no_math_verify, tmp_path, capsys):
    from svrmad_local import cli

    assert cli.main(["run", "--dataset", "gsm8k", "--grader", "math-verify", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mathverify" in err[0] and err[0].startswith("svrmad run:")
    assert not (tmp_path / "r").exists()  # nothing started


def test_ours_records_no_grades_and_keeps_rows_as_they_were():
    q = Question(id="q", question="?", gold=r"\frac{1}{2}", answer_type="math")
    result = finish("x", q, [], [], "0.5", ncomm=0)
    assert result.correct is True and result.grades is None and "grades" not in result.to_row(q)


def _report_args(run_dir, *extra):
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    return parser.parse_args([str(run_dir), *extra])


def _with_grades(path):
    rows = [json.loads(line) for line in open(path / "results.jsonl")]
    for i, row in enumerate(rows):
        row["grades"] = {"ours": bool(row["correct"]), "math-verify": bool(row["correct"]) ^ (i >= len(rows) - 2)}
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_report_lists_where_the_graders_disagree(tmp_path):
    path = write_run(tmp_path / "run")
    rows = _with_grades(path)
    page = report.build_report(path).read_text()
    assert "## Graders: ours vs math-verify" in page
    out = (path / "report" / "disagreements.md").read_text()
    for i in (-1, -2):  # the last rows: never overridden by a resumed line
        assert f"| {rows[i]['id']} |" in out and f"`{rows[i]['answer']}`" in out
    assert len(out.strip().splitlines()) == 2 + 2  # header, rule, the two rows
    assert "disagreements.csv" in page


def test_report_regrades_a_saved_run(tmp_path, capsys):
    path = write_run(tmp_path / "run")
    rows = [json.loads(line) for line in open(path / "results.jsonl")]
    rows[0]["answer"], rows[0]["gold"], rows[0]["correct"] = "0.5", r"\frac{1}{2}", False  # saved wrongly
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.main(_report_args(path, "--grader", "ours")) == 0
    assert '"regraded_by": "ours"' in (path / "report" / "report.md").read_text()


def test_report_regrade_with_missing_math_verify_exits_2(no_math_verify, tmp_path, capsys):
    assert report.main(_report_args(write_run(tmp_path / "run"), "--grader", "both")) == 2
    assert "mathverify" in capsys.readouterr().err


@needs_math_verify
def test_math_verify_grades_in_the_worker():
    assert grading.grade(r"\frac{1}{2}", "0.5", "math", grader="math-verify")
    assert not grading.grade(r"\frac{1}{3}", "0.5", "math", grader="math-verify")
    assert grading.grade("B", "B", "mc", grader="math-verify")  # letters: ours decides


@needs_math_verify
def test_both_records_both_verdicts_on_result_rows():
    grading.set_grader("both")
    q = Question(id="q", question="?", gold=r"\frac{1}{2}", answer_type="math")
    row = finish("x", q, [], [], "0.5", ncomm=0).to_row(q)
    assert row["correct"] is True and row["grades"] == {"ours": True, "math-verify": True}
