"""Dataset loaders: fixtures (incl. malformed rows), bundled samples, and the shared data if present."""

import collections
import json
import shutil
from pathlib import Path

import pytest

from svrmad_local.job import datasets
from svrmad_local.job.datasets import DatasetError, DatasetWarning, load_dataset

FIXTURES = Path(__file__).parent / "fixtures"
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="shared data not present")


def _load_quiet(path, **kw):
    with pytest.warns(DatasetWarning) as caught:
        questions = load_dataset(path, **kw)
    return questions, [str(w.message) for w in caught]


def test_gsm8k_fixture_skips_and_reports_malformed_rows():
    path = FIXTURES / "gsm8k_small.jsonl"
    questions, messages = _load_quiet(path)
    assert [q.id for q in questions] == ["gsm8k-0000", "gsm8k-0001", "gsm8k-0006"]
    assert [q.gold for q in questions] == ["7", "1234", "-2"]  # thousands comma removed
    assert all(q.answer_type == "math" and q.choices is None for q in questions)
    assert len(messages) == 3
    assert f"{path}:3: bad JSON" in messages[0]
    assert f"{path}:4:" in messages[1] and "####" in messages[1]
    assert f"{path}:6:" in messages[2] and "empty 'question'" in messages[2]


def test_on_error_fail_names_file_and_line():
    path = FIXTURES / "gsm8k_small.jsonl"
    with pytest.raises(DatasetError, match=r"gsm8k_small\.jsonl:3: bad JSON"):
        load_dataset(path, on_error="fail")
    with pytest.raises(ValueError):
        load_dataset(path, on_error="ignore")


def test_csqa_fixture():
    path = FIXTURES / "csqa_small.jsonl"
    questions, messages = _load_quiet(path)
    assert [q.id for q in questions] == ["q1", "q2"]
    q = questions[1]
    assert q.answer_type == "mc" and q.gold == "B" and q.choices == ["dogs", "mice", "cars", "birds", "fish"]
    assert "(A) dogs" in q.question and "(E) fish" in q.question
    assert any(":3:" in m and "'F'" in m for m in messages)  # bad answer letter
    assert any(":4:" in m and "labels" in m for m in messages)
    assert any(":5:" in m and "duplicate id 'q1'" in m for m in messages)


def test_imo_fixture_category_and_missing_gold():
    path = FIXTURES / "imo_small.jsonl"
    questions, messages = _load_quiet(path)
    assert [q.id for q in questions] == ["imo-bench-algebra-001", "imo-bench-algebra-009", "imo-bench-number_theory-002"]
    assert questions[1].gold == r"$\frac{1}{2}$"
    assert questions[2].meta == {"dataset": "imo-answerbench", "category": "Number theory",
                                 "subcategory": "Primes", "source": "y"}
    assert "missing field 'Short Answer'" in messages[0] and ":4:" in messages[0]
    with pytest.warns(DatasetWarning):
        algebra = load_dataset(path, category="algebra")
    assert [q.id for q in algebra] == ["imo-bench-algebra-001", "imo-bench-algebra-009"]
    with pytest.warns(DatasetWarning), pytest.raises(DatasetError, match="Number theory"):
        load_dataset(path, category="Topology")


def test_mmlu_pro_fixture_stratified_and_deterministic():
    path = FIXTURES / "mmlu_pro_small.jsonl"
    questions, messages = _load_quiet(path)
    assert len(questions) == 20 and "'J'" in messages[0] and ":21:" in messages[0]
    assert all(q.id.startswith("mmlu-pro-") and q.answer_type == "mc" for q in questions)
    assert all(q.gold in "ABCDEFGHIJ"[: len(q.choices)] for q in questions)
    with pytest.warns(DatasetWarning):
        a = load_dataset(path, limit=10, seed=3)
    with pytest.warns(DatasetWarning):
        b = load_dataset(path, limit=10, seed=3)
    with pytest.warns(DatasetWarning):
        c = load_dataset(path, limit=10, seed=4)
    assert [q.id for q in a] == [q.id for q in b] != [q.id for q in c]
    assert collections.Counter(q.meta["category"] for q in a) == {"math": 6, "law": 3, "history": 1}
    assert [q.id for q in a] == sorted((q.id for q in a), key=lambda i: int(i.rsplit("-", 1)[1]))  # file order


def test_math_csv_fixture_with_multiline_cell():
    path = FIXTURES / "math_small.csv"
    questions, messages = _load_quiet(path)
    assert [q.id for q in questions] == ["math-0000", "math-0001", "math-0003"]
    assert questions[1].gold == r"\frac{1}{2}" and "please." in questions[1].question
    assert ":5:" in messages[0]  # the row after the two-line cell


