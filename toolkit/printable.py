"""Text from outside made safe to log or print: a peer's claimed name, a rejected message's fields, a process's log
line, a path found on a host. Every control character (newline, carriage return, escape, the C1 set, the Unicode
line separators and bidirectional overrides) is shown as a Python-style escape, and the length is bounded, so one
string can neither forge other lines of a log nor drive the terminal that shows it (docs/security.md)."""

from __future__ import annotations

import re
from typing import Any

# C0 controls and DEL, the C1 set, line/paragraph separators, bidirectional embeddings/overrides/isolates.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_CONTROL_BUT_TAB = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    if c == "\n":
        return "\\n"
    if c == "\r":
        return "\\r"
    if c == "\t":
        return "\\t"
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def clean(text: Any, limit: int | None = 200, tabs: bool = False) -> str:
    """`text` (made a str) with its control characters escaped (`\\n`, `\\x1b`, `\\u202e`; a tab kept as is with
    `tabs`) and cut to `limit` characters before escaping (None: no bound), the cut said: `...(+N)`."""
    s = str(text)
    cut = 0
    if limit is not None and len(s) > limit:
        s, cut = s[:limit], len(s) - limit
    s = (_CONTROL_BUT_TAB if tabs else _CONTROL).sub(_escape, s)
    return f"{s}...(+{cut})" if cut else s


def clean_lines(lines: list[str], tabs: bool = False) -> list[str]:
    """`clean(line, None, tabs)` of each line, without a bound; when no line needs it (the usual case), one search
    over them all: what following a fast printer costs is then per batch of lines, not per line."""
    pattern = _CONTROL_BUT_TAB if tabs else _CONTROL
    if pattern.search("".join(lines)) is None:
        return lines
    return [pattern.sub(_escape, line) for line in lines]
