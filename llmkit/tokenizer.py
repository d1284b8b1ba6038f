"""A sentencepiece tokenizer read from model bytes: what the engine and the server use.

It needs nothing from ``llmkit.models`` (the server never imports model code); the static model
file ships ``tokenizer.model`` and this class reads it. ``Tokenizer.of(obj)`` adapts a
``LlamaTokenizer`` (or anything with ``model_proto``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import sentencepiece as spm

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class Tokenizer:
    """Text <-> token ids; ``token_bytes`` gives the bytes one token contributes (for logprobs)."""

    def __init__(self, model_proto: bytes) -> None:
        self.model_proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        self.vocab_size: int = self._sp.get_piece_size()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        self._bytes: list[bytes | None] = [None] * self.vocab_size

    @classmethod
    def of(cls, tokenizer: Any) -> Tokenizer:
        if isinstance(tokenizer, Tokenizer):
            return tokenizer
        proto = getattr(tokenizer, "model_proto", None)
        if proto is None:
            raise TypeError(
                f"cannot use {type(tokenizer).__name__} as a tokenizer: it has no sentencepiece model_proto"
            )
        return cls(proto)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self._sp.encode(text, add_bos=add_bos)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; control tokens (bos, eos) decode to nothing."""
        return self._sp.decode([int(i) for i in ids])

    def is_control(self, token_id: int) -> bool:
        return bool(self._sp.is_control(int(token_id)))

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes of one token as it appears in text (a byte-fallback piece is its byte)."""
        b = self._bytes[token_id]
        if b is None:
            piece = self._sp.id_to_piece(int(token_id))
            m = _BYTE_PIECE.match(piece)
            if m:
                b = bytes([int(m.group(1), 16)])
            elif self.is_control(token_id):
                b = b""
            else:
                b = piece.replace("\u2581", " ").encode()
            self._bytes[token_id] = b
        return b

    def token_text(self, token_id: int) -> str:
        """One token's text (a partial UTF-8 byte shows as U+FFFD, as OpenAI does)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")
