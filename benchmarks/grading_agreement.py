"""Recall and false positives of our grader and of math-verify, on pairs built by construction.

From every MATH test gold and IMO-AnswerBench short answer (the shared data folder):
- positives: the gold against rewrites that keep its value (`$g$`, `\\boxed{g}`, other spacing,
  `\\dfrac`, `\\left( \\right)`, `x = g`, `g.0`, thousands separators `1,234` and MATH's `1,\\!234`,
  a unit after a number or a fraction, a list in another order, a fraction as its decimal,
  `\\frac12`, degree marks dropped);
- negatives: the gold against changes that alter its value (an integer +1, the first number of an
  expression +1, the sign, a tuple's order, a list without an element, another integer gold).
- responses: for a sample of golds, whole responses in public styles (a boxed chain of thought,
  Minerva's "Final Answer: ... I hope it is correct.", "The answer is $g$, as required.",
  "**Answer:** g") holding the gold (positive) or a negative. Ours extracts then grades; math-verify
  parses the whole response (its own extraction).

Reports per dataset and kind: recall (positives judged equal) and false positives (negatives judged
equal) of each grader, and where the two disagree. math-verify runs in this process (its time
limits need the main thread); it must be installed: `pip install -e ".[mathverify]"`.

    python benchmarks/grading_agreement.py [--data-dir DIR] [--limit N] [--responses 1500] [--out FILE]

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from svrmad_local.grading import extract_answer, is_correct, worker  # noqa: E402
from svrmad_local.grading.text import split_top  # noqa: E402


def golds(data: Path) -> dict[str, list[str]]:
    math = [r["Answer"] for r in csv.DictReader(open(data / "math" / "math_test_simple_evals.csv"))]
    imo = [json.loads(line)["Short Answer"] for line in open(data / "imo_answerbench" / "answerbench_v2_fixed.jsonl")]
    return {"MATH": math, "IMO": imo}


_INT = re.compile(r"-?\d+")
_FIRST_NUMBER = re.compile(r"(?<![\d.])\d+(?![\d.])")


def _core(g: str) -> tuple[str, bool]:
    """The gold without its wrapping `$`, and whether it is prose around math ("odd $n$", "... for
    some $a>0$"): such golds are rewritten only in ways that keep their words apart."""
    s = g.strip()
    inner = s[1:-1] if len(s) > 1 and s[0] == s[-1] == "$" else s
    bare = re.sub(r"\\[A-Za-z]+", "", re.sub(r"\\(?:text\w*|math\w+|mbox|begin|end|operatorname)\{[^{}]*\}", "", inner))
    prose = "$" in inner.replace("\\$", "") or bool(re.search(r"\b[A-Za-z]{3,}\b", bare))  # words outside \text{}
    return (s if prose else inner.strip()), prose


def _items(s: str) -> list[str]:
    """Top-level list items; MATH's thousands separators (`30,\\!240`, `1{,}234`) and `\\,` are no commas."""
    if re.search(r"\d,\s*\\!|\{\s*,\s*\}|\\,", s) or re.fullmatch(r"-?(?:\\\$)?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        return [s]  # "15,600" is a number (3 of the 4 such MATH golds; "70,110" is a list of two)
    return split_top(s)


def positives(g: str) -> list[str]:
    """Rewrites of gold g that keep its value."""
    s, prose = _core(g)
    if prose:  # a period only after the math ("odd $n$."), not inside it
        out = ([s + "."] if s.endswith("$") else []) + [f"  {s}  ", s.replace(" ", "  ")]
    else:  # spacing: none (kept after a backslash and between letters), or around operators
        out = [f"${s}$", f"\\boxed{{{s}}}", re.sub(r"(?<![\\{^_])\s*([+=<>]|(?<![{^_])-)\s*", r" \1 ", s).strip()]
        if "\\text" not in s:  # the words of \text{ and } keep their spaces
            out.append(re.sub(r"(?<![A-Za-z\\])\s+|(?<=[A-Za-z])\s+(?![A-Za-z])", "", s))
    if r"\frac" in s:
        out.append(s.replace(r"\frac", r"\dfrac"))
        out.append(re.sub(r"\\frac\{(\d)\}\{(\d)\}", r"\\frac\1\2", s))
    if s.startswith("(") and s.endswith(")"):
        out.append(r"\left" + s[:-1] + r"\right)")
    if "^\\circ" in s:
        out.append(re.sub(r"\s*\^\s*\\circ", "", s))
    items = _items(s)
    if not prose and len(items) > 1 and not s.startswith(("(", "[", r"\{")) and "=" not in s:
        out.append(", ".join(reversed([i.strip() for i in items])))
    free = next((v for v in "xyzuvw" if v not in s), None)
    if not prose and free and len(items) == 1 and not re.search(r"[=<>]|\\(?:[gl]eq?|neq?|in|text)(?![A-Za-z])", s):
        out.append(f"{free} = {s}")
    if _INT.fullmatch(s):
        out.append(s + ".0")
        if len(s.lstrip("-")) > 3:
            n = int(s)
            out += [f"{n:,}", f"{n:,}".replace(",", ",\\!")]
    if re.fullmatch(r"-?\d+(?:\.\d+)?|-?\\frac\{\d+\}\{\d+\}", s):
        out.append(s + r"\text{ units}")
    m = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", s)
    if m and int(m.group(3)) in (2, 4, 5, 8, 10, 20, 25, 50, 100):
        value = int(m.group(2)) / int(m.group(3))
        out.append(f"{m.group(1)}{value:g}")
    seen, kept = {g}, []
    for v in out:
        if v not in seen:
            seen.add(v)
            kept.append(v)
    return kept


def negatives(g: str, integer_golds: list[str], rng: random.Random) -> list[str]:
    """Changes of gold g that alter its value."""
    s, prose = _core(g)
    out = []
    if _INT.fullmatch(s):
        out.append(str(int(s) + 1))
        other = rng.choice(integer_golds)
        if int(other) != int(s):
            out.append(other)
    else:
        m = _FIRST_NUMBER.search(s)
        if m:
            out.append(s[: m.start()] + str(int(m.group()) + 1) + s[m.end():])
    items = _items(s)
    if not prose and len(items) == 1 and s not in ("0", "-0") and not re.search(r"[<>=]|\\(?:leq|geq|in|cup)|[A-Za-z]{3}", s):
        out.append(s[1:] if s.startswith("-") else f"-{s}" if re.fullmatch(r"[\w\\{}^.]+", s) else f"-({s})")
    if s.startswith("(") and s.endswith(")"):
        inner = split_top(s[1:-1])
        if len(inner) == 2 and inner[0].strip() != inner[1].strip():
            out.append(f"({inner[1].strip()}, {inner[0].strip()})")
    if not prose and len(items) > 2 and not s.startswith(("(", "[")):
        out.append(",".join(items[:-1]))
    return [v for v in dict.fromkeys(out) if v != s]


STYLES = [  # {} is the answer: inline math `$...$`, or the gold as written when it is prose
    "We simplify step by step. Substituting gives 3x + 7 = 22, so x = 5 in the auxiliary equation. "
    "Therefore, the final answer is \\boxed{{{}}}.",
    "Let me compute. The intermediate value is 12.\nFinal Answer: The final answer is {}. I hope it is correct.",
    "Combining the two cases (n = 1 and n = 2), the answer is {}, as required.",
    "Working through the constraints we find 4 candidates and check each.\n\n**Answer:** {}",
]


def responses(sets: dict[str, list[str]], n: int, rng: random.Random, integer_golds) -> list[tuple]:
    """(dataset, kind, response, gold, positive?) for n golds drawn from both datasets."""
    out = []
    pool = [(name, g) for name, gs in sets.items() for g in gs]
    for name, g in rng.sample(pool, min(n, len(pool))):
        i = rng.randrange(len(STYLES))
        s, prose = _core(g)
        if prose and i == 0:
            i = 1  # prose does not go in a box
        wrap = (lambda a: a) if prose or i == 0 else (lambda a: f"${a}$")
        out.append((name, "responses", STYLES[i].format(wrap(s)), g, True))
        neg = negatives(g, integer_golds, rng)
        if neg:
            out.append((name, "responses", STYLES[i].format(wrap(rng.choice(neg))), g, False))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--limit", type=int, help="golds per dataset (default all)")
    p.add_argument("--responses", type=int, default=1500, help="golds drawn for built responses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="also write the JSON (with the misses and false positives) here")
    args = p.parse_args()
    from math_verify import parse, verify  # the optional extra: fail here, before any work

    rng = random.Random(args.seed)
    sets = {k: v[: args.limit] for k, v in golds(args.data_dir).items()}
    integer_golds = [c for gs in sets.values() for c in (_core(g)[0] for g in gs) if _INT.fullmatch(c)]
    cases = []  # (dataset, kind, candidate, gold, positive)
    for name, gs in sets.items():
        for g in gs:
            cases += [(name, "pairs", v, g, True) for v in positives(g)]
            cases += [(name, "pairs", v, g, False) for v in negatives(g, integer_golds, rng)]
    cases += responses(sets, args.responses, rng, integer_golds)
    print(f"{len(cases)} cases ({sum(c[4] for c in cases)} positive)", file=sys.stderr)

    def mv_latex(s: str) -> str:
        s = s.strip()
        return s if "$" in s or "\\boxed" in s else f"${s}$"

    worker.call("ping")
    times = defaultdict(float)
    verdicts = []
    for i, (name, kind, cand, gold, pos) in enumerate(cases):
        t0 = time.perf_counter()
        answer = extract_answer(cand, "math") if kind == "responses" else cand
        ours = is_correct(answer, gold, "math")
        t1 = time.perf_counter()
        try:
            mv = bool(verify(parse(mv_latex(gold)), parse(cand if kind == "responses" else mv_latex(cand))))
        except Exception:
            mv = False
        t2 = time.perf_counter()
        times["ours"] += t1 - t0
        times["math-verify"] += t2 - t1
        verdicts.append((ours, mv))
        if (i + 1) % 5000 == 0:
            print(f"{i + 1}/{len(cases)}", file=sys.stderr)

    table, misses, false_pos, disagree = {}, defaultdict(list), defaultdict(list), 0
    for (name, kind, cand, gold, pos), (ours, mv) in zip(cases, verdicts):
        row = table.setdefault(f"{name} {kind}", {"positives": 0, "negatives": 0, "ours_tp": 0, "mv_tp": 0,
                                                   "ours_fp": 0, "mv_fp": 0})
        row["positives" if pos else "negatives"] += 1
        for grader, v in (("ours", ours), ("mv", mv)):
            if pos and v:
                row[f"{grader}_tp"] += 1
            elif pos:
                misses[grader].append((name, kind, cand, gold))
            elif v:
                row[f"{grader}_fp"] += 1
                false_pos[grader].append((name, kind, cand, gold))
        disagree += ours != mv
    print(f"\n| set | positives | recall ours | recall math-verify | negatives | FP ours | FP math-verify |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, r in table.items():
        rec = lambda tp: f"{100 * tp / r['positives']:.1f}%" if r["positives"] else "-"  # noqa: E731
        print(f"| {key} | {r['positives']} | {rec(r['ours_tp'])} | {rec(r['mv_tp'])} | {r['negatives']} | "
              f"{r['ours_fp']} | {r['mv_fp']} |")
    print(f"\ndisagreements: {disagree} of {len(cases)}; time: ours {times['ours']:.1f} s, "
          f"math-verify {times['math-verify']:.1f} s")
    for grader in ("ours", "mv"):
        print(f"\nfalse positives of {grader}: {len(false_pos[grader])}")
        for case in false_pos[grader][:30]:
            print("  ", case)
        print(f"misses of {grader}: {len(misses[grader])} (first 30)")
        for case in misses[grader][:30]:
            print("  ", case)
    result = {"table": table, "cases": len(cases), "disagreements": disagree,
              "seconds": {k: round(v, 1) for k, v in times.items()}}
    if args.out:
        args.out.write_text(json.dumps({**result, "false_positives": false_pos, "misses": misses}, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
