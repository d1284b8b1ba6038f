"""Training data: sources -> documents -> one packed, cached token stream -> seeded batches.

A source is "builtin" (the built-in corpus, see corpus.py), a path, or a glob. A `.jsonl` file holds
one document per line in its "text" field, or one conversation per line in its "messages" field
(`[{"role", "content"}, ...]`, ending with an assistant turn: chat data for supervised
fine-tuning); any other file is one document of UTF-8 text.

A conversation is rendered by the chat template the server uses (the tokenizer's Jinja
`chat_template`, else the Llama 2 default: `llmkit.infer.ChatTemplate`), and only its assistant tokens
(what the template writes for each reply, e.g. " reply </s>" for Llama 2, "reply<|eot_id|>" for Llama 3,
or its `{% generation %}` blocks) are training targets: with chat data a
second file, a uint8 mask parallel to the stream, marks the targets, and a window's labels are -100
(ignored by the loss) wherever it is 0.

Every document is tokenized once as `<s> doc </s>` and the results are concatenated into one token
stream, stored as raw uint16 (uint32 for vocabularies over 65536) in the cache directory under a key
that hashes the source bytes, the tokenizer model and the packing settings, and read back with
np.memmap. Documents are packed in the order of their sha256 (a fixed pseudo-random order), so that
the validation split, the last `val_fraction` of the stream, is a sample of whole documents (plus
the tail of one) rather than whichever source came last.

Batches are windows of seq_len + 1 tokens at uniformly random offsets: inputs are the first
seq_len, labels the last seq_len (-100 where the mask says the token is not a target). Batch k
depends only on (seed, k), so resuming from a step counter replays exactly the batches of an
uninterrupted run.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from llmkit.framework.files import atomic_open
from llmkit.infer.chat import ChatTemplate, ChatTemplateError
from llmkit.models.llama.tokenizer import LlamaTokenizer, train_tokenizer
from llmkit.train.corpus import builtin_corpus, builtin_documents, default_cache_dir

BUILTIN = "builtin"
# Bump when the packing below changes, so stale caches are not reused.
_PACKING = {"format": 1, "bos": True, "eos": True, "order": "sha256"}
IGNORE = -100  # the label of a token that is not a training target (cross_entropy's ignore_index)
Conversation = list  # [{"role", "content"}, ...]: a chat document
_ENCODE_CHUNK = 256  # documents per encode_batch call


class DataError(ValueError):
    """Bad data input: a missing source, malformed JSONL, or too little text."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id below `vocab_size`."""
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise DataError(f"vocab_size {vocab_size} does not fit the uint32 token file format")


def resolve_sources(sources: Sequence[str]) -> list[str]:
    """Expand globs (sorted, recursive `**`) and check that every path exists; keep "builtin"."""
    if isinstance(sources, str):
        sources = [sources]
    if not sources:
        raise DataError("no data sources given")
    resolved: list[str] = []
    for source in sources:
        if source == BUILTIN:
            resolved.append(source)
        elif any(c in source for c in "*?["):
            matches = sorted(p for p in glob.glob(source, recursive=True) if os.path.isfile(p))
            if not matches:
                raise DataError(f"data source glob {source!r} matched no files")
            resolved += matches
        elif os.path.isdir(source):
            raise DataError(f"data source {source!r} is a directory; pass a glob such as '{source}/*.txt'")
        elif not os.path.isfile(source):
            raise DataError(f"data source {source!r} does not exist")
        else:
            resolved.append(source)
    return resolved


def read_documents(sources: Sequence[str]) -> list[str | Conversation]:
    """The documents of `sources` (see the module docstring), in source order, empty ones dropped."""
    docs: list[str | Conversation] = []
    for source in resolve_sources(sources):
        if source == BUILTIN:
            docs += builtin_documents()
        elif source.endswith(".jsonl"):
            docs += _read_jsonl(source)
        else:
            docs.append(_read_text(source))
    return [doc for doc in docs if doc]