def _check_hle(questions):
    assert [q.id for q in questions] == ["hle-mc-1", "hle-mc-2", "hle-mc-3"]
    assert questions[0].choices == ["Oxygen", "Argon", "Hydrogen", "Chlorine"] and questions[0].gold == "B"
    assert questions[1].choices == ["Shark", "Trout", "Whale"] and questions[1].gold == "C"
    assert questions[2].choices is None and questions[2].gold == "E"  # options not parseable: any letter
    assert all(q.answer_type == "mc" and q.meta["category"] != "Math" for q in questions)


def test_hle_jsonl_paper_filter():
    path = FIXTURES / "hle_small.jsonl"
    questions, messages = _load_quiet(path)
    _check_hle(questions)
    assert len(messages) == 1 and ":6:" in messages[0] and "'AB'" in messages[0]
    with pytest.warns(DatasetWarning):
        physics = load_dataset(path, category="physics")
    assert [q.id for q in physics] == ["hle-mc-3"]


def test_hle_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    rows = [json.loads(line) for line in open(FIXTURES / "hle_small.jsonl")]
    path = tmp_path / "hle.parquet"
    pd.DataFrame(rows).to_parquet(path)
    with pytest.warns(DatasetWarning, match=r"hle\.parquet:row 6:"):
        questions = load_dataset(path)
    _check_hle(questions)
    with pytest.raises(DatasetError, match="row 6"):
        load_dataset(path, on_error="fail")
    # by name, from a data directory holding hle/
    (tmp_path / "hle").mkdir()
    shutil.copy(path, tmp_path / "hle" / "test.parquet")
    with pytest.warns(DatasetWarning):
        assert [q.id for q in load_dataset("hle", data_dir=tmp_path)] == [q.id for q in questions]


def test_question_shaped_jsonl():
    questions = load_dataset(FIXTURES / "questions_small.jsonl")
    assert [(q.id, q.gold, q.answer_type) for q in questions] == [("my-1", "2", "math"), ("my-2", "B", "mc")]
    assert questions[1].choices == ["yes", "no"] and questions[1].meta == {"category": "toy"}


def test_a_file_whose_every_row_fails_the_guessed_format_says_so(tmp_path):
    """{"question", "answer"} rows look like GSM8K; where none has its '#### N' line the file is more
    likely another format than all broken: one error naming the guess and the plain format, not a run
    with no questions after a warning per row."""
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n')
    with pytest.warns(DatasetWarning), pytest.raises(
            DatasetError, match=r"none of its 2 row\(s\) reads as gsm8k .* needs id, question, gold, answer_type"):
        load_dataset(mine)
    questions, _ = _load_quiet(FIXTURES / "gsm8k_small.jsonl")  # some rows good: the bad ones are skipped
    assert len(questions) == 3


def test_unknown_name_and_missing_files(tmp_path):
    with pytest.raises(DatasetError, match="known names: gsm8k, commonsenseqa"):
        load_dataset("squad")
    with pytest.raises(DatasetError, match="imo_answerbench"):
        load_dataset("imo", data_dir=tmp_path)
    with pytest.raises(DatasetError, match="HLE is gated"):
        load_dataset("hle", data_dir=tmp_path)
    with pytest.raises(DatasetError, match="no categories"):
        load_dataset("gsm8k", category="algebra")
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"foo": 1}\n')
    with pytest.raises(DatasetError, match="cannot tell the dataset format"):
        load_dataset(odd)


def test_data_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("SVRMAD_DATA_DIR", raising=False)
    assert datasets.data_dirs()[0] == datasets.BUNDLED_DIR
    monkeypatch.setenv("SVRMAD_DATA_DIR", str(tmp_path))
    assert datasets.data_dirs() == [tmp_path]
    (tmp_path / "gsm8k").mkdir()
    shutil.copy(FIXTURES / "gsm8k_small.jsonl", tmp_path / "gsm8k" / "test.jsonl")
    with pytest.warns(DatasetWarning):
        assert len(load_dataset("gsm8k")) == 3
    assert datasets.data_dirs(tmp_path / "x") == [tmp_path / "x"]  # the argument beats the env


def test_bundled_samples(monkeypatch):
    monkeypatch.delenv("SVRMAD_DATA_DIR", raising=False)
    gsm = load_dataset("gsm8k", data_dir=datasets.BUNDLED_DIR)
    assert len(gsm) == 200 and gsm[0].id == "gsm8k-0000" and gsm[0].gold == "18" and gsm[-1].id == "gsm8k-0199"
    csqa = load_dataset("csqa", data_dir=datasets.BUNDLED_DIR, limit=5)
    assert len(csqa) == 5 and all(len(q.choices) == 5 and q.gold in "ABCDE" for q in csqa)
    assert (datasets.BUNDLED_DIR / "ATTRIBUTION.md").is_file() and (datasets.BUNDLED_DIR / "LICENSE.gsm8k").is_file()


