"""Evaluation sets as `Question`s.

Ids are stable across runs and subsets (a rerun skips ids already in a trace), so they come from
the source: the row's own id where it has one, else its position in the full upstream file
(the bundled GSM8K sample keeps the full file's ids). A malformed row is reported with file and
line and then skipped or fatal (`on_error`); a row is never repaired silently.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import random
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

from svrmad_local.debate.types import Question

log = logging.getLogger(__name__)

__all__ = [
    "DatasetError", "DatasetWarning", "KNOWN_DATASETS", "load_dataset", "data_dirs",
    "load_gsm8k", "load_commonsenseqa", "load_imo_answerbench", "load_mmlu_pro", "load_math",
    "load_hle", "load_questions", "stratified_sample",
]

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
BUNDLED_DIR = Path(__file__).resolve().parent.parent / "data"
SHARED_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"


class DatasetError(ValueError):
    """A dataset that cannot be loaded as asked (unknown name, missing file, malformed row)."""


class DatasetWarning(UserWarning):
    """A malformed row that was skipped (on_error="skip")."""


class _BadRow(Exception):
    pass


_NOT_UTF8 = re.compile("[\udc80-\udcff]")


# ----------------------------------------------------------------------------- reading rows


class _Reporter:
    def __init__(self, path: Path, on_error: str):
        if on_error not in ("skip", "fail"):
            raise ValueError(f"on_error must be 'skip' or 'fail', not {on_error!r}")
        self.path, self.on_error, self.skipped = path, on_error, 0

    def bad(self, where: str, reason: str) -> None:
        message = f"{self.path}:{where}: {reason}"
        if self.on_error == "fail":
            raise DatasetError(message)
        self.skipped += 1
        warnings.warn(message + " (row skipped)", DatasetWarning, stacklevel=3)


def _read_rows(path: Path, report: _Reporter) -> Iterator[tuple[str, int, dict]]:
    """(where, index, row): `where` names the line for messages ("17" or "row 3"), `index` is
    the 0-based position in the file (used for ids of sources without their own)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow's ArrowInvalid and kin: not a Parquet file, or a damaged one
            raise DatasetError(f"{path}: cannot be read as Parquet ({' '.join(str(exc).split())[:200]})") from None
        # plain Python values: list columns as lists, structs (CommonsenseQA's choices) as dicts, nulls as None
        for i, row in enumerate(table.to_pylist()):
            yield f"row {i + 1}", i, row
    elif suffix == ".csv":
        # bytes that are not UTF-8 become lone surrogates here, so the row that holds them is named;
        # utf-8-sig drops a byte-order mark, which would otherwise become part of the first column's name
        with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as f:
            reader = csv.DictReader(f)
            start = 2
            for i, row in enumerate(reader):
                if None in row or any(v is None for v in row.values()):
                    report.bad(str(start), f"expected {len(reader.fieldnames or [])} columns")
                elif any(_NOT_UTF8.search(v) for v in row.values()):
                    report.bad(str(start), "not UTF-8")
                else:
                    yield str(start), i, row
                start = reader.line_num + 1
    else:
        with open(path, "rb") as f:
            for i, raw in enumerate(f):
                try:
                    line = raw.decode("utf-8-sig" if i == 0 else "utf-8")  # a byte-order mark is not the row's
                except UnicodeDecodeError as exc:
                    report.bad(str(i + 1), f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})")
                    continue
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    report.bad(str(i + 1), f"bad JSON ({exc.msg})")
                    continue
                if not isinstance(row, dict):
                    report.bad(str(i + 1), "not a JSON object")
                    continue
                yield str(i + 1), i, row


def _field(row: dict, name: str, kind: type = str) -> Any:
    if name not in row or row[name] is None:
        raise _BadRow(f"missing field {name!r}")
    value = row[name]
    if kind is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise _BadRow(f"field {name!r} is not text")
        if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN/Infinity (Python reads them)
            raise _BadRow(f"field {name!r} is {value}, not a value (a gold of NaN would be graded as the text 'nan')")
        value = str(value).strip()
        if not value:
            raise _BadRow(f"empty {name!r}")
    elif not isinstance(value, kind):
        raise _BadRow(f"field {name!r} is not a {kind.__name__}")
    return value


def _with_options(question: str, options: list[str]) -> str:
    lines = [f"({LETTERS[i]}) {opt}" for i, opt in enumerate(options)]
    return question.rstrip() + "\n\nAnswer choices:\n" + "\n".join(lines)


def _letter(value: str, n_options: int | None) -> str:
    letter = value.strip().upper()
    valid = LETTERS[:n_options] if n_options else LETTERS
    if len(letter) != 1 or letter not in valid:
        raise _BadRow(f"answer {value!r} is not one of the letters {valid[0]}-{valid[-1]}")
    return letter


