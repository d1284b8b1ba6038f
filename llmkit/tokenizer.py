"""The tokenizer: one class over two formats, read and written as Hugging Face directories hold them.

- ``tokenizer.json``: any tokenizer the ``tokenizers`` library reads (byte-level BPE as Llama 3,
  SmolLM and most current checkpoints ship, byte-fallback BPE, Unigram, WordPiece); ``kind`` "bpe".
- ``tokenizer.model``: a sentencepiece model (Llama 1/2, and the ones ``llmkit tokenizer train``
  makes); ``kind`` "sentencepiece". When a ``tokenizer.json`` with the same vocabulary sits beside
  it (Llama 2's Hugging Face repos, and every directory llmkit writes), sentencepiece stays the
  tokenizer and the JSON is kept as it is.

Beside them: ``tokenizer_config.json`` (add_bos_token, add_eos_token, the bos/eos/unk/pad tokens
as strings or AddedToken objects, added_tokens_decoder, chat_template as a string or a list of
named templates), ``special_tokens_map.json``, ``generation_config.json`` (eos_token_id, an int or
a list: every stop id) and ``chat_template.jinja`` (transformers 5 writes the template there).

Special and added tokens that occur in the text are matched before the rest is tokenized, as
Hugging Face tokenizers do by default ("<|eot_id|>" is one id, "<s>" is bos for a sentencepiece
model), so ``encode(text, add_bos=False)`` equals transformers'
``AutoTokenizer.from_pretrained(dir)(text, add_special_tokens=False).input_ids``.

``files()`` is the complete set ``save_pretrained`` writes (for a sentencepiece model also a
``tokenizer.json`` made from it, so transformers reads the directory without protobuf); the static
model file stores the same bytes and ``Tokenizer.from_files`` reads them back.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import sentencepiece as spm
from tokenizers import Tokenizer as HFTokenizer

from llmkit.framework.files import atomic_write

MODEL_FILE = "tokenizer.model"
JSON_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
GENERATION_FILE = "generation_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"  # transformers 5: <name>.jinja per named template
# What from_pretrained reads from a directory (besides TEMPLATE_DIR/*.jinja).
FILES = (MODEL_FILE, JSON_FILE, CONFIG_FILE, SPECIAL_MAP_FILE, GENERATION_FILE, TEMPLATE_FILE)
SPECIAL_NAMES = ("bos", "eos", "unk", "pad")  # <name>_token in tokenizer_config.json
MODEL_TYPES = ("BPE", "Unigram", "WordPiece", "WordLevel")  # the tokenizers library's models
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPACE = "\u2581"


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used (the message names the file)."""


