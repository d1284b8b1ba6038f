"""The errors PIR raises: every one names what was wrong and where."""

from __future__ import annotations


class IRError(ValueError):
    """Base class of PIR errors (a ``ValueError``, like the op table's ``OpError``)."""


class ParseError(IRError):
    """Bad PIR text. ``line`` and ``column`` (1-based) point at the offending token; ``reason``
    is the message without the position; the source line and a caret follow the message."""

    def __init__(self, reason: str, line: int = 0, column: int = 0, source_line: str | None = None) -> None:
        msg = f"{line}:{column}: {reason}" if line else reason
        if source_line is not None:
            msg += f"\n    {source_line}\n    {' ' * max(column - 1, 0)}^"
        super().__init__(msg)
        self.line, self.column, self.reason = line, column, reason


class VerifyError(IRError):
    """A program that breaks an IR rule (SSA, types, attributes, terminators).

    ``op`` is the offending operation when there is one; the message shows it in text form.
    ``location`` is its (line, column) when the program came from text; ``reason`` is the
    message without that position.
    """

    def __init__(self, reason: str, op: object = None, location: tuple[int, int] | None = None) -> None:
        super().__init__(f"{location[0]}:{location[1]}: {reason}" if location else reason)
        self.op, self.location, self.reason = op, location, reason
