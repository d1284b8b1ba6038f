"""Data pipeline: sources, packing and its cache, train/val split, seeded batches, resume, errors."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from llmkit.models.llama.tokenizer import LlamaTokenizer
from llmkit.train import data
from llmkit.train.corpus import builtin_documents
from llmkit.train.data import BatchSampler, DataError, eval_batches, load_token_data, token_dtype


@pytest.fixture
def sources(tmp_path: Path) -> list[str]:
    (tmp_path / "a.txt").write_text("First file.\nIt has two lines.\n")
    (tmp_path / "b.txt").write_text("Second file, one line.")
    records = [{"text": "json doc one", "id": 1}, {"text": "json doc two\nwith a newline"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    return [str(tmp_path / "*.txt"), str(tmp_path / "c.jsonl")]


def expected_stream(docs: list[str], tok: LlamaTokenizer) -> list[int]:
    """The packing contract written out: sha256 order, <s> doc </s> each."""
    ordered = sorted(docs, key=lambda d: hashlib.sha256(d.encode()).hexdigest())
    return [t for d in ordered for t in [tok.bos_id, *tok.encode(d, add_bos=False), tok.eos_id]]


def test_token_dtype() -> None:
    assert token_dtype(4096) == np.uint16 and token_dtype(2**16) == np.uint16
    assert token_dtype(2**16 + 1) == np.uint32 and token_dtype(128256) == np.uint32
    with pytest.raises(DataError, match="vocab_size 4294967297 does not fit"):
        token_dtype(2**32 + 1)


def test_packing_and_split(sources: list[str], builtin_tok: LlamaTokenizer, tmp_path: Path) -> None:
    td = load_token_data(sources, builtin_tok, val_fraction=0.25, cache_dir=tmp_path / "cache")
    docs = [
        "First file.\nIt has two lines.\n",
        "Second file, one line.",
        "json doc one",
        "json doc two\nwith a newline",
    ]
    assert td.tokens.dtype == np.uint16 and isinstance(td.tokens, np.memmap)
    assert td.tokens.tolist() == expected_stream(docs, builtin_tok)
    n = len(td.tokens)
    assert len(td.val) == int(n * 0.25) and len(td.train) + len(td.val) == n
    assert td.train.tolist() + td.val.tolist() == td.tokens.tolist()
    assert td.path.parent == tmp_path / "cache" / "tokens" and td.path.name.endswith(".uint16.bin")
    assert [p.name for p in td.path.parent.iterdir()] == [td.path.name]  # no temporary files left


def test_cache_is_reused_and_keyed_by_content(
    sources: list[str], builtin_tok: LlamaTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load_token_data(sources, builtin_tok, cache_dir=tmp_path)

    def no_tokenizing(*args: object) -> None:
        raise AssertionError("the cached token file should have been used")

    monkeypatch.setattr(data, "_pack", no_tokenizing)
    assert load_token_data(sources, builtin_tok, cache_dir=tmp_path).path == first.path
    monkeypatch.undo()
    (tmp_path / "b.txt").write_text("Second file, changed.")
    changed = load_token_data(sources, builtin_tok, cache_dir=tmp_path)
    assert changed.path != first.path


def test_builtin_source(builtin_tok: LlamaTokenizer) -> None:
    td = load_token_data(["builtin"], builtin_tok, val_fraction=0.05)
    assert td.tokens.tolist() == expected_stream(list(builtin_documents()), builtin_tok)
    assert int((td.tokens == builtin_tok.bos_id).sum()) == len(builtin_documents())


def test_uint32_for_large_vocabularies(
    sources: list[str], builtin_tok: LlamaTokenizer, tmp_path: Path
) -> None:
    class BigVocab(LlamaTokenizer):
        vocab_size = 100_000  # ids still fit; only the file dtype changes

    big = BigVocab(builtin_tok.model_proto)
    td = load_token_data(sources, big, cache_dir=tmp_path)
    assert td.tokens.dtype == np.uint32 and td.path.name.endswith(".uint32.bin")
    assert td.tokens.tolist() == load_token_data(sources, builtin_tok, cache_dir=tmp_path).tokens.tolist()


# ---- bad sources --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "source", "message"),
    [
        ({}, "missing.txt", r"data source '.*missing.txt' does not exist"),
        ({}, "*.md", r"data source glob '.*\*\.md' matched no files"),
        (
            {"sub/x.txt": "x"},
            "sub",
            r"data source '.*sub' is a directory; pass a glob such as '.*sub/\*\.txt'",
        ),
        ({"d.jsonl": '{"text": "ok"}\n{"text": "bad",\n'}, "d.jsonl", r"d\.jsonl:2: invalid JSON"),
        (
            {"d.jsonl": '{"text": "ok"}\n\n{"content": "x"}\n'},
            "d.jsonl",
            r"d\.jsonl:3: no \"text\" or \"messages\" field \(got \['content'\]\)",
        ),
        ({"d.jsonl": '["text"]\n'}, "d.jsonl", r"d\.jsonl:1: no \"text\" or \"messages\" field \(got list\)"),
        ({"d.jsonl": '{"text": 5}\n'}, "d.jsonl", r"d\.jsonl:1: \"text\" must be a string, got int"),
        ({"e.txt": ""}, "e.txt", r"contain no text"),
        ({"e.jsonl": "\n\n"}, "e.jsonl", r"contain no text"),
        ({"bin.txt": b"ok \xff\xfe"}, "bin.txt", r"bin\.txt: not UTF-8 text \(byte 3"),
    ],
    ids=[
        "missing",
        "glob",
        "directory",
        "bad-json",
        "no-text",
        "not-object",
        "text-type",
        "empty",
        "empty-jsonl",
        "utf8",
    ],
)
def test_bad_sources_raise_one_clear_error(
    tmp_path: Path, builtin_tok: LlamaTokenizer, files: dict[str, str | bytes], source: str, message: str
) -> None:
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError, match=message):
        load_token_data([str(tmp_path / source)], builtin_tok, cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("tokens/*"))  # nothing half-written


def test_no_sources_and_bad_val_fraction(builtin_tok: LlamaTokenizer) -> None:
    with pytest.raises(DataError, match="no data sources given"):
        load_token_data([], builtin_tok)
    with pytest.raises(DataError, match=r"val_fraction must be in \[0, 1\), got 1.0"):
        load_token_data(["builtin"], builtin_tok, val_fraction=1.0)


# ---- batches ------------------------------------------------------------------------------------


def test_batches_are_shifted_windows() -> None:
    tokens = np.arange(1000, dtype=np.uint16)  # token value == position, so windows are visible
    sampler = BatchSampler(tokens, batch_size=4, seq_len=16, seed=0)
    for _ in range(50):
        x, y = next(sampler)
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == np.int64
        np.testing.assert_array_equal(x, x[:, :1] + np.arange(16))  # contiguous windows
        np.testing.assert_array_equal(y, x + 1)  # labels are the next tokens
        assert x.min() >= 0 and y.max() <= 999


def test_every_start_offset_is_reachable() -> None:
    tokens = np.arange(20, dtype=np.uint16)
    sampler = BatchSampler(tokens, batch_size=64, seq_len=16, seed=1)
    starts = {int(x[0]) for _ in range(10) for x in next(sampler)[0]}
    assert starts == {0, 1, 2, 3}  # 20 tokens hold windows of 17 at offsets 0..3


def test_sampler_is_seeded_and_resumes_exactly() -> None:
    tokens = np.arange(5000, dtype=np.uint16)
    run = BatchSampler(tokens, 2, 8, seed=7)
    uninterrupted = [next(run) for _ in range(10)]
    first = BatchSampler(tokens, 2, 8, seed=7)
    for _ in range(4):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert state == {"seed": 7, "step": 4}
    resumed = BatchSampler(tokens, 2, 8, seed=0)
    resumed.load_state_dict(state)
    for expected in uninterrupted[4:]:
        got = next(resumed)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
    other_seed = BatchSampler(tokens, 2, 8, seed=8)
    assert not np.array_equal(next(other_seed)[0], uninterrupted[0][0])


def test_sampler_errors() -> None:
    with pytest.raises(DataError, match=r"the train split has 16 tokens, fewer than seq_len \+ 1 = 17"):
        BatchSampler(np.arange(16, dtype=np.uint16), batch_size=2, seq_len=16)
    with pytest.raises(DataError, match="batch_size and seq_len must be positive"):
        BatchSampler(np.arange(100, dtype=np.uint16), batch_size=0, seq_len=16)
    with pytest.raises(DataError, match="seed must be non-negative"):
        BatchSampler(np.arange(100, dtype=np.uint16), batch_size=1, seq_len=16, seed=-1)


def test_eval_batches_are_fixed_and_span_the_split() -> None:
    tokens = np.arange(300, dtype=np.uint16)
    batches = list(eval_batches(tokens, n=3, batch_size=2, seq_len=10))
    assert len(batches) == 3
    starts = [int(row[0]) for x, _ in batches for row in x]
    assert starts[0] == 0 and starts[-1] == 300 - 11 and starts == sorted(starts)
    for x, y in batches:
        np.testing.assert_array_equal(y, x + 1)
    again = list(eval_batches(tokens, n=3, batch_size=2, seq_len=10))
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    with pytest.raises(DataError, match=r"the val split has 5 tokens, fewer than seq_len \+ 1 = 11"):
        next(eval_batches(tokens[:5], n=1, batch_size=1, seq_len=10))


# ---- tokenizer training from sources ------------------------------------------------------------


def test_tokenizer_train_from_globs(sources: list[str], tmp_path: Path) -> None:
    data.tokenizer_train(sources, 300, str(tmp_path / "tok"))
    tok = LlamaTokenizer.from_pretrained(tmp_path / "tok")
    assert tok.vocab_size == 300
    text = "json doc two\nwith a newline"
    assert tok.decode(tok.encode(text)) == text
    assert sorted(os.listdir(tmp_path / "tok")) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
