"""Traces: record every response a run asked for, once, and write/read trace.jsonl (docs/formats.md).

`RecordingBackend` sits between the methods and the real backend. Response ids say what a call
is, so it memoises by (question id, response id): the same debate asked for by several methods
(SID-ET's and all-to-all's rounds, SVR-MAD's and S2-MAD's one-peer debates) is computed once,
while each method still receives, and counts, the full response. A repeat of a call ("#k" in its
id, SVR-MAD re-selecting a pair) is a different id, so a new sample, never the memoised first one;
two methods asking for the same repeat share it. The trace it writes is what
`ReplayBackend` serves, so any method can be re-run without a model.

Run-ahead (`run_ahead=True`, `svrmad run --run-ahead`): a method may announce the debates it will
ask for next (`prefetch`); the backend starts them at once, so they share the engine's batch with
the work in flight, and memoises them like any call, but records nothing until the method asks.
A debate is a pure function of its id (its seed comes from the id), so what a method receives, the
trace and the billing are those of the sequential run; a prefetched debate never asked for is
compute spent and reported in `ahead` (docs/engine.md, "Run-ahead debates").
"""

from __future__ import annotations

import asyncio
import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Iterator, Sequence

from svrmad_local.grading import equivalent, is_correct, settle
from svrmad_local.debate.types import ANSWER_TYPES, Backend, Question, Response, debate_id


