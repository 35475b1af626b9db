"""What the agents are told: the initial prompt and DebateFormat (Du et al., 2024).

Prompts are lists of chat messages whose contents may mix text and token lists (see
`models.chat`), so a peer's response enters a debate as the exact tokens it generated.
"""

from __future__ import annotations

from svrmad_local.debate.types import Question, Response
from svrmad_local.signals import CONFIDENCE_INSTRUCTION

ANSWER_FORMAT = {
    "math": "Solve the problem step by step, and put your final answer within \\boxed{}.",
    "mc": "Think it through, then give the letter of the correct option on its own line as \"Answer: (X)\".",
}


def instruction(q: Question, elicit_confidence: bool) -> str:
    text = ANSWER_FORMAT[q.answer_type]
    return f"{text} {CONFIDENCE_INSTRUCTION}" if elicit_confidence else text


def initial_messages(q: Question, elicit_confidence: bool = True) -> list[dict]:
    return [{"role": "user", "content": f"{q.question}\n\n{instruction(q, elicit_confidence)}"}]


def shown(r: Response):
    """What a peer's response shows: its final response, never hidden reasoning (as an API returns
    it), as exact tokens where the backend has them."""
    return r.final_tokens or r.text


def debate_format(q: Question, peers: list[Response], brief: list[Response], elicit_confidence: bool = True) -> list:
    """The user turn that carries peers' full responses (and, for GroupDebate, other agents'
    final answers only), then asks the receiver to answer again."""
    parts: list = ["These are the solutions to the problem from other agents:"]
    for p in peers:
        parts += ["\n\nOne agent solution: ```", shown(p), "```"]
    if brief:
        answers = ", ".join(str(b.answer) if b.answer is not None else "(no answer)" for b in brief)
        parts.append(f"\n\nFinal answers from the other agents: {answers}")
    parts.append("\n\nUsing the solutions from other agents as additional information, can you provide your "
                 f"answer to the problem? {instruction(q, elicit_confidence)}")
    return parts
