"""Llama's tokenizer: a sentencepiece BPE model (``llmkit.tokenizer.Tokenizer``), and training one.

Meta's Llama 1/2 tokenizers are sentencepiece BPE models (`tokenizer.model`); ``LlamaTokenizer``
(the one tokenizer class, under its Hugging Face name) reads them as they are. `train_tokenizer`
makes new ones with the same recipe, except `add_dummy_prefix=False` so that decoding inverts
encoding exactly: decode(encode(text)) == text for every string that does not contain U+2581
("▁", which sentencepiece uses to mark spaces and so turns into a space).

Special ids of trained models: unk 0, bos 1, eos 2, and no pad piece (pad_id is None), as in Meta's
Llama 2 tokenizer; packed pretraining needs no padding and inference masks padded positions, so any
id can fill them.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from typing import Any

import sentencepiece as spm

from llmkit.tokenizer import Tokenizer, TokenizerError

LlamaTokenizer = Tokenizer
__all__ = ["TRAINER_SETTINGS", "LlamaTokenizer", "TokenizerError", "train_tokenizer"]

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
