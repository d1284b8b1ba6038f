"""A sentencepiece model as a Hugging Face ``tokenizer.json``, so transformers needs no protobuf.

``to_tokenizer_json(model_proto)`` builds, with the ``tokenizers`` library, the tokenizer that
encodes as sentencepiece does: the pieces and their scores become a BPE model with
``byte_fallback`` (or a Unigram model for unigram sentencepiece models), merges ordered by the
merged piece's score as sentencepiece's BPE applies them, a normalizer for the model's whitespace
rules (``▁`` for spaces, the dummy prefix when the model has one) and the decoder back. Control
and unknown pieces become special added tokens, user-defined pieces plain added tokens, so they
are matched in text first, as transformers does.

The settings come from the model's serialized ``ModelProto``, read here with a small protobuf
wire-format reader (the few fields needed; sentencepiece's Python package exposes them only
through ``protobuf``, which llmkit does not need).
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import sentencepiece as spm
from tokenizers import AddedToken, Regex, decoders, models, normalizers, processors
from tokenizers import Tokenizer as HFTokenizer

SPACE = "\u2581"  # sentencepiece's whitespace mark

# Field numbers of sentencepiece_model.proto used here, and proto2 defaults of absent fields.
_TRAINER, _NORMALIZER = 2, 3
_MODEL_TYPE, _BYTE_FALLBACK = 3, 35  # TrainerSpec
_CHARSMAP, _DUMMY_PREFIX, _EXTRA_WS = 2, 3, 4  # NormalizerSpec
_UNIGRAM, _BPE = 1, 2
_MODEL_TYPES = {_UNIGRAM: "unigram", _BPE: "bpe"}  # TrainerSpec.model_type (the others: "other")


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def proto_fields(buf: bytes) -> dict[int, list[Any]]:
    """The top-level fields of one protobuf message: field number -> values (ints for varints
    and fixed-width fields, bytes for length-delimited ones)."""
    out: dict[int, list[Any]] = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = int.from_bytes(buf[i : i + 8], "little"), i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire == 5:
            value, i = int.from_bytes(buf[i : i + 4], "little"), i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} (field {field})")
        out.setdefault(field, []).append(value)
    return out


def spm_settings(model_proto: bytes) -> dict[str, Any]:
    """The settings of a sentencepiece model that decide how it encodes."""
    top = proto_fields(model_proto)
    trainer = proto_fields(top.get(_TRAINER, [b""])[-1])
    norm = proto_fields(top.get(_NORMALIZER, [b""])[-1])
    return {
        "model_type": _MODEL_TYPES.get(trainer.get(_MODEL_TYPE, [_UNIGRAM])[-1], "other"),
        "byte_fallback": bool(trainer.get(_BYTE_FALLBACK, [0])[-1]),
        "precompiled_charsmap": norm.get(_CHARSMAP, [b""])[-1],
        "add_dummy_prefix": bool(norm.get(_DUMMY_PREFIX, [1])[-1]),
        "remove_extra_whitespaces": bool(norm.get(_EXTRA_WS, [1])[-1]),
    }


USER_DEFINED = 4  # SentencePiece.Type


def user_defined_ids(model_proto: bytes) -> list[int]:
    """Ids of a model's user-defined pieces (sentencepiece's Python API cannot tell them)."""
    # a piece whose type field (3) is 4 holds the bytes 0x18 0x04: only those are parsed (a tenth of
    # a second of a server's start for a 32000-piece model otherwise)
    if b"\x18\x04" not in model_proto:
        return []
    pieces = proto_fields(model_proto).get(1, [])
    return [
        i
        for i, p in enumerate(pieces)
        if b"\x18\x04" in p and proto_fields(p).get(3, [1])[-1] == USER_DEFINED
    ]


def _bpe_merges(sp: spm.SentencePieceProcessor, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces, in the order sentencepiece's BPE applies them:
    by the merged piece's score, highest first (ties: by the ids of the two halves)."""
    merges = []
    for piece, pid in vocab.items():
        local = [
            (piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab
        ]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges += [(sp.get_score(pid), pid, lr) for lr in local]
    merges.sort(key=lambda m: (-m[0], m[1]))
    return [lr for _, _, lr in merges]


@cache
def to_tokenizer_json(model_proto: bytes, add_bos: bool = True, add_eos: bool = False) -> bytes:
    """``tokenizer.json`` bytes of a sentencepiece model (see the module docstring); ``add_bos`` /
    ``add_eos`` become its post-processor (what ``tokenizer(text)`` adds)."""
    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    s = spm_settings(model_proto)
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    unk = pieces[sp.unk_id()] if sp.unk_id() >= 0 else None
    if s["model_type"] == "bpe":
        vocab = {p: i for i, p in enumerate(pieces)}
        model = models.BPE(
            vocab=vocab,
            merges=_bpe_merges(sp, vocab),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=s["byte_fallback"],
        )
    elif s["model_type"] == "unigram":
        model = models.Unigram(
            [(p, sp.get_score(i)) for i, p in enumerate(pieces)], sp.unk_id(), s["byte_fallback"]
        )
    else:
        raise ValueError(f"cannot convert a {s['model_type']} sentencepiece model to tokenizer.json")
    tok = HFTokenizer(model)
    norm = []
    if s["precompiled_charsmap"]:
        norm.append(normalizers.Precompiled(s["precompiled_charsmap"]))
    if s["remove_extra_whitespaces"]:
        norm += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if s["add_dummy_prefix"]:
        norm.append(normalizers.Prepend(SPACE))
    norm.append(normalizers.Replace(" ", SPACE))
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if s["add_dummy_prefix"]:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    tok.add_special_tokens([AddedToken(pieces[i], special=True, normalized=False) for i in special])
    user = user_defined_ids(model_proto)
    tok.add_tokens([AddedToken(pieces[i], special=False, normalized=False) for i in user])
    bos, eos = sp.bos_id(), sp.eos_id()
    head = [pieces[bos]] if add_bos and bos >= 0 else []
    tail = [pieces[eos]] if add_eos and eos >= 0 else []
    tok.post_processor = processors.TemplateProcessing(  # as transformers' Llama tokenizer.json
        single=" ".join([*head, "$A", *tail]),
        pair=" ".join([*head, "$A", *tail, *(f"{t}:1" for t in head), "$B:1", *(f"{t}:1" for t in tail)]),
        special_tokens=[(pieces[i], i) for i in sorted({bos, eos}) if i >= 0],
    )
    return json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=2).encode()
