"""Incremental detokenization with stop strings: token ids in, stable text deltas out.

Text is decoded in a window of the last tokens: the window ``ids[prefix:]`` is decoded once per
token, and the new text is what follows ``decode(ids[prefix:read])``, where ``read`` is where the
text last ended on a whole character. The window keeps at least one token before ``read`` as
context: sentencepiece drops a word's leading space at the start of a decode (Llama's dummy
prefix), and the context keeps the space inside the window. Appended, the windows give the decode
of the whole sequence, at a bounded cost per token (decoding everything again cost O(length)). A
delta is released only when it can no longer change or be cut:

- a trailing U+FFFD is an incomplete UTF-8 character (byte-fallback pieces): held back;
- a suffix that is the start of a stop string is held back until the next token decides;
- when a stop string appears, the text ends right before it (OpenAI's behaviour).

So the concatenation of all deltas equals the final text, streaming or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

WINDOW = 16  # tokens a decode window grows to before it starts again from its last token


class Detokenizer:
    """``add(token) -> (delta, stopped)``; ``finish() -> delta`` releases what was held back."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.text = ""  # the output text so far (ends before a stop string once stopped)
        self._stable = ""  # the text of ids[:read]
        self._prefix = self._read = 0  # the decode window: ids[prefix:] (see the module docstring)
        self._before = 0  # characters of decode(ids[prefix:read])
        self._sent = 0  # characters of self.text already released
        self.stopped = False

    def add(self, token_id: int, visible: bool = True) -> tuple[str, bool]:
        """Append a token (``visible=False``: a stop token, counted but not part of the text)."""
        if self.stopped:
            raise RuntimeError("Detokenizer: token added after a stop string")
        if visible:
            self.ids.append(int(token_id))
            if self.tokenizer is not None:  # no tokenizer: token ids only, no text
                tail = self._window()
                self.text = self._stable + tail
        if self.stop:
            hit = self._find_stop()
            if hit is not None:
                self.text = self.text[:hit]
                self.stopped = True
                return self._release(len(self.text)), True
        return self._release(self._safe_end()), False

    def finish(self) -> str:
        """The rest of the text (at the end of generation nothing is pending any more)."""
        return self._release(len(self.text))

    def _window(self) -> str:
        """The text of ids[read:] (one decode of the window); moves the window on when it ends on a
        whole character."""
        text = self.tokenizer.decode(self.ids[self._prefix :])
        tail = text[self._before :]
        if not tail or tail.endswith("\ufffd"):
            return tail
        self._stable += tail
        self._read = len(self.ids)
        if self._read - self._prefix <= WINDOW:
            self._before = len(text)  # the next window starts where this one did
            return ""
        # A new window: the last token as context, or more while that decodes to nothing (a
        # control token keeps no leading space).
        start, before = self._read, ""
        while not before and start > 0:
            start -= 1
            before = self.tokenizer.decode(self.ids[start : self._read])
        self._prefix, self._before = start, len(before)
        return ""

    def _find_stop(self) -> int | None:
        # A new stop string can only end in text not yet released, so search from there back.
        start = max(0, self._sent - self._longest + 1)
        found = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        return min(found) if found else None

    def _safe_end(self) -> int:
        end = len(self.text)
        while end > self._sent and self.text[end - 1] == "\ufffd":
            end -= 1
        hold = 0  # the longest suffix that may still grow into a stop string
        for s in self.stop:
            for k in range(min(len(s) - 1, end - self._sent), hold, -1):
                if self.text.endswith(s[:k], 0, end):
                    hold = k
                    break
        return end - hold

    def _release(self, end: int) -> str:
        end = max(end, self._sent)
        delta = self.text[self._sent : end]
        self._sent = end
        return delta