@needs_shared
@pytest.mark.parametrize(
    "name,count,first_id",
    [
        ("gsm8k", 1319, "gsm8k-0000"),
        ("csqa", 1221, "1afa02df02c908a558b4036e80242fac"),
        ("imo", 400, "imo-bench-algebra-001"),
        ("mmlu-pro", 12030, "mmlu-pro-70"),
        ("math", 5000, "math-0000"),
    ],
)
def test_shared_data_loads_cleanly(name, count, first_id, recwarn):
    questions = load_dataset(name, data_dir=SHARED, on_error="fail")
    assert len(questions) == count and questions[0].id == first_id
    assert len({q.id for q in questions}) == count
    assert all(q.question and q.gold for q in questions)


@needs_shared
def test_shared_bundled_samples_match_the_full_files():
    full = load_dataset("gsm8k", data_dir=SHARED)[:200]
    sample = load_dataset("gsm8k", data_dir=datasets.BUNDLED_DIR)
    assert [(q.id, q.question, q.gold) for q in full] == [(q.id, q.question, q.gold) for q in sample]
    assert load_dataset("csqa", data_dir=SHARED)[:200] == load_dataset("csqa", data_dir=datasets.BUNDLED_DIR)


@needs_shared
def test_shared_gsm8k_comma_golds_and_imo_categories():
    gsm = load_dataset("gsm8k", data_dir=SHARED)
    assert all("," not in q.gold for q in gsm)
    imo = load_dataset("imo", data_dir=SHARED, category="Number theory")
    assert len(imo) == 100 and all(q.meta["category"] == "Number theory" for q in imo)


@needs_shared
def test_shared_mmlu_pro_stratified_sample():
    a = load_dataset("mmlu-pro", data_dir=SHARED, limit=140, seed=0)
    b = load_dataset("mmlu-pro", data_dir=SHARED, limit=140, seed=0)
    assert [q.id for q in a] == [q.id for q in b] and len(a) == 140
    counts = collections.Counter(q.meta["category"] for q in a)
    assert len(counts) == 14 and counts["math"] == 16 and counts["history"] == 4
    assert all(q.gold in "ABCDEFGHIJ"[: len(q.choices)] for q in a)


# ---------------------------------------------------------------- files as other tools write them

def test_a_byte_order_mark_does_not_cost_the_first_question(tmp_path):
    """Windows tools write UTF-8 with a BOM; JSON refuses it, so the first row was lost to a warning."""
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + (FIXTURES / "questions_small.jsonl").read_bytes())
    assert [q.id for q in load_dataset(jsonl, on_error="fail")] == ["my-1", "my-2"]
    csv = tmp_path / "bom.csv"
    csv.write_bytes(b"\xef\xbb\xbfidx,Question,Answer\n7,What is 1 + 1?,2\n")
    assert [(q.id, q.gold) for q in load_dataset(csv, on_error="fail")] == [("math-0007", "2")]


def test_csqa_parquet_as_the_hub_publishes_it(tmp_path):
    """CommonsenseQA's Parquet holds `choices` as a struct of two string lists (pandas reads numpy
    arrays there); a question-shaped Parquet holds `choices` as a list column."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in open(datasets.BUNDLED_DIR / "csqa_sample.jsonl")][:3]
    path = tmp_path / "validation-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    got = load_dataset(path, on_error="fail")
    want = load_dataset(datasets.BUNDLED_DIR / "csqa_sample.jsonl", limit=3)
    assert [(q.id, q.question, q.gold, q.choices) for q in got] == [(q.id, q.question, q.gold, q.choices) for q in want]
    shaped = tmp_path / "mine.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "m1", "question": "Yes?", "gold": "A", "answer_type": "mc",
                                          "choices": ["yes", "no"]}]), shaped)
    assert load_dataset(shaped, on_error="fail")[0].choices == ["yes", "no"]


@pytest.mark.parametrize("gold", ["NaN", "Infinity", "-Infinity"])
def test_a_gold_that_is_not_a_value_is_a_bad_row(tmp_path, gold):
    """Python's json reads NaN and Infinity; a gold of NaN was taken as the answer "nan"."""
    path = tmp_path / "qs.jsonl"
    path.write_text('{"id": "a", "question": "1 + 1?", "gold": 2, "answer_type": "math"}\n'
                    f'{{"id": "b", "question": "0 / 0?", "gold": {gold}, "answer_type": "math"}}\n')
    with pytest.warns(DatasetWarning, match=r"qs\.jsonl:2: field 'gold' is .*inf|qs\.jsonl:2: field 'gold' is nan"):
        assert [q.id for q in load_dataset(path)] == ["a"]
    with pytest.raises(DatasetError, match=r"qs\.jsonl:2: field 'gold' is (nan|inf|-inf), not a value"):
        load_dataset(path, on_error="fail")