# ----------------------------------------------------------------------------- row converters
# Each takes (row, index) and returns a Question, None (filtered out on purpose), or raises _BadRow.


def _gsm8k(row: dict, index: int) -> Question:
    answer = _field(row, "answer")
    if "####" not in answer:
        raise _BadRow("answer has no '#### N' line")
    gold = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not re.fullmatch(r"-?\d+(?:\.\d+)?", gold):
        raise _BadRow(f"gold {gold!r} after '####' is not a number")
    return Question(f"gsm8k-{index:04d}", _field(row, "question"), gold, "math", meta={"dataset": "gsm8k"})


def _csqa(row: dict, index: int) -> Question:
    choices = _field(row, "choices", dict)
    labels, texts = choices.get("label"), choices.get("text")
    if not isinstance(labels, list) or not isinstance(texts, list) or len(labels) != len(texts) or not labels:
        raise _BadRow("choices need equal, non-empty 'label' and 'text' lists")
    if [str(x).strip().upper() for x in labels] != list(LETTERS[: len(labels)]):
        raise _BadRow(f"choice labels {labels} are not A, B, C, ... in order")
    texts = [str(t).strip() for t in texts]
    if not all(texts):
        raise _BadRow("empty choice text")
    gold = _letter(_field(row, "answerKey"), len(texts))
    meta = {"dataset": "commonsenseqa", "concept": row.get("question_concept")}
    return Question(_field(row, "id"), _with_options(_field(row, "question"), texts), gold, "mc", texts, meta)


def _imo(row: dict, index: int) -> Question:
    meta = {
        "dataset": "imo-answerbench",
        "category": _field(row, "Category"),
        "subcategory": str(row.get("Subcategory") or "").strip(),
        "source": str(row.get("Source") or "").strip(),
    }
    return Question(_field(row, "Problem ID"), _field(row, "Problem"), _field(row, "Short Answer"), "math", meta=meta)


def _mmlu_pro(row: dict, index: int) -> Question:
    options = _field(row, "options", list)
    options = [str(o).strip() for o in options]
    if not 2 <= len(options) <= 10 or not all(options):
        raise _BadRow(f"need 2-10 non-empty options, got {len(options)}")
    gold = _letter(_field(row, "answer"), len(options))
    if row.get("answer_index") is not None and row["answer_index"] != LETTERS.index(gold):
        raise _BadRow(f"answer {gold!r} disagrees with answer_index {row['answer_index']}")
    meta = {"dataset": "mmlu-pro", "category": _field(row, "category"), "src": row.get("src")}
    qid = f"mmlu-pro-{_field(row, 'question_id')}"
    return Question(qid, _with_options(_field(row, "question"), options), gold, "mc", options, meta)


def _math(row: dict, index: int) -> Question:
    raw = str(row.get("idx", row.get("", "")) or "").strip()
    if raw and not raw.isdigit():
        raise _BadRow(f"idx {raw!r} is not a number")
    idx = int(raw) if raw else index
    return Question(f"math-{idx:04d}", _field(row, "Question"), _field(row, "Answer"), "math", meta={"dataset": "math"})


def _hle_choices(question: str) -> list[str] | None:
    """The options of an HLE question, which live in its text ("A. ...", "B) ..." lines)."""
    found = re.findall(r"^[ \t]*\(?([A-Z])[.)][ \t]+(.+?)[ \t]*$", question, re.M)
    options: list[str] = []
    for letter, text in found:
        if letter == LETTERS[len(options)]:
            options.append(text)
        elif letter == "A":  # a later block restarts the list
            options = [text]
    return options if len(options) >= 2 else None


def _blank(value: Any) -> bool:
    return value is None or value == "" or (isinstance(value, float) and value != value)  # NaN


def _hle(row: dict, index: int) -> Question | None:
    # The paper's subset: multiple choice, text-only (image '' or null), category != 'Math'.
    category = _field(row, "category")
    if _field(row, "answer_type") != "multipleChoice" or not _blank(row.get("image")) or category == "Math":
        return None
    question = _field(row, "question")
    choices = _hle_choices(question)
    gold = _letter(_field(row, "answer"), len(choices) if choices else None)
    return Question(_field(row, "id"), question, gold, "mc", choices, {"dataset": "hle", "category": category})


def _questions(row: dict, index: int) -> Question:
    """Rows already in `Question` shape (id, question, gold, answer_type[, choices, meta])."""
    answer_type = str(row.get("answer_type") or "math")
    if answer_type not in ("math", "mc"):
        raise _BadRow(f"answer_type {answer_type!r} is not 'math' or 'mc'")
    choices = row.get("choices")
    if choices is not None and (not isinstance(choices, list) or not all(str(c).strip() for c in choices)):
        raise _BadRow("choices must be a list of non-empty texts")
    gold = _field(row, "gold")
    if answer_type == "mc":
        gold = _letter(gold, len(choices) if choices else None)
    meta = row.get("meta") if isinstance(row.get("meta"), dict) else {}
    return Question(_field(row, "id"), _field(row, "question"), gold, answer_type,
                    [str(c).strip() for c in choices] if choices else None, dict(meta))


