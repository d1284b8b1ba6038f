"""The built-in corpus and its tokenizer: deterministic, the expected size, every line round-trips."""

from __future__ import annotations

import hashlib
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from llmkit.models.llama.tokenizer import LlamaTokenizer
from llmkit.train import corpus


def test_corpus_content_and_size() -> None:
    text = corpus.builtin_corpus()
    assert 1_000_000 < len(text.encode("utf-8")) < 3_000_000
    assert 'The "with" statement' in text  # a pydoc topic
    assert "Return the fields of a dataclass instance" in text  # a stdlib docstring
    topics_only = corpus.builtin_corpus(include_docstrings=False)
    assert 300_000 < len(topics_only) < len(text) and text.startswith(topics_only)
    docs = corpus.builtin_documents()
    assert all(doc and doc == doc.strip("\n") for doc in docs)
    assert len(set(docs)) == len(docs)
    # sentencepiece writes spaces as U+2581; text containing it could not round-trip.
    assert "\u2581" not in text


def test_docstrings_are_dedented() -> None:
    # inspect.cleandoc removes the indentation docstrings have in source.
    assert "\nReturn the fields of a dataclass instance" in corpus.builtin_corpus()


def test_module_list_is_sorted_and_importable() -> None:
    assert list(corpus.STDLIB_MODULES) == sorted(set(corpus.STDLIB_MODULES))
    for name in corpus.STDLIB_MODULES:
        importlib.import_module(name)


@pytest.mark.slow
def test_corpus_is_identical_in_a_fresh_interpreter() -> None:
    script = "from llmkit.train.corpus import builtin_corpus_sha256; print(builtin_corpus_sha256())"
    for seed in ("0", "123"):  # str hashing order must not leak into the text
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=Path(__file__).parents[2],
        )
        assert out.stdout.strip() == corpus.builtin_corpus_sha256()
    assert corpus.builtin_corpus_sha256() == hashlib.sha256(corpus.builtin_corpus().encode()).hexdigest()


def test_every_corpus_line_round_trips(builtin_tok: LlamaTokenizer) -> None:
    lines = corpus.builtin_corpus().split("\n")
    decoded = builtin_tok.decode_batch(builtin_tok.encode_batch(lines, add_bos=False))
    bad = [line for line, back in zip(lines, decoded, strict=True) if line != back]
    assert not bad, f"{len(bad)} lines do not round-trip, e.g. {bad[0]!r}"
    assert builtin_tok.vocab_size == 4096


def test_builtin_tokenizer_is_cached(
    builtin_tok: LlamaTokenizer, session_cache_dir: Path, monkeypatch
) -> None:
    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(corpus, "train_tokenizer", no_training)
    again = corpus.builtin_tokenizer(4096, cache_dir=session_cache_dir)
    assert again.sha256 == builtin_tok.sha256
    entries = (session_cache_dir / "tokenizers").glob("builtin-*/tokenizer.model")  # other sizes too
    assert builtin_tok.model_proto in [entry.read_bytes() for entry in entries]
    # The default cache dir comes from $LLMKIT_CACHE_DIR (set to session_cache_dir by conftest).
    assert corpus.builtin_tokenizer(4096).sha256 == builtin_tok.sha256


def test_builtin_tokenizer_vocab_sizes_are_separate_entries(tmp_path: Path) -> None:
    small = corpus.builtin_tokenizer(512, cache_dir=tmp_path)
    assert small.vocab_size == 512
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    corpus.builtin_tokenizer(600, cache_dir=tmp_path)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 2


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(tmp_path))
    assert corpus.default_cache_dir() == tmp_path
    monkeypatch.delenv("LLMKIT_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert corpus.default_cache_dir() == tmp_path / ".cache" / "llmkit"