def tokenizer_train(
    input: list[str], vocab_size: int, out: str, kind: str = "sentencepiece"
) -> LlamaTokenizer:
    """`llmkit tokenizer train`: train a tokenizer of `kind` ("sentencepiece" or "bpe") on data
    sources, write its Hugging Face files into `out`."""
    texts = [d if isinstance(d, str) else "\n".join(m["content"] for m in d) for d in read_documents(input)]
    return train_tokenizer(texts, vocab_size, out, kind=kind)


@dataclass(frozen=True)
class TokenData:
    """A packed token stream and its train/val split (the last `val_fraction` of the stream)."""

    tokens: np.ndarray  # (N,) uint16 or uint32, memory-mapped read-only
    val_fraction: float
    path: Path  # the cache file
    mask: np.ndarray | None = None  # (N,) uint8: 1 where the token is a training target (chat data)

    @property
    def num_val(self) -> int:
        return int(len(self.tokens) * self.val_fraction)

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: len(self.tokens) - self.num_val]

    @property
    def val(self) -> np.ndarray:
        return self.tokens[len(self.tokens) - self.num_val :]

    @property
    def train_mask(self) -> np.ndarray | None:
        return None if self.mask is None else self.mask[: len(self.tokens) - self.num_val]

    @property
    def val_mask(self) -> np.ndarray | None:
        return None if self.mask is None else self.mask[len(self.tokens) - self.num_val :]


def load_token_data(
    sources: Sequence[str],
    tokenizer: LlamaTokenizer,
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike[str] | None = None,
) -> TokenData:
    """Tokenize `sources` into the token cache (first time only) and memory-map the stream."""
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    dtype = token_dtype(tokenizer.vocab_size)
    resolved = resolve_sources(sources)
    key = _cache_key(resolved, tokenizer)
    path = Path(cache_dir or default_cache_dir()) / "tokens" / f"{key}.{dtype.name}.bin"
    mask_path = path.with_suffix(".mask.bin")
    if not path.is_file():
        _pack(resolved, tokenizer, dtype, path, mask_path)
    mask = np.memmap(mask_path, dtype=np.uint8, mode="r") if mask_path.is_file() else None
    return TokenData(np.memmap(path, dtype=dtype, mode="r"), val_fraction, path, mask)


