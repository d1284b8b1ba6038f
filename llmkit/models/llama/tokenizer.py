"""LlamaTokenizer: a sentencepiece BPE model, plus training one with Llama's settings.

Meta's Llama 1/2 tokenizers are sentencepiece BPE models (`tokenizer.model`); this class reads them
as they are. `train_tokenizer` makes new ones with the same recipe, except `add_dummy_prefix=False`
so that decoding inverts encoding exactly: decode(encode(text)) == text for every string that does
not contain U+2581 ("▁", which sentencepiece uses to mark spaces and so turns into a space).

Special ids of trained models: unk 0, bos 1, eos 2, and no pad piece (pad_id is None), as in Meta's
Llama 2 tokenizer; packed pretraining needs no padding and inference masks padded positions, so any
id can fill them.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm

from llmkit.framework.files import atomic_write

MODEL_FILE = "tokenizer.model"


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used (the message names the file)."""


# sentencepiece trainer options for new tokenizers: Llama 2's recipe, changed where noted.
TRAINER_SETTINGS: dict[str, Any] = {
    "model_type": "bpe",
    "byte_fallback": True,  # unseen characters (and "\n", which never occurs in a training line) -> <0xNN>
    "split_digits": True,  # numbers become digit sequences, as in Llama
    "normalization_rule_name": "identity",  # no NFKC: the text is kept byte for byte
    "remove_extra_whitespaces": False,  # keep runs of spaces (indented code)
    "add_dummy_prefix": False,  # Llama: True; off so that decode(encode(x)) == x exactly
    "allow_whitespace_only_pieces": True,  # "▁▁▁▁" can be one piece (indentation)
    "split_by_whitespace": True,
    "character_coverage": 0.9995,  # rarer characters go to byte fallback
    "max_sentencepiece_length": 16,
    "max_sentence_length": 16384,  # bytes; longer training lines are skipped, never truncated
    "unk_id": 0,
    "bos_id": 1,
    "eos_id": 2,
    "pad_id": -1,  # no pad piece (see the module docstring)
    "num_threads": 1,  # fixed, so the model bytes do not depend on the machine
    "shuffle_input_sentence": True,
    "train_extremely_large_corpus": False,
    "minloglevel": 2,  # errors only; sentencepiece is chatty
}


class LlamaTokenizer:
    """Text <-> token ids with a sentencepiece model.

    The serialized model is kept (`model_proto`), so the tokenizer can be saved and hashed (data
    caches are keyed by `sha256`) without the file it came from.
    """

    def __init__(self, model_proto: bytes) -> None:
        self.model_proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> LlamaTokenizer:
        """Load `path/tokenizer.model` (or `path` itself when it is the model file)."""
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
        """Write `directory/tokenizer.model` atomically; return its path."""
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

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally wrapped in bos/eos."""
        return self._sp.encode(text, add_bos=add_bos, add_eos=add_eos)

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool = True, add_eos: bool = False, num_threads: int = -1
    ) -> list[list[int]]:
        """`encode` of each text, on `num_threads` sentencepiece threads (-1: one per core)."""
        return self._sp.encode(list(texts), add_bos=add_bos, add_eos=add_eos, num_threads=num_threads)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """The text of `ids`. Control pieces (bos, eos) are dropped, or with skip_special=False
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

    def _check_ids(self, ids: Sequence[int]) -> None:
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for a vocabulary of {n} pieces")

    def __repr__(self) -> str:
        return f"LlamaTokenizer(vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | os.PathLike[str],
    *,
    input_sentence_size: int = 1_000_000,
    seed: int = 0,
) -> LlamaTokenizer:
    """Train a BPE tokenizer with `TRAINER_SETTINGS` on `texts`; write `out_dir/tokenizer.model`.

    Each non-blank line of each text is one training sentence (sentencepiece pieces never span a
    newline; newlines are encoded by byte fallback). At most `input_sentence_size` sentences,
    sampled with `seed`, are used. The same texts, vocab_size and seed give the same model bytes.
    """
    if isinstance(texts, str):
        raise TypeError("train_tokenizer takes an iterable of texts, not a single string")
    sentences = [line for text in texts for line in text.split("\n") if line.strip()]
    if not sentences:
        raise ValueError("cannot train a tokenizer: the input has no text")
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            input_sentence_size=input_sentence_size,
            **TRAINER_SETTINGS,
        )
    except RuntimeError as e:
        # sentencepiece errors read "INTERNAL: src/trainer_interface.cc(744) [...] <message>".
        reason = str(e).rsplit("] ", 1)[-1]
        raise ValueError(f"cannot train a {vocab_size}-piece tokenizer on this text: {reason}") from None
    tokenizer = LlamaTokenizer(model.getvalue())
    tokenizer.save_pretrained(out_dir)
    return tokenizer