_CONVERTERS: dict[str, Callable[[dict, int], Question | None]] = {
    "gsm8k": _gsm8k, "commonsenseqa": _csqa, "imo-answerbench": _imo, "mmlu-pro": _mmlu_pro,
    "math": _math, "hle": _hle, "questions": _questions,
}
_HAS_CATEGORY = ("imo-answerbench", "mmlu-pro", "hle", "questions")


def _guess_format(row: dict) -> str | None:
    keys = set(row)
    rules = [
        ({"Problem ID", "Short Answer"}, "imo-answerbench"),
        ({"question_id", "options", "answer"}, "mmlu-pro"),
        ({"choices", "answerKey"}, "commonsenseqa"),
        ({"id", "question", "answer", "answer_type"}, "hle"),
        ({"id", "question", "gold"}, "questions"),
        ({"Question", "Answer"}, "math"),
        ({"question", "answer"}, "gsm8k"),
    ]
    return next((fmt for need, fmt in rules if need <= keys), None)


def _load_file(path: Path, fmt: str | None, on_error: str) -> tuple[list[Question], str]:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"no such file: {path}")
    report = _Reporter(path, on_error)
    questions: list[Question] = []
    seen: set[str] = set()
    filtered = 0
    guessed = fmt is None
    for where, index, row in _read_rows(path, report):
        if fmt is None:
            fmt = _guess_format(row)
            if fmt is None:
                raise DatasetError(f"{path}:{where}: cannot tell the dataset format from fields {sorted(row)}")
        try:
            q = _CONVERTERS[fmt](row, index)
        except _BadRow as exc:
            report.bad(where, str(exc))
            continue
        if q is None:
            filtered += 1
            continue
        if q.id in seen:
            report.bad(where, f"duplicate id {q.id!r}")
            continue
        seen.add(q.id)
        questions.append(q)
    if report.skipped and not questions and not filtered and guessed and fmt is not None:
        # every row failed: more likely the format was guessed wrong than every row is broken
        raise DatasetError(f"{path}: none of its {report.skipped} row(s) reads as {fmt} (the format its fields "
                           f"suggest); a plain JSONL needs id, question, gold, answer_type (docs/grading.md)")
    if report.skipped:
        log.warning("%s: skipped %d malformed row(s)", path, report.skipped)
    log.info("%s: %d questions (%s)%s", path, len(questions), fmt,
             f", {filtered} outside the paper's subset" if filtered else "")
    return questions, fmt or "questions"


# ----------------------------------------------------------------------------- selection


def _by_category(questions: list[Question], category: str | None, fmt: str, source: str) -> list[Question]:
    if category is None:
        return questions
    if fmt not in _HAS_CATEGORY:
        raise DatasetError(f"{source} has no categories to filter on")
    wanted = category.strip().lower()
    kept = [q for q in questions if str(q.meta.get("category", "")).lower() == wanted]
    if not kept:
        known = sorted({str(q.meta.get("category")) for q in questions if q.meta.get("category")})
        raise DatasetError(f"{source}: no questions in category {category!r}; categories: {', '.join(known)}")
    return kept


def stratified_sample(questions: list[Question], n: int, seed: int = 0) -> list[Question]:
    """n questions with each category's share kept (largest remainder), drawn with a fixed seed;
    returned in file order, so the same (file, n, seed) always gives the same questions."""
    if n >= len(questions):
        return list(questions)
    groups: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        groups.setdefault(str(q.meta.get("category", "")), []).append(i)
    quotas = {c: n * len(ix) / len(questions) for c, ix in groups.items()}
    counts = {c: int(quotas[c]) for c in groups}
    for c in sorted(groups, key=lambda c: (-(quotas[c] - counts[c]), c))[: n - sum(counts.values())]:
        counts[c] += 1
    rng = random.Random(seed)
    chosen = [i for c in sorted(groups) for i in rng.sample(groups[c], counts[c])]
    return [questions[i] for i in sorted(chosen)]


# ----------------------------------------------------------------------------- named datasets

KNOWN_DATASETS: dict[str, tuple[str, ...]] = {
    # name -> file names looked for in each data directory, first match wins
    "gsm8k": ("gsm8k/test.jsonl", "gsm8k_sample.jsonl"),
    "commonsenseqa": ("commonsenseqa/csqa_validation_dev_rand_split.jsonl", "csqa_sample.jsonl"),
    "imo-answerbench": ("imo_answerbench/answerbench_v2_fixed.jsonl",),
    "mmlu-pro": ("mmlu_pro/mmlu_pro_test.jsonl",),
    "math": ("math/math_test_simple_evals.csv",),
    "hle": ("hle/*.parquet", "hle/*.jsonl", "hle.parquet", "hle.jsonl"),
}
ALIASES = {"csqa": "commonsenseqa", "imo": "imo-answerbench", "answerbench": "imo-answerbench",
           "mmlu_pro": "mmlu-pro", "mmlupro": "mmlu-pro", "imo_answerbench": "imo-answerbench"}