class BatchSampler:
    """Seeded random windows from a token stream: `next(sampler)` -> (input_ids, labels).

    Both are int64 arrays of shape (batch_size, seq_len), labels[:, t] == input_ids[:, t + 1] of the
    same window (or -100 where ``mask`` is 0). Batch k is a pure function of (seed, k); the state is
    just the step counter.
    """

    def __init__(
        self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0, mask: np.ndarray | None = None
    ) -> None:
        if batch_size <= 0 or seq_len <= 0:
            raise DataError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
        if seed < 0:
            raise DataError(f"seed must be non-negative, got {seed}")
        _check_length(tokens, seq_len, "train split")
        self.tokens, self.batch_size, self.seq_len, self.mask = tokens, batch_size, seq_len, mask
        self.seed, self.step = seed, 0

    def batch(self, step: int, rows: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """The batch drawn at `step` (only its `rows`: a data-parallel rank's share), without
        moving the sampler."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        return _windows(self.tokens, starts[rows], self.seq_len, self.mask)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        batch = self.batch(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.step = int(state["seed"]), int(state["step"])


def eval_batches(
    tokens: np.ndarray, n: int, batch_size: int, seq_len: int, mask: np.ndarray | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`n` fixed batches spanning `tokens` (the val split) with evenly spaced windows, no RNG."""
    _check_length(tokens, seq_len, "val split")
    starts = np.linspace(0, len(tokens) - seq_len - 1, n * batch_size).round().astype(np.int64)
    for batch_starts in starts.reshape(n, batch_size):
        yield _windows(tokens, batch_starts, seq_len, mask)


def _windows(
    tokens: np.ndarray, starts: np.ndarray, seq_len: int, mask: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    at = starts[:, None] + np.arange(seq_len + 1)  # (B, S + 1)
    window = np.array(tokens[at], dtype=np.int64)
    labels = window[:, 1:]
    if mask is not None:
        labels = np.where(mask[at[:, 1:]] > 0, labels, IGNORE)
    return window[:, :-1], labels


def _check_length(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"the {what} has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "use more data, a shorter seq_len, or a different data.val_fraction"
        )


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", newline="") as f:  # newline="": keep "\r\n" as written
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def jsonl_records(path: str) -> Iterator[tuple[int, Any]]:
    """(line number, decoded value) of each non-blank line of a JSONL file; DataError names the line."""
    for lineno, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON: {e}") from None


def _read_jsonl(path: str) -> list[str]:
    docs = []
    for lineno, record in jsonl_records(path):
        if isinstance(record, dict) and "messages" in record:
            docs.append(_conversation(record["messages"], f"{path}:{lineno}"))
            continue
        if not isinstance(record, dict) or "text" not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f'{path}:{lineno}: no "text" or "messages" field (got {keys})')
        if not isinstance(record["text"], str):
            raise DataError(f'{path}:{lineno}: "text" must be a string, got {type(record["text"]).__name__}')
        docs.append(record["text"])
    return docs


def check_messages(
    messages: Any, where: str, empty: str = "a conversation needs at least one message"
) -> None:
    """A conversation: a non-empty list (else ``empty`` says what is wrong) of {"role", "content"}
    strings (SFT's "messages", an RLHF prompt)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {empty}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not all(isinstance(m.get(k), str) for k in ("role", "content")):
            raise DataError(f'{where}: messages[{i}] must be an object with string "role" and "content"')


def _conversation(messages: Any, where: str) -> Conversation:
    """A checked "messages" list, ending with an assistant turn."""
    check_messages(messages, where, '"messages" must be a non-empty list of {"role", "content"} objects')
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be the assistant's (the reply to train on)")
    return messages


def _cache_key(sources: list[str], tokenizer: LlamaTokenizer) -> str:
    """sha256 over the packing settings, the tokenizer model and each source's kind and bytes."""
    h = hashlib.sha256(json.dumps(_PACKING, sort_keys=True).encode())
    h.update(tokenizer.sha256.encode())
    h.update(ChatTemplate.of(tokenizer).source.encode())  # how conversations render
    for source in sources:
        h.update(b"\0source\0")
        if source == BUILTIN:
            h.update(b"builtin\0" + builtin_corpus().encode("utf-8"))
            continue
        h.update(b"jsonl\0" if source.endswith(".jsonl") else b"text\0")
        with open(source, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:32]


def _pack(
    sources: list[str], tokenizer: LlamaTokenizer, dtype: np.dtype, path: Path, mask_path: Path
) -> None:
    """Tokenize the documents of `sources` into `path` (and, with conversations among them, their
    target mask into `mask_path`, written first): streamed to temp files, then renamed."""
    docs = read_documents(sources)
    if not docs:
        raise DataError(f"the data sources {sources} contain no text")
    docs.sort(key=lambda doc: hashlib.sha256(_doc_bytes(doc)).digest())
    chat = any(not isinstance(d, str) for d in docs)
    template = ChatTemplate.of(tokenizer)
    bar = tqdm(total=len(docs), unit="doc", desc="tokenizing", disable=None)  # silent off a terminal
    masks: list[np.ndarray] = []
    with atomic_open(path) as f, bar:
        for i in range(0, len(docs), _ENCODE_CHUNK):
            part = docs[i : i + _ENCODE_CHUNK]
            texts = [d for d in part if isinstance(d, str)]
            encoded = iter(tokenizer.encode_batch(texts, add_bos=True, add_eos=True))
            for doc in part:
                if isinstance(doc, str):
                    ids = next(encoded)
                    targets = [True] * len(ids)
                else:
                    try:
                        ids, targets = template.render_conversation(doc, tokenizer)
                    except ChatTemplateError as e:
                        raise DataError(f"{sources}: a conversation: {e}") from None
                f.write(np.asarray(ids, dtype=dtype).tobytes())
                if chat:
                    masks.append(np.asarray(targets, dtype=np.uint8))
            bar.update(len(part))
        if chat:  # before the token file is renamed into place: a token file implies its mask
            with atomic_open(mask_path) as m:
                m.write(np.concatenate(masks).tobytes())


def _doc_bytes(doc: str | Conversation) -> bytes:
    return (doc if isinstance(doc, str) else json.dumps(doc, sort_keys=True)).encode("utf-8")
