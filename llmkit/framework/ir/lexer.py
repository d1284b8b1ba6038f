"""Tokens of the PIR text form, with positions for error messages.

Comments run from ``//`` to the end of the line. Token kinds: ``value`` (``%x``), ``symbol``
(``@main``), ``label`` (``^bb0``), ``hash`` (``#shard``), ``ident`` (``llm.add``, ``f32``, ``B``),
``int``, ``float``, ``hex`` (``0x00FF``), ``string`` (JSON-style escapes), ``->`` and single-char
punctuation. Positions are byte offsets turned into line:column only when needed.
"""

from __future__ import annotations

import bisect
import json
import re
from typing import NoReturn

from .errors import ParseError

# Whitespace and comments are a possessive prefix of each match (one match per token, and no
# backtracking into a comment); alternatives are ordered by how often they occur, longest first
# where two could match ("->" before "-", hex and float before int).
_TOKEN = re.compile(
    r"""
    (?:\s++|//[^\n]*+)*+
    (?:
      (?P<arrow>->)
    | (?P<punct>[(){}\[\]<>,:=*+\-])
    | (?P<value>%[A-Za-z0-9_.$]+)
    | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
    | (?P<hex>0x[0-9A-Fa-f]*)
    | (?P<float>\d+\.\d*(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)
    | (?P<int>\d+)
    | (?P<string>"(?:\\.|[^"\\\n])*")
    | (?P<symbol>@[A-Za-z0-9_.$]+|@"(?:\\.|[^"\\\n])*")
    | (?P<label>\^[A-Za-z0-9_.$]+)
    | (?P<hash>\#[A-Za-z_][A-Za-z0-9_.]*)
    )
    """,
    re.VERBOSE,
)
_SKIP = re.compile(r"(?:\s++|//[^\n]*+)*+")

EOF_KIND = "eof"


class Tokens:
    """The token stream of one text: parallel lists ``kinds``, ``texts``, ``offsets``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._line_starts: list[int] | None = None
        kinds: list[str] = []
        texts: list[str] = []
        offsets: list[int] = []
        pos = 0
        for m in _TOKEN.finditer(text):
            if m.start() != pos:  # finditer skipped something no token matches
                break
            pos = m.end()
            kind = m.lastgroup
            kinds.append("punct" if kind == "arrow" else kind)  # type: ignore[arg-type]
            texts.append(m.group(kind))  # type: ignore[arg-type]
            offsets.append(m.start(kind))  # type: ignore[arg-type]
        pos = _SKIP.match(text, pos).end()  # type: ignore[union-attr]  (trailing whitespace)
        if pos != len(text):
            self.fail(f"unexpected character {text[pos]!r}", pos)
        kinds.append(EOF_KIND)
        texts.append("")
        offsets.append(len(text))
        self.kinds, self.texts, self.offsets = kinds, texts, offsets

    def position(self, offset: int) -> tuple[int, int]:
        """(line, column), both 1-based."""
        if self._line_starts is None:
            self._line_starts = [0] + [m.end() for m in re.finditer(r"\n", self.text)]
        line = bisect.bisect_right(self._line_starts, offset)
        return line, offset - self._line_starts[line - 1] + 1

    def source_line(self, line: int) -> str:
        self.position(0)
        starts = self._line_starts or [0]
        start = starts[line - 1]
        end = self.text.find("\n", start)
        return self.text[start : end if end >= 0 else len(self.text)]

    def fail(self, reason: str, offset: int) -> NoReturn:
        line, col = self.position(offset)
        raise ParseError(reason, line, col, self.source_line(line))


def unquote(tok: str) -> str:
    """The value of a string token (JSON escapes)."""
    try:
        v = json.loads(tok)
    except ValueError:
        raise ValueError(f"bad string literal {tok}") from None
    if not isinstance(v, str):
        raise ValueError(f"bad string literal {tok}")
    return v


def describe(kind: str, text: str) -> str:
    """How a token reads in an error message."""
    return "end of input" if kind == EOF_KIND else repr(text)
