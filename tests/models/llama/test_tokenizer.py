"""LlamaTokenizer and train_tokenizer: exact round trips, Llama's special ids, determinism, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmkit.models.llama.tokenizer import LlamaTokenizer, train_tokenizer

TEXT = """The quick brown fox jumps over the lazy dog.
Numbers like 12345 and 2024 are split into digits.

def tokenize(text: str) -> list[int]:
    \"\"\"Return token ids.\"\"\"
    for line in text.splitlines():
        yield line  # indented code keeps its spaces
\tTabs\tand  double  spaces stay.
"""
TEXTS = [
    TEXT * 3,
    "A second document.\nWith two lines.",
    "Tokenizers learn merges from frequent pairs. " * 20,
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> LlamaTokenizer:
    return train_tokenizer(TEXTS, 320, tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize(
    "text",
    [
        TEXT,
        "",
        "\n",
        "\n\n\nthree newlines first",
        "   leading and trailing spaces   ",
        "windows\r\nline\r\nendings\r\n",
        "unicode: héllo wörld, 中文, emoji 🦙, math ∑x²",
        "control \x00\x01\x7f bytes",
        "    " * 10 + "deep indent",
    ],
    ids=["sample", "empty", "newline", "newlines", "spaces", "crlf", "unicode", "control", "indent"],
)
def test_decode_inverts_encode(tok: LlamaTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, add_bos=True, add_eos=True)) == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(exclude_characters="\u2581", exclude_categories=["Cs"])))
def test_decode_inverts_encode_on_any_text(tok: LlamaTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_newline_is_a_byte_piece(tok: LlamaTokenizer) -> None:
    assert [tok.id_to_piece(i) for i in tok.encode("\n", add_bos=False)] == ["<0x0A>"]


def test_digits_are_split(tok: LlamaTokenizer) -> None:
    assert [tok.id_to_piece(i) for i in tok.encode("12345", add_bos=False)] == list("12345")


def test_special_ids_follow_llama(tok: LlamaTokenizer) -> None:
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, None)
    assert tok.vocab_size == 320
    ids = tok.encode("fox", add_bos=True, add_eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]
    assert tok.encode("fox", add_bos=False) == ids[1:-1]
    assert tok.decode(ids, skip_special=False) == "<s>fox</s>"


def test_batch_methods_match_single(tok: LlamaTokenizer) -> None:
    texts = ["one", "two lines\nhere", ""]
    batch = tok.encode_batch(texts, add_bos=True, add_eos=True)
    assert batch == [tok.encode(t, add_bos=True, add_eos=True) for t in texts]
    assert tok.decode_batch(batch) == texts


def test_out_of_range_ids_are_rejected(tok: LlamaTokenizer) -> None:
    with pytest.raises(ValueError, match="token id -1 is out of range for a vocabulary of 320 pieces"):
        tok.decode([5, -1])
    with pytest.raises(ValueError, match="token id 320 is out of range"):
        tok.id_to_piece(320)
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        tok.token_bytes(-1)
    # rows of a padded embedding past the vocabulary have no text (the tokenizers library's rule)
    assert tok.decode([*tok.encode("fox", add_bos=False), 320, 999]) == "fox"
    assert tok.token_bytes(320) == b""


def test_training_is_deterministic(tok: LlamaTokenizer, tmp_path: Path) -> None:
    again = train_tokenizer(TEXTS, 320, tmp_path)
    assert again.model_proto == tok.model_proto
    assert (tmp_path / "tokenizer.model").read_bytes() == tok.model_proto


def test_save_and_load(tok: LlamaTokenizer, tmp_path: Path) -> None:
    path = tok.save_pretrained(tmp_path / "out")
    assert path == tmp_path / "out" / "tokenizer.model"
    assert LlamaTokenizer.from_pretrained(tmp_path / "out").sha256 == tok.sha256
    assert LlamaTokenizer.from_pretrained(path).sha256 == tok.sha256


def test_missing_model_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"no tokenizer.model or tokenizer.json in {tmp_path}"):
        LlamaTokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        LlamaTokenizer.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"tokenizer.model is not a sentencepiece model"):
        LlamaTokenizer.from_pretrained(tmp_path)


def test_training_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the input has no text"):
        train_tokenizer(["", "  \n"], 300, tmp_path)
    with pytest.raises(
        ValueError, match=r"cannot train a 5000-piece tokenizer on this text: Vocabulary size"
    ):
        train_tokenizer(["tiny text"], 5000, tmp_path)
    with pytest.raises(TypeError, match="not a single string"):
        train_tokenizer("a string is not a list of texts", 300, tmp_path)
    assert not (tmp_path / "tokenizer.model").exists()
