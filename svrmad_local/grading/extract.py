"""The final answer stated in a model response (docs/grading.md lists the rules in order).

Responses are untrusted text of any length: nothing here raises, and every step is linear in the
length of the response (no regex may rescan a long run from each of its positions; brace groups
are matched once; at most MAX_CANDIDATES boxes or answer lines are examined, the last ones).
"""

from __future__ import annotations

import logging
import re

from svrmad_local.grading.text import match_braces, unwrap
from svrmad_local.signals import strip_confidence

log = logging.getLogger(__name__)

__all__ = ["extract_answer"]

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MAX_CANDIDATES = 64  # boxes / answer lines looked at, from the last: a looping model writes thousands
MAX_OPTION_CHARS = 4000  # of a box or an answer line, read for a letter or an option's text


def extract_answer(text: str, answer_type: str, choices: list[str] | None = None) -> str | None:
    """The final answer stated in a model response, or None when none can be found.

    Math: the last \\boxed{} wins, then an "Answer:"/"final answer is" line, then the last number.
    MC: the uppercase letter (see docs/grading.md for the order of the patterns)."""
    try:
        if not text:
            return None
        body = strip_confidence(text)  # "Confidence: 85%" must never be read as the answer
        if answer_type == "mc":
            return _extract_mc(body, choices)
        return _extract_math(body)
    except Exception:  # untrusted text: never propagate
        log.debug("extract_answer failed", exc_info=True)
        return None


# ----------------------------------------------------------------------------- boxes

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])[ \t]*")
_BARE = re.compile(r"[^\s${}\\]{1,100}")  # `\boxed 5`: one token, as LaTeX reads it
_NONSPACE = re.compile(r"\S")


def boxed(text: str, limit: int = MAX_CANDIDATES) -> list[str]:
    r"""Contents of the last `limit` non-empty \boxed{...} / \fbox{...} (or brace-less `\boxed 5`),
    in order. Nested boxes each count (`\boxed{\boxed{5}}` gives the outer, then `5`)."""
    spans = []
    close = None
    for m in _BOX.finditer(text):
        start = m.end()
        if text.startswith("{", start):
            if close is None:
                close = match_braces(text)
            end = close.get(start)
            if end is None:
                continue
            start += 1
        else:
            bare = _BARE.match(text, start)
            if not bare:
                continue
            end = bare.end()
        if _NONSPACE.search(text, start, end):  # scans only up to the first non-space
            spans.append((start, end))
    return [text[a:b].strip() for a, b in spans[-limit:]]


# ----------------------------------------------------------------------------- math

# Markers are found alone (not with their line), so that every marker of a line counts:
# "Final Answer: The final answer is $g$." ends with the second one.
_ANSWER_MARK = re.compile(r"\banswer[ \t*]*(?:is\b|:|=)|####", re.I)
_MC_MARK = re.compile(r"\b(?:answer|option|choice)[ \t*]*(?:is\b|:|=)", re.I)
_GAP = re.compile(r"[\s*:]*")  # after a marker, the answer may start on a later line ("**Answer:**\n42")
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]")
# After the answer, a sentence goes on: "$g$. I hope it is correct.", "42, as required."
_SENTENCE_END = re.compile(r"\.(?:\s|$)|;|,\s+(?=(?:as|which|since|because|so|where|when|thus|hence|therefore|"
                           r"but|we|this|that|it|if|for|given|using|by|with|note)\b)", re.I)


def _after(text: str, marks: list[re.Match]) -> list[tuple[str, int]]:
    """For each marker: (the text of the line where its answer starts, the index after that line)."""
    out = []
    for m in marks:
        start = _GAP.match(text, m.end()).end()
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        out.append((text[start:end], end))
    return out


def _extract_math(text: str) -> str | None:
    boxes = boxed(text, 1)
    if boxes:
        return boxes[-1]
    last = None
    for last in _ANSWER_MARK.finditer(text):
        pass
    if last is not None:
        [(line, end)] = _after(text, [last])
        # "the answer is not obvious ... 42": a marker followed by more numbers was not final
        if not _NUMBER.search(text, end):
            answer = answer_of_line(line)
            if answer:
                return answer
    number = None
    for number in _NUMBER.finditer(text):
        pass
    return number.group() if number else None