def data_dirs(data_dir: str | os.PathLike | None = None) -> list[Path]:
    """Where named datasets are looked for, in order. An explicit `data_dir` or $SVRMAD_DATA_DIR
    is the only place searched (so a run never silently falls back to a sample); otherwise the
    samples bundled in the package, then ../shared/data next to the repository."""
    if data_dir is not None:
        return [Path(data_dir).expanduser()]
    if os.environ.get("SVRMAD_DATA_DIR"):
        return [Path(os.environ["SVRMAD_DATA_DIR"]).expanduser()]
    return [BUNDLED_DIR] + ([SHARED_DIR] if SHARED_DIR.is_dir() else [])


def _find(name: str, data_dir) -> Path:
    dirs = data_dirs(data_dir)
    for d in dirs:
        for pattern in KNOWN_DATASETS[name]:
            hits = sorted(d.glob(pattern))
            if hits:
                return hits[0]
    where = ", ".join(str(d) for d in dirs)
    hint = (" HLE is gated: download it (JSONL or Parquet) and pass the file's path,"
            " or put it in <data_dir>/hle/." if name == "hle" else "")
    raise DatasetError(f"dataset {name!r}: none of {list(KNOWN_DATASETS[name])} in {where}.{hint}")


def load_dataset(
    name_or_path: str | os.PathLike,
    *,
    limit: int | None = None,
    seed: int = 0,
    category: str | None = None,
    on_error: str = "skip",
    data_dir: str | os.PathLike | None = None,
) -> list[Question]:
    """Questions of a named dataset (see KNOWN_DATASETS, ALIASES) or of a file (format guessed
    from its fields). `limit` keeps the first N, except for MMLU-Pro, where it draws a
    category-stratified sample with `seed`. `category` filters IMO/MMLU-Pro/HLE (case-insensitive)."""
    if on_error not in ("skip", "fail"):
        raise ValueError(f"on_error must be 'skip' or 'fail', not {on_error!r}")
    text = str(name_or_path)
    name = ALIASES.get(text.strip().lower(), text.strip().lower())
    if name in KNOWN_DATASETS:
        path, fmt = _find(name, data_dir), name
    else:
        path, fmt = Path(text).expanduser(), None
        if not path.is_file():
            known = ", ".join(list(KNOWN_DATASETS) + [f"{a} (= {n})" for a, n in ALIASES.items()])
            raise DatasetError(f"{text!r} is neither a known dataset nor a file; known names: {known}")
    questions, fmt = _load_file(path, fmt, on_error)
    questions = _by_category(questions, category, fmt, str(path))
    if limit is not None and limit >= 0:
        questions = stratified_sample(questions, limit, seed) if fmt == "mmlu-pro" else questions[:limit]
    return questions


def _loader(name: str, doc: str):
    def load(path: str | os.PathLike | None = None, *, limit: int | None = None, seed: int = 0,
             category: str | None = None, on_error: str = "skip", data_dir=None) -> list[Question]:
        if path is None:
            return load_dataset(name, limit=limit, seed=seed, category=category, on_error=on_error, data_dir=data_dir)
        questions, fmt = _load_file(Path(path), name, on_error)
        questions = _by_category(questions, category, fmt, str(path))
        if limit is not None and limit >= 0:
            questions = stratified_sample(questions, limit, seed) if name == "mmlu-pro" else questions[:limit]
        return questions

    load.__name__ = "load_" + name.replace("-", "_")
    load.__doc__ = doc
    return load


load_gsm8k = _loader("gsm8k", "GSM8K: gold = the number after '####' (commas removed); ids gsm8k-NNNN by line.")
load_commonsenseqa = _loader("commonsenseqa", "CommonsenseQA: 5 lettered options appended to the question.")
load_imo_answerbench = _loader("imo-answerbench", "IMO-AnswerBench (fixed JSONL): gold = Short Answer.")
load_mmlu_pro = _loader("mmlu-pro", "MMLU-Pro: up to 10 options A-J; `limit` = stratified sample by category.")
load_math = _loader("math", "MATH (csv idx, Question, Answer): ids math-NNNN from idx.")
load_hle = _loader("hle", "HLE file (JSONL/Parquet) restricted to multipleChoice, no image, category != Math.")
load_questions = _loader("questions", "JSONL already in Question shape: id, question, gold, answer_type, choices.")
