"""Llama's tokenizers (``llmkit.tokenizer.Tokenizer``), and training new ones of either kind.

``LlamaTokenizer`` is the one tokenizer class under its Hugging Face name. ``train_tokenizer``
makes, with ``kind``:

- ``"sentencepiece"`` (the default): a sentencepiece BPE model (``tokenizer.model``) with Llama 2's
  recipe, except ``add_dummy_prefix=False`` so that decoding inverts encoding exactly:
  decode(encode(text)) == text for every string that does not contain U+2581 ("▁", which
  sentencepiece uses to mark spaces and so turns into a space). Special ids: unk 0, bos 1, eos 2,
  and no pad piece (pad_id is None), as in Meta's Llama 2 tokenizer; packed pretraining needs no
  padding and inference masks padded positions, so any id can fill them.
- ``"bpe"``: a byte-level BPE ``tokenizer.json`` (the ``tokenizers`` library's trainer) with Llama
  3's pre-tokenizer: its split regex, then GPT-2's byte map, so every string encodes without an
  unknown token and decodes back exactly. Special ids: ``<|begin_of_text|>`` 0 (bos, added by
  ``tokenizer(text)``), ``<|end_of_text|>`` 1 (eos), then the 256 bytes and the merges.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import sentencepiece as spm
from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from llmkit.tokenizer import CONFIG_FILE, JSON_FILE, Tokenizer, TokenizerError

LlamaTokenizer = Tokenizer
__all__ = ["KINDS", "LLAMA3_SPLIT", "TRAINER_SETTINGS", "LlamaTokenizer", "TokenizerError", "train_tokenizer"]

# Llama 3's pre-tokenizer regex (its tokenizer.json: a Split, then ByteLevel without its own regex).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BPE_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")  # bos, eos: ids 0 and 1

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
    kind: str = "sentencepiece",
    input_sentence_size: int = 1_000_000,
    seed: int = 0,
) -> LlamaTokenizer:
    """Train a tokenizer of ``kind`` (see the module docstring) on ``texts``; write it into
    ``out_dir`` with ``save_pretrained`` (the complete Hugging Face file set).

    sentencepiece: each non-blank line of each text is one training sentence (its pieces never span
    a newline; newlines are encoded by byte fallback); at most ``input_sentence_size`` sentences,
    sampled with ``seed``, are used. bpe: whole texts. The same texts, vocab_size and seed give the
    same files.
    """
    if isinstance(texts, str):
        raise TypeError("train_tokenizer takes an iterable of texts, not a single string")
    if kind not in KINDS:
        raise ValueError(f"tokenizer kind {kind!r}: expected one of {', '.join(KINDS)}")
    texts = list(texts)
    if not any(line.strip() for text in texts for line in text.split("\n")):
        raise ValueError("cannot train a tokenizer: the input has no text")
    tokenizer = KINDS[kind](texts, vocab_size, input_sentence_size, seed)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def _train_sentencepiece(texts: list[str], vocab_size: int, input_sentence_size: int, seed: int) -> Tokenizer:
    sentences = [line for text in texts for line in text.split("\n") if line.strip()]
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
    return LlamaTokenizer(model.getvalue())


def _train_bpe(texts: list[str], vocab_size: int, input_sentence_size: int, seed: int) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(BPE_SPECIALS) + len(alphabet):
        raise ValueError(
            f"cannot train a {vocab_size}-piece tokenizer on this text: a byte-level BPE needs at least "
            f"{len(BPE_SPECIALS) + len(alphabet)} (its special tokens and 256 bytes)"
        )
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BPE_SPECIALS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer)
    bos, eos = BPE_SPECIALS
    tk.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, 0)]
    )
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    config |= {"bos_token": bos, "eos_token": eos, "add_bos_token": True}
    return Tokenizer.from_files({JSON_FILE: tk.to_str().encode(), CONFIG_FILE: json.dumps(config).encode()})


KINDS: dict[str, Callable[[list[str], int, int, int], Tokenizer]] = {
    "sentencepiece": _train_sentencepiece,
    "bpe": _train_bpe,
}
