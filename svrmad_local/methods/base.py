"""What every method shares: the result record, answer clustering and majority voting.

Methods are plain control flow over `Response`s; they differ only in which debates they ask the
backend for and how they turn answers into one. Voting and token accounting live here so every
method counts and breaks ties the same way (docs/methods.md lists the rules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Sequence

from svrmad_local import grading
from svrmad_local.grading import equivalent, is_correct
from svrmad_local.debate.types import Question, Response


@dataclass
class MethodResult:
    """One method's outcome on one question. Token fields sum every response the method used,
    the N initial responses included (the paper's count)."""

    method: str
    answer: str | None
    correct: bool | None
    ncomm: int
    tokens: int
    prompt_tokens: int
    completion_tokens: int
    computed_tokens: int
    n_correct_initial: int
    accepted: bool | None = None
    scores: list[float] | None = None
    responses: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    grades: dict[str, bool] | None = None  # every grader's verdict, when the run grades with "both"

    def to_row(self, q: Question) -> dict[str, Any]:
        """The results.jsonl line (docs/formats.md)."""
        return {
            "id": q.id, "method": self.method, "answer": self.answer, "gold": q.gold,
            "correct": self.correct, "ncomm": self.ncomm, "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "computed_tokens": self.computed_tokens, "n_correct_initial": self.n_correct_initial,
            "accepted": self.accepted, "scores": self.scores, "params": self.params,
            **({"grades": self.grades} if self.grades is not None else {}),
        }


def finish(method: str, q: Question, initial: Sequence[Response], debates: Iterable[Response],
           answer: str | None, ncomm: int, **extra: Any) -> MethodResult:
    """Build the result: grade the answer and count the tokens of the initial responses plus every
    debate response the method asked for (each response id once)."""
    used = {r.id: r for r in initial}
    used.update((r.id, r) for r in debates)
    prompt = sum(r.prompt_tokens for r in used.values())
    completion = sum(r.completion_tokens for r in used.values())
    return MethodResult(
        method=method, answer=answer, correct=is_correct(answer, q.gold, q.answer_type),
        grades=grading.grades(answer, q.gold, q.answer_type),
        ncomm=ncomm, tokens=prompt + completion, prompt_tokens=prompt,
        completion_tokens=completion, computed_tokens=sum(r.computed_tokens for r in used.values()),
        n_correct_initial=sum(is_correct(r.answer, q.gold, q.answer_type) for r in initial),
        responses=list(used), **extra)


def cluster(answers: Sequence[str | None], answer_type: str) -> list[list[int]]:
    """Indices grouped by answer equivalence, groups in order of first appearance; each member is
    compared with its group's first member. A None answer equals nothing, so it is a group alone."""
    return group(answers, lambda a, b: equivalent(a, b, answer_type))


def group(items: Sequence[Any], same: Callable[[Any, Any], bool]) -> list[list[int]]:
    """Indices of `items` grouped greedily: each joins the first group whose first member it is
    `same` as, else starts a new group (groups in order of first appearance)."""
    groups: list[list[int]] = []
    for i, a in enumerate(items):
        for g in groups:
            if same(items[g[0]], a):
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


def majority(answers: Sequence[str | None], answer_type: str,
             *tiebreaks: Sequence[str | None]) -> str | None:
    """The most common answer (None answers abstain). A tie goes to the tied answer most supported
    by each `tiebreaks` list in turn, then to the tied answer that appears first in `answers`.
    None only when every answer is None."""
    groups = [g for g in cluster(answers, answer_type) if answers[g[0]] is not None]
    if not groups:
        return None
    top = max(len(g) for g in groups)
    tied = [answers[g[0]] for g in groups if len(g) == top]
    for other in tiebreaks:
        if len(tied) == 1:
            break
        support = [sum(equivalent(a, b, answer_type) for b in other) for a in tied]
        tied = [a for a, s in zip(tied, support) if s == max(support)]
    return tied[0]


def largest_cluster(answers: Sequence[str | None], answer_type: str) -> int:
    """Size of the largest group of equivalent non-None answers (the consensus count)."""
    return max((len(g) for g in cluster(answers, answer_type) if answers[g[0]] is not None),
               default=0)


async def debate_rounds(q: Question, initial: Sequence[Response], step: Callable[
        [list[Response], int], Awaitable[tuple[list[Response], list[Response], int]]], *,
        rounds: int, consensus: int) -> tuple[str | None, list[Response], int, int]:
    """The round structure the paper gives every round-based baseline: at most `rounds` rounds,
    stopping after a round (not the last) whose largest answer cluster has `consensus` agents.

    `step(current, t)` runs round t from the agents' current responses and returns (new current
    responses, the debate responses it asked for, links it used). The answer is the majority of
    the last round, ties going to the earlier rounds' majorities, newest first.
    Returns (answer, debates, ncomm, rounds run)."""
    history = [list(initial)]
    debates: list[Response] = []
    ncomm = 0
    for t in range(1, rounds + 1):
        current, new, links = await step(history[-1], t)
        history.append(current)
        debates += new
        ncomm += links
        if t < rounds and largest_cluster([r.answer for r in current], q.answer_type) >= consensus:
            break
    votes = [[r.answer for r in h] for h in reversed(history)]
    return majority(votes[0], q.answer_type, *votes[1:]), debates, ncomm, len(history) - 1