def answer_of_line(rest: str) -> str:
    """The answer at the start of what follows an answer marker: a leading $...$ (or \\(...\\),
    \\[...\\]) span when it is the only span of its sentence, else the text up to the end of the
    sentence, markdown and a wrapping `$` stripped."""
    s = rest.strip().strip("*").strip()
    s = re.sub(r"^[:\s*]+", "", s)
    span = _MATH_SPAN.match(s)
    if span:  # "$g$. I hope it is correct." -> g; but "$5$ and $6$." is a sentence of two spans
        end = _SENTENCE_END.search(s, span.end())
        tail = s[span.end() : end.start() if end else len(s)]
        if "$" not in tail and "\\(" not in tail:
            return next(g for g in span.groups() if g is not None).strip()
    end = _SENTENCE_END.search(s)
    if end:
        s = s[: end.start()]
    s = s.rstrip(" .;*").strip()
    if len(s) > 2 and s[0] == s[-1] == "$":
        s = s.strip("$").strip()
    return s


# ----------------------------------------------------------------------------- multiple choice

def option_keys(text: str) -> tuple[str, str]:
    """(exact, loose) keys of an option's text: exact keeps case and signs (`-1` is not `1`, `pH`
    is not `PH`); loose also ignores case and punctuation other than signs and decimal points."""
    text = unwrap(text, ("text", "textbf", "mathrm", "mathbf")).replace("$", "")
    exact = re.sub(r"\s+", " ", text).strip().strip("*").strip().rstrip(".").strip()
    loose = re.sub(r"\s+", " ", re.sub(r"[^\w\s+\-.]|(?<!\d)\.|\.(?!\d)", " ", exact.casefold())).strip()
    return exact, loose


def _unique(hits: set[int], keys: list[tuple[str, str]]) -> int | None:
    """The one option hit; options with the very same text (a dataset's duplicates, as in a few
    CommonsenseQA rows) count as one, the first."""
    return min(hits) if hits and len({keys[i][0] for i in hits}) == 1 else None


def _extract_mc(text: str, choices: list[str] | None) -> str | None:
    valid = LETTERS[: len(choices)] if choices else LETTERS
    L = f"[{valid}]"
    keys = [option_keys(c) for c in choices] if choices else []
    # a letter is an answer when it stands alone: "B", "(B)", "B)", "B.", "B:", "**B**", "B) text";
    # not "E_av = 3" or "B12"
    label = re.compile(rf"^[ \t]*\**[ \t]*(?:\(({L})\)|({L})(?=$|[\s).:,;*]))")

    def letter_of(s: str) -> str | None:
        s = unwrap(s[:MAX_OPTION_CHARS], ("text", "textbf", "mathrm", "mathbf")).replace("$", "")
        m = label.match(s)
        if m:
            return m.group(1) or m.group(2)
        if keys:
            exact, loose = option_keys(s)
            for tier, key in ((0, exact), (1, loose)):
                hit = _unique({i for i, k in enumerate(keys) if key and k[tier] == key}, keys)
                if hit is not None:
                    return valid[hit]
        return None

    def last_of(found) -> str | None:
        for value in reversed(found):
            if value:
                return value
        return None

    markers = [line for line, _ in _after(text, list(_MC_MARK.finditer(text))[-MAX_CANDIDATES:])]
    lines = text.rstrip().rsplit("\n", 1)
    last_line = lines[-1].strip() if lines else ""
    last_label = re.match(rf"^[\s*#>]*(?:\(({L})\)|({L})[.):])(?=\s|\*|$)", last_line)
    stages = (
        lambda: last_of([letter_of(b) for b in boxed(text)]),
        lambda: last_of([letter_of(s) for s in markers]),
        lambda: last_label and (last_label.group(1) or last_label.group(2)),
        lambda: last_of(re.findall(rf"^[ \t*]*\(?({L})\)?[.)]?[ \t*]*$", text, re.M)),
        lambda: last_of(re.findall(rf"\(({L})\)", text)),
        lambda: _option_in_line(last_line, keys, valid),
    )
    for stage in stages:
        found = stage()
        if found:
            return found
    return None


def _option_in_line(line: str, keys: list[tuple[str, str]], valid: str) -> str | None:
    """The one option whose text the line names. An option named only inside another named
    option ("mall" in "shopping mall") does not count; case and signs count first (exact keys),
    then the loose keys."""
    if not keys or not line:
        return None
    exact_line, loose_line = option_keys(line)
    for tier, text in ((0, exact_line), (1, loose_line)):
        spans = {}
        for i, k in enumerate(keys):
            if k[tier] and k[tier] in text:  # `in` first: a regex pass over a long line only when needed
                found = [(m.start(), m.end()) for m in
                         re.finditer(rf"(?<![\w+\-]){re.escape(k[tier])}(?!\w)", text)]
                if found:
                    spans[i] = found
        inside = {i for i in spans for j in spans if i != j and all(
            any(a2 <= a and b <= b2 and (a2, b2) != (a, b) for a2, b2 in spans[j]) for a, b in spans[i])}
        hit = _unique(set(spans) - inside, keys)
        if hit is not None:
            return valid[hit]
    return None
