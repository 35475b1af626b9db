"""LaTeX as text: brace groups, unwrapping commands, splitting at top level.

Model outputs can be any length and shape (a model stuck in a loop writes 200k characters of
`\\boxed{` or newlines), so every function here makes one pass over its input: brace groups are
matched once for the whole text with a stack, never by rescanning from each opening brace.
"""

from __future__ import annotations

import functools
import re

_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.S)  # an escaped character (\{, \\) is never a brace


def match_braces(text: str) -> dict[int, int]:
    """{index of a '{': index of its matching '}'} for every balanced group of `text`."""
    close: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE_TOKEN.finditer(text):
        c = m.group()
        if c == "{":
            stack.append(m.start())
        elif c == "}" and stack:
            close[stack.pop()] = m.start()
    return close


def unwrap(text: str, commands: tuple[str, ...], space: bool = False) -> str:
    r"""Replace \cmd{X} by X for each command, nested ones too (`\text{\textbf{5}}` -> `5`); with
    `space`, by " X" (`5\text{cm}` -> `5 cm`: a word that was text stays a word)."""
    pattern = re.compile(r"\\(?:%s)(?![A-Za-z])\s*" % "|".join(commands))
    close = None
    cuts: list[tuple[int, int]] = []
    for m in pattern.finditer(text):
        if close is None:
            close = match_braces(text)
        end = close.get(m.end())
        if end is not None:
            cuts += [(m.start(), m.end() + 1), (end, end + 1)]
    if not cuts:
        return text
    out, pos = [], 0
    for start, stop in sorted(cuts):
        out.append(text[pos:start])
        if space and text[start] == "\\":
            out.append(" ")
        pos = stop
    out.append(text[pos:])
    return "".join(out)


@functools.lru_cache(maxsize=None)
def _splitter(seps: tuple[str, ...]) -> re.Pattern:
    alternatives = [r"\\[{}\\]"]  # \{ \} count as brackets; \\ (a row break) is no separator
    alternatives += [re.escape(s) + (r"(?![A-Za-z])" if s[0] == "\\" else "") for s in seps]
    return re.compile("|".join(alternatives + [r"[()\[\]{}]"]))


def split_top(text: str, seps: tuple[str, ...] = (",",)) -> list[str]:
    """Split on separators outside any bracket; intervals like (a,b] count as balanced."""
    parts, depth, last = [], 0, 0
    for m in _splitter(seps).finditer(text):
        t = m.group()
        if t in ("(", "[", "{", "\\{"):
            depth += 1
        elif t in (")", "]", "}", "\\}"):
            depth -= 1
        elif depth == 0 and t != "\\\\":
            parts.append(text[last : m.start()])
            last = m.end()
    parts.append(text[last:])
    return parts


def balanced(s: str) -> bool:
    """Brackets of every kind close in order of depth (not of kind: "(0,1]" is balanced)."""
    depth = 0
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0
