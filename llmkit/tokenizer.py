"""The tokenizer: a sentencepiece model kept as its bytes (``tokenizer.model``).

One class for every user: training packs data with it, the models save and load it next to their
weights, and the engine and the server (which never import model code) read it from the static
model file. ``models.llama.tokenizer`` trains new ones with Llama's recipe (``LlamaTokenizer`` is
this class under its Hugging Face name).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm

from llmkit.framework.files import atomic_write

MODEL_FILE = "tokenizer.model"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used (the message names the file)."""


class Tokenizer:
    """Text <-> token ids with a sentencepiece model.

    The serialized model is kept (``model_proto``), so the tokenizer can be saved, shipped in a
    static model file and hashed (data caches are keyed by ``sha256``) without the file it came
    from. ``token_bytes`` gives the bytes one token contributes to the text (for logprobs).
    """

    def __init__(self, model_proto: bytes) -> None:
        self.model_proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        self._bytes: list[bytes | None] = [None] * self._sp.get_piece_size()

    @classmethod
    def of(cls, tokenizer: Any) -> Tokenizer:
        """``tokenizer`` itself, or a Tokenizer of anything holding a sentencepiece ``model_proto``."""
        if isinstance(tokenizer, Tokenizer):
            return tokenizer
        proto = getattr(tokenizer, "model_proto", None)
        if proto is None:
            raise TypeError(
                f"cannot use {type(tokenizer).__name__} as a tokenizer: it has no sentencepiece model_proto"
            )
        return cls(proto)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load ``path/tokenizer.model`` (or ``path`` itself when it is the model file)."""
        path = Path(path)
        file = path / MODEL_FILE if path.is_dir() else path
        if not file.is_file():
            where = f"no {MODEL_FILE} in {path}" if path.is_dir() else f"{path} does not exist"
            raise FileNotFoundError(f"cannot load tokenizer: {where}")
        try:
            return cls(file.read_bytes())
        except RuntimeError:  # sentencepiece: "could not parse ModelProto"
            raise TokenizerError(f"cannot load tokenizer: {file} is not a sentencepiece model") from None

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``directory/tokenizer.model`` atomically; return its path."""
        file = Path(directory) / MODEL_FILE
        atomic_write(file, self.model_proto)
        return file

    @property
    def sha256(self) -> str:
        """Hex digest of the model bytes: identifies the tokenizer in cache keys."""
        return hashlib.sha256(self.model_proto).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    @property
    def pad_id(self) -> int | None:
        """The pad piece's id, or None when the model has none (Llama's convention)."""
        pad = self._sp.pad_id()
        return None if pad < 0 else pad

    def id_to_piece(self, token_id: int) -> str:
        self._check_ids([token_id])
        return self._sp.id_to_piece(int(token_id))

    def is_control(self, token_id: int) -> bool:
        return bool(self._sp.is_control(int(token_id)))

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally wrapped in bos/eos."""
        return self._sp.encode(text, add_bos=add_bos, add_eos=add_eos)

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool = True, add_eos: bool = False, num_threads: int = -1
    ) -> list[list[int]]:
        """``encode`` of each text, on ``num_threads`` sentencepiece threads (-1: one per core)."""
        return self._sp.encode(list(texts), add_bos=add_bos, add_eos=add_eos, num_threads=num_threads)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """The text of ``ids``. Control pieces (bos, eos) are dropped, or with skip_special=False
        written as their pieces ("<s>", "</s>")."""
        ids = [int(i) for i in ids]
        self._check_ids(ids)
        if skip_special:
            return self._sp.decode(ids)  # sentencepiece decodes control pieces to ""
        parts, run = [], []
        for i in ids:
            if self._sp.is_control(i):
                parts += [self._sp.decode(run), self._sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join([*parts, self._sp.decode(run)])

    def decode_batch(self, batch: Iterable[Iterable[int]], skip_special: bool = True) -> list[str]:
        return [self.decode(ids, skip_special=skip_special) for ids in batch]

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

    def _check_ids(self, ids: Sequence[int]) -> None:
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for a vocabulary of {n} pieces")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"
