"""Grading: the answer stated in a response, a canonical form of it, and whether two answers (or an
answer and its gold) are the same. One notion of sameness serves agreement between agents, the
debate outcome and accuracy. The rules are in docs/grading.md.

- extract.py: the final answer in a response (linear time on any text)
- normalize.py: a canonical string per answer (also a vote key)
- equivalence.py: structure (sets, tuples, intervals, relations, matrices) over cheap or sympy atoms
- latex.py, symbolic.py: LaTeX -> sympy, and a load-independent sympy comparison
- worker.py: the child process that runs sympy (and math-verify) off the caller's event loop
- verdicts.py: the API below, its cache, and the grader choice (ours | math-verify | both)
- mathverify.py: math-verify as an optional second opinion
"""

from svrmad_local.grading.extract import extract_answer
from svrmad_local.grading.normalize import normalize
from svrmad_local.grading.verdicts import (GRADERS, aequivalent, ais_correct, clear_cache, equivalent, get_grader,
                                           grade, grades, is_correct, set_grader, settle, stats)
from svrmad_local.grading.worker import GradingTimeout

__all__ = ["extract_answer", "normalize", "equivalent", "is_correct", "aequivalent", "ais_correct", "settle",
           "grade", "grades", "GRADERS", "set_grader", "get_grader", "clear_cache", "stats", "GradingTimeout"]