def _unloadable(message: str) -> TokenizerError:
    return TokenizerError(f"cannot load tokenizer: {message}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


BYTE_ENCODER = _bytes_to_unicode()
BYTE_DECODER = {c: b for b, c in BYTE_ENCODER.items()}


def _json(files: Mapping[str, bytes], name: str, where: str) -> dict[str, Any]:
    """A JSON object file of ``files`` ({} when absent)."""
    if name not in files:
        return {}
    try:
        value = json.loads(files[name].decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _unloadable(f"{where}: not valid JSON text ({e})") from None
    if not isinstance(value, dict):
        raise _unloadable(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_string(value: Any, where: str) -> str | None:
    """A special token given as a string or as an AddedToken object ({"content": ...})."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise _unloadable(
        f'{where}: expected a token string or an AddedToken object with "content", got {value!r}'
    )


def _token_ids(value: Any, where: str) -> list[int]:
    """A token id field of generation_config.json: an int, a list of ints, or null."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise _unloadable(f"{where}: expected a token id or a list of them, got {value!r}")
    return ids


def _piece_bytes(piece: str) -> bytes:
    """A sentencepiece-style piece's bytes: a byte-fallback piece (<0xNN>) its byte, else its text."""
    m = _BYTE_PIECE.match(piece)
    return bytes([int(m.group(1), 16)]) if m else piece.replace(_SPACE, " ").encode()


def _added_token(content: str, special: bool) -> dict[str, Any]:
    """An AddedToken object as transformers writes it."""
    flags = dict.fromkeys(("lstrip", "normalized", "rstrip", "single_word"), False)
    return {"content": content, **flags, "special": special}


def write_generation_config(
    directory: str | os.PathLike[str], bos: int | None, eos: Sequence[int], pad: int | None
) -> Path:
    """Write ``directory/generation_config.json`` with these token ids, merged into the file that is
    already there (its other settings kept, eos ids united), atomically."""
    file = Path(directory) / GENERATION_FILE
    cfg = _json({GENERATION_FILE: file.read_bytes()} if file.is_file() else {}, GENERATION_FILE, str(file))
    for key, value in (("bos_token_id", bos), ("pad_token_id", pad)):
        if value is not None:
            cfg[key] = value
    ids = list(dict.fromkeys([*_token_ids(cfg.get("eos_token_id"), f"{file}: eos_token_id"), *eos]))
    if ids:
        cfg["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    atomic_write(file, (json.dumps(cfg, indent=2) + "\n").encode())
    return file


class _SentencePiece:
    """Pieces from a sentencepiece model; added tokens past its pieces extend the vocabulary."""

    kind = "sentencepiece"

    def __init__(self, proto: bytes) -> None:
        self.proto = proto
        self.sp = spm.SentencePieceProcessor(model_proto=proto)
        self.n = self.sp.get_piece_size()
        self.pieces = [self.sp.id_to_piece(i) for i in range(self.n)]

    def added(self) -> dict[int, tuple[str, bool]]:
        """The pieces matched in text before tokenizing: control and unknown ones are special."""
        from llmkit.tokenizer_convert import user_defined_ids

        sp = self.sp
        out = {i: (self.pieces[i], True) for i in range(self.n) if sp.is_control(i) or sp.is_unknown(i)}
        out.update((i, (self.pieces[i], False)) for i in user_defined_ids(self.proto))
        return out

    def default_token(self, name: str) -> str | None:
        i = getattr(self.sp, f"{name}_id")()  # bos_id, eos_id, unk_id, pad_id
        return None if i < 0 else self.pieces[i]

    def encode(self, texts: list[str], num_threads: int) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def piece_bytes(self, i: int) -> bytes:
        return _piece_bytes(self.pieces[i])


class _Tokenizers:
    """A ``tokenizer.json`` run by the ``tokenizers`` library (added tokens included)."""

    kind = "bpe"

    def __init__(self, data: bytes, where: str) -> None:
        self.data = data
        spec = _json({JSON_FILE: data}, JSON_FILE, where)
        model = spec.get("model")
        if not isinstance(model, dict) or "vocab" not in model:
            raise _unloadable(f'{where}: no "model" with a "vocab" (not a tokenizer.json)')
        kind = model.get("type", "BPE")
        if kind not in MODEL_TYPES:
            raise _unloadable(f"{where}: model.type {kind!r} is not one of {', '.join(MODEL_TYPES)}")
        try:
            self.tk = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # tokenizers raises a plain Exception naming the bad field
            raise _unloadable(f"{where}: {e} (tokenizers)") from None
        self.spec = spec
        self.model_type = kind
        vocab = self.tk.get_vocab(with_added_tokens=True)
        self.n = max(vocab.values(), default=-1) + 1
        self.pieces: list[str | None] = [None] * self.n
        for piece, i in vocab.items():
            self.pieces[i] = piece

        def has_byte_level(part: Any) -> bool:
            if not isinstance(part, dict):
                return False
            parts = part.get("decoders") or part.get("pretokenizers") or []
            return part.get("type") == "ByteLevel" or any(has_byte_level(p) for p in parts)

        self.byte_level = has_byte_level(spec.get("decoder"))
        self._post = spec.get("post_processor")

    def added(self) -> dict[int, tuple[str, bool]]:
        return {i: (t.content, bool(t.special)) for i, t in self.tk.get_added_tokens_decoder().items()}

    def default_token(self, name: str) -> str | None:
        if name == "unk":
            return self.spec["model"].get("unk_token")
        if name == "bos":  # the special token a TemplateProcessing post-processor puts first
            post = self._post if isinstance(self._post, dict) else {}
            for p in [post, *(post.get("processors") or [])]:
                single = (
                    p.get("single") if isinstance(p, dict) and p.get("type") == "TemplateProcessing" else None
                )
                if single and isinstance(single[0], dict) and "SpecialToken" in single[0]:
                    return single[0]["SpecialToken"].get("id")
        return None

    def encode(self, texts: list[str], num_threads: int) -> list[list[int]]:
        return [e.ids for e in self.tk.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=False)

    def piece_bytes(self, i: int) -> bytes:
        piece = self.pieces[i]
        if piece is None:
            return b""
        if self.byte_level:
            return bytes(BYTE_DECODER[c] if c in BYTE_DECODER else ord(c) for c in piece)
        return _piece_bytes(piece)


class Tokenizer:
    """Text <-> token ids (see the module docstring): ``Tokenizer(model_proto)`` for a
    sentencepiece model, ``Tokenizer.from_pretrained(dir)`` / ``Tokenizer.from_files(files)`` for
    a Hugging Face tokenizer's files.

    ``token_bytes`` gives the bytes one token contributes to the text (exact for byte-level BPE,
    byte-fallback and sentencepiece pieces), so logprobs and streaming stay exact on multi-byte
    characters. ``sha256`` identifies the tokenizer (data caches are keyed by it).
    """

    def __init__(
        self, model_proto: bytes | None = None, *, files: Mapping[str, bytes] | None = None, origin: str = ""
    ) -> None:
        files = dict(files or {})
        if model_proto is not None:
            files[MODEL_FILE] = bytes(model_proto)
        where = {name: f"{origin}/{name}" if origin else name for name in [*FILES, *files]}
        self._backend, json_backend = self._load_backend(files, where, origin)
        b = self._backend
        self.kind: str = b.kind
        self.model_proto: bytes | None = b.proto if isinstance(b, _SentencePiece) else None
        self._json_file = files.get(JSON_FILE)  # kept as it came, written back unchanged
        config = _json(files, CONFIG_FILE, where[CONFIG_FILE])
        special_map = _json(files, SPECIAL_MAP_FILE, where[SPECIAL_MAP_FILE])
        generation = _json(files, GENERATION_FILE, where[GENERATION_FILE])

        # Added tokens: the backend's own, then tokenizer_config.json's added_tokens_decoder.
        added = b.added()
        if json_backend is not None and json_backend is not b:  # tokens past the sentencepiece pieces
            added.update((i, t) for i, t in json_backend.added().items() if i >= b.n)
        decoder = config.get("added_tokens_decoder", {})
        if not isinstance(decoder, dict):
            raise _unloadable(f"{where[CONFIG_FILE]}: added_tokens_decoder: expected an object")
        for key, tok in decoder.items():
            at = f"{where[CONFIG_FILE]}: added_tokens_decoder.{key}"
            content = _token_string(tok, at)
            if not key.isdigit() or content is None:
                raise _unloadable(f"{at}: expected a token id key and an AddedToken object")
            i = int(key)
            known = b.pieces[i] if i < b.n else added.get(i, (None,))[0]
            if known is not None and known != content:
                raise _unloadable(f"{at}: {content!r}, but id {i} is {known!r} in the vocabulary")
            if known is None:
                if not isinstance(b, _SentencePiece):
                    raise _unloadable(f"{at}: {content!r} is not in {JSON_FILE}")
                added[i] = (content, bool(tok.get("special", True)) if isinstance(tok, dict) else True)
        self._added = added
        self._special = {i for i, (_, special) in added.items() if special}
        self._ids = {content: i for i, (content, _) in added.items()}
        self._vocab_size = max([b.n - 1, *added]) + 1
        # Matched leftmost-longest in text, as the tokenizers library matches added tokens.
        extra = sorted((c for i, (c, _) in added.items() if c), key=len, reverse=True)
        self._split = (
            re.compile("|".join(map(re.escape, extra))) if extra and isinstance(b, _SentencePiece) else None
        )

        # Special tokens: tokenizer_config.json, else special_tokens_map.json, else the model's own.
        tokens: dict[str, str | None] = {}
        for name in SPECIAL_NAMES:
            key = f"{name}_token"
            if key in config:
                tokens[name] = _token_string(config[key], f"{where[CONFIG_FILE]}: {key}")
            elif key in special_map:
                tokens[name] = _token_string(special_map[key], f"{where[SPECIAL_MAP_FILE]}: {key}")
            elif f"{name}_token_id" in generation and name != "unk":
                ids = _token_ids(generation[f"{name}_token_id"], f"{where[GENERATION_FILE]}: {name}_token_id")
                tokens[name] = self._piece(ids[0]) if ids else None
            else:
                tokens[name] = b.default_token(name)
        self._token_ids: dict[str, int | None] = {}
        for name, token in tokens.items():
            i = None if token is None else self.token_to_id(token)
            if token is not None and i is None:
                src = CONFIG_FILE if f"{name}_token" in config else SPECIAL_MAP_FILE
                raise _unloadable(f"{where[src]}: {name}_token {token!r} is not in the vocabulary")
            self._token_ids[name] = i
        self._tokens = tokens
        gen_eos = _token_ids(generation.get("eos_token_id"), f"{where[GENERATION_FILE]}: eos_token_id")
        bad = [i for i in gen_eos if i >= self._vocab_size]
        if bad:
            raise _unloadable(
                f"{where[GENERATION_FILE]}: eos_token_id {bad[0]} is out of range "
                f"for a vocabulary of {self._vocab_size}"
            )
        own_eos = [] if self.eos_id is None else [self.eos_id]
        self.eos_ids: list[int] = list(dict.fromkeys([*own_eos, *gen_eos]))
        # generation_config.json's ids, kept (in files()) only where they add stop ids to the eos
        self._generation_eos = gen_eos if self.eos_ids != own_eos else []

        def flag(key: str, default: bool) -> bool:
            v = config.get(key, default)
            if v is not None and not isinstance(v, bool):
                raise _unloadable(f"{where[CONFIG_FILE]}: {key}: expected true or false, got {v!r}")
            return default if v is None else v

        default_bos = isinstance(b, _SentencePiece) or b.default_token("bos") is not None
        self.add_bos_token: bool = flag("add_bos_token", default_bos)
        self.add_eos_token: bool = flag("add_eos_token", False)
        self.chat_templates: dict[str, str] = self._read_templates(config, files, where)
        managed = {"added_tokens_decoder", "chat_template", "add_bos_token", "add_eos_token"}
        managed |= {f"{n}_token" for n in SPECIAL_NAMES}
        self._config_extra = {k: v for k, v in config.items() if k not in managed}

    # -- loading ------------------------------------------------------------------------------

    @staticmethod
    def _load_backend(
        files: Mapping[str, bytes], where: Mapping[str, str], origin: str
    ) -> tuple[_SentencePiece | _Tokenizers, _Tokenizers | None]:
        """The tokenizer that encodes, and the tokenizer.json's when there is one."""
        sp = None
        if MODEL_FILE in files:
            try:
                sp = _SentencePiece(files[MODEL_FILE])
            except RuntimeError:  # sentencepiece: "could not parse ModelProto"
                raise _unloadable(f"{where[MODEL_FILE]} is not a sentencepiece model") from None
        if JSON_FILE in files:
            tk = _Tokenizers(files[JSON_FILE], where[JSON_FILE])
            if sp is not None and tk.pieces[: sp.n] == sp.pieces:
                return sp, tk  # the same vocabulary: sentencepiece is the reference (see the docstring)
            return tk, tk
        if sp is None:
            raise _unloadable(f"no {JSON_FILE} or {MODEL_FILE} in {origin or 'the files'}")
        return sp, None

    @staticmethod
    def _read_templates(
        config: Mapping[str, Any], files: Mapping[str, bytes], where: Mapping[str, str]
    ) -> dict[str, str]:
        value = config.get("chat_template")
        at = f"{where[CONFIG_FILE]}: chat_template"
        templates: dict[str, str] = {}
        if isinstance(value, str):
            templates["default"] = value
        elif isinstance(value, list):
            for k, t in enumerate(value):
                if not (isinstance(t, dict) and all(isinstance(t.get(k), str) for k in ("name", "template"))):
                    raise _unloadable(f'{at}[{k}]: expected {{"name": ..., "template": ...}}')
                templates[t["name"]] = t["template"]
        elif value is not None:
            raise _unloadable(f"{at}: expected a string or a list of named templates")
        for name, data in files.items():
            if name == TEMPLATE_FILE or (name.startswith(f"{TEMPLATE_DIR}/") and name.endswith(".jinja")):
                key = "default" if name == TEMPLATE_FILE else name[len(TEMPLATE_DIR) + 1 : -len(".jinja")]
                try:
                    templates[key] = data.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _unloadable(f"{where.get(name, name)}: not UTF-8 text ({e})") from None
        return templates

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
    def from_files(cls, files: Mapping[str, bytes], origin: str = "") -> Tokenizer:
        """A tokenizer from its files' bytes by name (``files()``; ``origin`` prefixes error messages)."""
        return cls(files=files, origin=origin)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face tokenizer directory (see the module docstring), or ``path`` itself
        when it is a ``tokenizer.model`` or ``tokenizer.json`` file."""
        path = Path(path)
        if path.is_file():
            name = JSON_FILE if path.suffix == ".json" else MODEL_FILE
            return cls(files={name: path.read_bytes()}, origin=str(path.parent))
        if not path.is_dir():
            raise FileNotFoundError(f"cannot load tokenizer: {path} does not exist")
        files = {name: (path / name).read_bytes() for name in FILES if (path / name).is_file()}
        if JSON_FILE not in files and MODEL_FILE not in files:
            raise FileNotFoundError(f"cannot load tokenizer: no {MODEL_FILE} or {JSON_FILE} in {path}")
        if (path / TEMPLATE_DIR).is_dir():
            for f in sorted((path / TEMPLATE_DIR).glob("*.jinja")):
                files[f"{TEMPLATE_DIR}/{f.name}"] = f.read_bytes()
        return cls(files=files, origin=str(path))

    # -- saving -------------------------------------------------------------------------------

    def files(self) -> dict[str, bytes]:
        """The complete Hugging Face file set of this tokenizer, by name (what ``save_pretrained``
        writes and the static model file stores)."""
        return dict(self._files)

    @cached_property
    def _files(self) -> dict[str, bytes]:
        from llmkit.tokenizer_convert import to_tokenizer_json

        out: dict[str, bytes] = {}
        if self.model_proto is not None:
            out[MODEL_FILE] = self.model_proto
        # a tokenizer.json read is kept as it came; a sentencepiece model's is made from it
        out[JSON_FILE] = self._json_file or to_tokenizer_json(
            self.model_proto, self.add_bos_token, self.add_eos_token
        )
        config: dict[str, Any] = {}
        if self.kind == "sentencepiece" and self._json_file is None:
            # our tokenizer.json, used as it is (a model class could rebuild its normalizer)
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            config["clean_up_tokenization_spaces"] = False
        config.update(self._config_extra)
        config.update(add_bos_token=self.add_bos_token, add_eos_token=self.add_eos_token)
        config["added_tokens_decoder"] = {
            str(i): _added_token(content, special) for i, (content, special) in sorted(self._added.items())
        }
        config.update({f"{name}_token": token for name, token in self._tokens.items()})
        special_map = {f"{n}_token": _added_token(t, True) for n, t in self._tokens.items() if t is not None}
        if self.chat_templates:
            t = self.chat_templates
            config["chat_template"] = (
                t["default"] if list(t) == ["default"] else [{"name": k, "template": v} for k, v in t.items()]
            )
        out[CONFIG_FILE] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()
        out[SPECIAL_MAP_FILE] = (json.dumps(special_map, indent=2, ensure_ascii=False) + "\n").encode()
        eos = self._generation_eos
        if eos:
            gen = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
            out[GENERATION_FILE] = (json.dumps(gen, indent=2) + "\n").encode()
        return out

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``files()`` into ``directory``, each file atomically (``generation_config.json``
        merged into one already there; special_tokens_map.json last, so its presence says the set
        is whole); return the tokenizer's main file (tokenizer.model for a
        sentencepiece model, else tokenizer.json). A ``chat_template.jinja`` or, for a BPE
        tokenizer, a ``tokenizer.model`` left there by another tokenizer is removed: transformers
        would read it instead."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        files = self.files()
        for name in sorted(files, key=lambda n: n == SPECIAL_MAP_FILE):
            if name == GENERATION_FILE:
                write_generation_config(directory, None, self._generation_eos, None)
            else:
                atomic_write(directory / name, files[name])
        for name in [TEMPLATE_FILE] + ([MODEL_FILE] if self.model_proto is None else []):  # stale files
            (directory / name).unlink(missing_ok=True)
        return directory / (MODEL_FILE if self.model_proto is not None else JSON_FILE)

    @cached_property
    def sha256(self) -> str:
        """Hex digest of the tokenizer's files: identifies it in cache keys."""
        h = hashlib.sha256()
        for name, data in sorted(self._files.items()):
            h.update(f"{name}\0{len(data)}\0".encode())
            h.update(data)
        return h.hexdigest()

    # -- vocabulary ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """One past the largest token id (added tokens included)."""
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        return self._token_ids["bos"]

    @property
    def eos_id(self) -> int | None:
        return self._token_ids["eos"]

    @property
    def unk_id(self) -> int | None:
        return self._token_ids["unk"]

    @property
    def pad_id(self) -> int | None:
        """The pad token's id, or None when there is none (Llama's convention)."""
        return self._token_ids["pad"]

    @property
    def bos_token(self) -> str | None:
        return self._tokens["bos"]

    @property
    def eos_token(self) -> str | None:
        return self._tokens["eos"]

    @property
    def chat_template(self) -> str | None:
        """The default chat template's Jinja source, or None."""
        return self.chat_templates.get("default")

    def _piece(self, token_id: int) -> str | None:
        b = self._backend
        return b.pieces[token_id] if token_id < b.n else self._added.get(token_id, (None,))[0]

    def token_to_id(self, token: str) -> int | None:
        """The id of a token (an added token or a vocabulary piece), or None."""
        if token in self._ids:
            return self._ids[token]
        b = self._backend
        i = b.sp.piece_to_id(token) if isinstance(b, _SentencePiece) else b.tk.token_to_id(token)
        if i is None or (isinstance(b, _SentencePiece) and (i == b.sp.unk_id() and token != b.pieces[i])):
            return None
        return i

    def id_to_piece(self, token_id: int) -> str:
        self._check_ids([token_id])
        return self._piece(int(token_id)) or ""

    def is_control(self, token_id: int) -> bool:
        """Whether the id is a special token (bos, eos, "<|eot_id|>", ...): no text of its own."""
        return int(token_id) in self._special

    # -- text ---------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally wrapped in bos/eos (where the tokenizer has them)."""
        return self.encode_batch([text], add_bos=add_bos, add_eos=add_eos)[0]

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool = True, add_eos: bool = False, num_threads: int = -1
    ) -> list[list[int]]:
        """``encode`` of each text (sentencepiece: on ``num_threads`` threads, -1: one per core)."""
        texts = list(texts)
        if self._split is None:
            ids = self._backend.encode(texts, num_threads)
        else:  # added tokens first, then the text between them
            parts = [self._split_added(t) for t in texts]
            plain = [p for ps in parts for p in ps if isinstance(p, str)]
            encoded = iter(self._backend.encode(plain, num_threads))
            ids = [[i for p in ps for i in ([p] if isinstance(p, int) else next(encoded))] for ps in parts]
        head = [self.bos_id] if add_bos and self.bos_id is not None else []
        tail = [self.eos_id] if add_eos and self.eos_id is not None else []
        return [head + x + tail for x in ids] if head or tail else ids

    def _split_added(self, text: str) -> list[str | int]:
        out: list[str | int] = []
        pos = 0
        for m in self._split.finditer(text):
            if m.start() > pos:
                out.append(text[pos : m.start()])
            out.append(self._ids[m.group()])
            pos = m.end()
        if pos < len(text) or not out:
            out.append(text[pos:])
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """The text of ``ids``. Special tokens (bos, eos) are dropped, or with skip_special=False
        written as their text ("<s>", "</s>"). Ids past the vocabulary (the rows of a padded
        embedding) have no text, as in the tokenizers library; a negative id is a ValueError."""
        ids = [int(i) for i in ids]
        self._check_ids([i for i in ids if i < 0])
        ids = [i for i in ids if i < self.vocab_size]
        b = self._backend
        if isinstance(b, _Tokenizers):
            return b.tk.decode(ids, skip_special_tokens=skip_special)
        if max(ids, default=0) < b.n and self._special.isdisjoint(ids):  # (echo's prompts) one call
            return b.decode(ids)
        parts, run = [], []
        for i in ids:  # special tokens (control and unknown pieces) and added ones are ours
            if i < b.n and i not in self._special:
                run.append(i)
            elif not (skip_special and i in self._special):
                parts += [b.decode(run), self._piece(i) or ""]
                run = []
        return "".join([*parts, b.decode(run)])

    def decode_batch(self, batch: Iterable[Iterable[int]], skip_special: bool = True) -> list[str]:
        return [self.decode(ids, skip_special=skip_special) for ids in batch]

    @cached_property
    def _bytes(self) -> list[bytes | None]:
        return [None] * self.vocab_size

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes of one token as it appears in text: a byte-level BPE token's bytes
        (GPT-2's byte map), a byte-fallback piece's byte, nothing for a special token or an id
        past the vocabulary."""
        token_id = int(token_id)
        if token_id >= self.vocab_size:
            return b""
        self._check_ids([token_id])
        b = self._bytes[token_id]
        if b is None:
            if token_id in self._special:
                b = b""
            elif token_id in self._added:
                b = self._added[token_id][0].encode()
            else:
                b = self._backend.piece_bytes(token_id)
            self._bytes[token_id] = b
        return b

    @cached_property
    def _texts(self) -> list[str | None]:
        return [None] * self.vocab_size

    def token_text(self, token_id: int) -> str:
        """One token's text (a partial UTF-8 byte shows as U+FFFD, as OpenAI does)."""
        if 0 <= token_id < self.vocab_size:  # echo's logprobs ask several times per prompt token
            t = self._texts[token_id]
            if t is None:
                t = self._texts[token_id] = self.token_bytes(token_id).decode("utf-8", errors="replace")
            return t
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def check_fits(self, model_vocab_size: int, where: str) -> None:
        """TokenizerError unless every token id indexes the model's embedding (``model_vocab_size``
        rows; a larger, padded embedding is fine); ``where`` names the model."""
        if self.vocab_size > model_vocab_size:
            raise TokenizerError(
                f"{where}: tokenizer vocab ({self.vocab_size}) is larger than the model's "
                f"({model_vocab_size})"
            )

    def _check_ids(self, ids: Sequence[int]) -> None:
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for a vocabulary of {n} pieces")

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(kind={self.kind!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"
