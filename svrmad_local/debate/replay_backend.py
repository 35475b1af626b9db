"""Replay: serve a question's responses from its recorded trace line, no model.

Response ids are built from the structure of the call (`debate_id`), so a method re-run against
the trace asks for exactly the ids the live run recorded. A call the trace does not hold means
the method (or its parameters) differ from what was run live; that is an error, never a guess.
"""

from __future__ import annotations

from typing import Sequence

from svrmad_local.debate.trace import row_debates, row_initial
from svrmad_local.debate.types import Question, Response, debate_id


class MissingDebate(KeyError):
    """The trace holds no response for a debate a method asked for."""

    def __init__(self, qid: str, rid: str, detail: str, repeat: int = 1):
        self.qid, self.rid, self.repeat = qid, rid, repeat
        hint = "re-run live with this method/parameters to record it"
        if repeat > 1:  # traces written before repeated pairs existed hold first debates only
            hint += ("; a trace recorded without repeated pairs replays SVR-MAD with "
                     "repeat_pairs=False (svrmad replay --no-repeat-pairs)")
        super().__init__(f"question {qid!r}: the trace holds no debate {rid!r} ({detail}); {hint}")

    def __str__(self) -> str:
        return str(self.args[0])


class ReplayBackend:
    """A `Backend` over one trace.jsonl line (a dict as `read_trace` returns it)."""

    def __init__(self, trace_row: dict):
        self.qid = str(trace_row["id"])
        self._initial = row_initial(trace_row)
        self._debates = row_debates(trace_row)

    def _check(self, q: Question) -> None:
        if q.id != self.qid:
            raise ValueError(f"replay backend holds question {self.qid!r}, asked for {q.id!r}")

    async def initial(self, q: Question, n: int) -> list[Response]:
        self._check(q)
        if n > len(self._initial):
            raise ValueError(f"question {q.id!r}: the trace holds {len(self._initial)} agents, "
                             f"asked for {n}")
        return self._initial[:n]

    async def debate(self, q: Question, own: Response, peers: Sequence[Response],
                     brief: Sequence[Response] = (), *, repeat: int = 1) -> Response:
        self._check(q)
        rid = debate_id(own.id, [p.id for p in peers], [b.id for b in brief], repeat)
        try:
            return self._debates[rid]
        except KeyError:
            if len(peers) == 1 and not brief:
                detail = f"sender {peers[0].agent} -> receiver {own.agent}"
            else:
                detail = f"receiver {own.agent} hearing {len(peers)} peers, {len(brief)} brief"
            if repeat > 1:
                detail += f", repeat {repeat}"
            raise MissingDebate(q.id, rid, detail, repeat) from None