def _top_split(s: str, sep: str) -> list[str]:
    """`s` split at the `sep`s outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += (ch == "(") - (ch == ")")
        if ch == sep and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def split_repeat(rid: str) -> tuple[str, int]:
    """(the id without its repeat mark, the repeat number k >= 1) of a response id: "0<5#2" ->
    ("0<5", 2), "0<5" -> ("0<5", 1)."""
    head = _top_split(rid, "#")
    if len(head) == 1:
        return rid, 1
    if len(head) != 2 or not head[1].isdigit() or int(head[1]) < 2:
        raise ValueError(f"bad repeat mark in response id {rid!r}")
    return head[0], int(head[1])


def split_id(rid: str) -> tuple[str, list[str], list[str]]:
    """The inverse of `debate_id`: (own id, peer ids, brief ids) of a debate response id; a
    repeat mark ("#k", see `split_repeat`) is not part of them."""

    def unwrap(s: str) -> str:
        return s[1:-1] if s.startswith("(") else s

    head = _top_split(split_repeat(rid)[0], "<")
    if len(head) != 2:
        raise ValueError(f"not a debate response id: {rid!r}")
    own, rest = head
    full, *brief = _top_split(rest, "|")
    peers = [unwrap(p) for p in _top_split(full, "+")]
    return unwrap(own), peers, [unwrap(b) for b in _top_split(brief[0], "+")] if brief else []


def agent_of(rid: str) -> int:
    """The agent whose response `rid` is (the root of its chain of own responses)."""
    while "<" in rid:
        rid = split_id(rid)[0]
    return int(rid)


class RecordingBackend:
    """Wraps any backend: memoises calls per (question id, response id) and records them."""

    def __init__(self, inner: Backend, run_ahead: bool = False):
        self.inner = inner
        self.run_ahead = run_ahead
        self._memo: dict[tuple[str, str], Any] = {}
        self.initials: dict[str, list[Response]] = {}
        self.debates: dict[str, dict[str, Response | None]] = {}  # in order of first request
        self.hits = 0
        self.misses = 0
        self._ahead: dict[tuple[str, str], asyncio.Task] = {}  # prefetched, not asked for yet
        # prefetched debates: started, asked for later, never asked for (and the tokens those cost)
        self.ahead = {"started": 0, "used": 0, "unused": 0, "unused_tokens": 0}

    async def _once(self, key: tuple[str, str], make: Callable[[], Awaitable[Any]]) -> Any:
        got = self._memo.get(key)
        if got is not None:
            self.hits += 1
            return await got if isinstance(got, asyncio.Future) else got
        self.misses += 1
        fut = asyncio.get_running_loop().create_future()
        self._memo[key] = fut  # callers arriving while this is computed wait for it
        try:
            value = await make()
        except BaseException as exc:
            del self._memo[key]
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: nobody may be waiting
            raise
        fut.set_result(value)
        if self._memo.get(key) is fut:  # not forgotten meanwhile (an unused prefetch outliving its question)
            self._memo[key] = value
        return value

    async def initial(self, q: Question, n: int) -> list[Response]:
        out = await self._once((q.id, f"initial/{n}"), lambda: self.inner.initial(q, n))
        self.initials.setdefault(q.id, out)
        await settle([r.answer for r in out], q.answer_type, gold=q.gold)  # sympy off the event loop
        return list(out)

    def prefetch(self, q: Question, own: Response, peers: Sequence[Response],
                 brief: Sequence[Response] = (), *, repeat: int = 1) -> None:
        """Start a debate the caller may ask for next (only with run_ahead; otherwise nothing)."""
        key = (q.id, _debate_rid(own, peers, brief, repeat))
        if not self.run_ahead or key in self._memo or key in self._ahead:
            return
        self.ahead["started"] += 1
        task = asyncio.get_running_loop().create_task(
            self._once(key, lambda: self.inner.debate(q, own, peers, brief, repeat=repeat)))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure surfaces when asked for
        self._ahead[key] = task

    async def debate(self, q: Question, own: Response, peers: Sequence[Response],
                     brief: Sequence[Response] = (), *, repeat: int = 1) -> Response:
        rid = _debate_rid(own, peers, brief, repeat)
        if self._ahead.pop((q.id, rid), None) is not None:
            self.ahead["used"] += 1
        seen = self.debates.setdefault(q.id, {})
        seen.setdefault(rid, None)
        resp = await self._once((q.id, rid),
                                lambda: self.inner.debate(q, own, peers, brief, repeat=repeat))
        seen[rid] = resp
        known = [*self.initials.get(q.id, []), *filter(None, seen.values())]  # settle: sympy off the event loop
        await settle([resp.answer], q.answer_type, against=[r.answer for r in known], gold=q.gold)
        return resp

    def recorded(self, qid: str) -> list[Response]:
        """Question `qid`'s initial responses, then the debates asked for (in order of first request)."""
        return [*self.initials[qid], *(r for r in self.debates.get(qid, {}).values() if r is not None)]

    def trace_row(self, q: Question, priors: Sequence[float | None] | None = None) -> dict:
        """The trace.jsonl line of question `q` from what was recorded for it."""
        n = len(self.initials[q.id])
        recorded = self.recorded(q.id)
        return trace_row(q, recorded[:n], recorded[n:], priors)

    def forget(self, qid: str) -> None:
        """Drop a written question's records and memo (they are in the trace now). Its prefetched
        debates nobody asked for are counted as unused; one still computing finishes unrecorded."""
        for key in [k for k in self._ahead if k[0] == qid]:
            self.ahead["unused"] += 1
            self._ahead.pop(key).add_done_callback(self._count_unused)
        self.initials.pop(qid, None)
        self.debates.pop(qid, None)
        for key in [k for k in self._memo if k[0] == qid]:
            del self._memo[key]

    def _count_unused(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            r = task.result()
            self.ahead["unused_tokens"] += r.completion_tokens + r.computed_tokens


def _debate_rid(own: Response, peers: Sequence[Response], brief: Sequence[Response], repeat: int) -> str:
    """The response id of a debate call, as `debate` records it and `prefetch` announces it."""
    return debate_id(own.id, [p.id for p in peers], [b.id for b in brief], repeat)


# ---------------------------------------------------------------- rows <-> responses

def _tokens(r: Response) -> dict:
    out = {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
           "computed_tokens": r.computed_tokens, "signals": dict(r.signals), "text": r.text,
           "reasoning": r.reasoning, "final": r.final}
    if r.finish_reason is not None:
        out["finish_reason"] = r.finish_reason
    return out


def trace_row(q: Question, initial: Sequence[Response], debates: Iterable[Response],
              priors: Sequence[float | None] | None = None) -> dict:
    """One trace.jsonl line. A debate's `sender` is the agent of its single peer when it has
    exactly one full peer and no brief ones (a pairwise debate), else null; `repeat` is k for the
    k-th time its call was asked (1 for most); `outcome` compares the new answer with the
    receiver's previous one (the `own` response it continued)."""
    at = q.answer_type
    by_id = {r.id: r for r in initial}
    agents = [{"agent": r.agent, "id": r.id, "answer": r.answer,
               "prior": None if priors is None else priors[r.agent],
               "correct": is_correct(r.answer, q.gold, at), **_tokens(r)} for r in initial]
    rows = []
    for d in debates:
        by_id[d.id] = d
        own, peers, brief = split_id(d.id)
        prev = by_id.get(own)
        outcome = None if prev is None else (
            "retained" if equivalent(d.answer, prev.answer, at) else "changed")
        rows.append({"id": d.id, "sender": agent_of(peers[0]) if len(peers) == 1 and not brief
                     else None, "receiver": d.agent, "repeat": split_repeat(d.id)[1],
                     "round": d.round, "peers": list(d.peers),
                     "brief": list(d.brief), "answer": d.answer, "outcome": outcome, **_tokens(d)})
    return {"id": q.id, "gold": q.gold, "answer_type": at, "question": q.question,
            "agents": agents, "debates": rows}


def _response(entry: dict, agent: int, round_: int = 0) -> Response:
    return Response(id=str(entry["id"]), agent=agent, answer=entry.get("answer"),
                    text=entry.get("text", ""), signals=dict(entry.get("signals") or {}),
                    prompt_tokens=int(entry.get("prompt_tokens") or 0),
                    completion_tokens=int(entry.get("completion_tokens") or 0),
                    computed_tokens=int(entry.get("computed_tokens") or 0), round=round_,
                    peers=tuple(entry.get("peers", ())), brief=tuple(entry.get("brief", ())),
                    reasoning=entry.get("reasoning", ""), final=entry.get("final", True),
                    finish_reason=entry.get("finish_reason"))


def row_question(row: dict) -> Question:
    return Question(id=str(row["id"]), question=row.get("question", ""), gold=row["gold"],
                    answer_type=row.get("answer_type", "math"))


def row_initial(row: dict) -> list[Response]:
    """The initial responses of a trace line, by agent index."""
    return [_response(a, int(a["agent"])) for a in sorted(row["agents"], key=lambda a: a["agent"])]


def row_debates(row: dict) -> dict[str, Response]:
    """The debate responses of a trace line, by response id."""
    return {str(d["id"]): _response(d, int(d["receiver"]), int(d.get("round", 1)))
            for d in row.get("debates", [])}


def row_priors(row: dict) -> list[float | None]:
    return [a.get("prior") for a in sorted(row["agents"], key=lambda a: a["agent"])]


# ---------------------------------------------------------------- files

def append_trace(path: str | Path, row: dict) -> None:
    """Append one line and flush it (an interrupted run loses at most the question in flight)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()


def write_trace(path: str | Path, rows: Iterable[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


class TraceError(ValueError):
    """A malformed line of a run file, named by file, line and field."""


class TornLineWarning(UserWarning):
    """A last line without its end (a run stopped while writing it): ignored."""


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of a JSONL file; nothing when absent. A torn last line is skipped with a
    TornLineWarning; any other line that is not a JSON object is a TraceError naming it."""
    path = Path(path)
    if not path.exists():
        return
    lines = path.read_bytes().split(b"\n")
    torn = lines.pop()  # after the last newline: b"" unless the last write was cut short
    for i, raw in enumerate(lines, 1):
        if raw.strip():
            yield i, _parse(path, i, raw)
    if torn.strip():
        try:
            row = json.loads(torn)
        except (json.JSONDecodeError, UnicodeDecodeError):
            warnings.warn(f"{path}:{len(lines) + 1}: the last line is incomplete (a run stopped while writing it?); "
                          "ignored", TornLineWarning, stacklevel=3)
            return
        if not isinstance(row, dict):
            raise TraceError(f"{path}:{len(lines) + 1}: not a JSON object")
        yield len(lines) + 1, row


def _parse(path: Path, line: int, raw: bytes) -> dict:
    try:
        row = json.loads(raw)
    except UnicodeDecodeError:
        raise TraceError(f"{path}:{line}: not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:{line}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{path}:{line}: not a JSON object")
    return row


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file; [] when absent (see iter_jsonl for torn and malformed lines)."""
    return [row for _, row in iter_jsonl(path)]


def read_trace(path: str | Path) -> list[dict]:
    """Trace lines in file order, each checked and completed by `normalize_row`; a later line for an
    id replaces an earlier one."""
    if not Path(path).exists():
        raise FileNotFoundError(f"trace {path} does not exist")
    rows: dict[str, dict] = {}
    for line, row in iter_jsonl(path):
        row = normalize_row(row, f"{path}:{line}")
        rows.pop(row["id"], None)
        rows[row["id"]] = row
    return list(rows.values())


def normalize_row(row: dict, where: str = "trace line") -> dict:
    """Check a trace line and fill in what the minimal form leaves out: agents are indexed by their
    position when they have no "agent" (and no "id": then str(index)); a pairwise debate without an
    "id" gets "r<s" from its receiver and sender ("r<s#k" for the k-th debate of the same pair, or
    its "repeat": k). A problem is a TraceError naming `where` and the field."""

    def bad(field: str, problem: str):
        raise TraceError(f"{where}: {field}: {problem}")

    def count(obj: dict, field: str, name: str) -> None:
        v = obj.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            bad(f"{field}.{name}", f"expected a count, got {v!r}")

    def response(obj, field: str) -> None:
        if not isinstance(obj, dict):
            bad(field, "not a JSON object")
        if "answer" not in obj:
            bad(f"{field}.answer", "missing")
        for name in ("prompt_tokens", "completion_tokens", "computed_tokens"):
            count(obj, field, name)
        if obj.get("signals") is not None and not isinstance(obj["signals"], dict):
            bad(f"{field}.signals", "not a JSON object")

    for name in ("id", "gold"):
        if row.get(name) is None:
            bad(name, "missing")
    if row.get("answer_type", "math") not in ANSWER_TYPES:
        bad("answer_type", f"{row['answer_type']!r} is not one of {', '.join(ANSWER_TYPES)}")
    agents = row.get("agents")
    if not isinstance(agents, list):
        bad("agents", "missing or not a list")
    n, out_agents = len(agents), []
    for i, a in enumerate(agents):
        response(a, f"agents[{i}]")
        k = a.get("agent", i)
        if isinstance(k, bool) or not isinstance(k, int):
            bad(f"agents[{i}].agent", f"expected an agent index, got {k!r}")
        prior = a.get("prior")
        if prior is not None and (isinstance(prior, bool) or not isinstance(prior, (int, float))):
            bad(f"agents[{i}].prior", f"expected a number, got {prior!r}")
        out_agents.append({**a, "agent": k, "id": str(a.get("id", k))})
    if sorted(a["agent"] for a in out_agents) != list(range(n)):
        bad("agents", f"agent indices {sorted(a['agent'] for a in out_agents)} are not 0..{n - 1}")
    debates = row.get("debates") or []
    if not isinstance(debates, list):
        bad("debates", "not a list")
    out_debates, pairs = [], Counter()

    def agent_index(value, field: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
            bad(field, f"expected an agent index 0..{n - 1}, got {value!r}")
        return value

    for j, d in enumerate(debates):
        field = f"debates[{j}]"
        response(d, field)
        sender, receiver, rid = d.get("sender"), d.get("receiver"), d.get("id")
        if sender is not None:
            agent_index(sender, f"{field}.sender")
        if rid is None:
            if sender is None or receiver is None:
                bad(field, "no 'id', and no 'sender' and 'receiver' to tell which debate it is")
            agent_index(receiver, f"{field}.receiver")
            pairs[sender, receiver] += 1
            repeat = d.get("repeat", pairs[sender, receiver])
            rid = debate_id(str(receiver), [str(sender)]) + (f"#{repeat}" if repeat != 1 else "")
        rid = str(rid)
        if receiver is None:
            try:
                receiver = agent_of(rid)
            except ValueError as exc:
                bad(f"{field}.id", str(exc))
        agent_index(receiver, f"{field}.receiver")
        peers = d.get("peers") or ([str(sender)] if sender is not None else [])
        out_debates.append({**d, "id": rid, "receiver": receiver, "round": d.get("round", 1), "peers": peers})
    return {**row, "id": str(row["id"]), "agents": out_agents, "debates": out_debates}
