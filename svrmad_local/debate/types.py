"""The vocabulary shared by methods, backends and traces.

A method never touches tensors: it sees `Question`s and `Response`s and talks to a `Backend`.
Three things implement the backend: the real engine (`debate.engine_backend`), a replay of
recorded outcomes (`debate.replay_backend`) and scripted agents for tests (`debate.scripted`).

Response ids are deterministic and compositional, so a replay can find a recorded response from
the structure of the call alone:
  - initial response of agent i:  "i"                          e.g. "3"
  - a debate: receiver's own previous response id, "<", the peers' response ids joined by "+",
    then optionally "|" and the ids whose final answers only are shown (GroupDebate):
        "2<4"            agent 2 (own initial "2") after hearing agent 4's initial response
        "0<1+2+3+4+5"    all-to-all round 1 for agent 0
        "(0<1+2)<(1<0+2)+(2<0+1)"   round 2 (ids of compound responses are parenthesised)
  - a repeat of a debate (the same call asked again as a new, independent sample: SVR-MAD
    re-selecting a pair) appends "#k" for its k-th time, k = 2, 3, ...; the first is unmarked:
        "2<4#2"          agent 2's second debate against agent 4's initial response
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

ANSWER_TYPES = ("math", "mc")


@dataclass
class Question:
    """One evaluation item. `answer_type` is "math" (free-form, graded by equivalence) or "mc"
    (a choice letter; `choices` holds the option texts in letter order)."""

    id: str
    question: str
    gold: str
    answer_type: str = "math"
    choices: list[str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Response:
    """One agent's message: an initial response or the receiver's reply after a debate.

    Token counts follow the paper's accounting: `prompt_tokens` is what an API would bill for the
    call that produced this response (the whole prompt, every time), `completion_tokens` what it
    generated; `computed_tokens` is how many prompt tokens the engine actually ran through the
    model after KV-cache reuse (replay and scripted backends report what was recorded, or 0).
    `signals` holds the prior/posterior numbers of `svrmad_local.signals` (min_ll, ppl,
    mean_entropy, conf_*, self_conf); a value may be None when it could not be computed.

    For a reasoning model `text` is the final response (what an API returns as the message, what
    peers see, where the answer and self-confidence are read) and `reasoning` the hidden part;
    `tokens` is the whole completion, `final_tokens` the final response's exact tokens. `final` is
    False when the completion ended inside its reasoning (no final response: answer None);
    `finish_reason` is the engine's "stop" | "length" (None where not recorded).
    """

    id: str
    agent: int
    answer: str | None
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    signals: dict[str, float | None] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    computed_tokens: int = 0
    round: int = 0
    peers: tuple[str, ...] = ()
    brief: tuple[str, ...] = ()
    reasoning: str = ""
    final_tokens: list[int] = field(default_factory=list)
    final: bool = True
    # Why generation ended: "stop", "length" (max tokens or the context's end), "context" (the
    # prompt itself outgrew the model's context: nothing was generated, the answer is None), or
    # None where the backend does not say (scripted).
    finish_reason: str | None = None
    # Backend-private handle (e.g. the prompt segments an engine backend needs to extend this
    # response's context in a later round). Never serialised.
    context: Any = field(default=None, repr=False, compare=False)
    # (log-probs, entropies) per completion token, kept only when the run saves them
    # (`svrmad run --save-token-stats`, analysis/token_files.py); never in the trace.
    token_stats: Any = field(default=None, repr=False, compare=False)

    @property
    def tokens_total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _wrap(rid: str) -> str:
    return f"({rid})" if ("<" in rid or "|" in rid) else rid


def debate_id(own: str, peers: Sequence[str], brief: Sequence[str] = (), repeat: int = 1) -> str:
    """The id of the response `own`'s agent gives after seeing `peers` (full) and `brief` (answers
    only), the `repeat`-th time this call is asked (1-based)."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    rid = f"{_wrap(own)}<{'+'.join(_wrap(p) for p in peers)}"
    if brief:
        rid += "|" + "+".join(_wrap(b) for b in brief)
    return rid if repeat == 1 else f"{rid}#{repeat}"


class Backend(Protocol):
    """What a method may ask for. All calls are coroutines so many questions run concurrently."""

    async def initial(self, q: Question, n: int) -> list[Response]:
        """The n independent initial responses (ids "0".."n-1", agent = index)."""
        ...

    async def debate(
        self, q: Question, own: Response, peers: Sequence[Response], brief: Sequence[Response] = (),
        *, repeat: int = 1,
    ) -> Response:
        """`own.agent` (the receiver) continues its own context `own` after a DebateFormat message
        carrying the full `peers` responses and the final answers only of `brief`; returns its new
        response, id `debate_id(own.id, [p.id...], [b.id...], repeat)`, round = own.round + 1.
        A pairwise debate sender -> receiver is `debate(q, initial[receiver], [initial[sender]])`.
        `repeat` = k > 1 asks the same call for the k-th time: the same prompt, a new independent
        sample (its own id, so its own seed and its own trace entry)."""
        ...
