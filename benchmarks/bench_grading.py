"""Grading speed: worst cases on degenerate responses, and throughput on realistic ones.

(a) Worst case: ~200k-character degenerate responses of the kinds a model stuck in a loop writes
    (newlines, digits, unclosed `\\boxed{`, nested boxes, repeated answer lines, ...). Per input:
    the time of extract_answer (math, and mc with ten options), and of grading the extracted
    answer against a gold (normalise + equivalence, sympy in the worker included).
(b) Throughput: 1,000 realistic responses built from the public datasets in the answer styles
    models use (GSM8K reference solutions ending in `#### N`, MATH / IMO-AnswerBench golds in a
    `\\boxed{}` or a Minerva "Final Answer" line after some reasoning, CommonsenseQA / MMLU-Pro
    "The answer is (X)"), half of them with a wrong answer. Time per 1,000 to extract, and to
    grade with a cold cache (every pair decided) and with a warm one (the cache of a run).

    python benchmarks/bench_grading.py [--data-dir /work/shared/data] [--size 200000] [--n 1000]

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from svrmad_local.grading import clear_cache, extract_answer, is_correct, worker  # noqa: E402

TEN = [f"option {c}" for c in "ABCDEFGHIJ"]


def degenerate(size: int) -> dict[str, str]:
    """Name -> a response of about `size` characters."""
    def rep(unit: str) -> str:
        return unit * max(1, size // len(unit))

    rng = random.Random(0)
    loop = "Let me check again: 2 + 2 = 4, so the answer is 4.\n"
    return {
        "newlines": rep("\n"),
        "boxed then newlines": "\\boxed{5}" + rep("\n"),
        "digits": rep("1"),
        "unclosed boxes": rep("\\boxed{"),
        "nested boxes": "\\boxed{" * (size // 8) + "5" + "}" * (size // 8),
        "open braces": rep("{"),
        "close braces": rep("}"),
        "spaces": rep(" "),
        "parentheses": rep("("),
        "dollars": rep("$"),
        "backslashes": rep("\\"),
        "letters": rep("a"),
        "dashes": rep("-"),
        "answer lines": rep("Answer: 5\n"),
        "answer is": rep("The answer is "),
        "final answer is $": rep("The final answer is $"),
        "gsm8k marks": rep("#### "),
        "number lists": rep("1,"),
        "decimals": rep("1."),
        "option labels": rep("(A) "),
        "label lines": rep("A)\n"),
        "confidence lines": rep("Confidence: "),
        "percent sure": rep("9% sure "),
        "unclosed frac": rep("\\frac{"),
        "powers": rep("x^"),
        "text commands": rep("\\text{"),
        "looping reasoning": rep(loop),
        "random printable": "".join(rng.choice("{}()[]$\\ab1,.:=\n ^_") for _ in range(size)),
    }


def worst_case(size: int) -> dict:
    out = {}
    for name, text in degenerate(size).items():
        times = {}
        for kind, choices in (("math", None), ("mc", TEN)):
            t0 = time.perf_counter()
            answer = extract_answer(text, kind, choices)
            t1 = time.perf_counter()
            is_correct(answer, "5" if kind == "math" else "C", kind)
            t2 = time.perf_counter()
            times[f"extract_{kind}_s"] = t1 - t0
            times[f"grade_{kind}_s"] = t2 - t1
        out[name] = {"chars": len(text), **{k: round(v, 4) for k, v in times.items()}}
        print(f"{name:22s} {len(text):7d} chars  extract math {times['extract_math_s']:.3f} s, "
              f"mc {times['extract_mc_s']:.3f} s; grade math {times['grade_math_s']:.3f} s, "
              f"mc {times['grade_mc_s']:.3f} s")
    return out


def realistic(data: Path, n: int, seed: int = 0) -> list[tuple[str, str, str, list | None]]:
    """(response, gold, answer_type, choices) in public answer styles; every other one is wrong."""
    rng = random.Random(seed)
    gsm = [json.loads(line) for line in open(data / "gsm8k" / "test.jsonl")]
    math_golds = [r["Answer"] for r in csv.DictReader(open(data / "math" / "math_test_simple_evals.csv"))]
    imo = [json.loads(line)["Short Answer"].strip().strip("$") for line in
           open(data / "imo_answerbench" / "answerbench_v2_fixed.jsonl")]
    csqa = [json.loads(line) for line in open(data / "commonsenseqa" / "csqa_validation_dev_rand_split.jsonl")]
    mmlu = [json.loads(line) for _, line in zip(range(3000), open(data / "mmlu_pro" / "mmlu_pro_test.jsonl"))]
    reasoning = ("We start from the given conditions. Substituting the values, we get 3x + 7 = 22, "
                 "so x = 5. Checking the boundary case n = 1 separately gives 2, which also works.\n")
    rows = []
    for i in range(n):
        wrong = i % 2 == 1
        kind = rng.choice(["gsm8k", "math", "math", "imo", "csqa", "mmlu"])
        if kind == "gsm8k":
            r = rng.choice(gsm)
            gold = r["answer"].split("####")[-1].strip()
            text = r["answer"] if not wrong else r["answer"].rsplit("####", 1)[0] + "#### 7"
            rows.append((text, gold, "math", None))
        elif kind in ("math", "imo"):
            gold = rng.choice(math_golds if kind == "math" else imo)
            answer = rng.choice(math_golds if kind == "math" else imo) if wrong else gold
            style = rng.choice([f"Therefore, the final answer is $\\boxed{{{answer}}}$.",
                                f"Final Answer: The final answer is ${answer}$. I hope it is correct.",
                                f"**Answer:** ${answer}$"])
            rows.append((reasoning * rng.randint(1, 8) + style, gold, "math", None))
        else:
            r = rng.choice(csqa if kind == "csqa" else mmlu)
            choices = r["choices"]["text"] if kind == "csqa" else r["options"]
            gold = r["answerKey"] if kind == "csqa" else r["answer"]
            letter = "ABCDEFGHIJ"[rng.randrange(len(choices))] if wrong else gold
            rows.append((reasoning * rng.randint(1, 4) + f"The answer is ({letter}).", gold, "mc", choices))
    return rows


def throughput(data: Path, n: int) -> dict:
    rows = realistic(data, n)
    t0 = time.perf_counter()
    answers = [extract_answer(text, at, ch) for text, _, at, ch in rows]
    t1 = time.perf_counter()
    clear_cache()
    t2 = time.perf_counter()
    cold = [is_correct(a, gold, at) for a, (_, gold, at, _) in zip(answers, rows)]
    t3 = time.perf_counter()
    warm = [is_correct(a, gold, at) for a, (_, gold, at, _) in zip(answers, rows)]
    t4 = time.perf_counter()
    assert cold == warm
    scale = 1000 / len(rows)
    out = {"responses": len(rows), "mean_chars": round(sum(len(r[0]) for r in rows) / len(rows)),
           "extract_s_per_1000": round((t1 - t0) * scale, 3), "grade_cold_s_per_1000": round((t3 - t2) * scale, 3),
           "grade_warm_s_per_1000": round((t4 - t3) * scale, 3), "correct": sum(cold)}
    print(f"{len(rows)} realistic responses (mean {out['mean_chars']} chars), {sum(cold)} graded correct: "
          f"extract {out['extract_s_per_1000']} s, grade cold {out['grade_cold_s_per_1000']} s, "
          f"warm {out['grade_warm_s_per_1000']} s per 1,000")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--size", type=int, default=200_000)
    p.add_argument("--n", type=int, default=1000)
    args = p.parse_args()
    worker.call("ping")  # start the worker before anything is timed
    worst = worst_case(args.size)
    top = max(((name, k, v) for name, rec in worst.items() for k, v in rec.items() if k.endswith("_s")),
              key=lambda t: t[2])
    print(f"worst: {top[1]} on {top[0]!r}: {top[2]:.3f} s")
    result = {"worst_case": worst, "worst": {"input": top[0], "what": top[1], "seconds": top[2]}}
    if (args.data_dir / "gsm8k").is_dir():
        result["throughput"] = throughput(args.data_dir, args.n)
    else:
        print(f"no datasets under {args.data_dir}: throughput skipped (--data-dir)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
