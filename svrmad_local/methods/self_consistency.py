"""Self Consistency (Wang et al.): the majority of the initial answers, no debate.

The no-debate reference of Table 1: it costs exactly the N initial responses."""

from __future__ import annotations

from typing import Sequence

from svrmad_local.debate.types import Backend, Question, Response
from svrmad_local.methods.base import MethodResult, finish, majority


async def run(q: Question, initial: Sequence[Response], backend: Backend) -> MethodResult:
    """Majority by answer equivalence; None answers abstain; a tie goes to the lowest agent."""
    answer = majority([r.answer for r in initial], q.answer_type)
    return finish("self-consistency", q, initial, [], answer, ncomm=0)
