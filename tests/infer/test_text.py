"""Incremental detokenization with stop strings, and the tokenizer's token bytes (chat templates:
test_chat_templates.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmkit.infer import Tokenizer
from llmkit.infer.detokenize import Detokenizer


class CharTokenizer:
    """Token i is chr(i); 0xFFFD stands for an incomplete character until the next token."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def run(stop, text):
    d = Detokenizer(CharTokenizer(), stop)
    deltas = []
    for ch in text:
        delta, stopped = d.add(ord(ch))
        deltas.append(delta)
        if stopped:
            return deltas, True, d
    deltas.append(d.finish())
    return deltas, False, d


def test_stop_string_across_tokens_is_cut_and_never_streamed():
    deltas, stopped, d = run(["END"], "abcENxENDzz")
    assert stopped and "".join(deltas) == "abcENx" == d.text
    assert all("END" not in "".join(deltas[: i + 1]) for i in range(len(deltas)))
    assert deltas[3] == "" and deltas[4] == ""  # "E", "EN" held back until "x" decides


def test_no_stop_releases_everything_at_the_end():
    deltas, stopped, _ = run(["END"], "abcEN")
    assert not stopped and "".join(deltas) == "abcEN" and deltas[-1] == "EN"


def test_earliest_of_several_stop_strings_wins():
    _, stopped, d = run(["cd", "bcX"], "abcdX")
    assert stopped and d.text == "ab"
    assert run(["ab"], "ab")[2].text == ""


def test_incomplete_characters_are_held_back():
    d = Detokenizer(CharTokenizer())
    assert d.add(ord("a")) == ("a", False)
    assert d.add(0xFFFD) == ("", False)
    assert d.add(ord("b")) == ("\ufffdb", False)


def _dummy_prefix_tokenizer() -> Tokenizer:
    """A sentencepiece model with Meta's ``add_dummy_prefix``: decode drops a leading space."""
    import io

    import sentencepiece as spm

    lines = ["Once upon a time there was a little cat.", "The cat sat on the mat, and  the dog ran."] * 40
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=320, model_type="bpe",
        byte_fallback=True, add_dummy_prefix=True, character_coverage=1.0, num_threads=1, minloglevel=2,
    )  # fmt: skip
    return Tokenizer(buf.getvalue())


@pytest.mark.parametrize("window", [1, 16])
@pytest.mark.parametrize("which", ["builtin", "dummy_prefix"])
def test_windowed_deltas_add_up_to_the_decode_of_the_whole_sequence(tok, which, window, monkeypatch):
    """The detokenizer decodes a window of the last tokens; its deltas must still equal
    sentencepiece's decode of all the ids: words' leading spaces (which a Llama tokenizer drops at
    the start of a decode), characters split into byte-fallback pieces, bare "▁" pieces, control
    tokens (they decode to nothing)."""
    import numpy as np

    from llmkit.infer import detokenize

    monkeypatch.setattr(detokenize, "WINDOW", window)  # 1: a new window at every token
    t = Tokenizer.of(tok) if which == "builtin" else _dummy_prefix_tokenizer()
    if which == "dummy_prefix":
        assert t.decode(t.encode("the cat", add_bos=False)[1:]) == "cat"  # the case the window is for
    text = "Once upon a time, é€ 漢字 —  two  spaces\nnew line 123"
    cases = [t.encode(text, add_bos=False), t.encode(" " + text, add_bos=False)]
    rng = np.random.default_rng(0)
    specials = [t.bos_id, t.eos_id, t.encode(" the", add_bos=False)[-1], *t.encode("€", add_bos=False)]
    for _ in range(30):  # random ids, weighted towards the awkward ones
        ids = rng.integers(0, t.vocab_size, 40).tolist()
        for i in rng.integers(0, 40, 12):
            ids[i] = specials[rng.integers(len(specials))]
        cases.append(ids)
    for ids in cases:
        d = Detokenizer(t)
        deltas = [d.add(i)[0] for i in ids] + [d.finish()]
        assert "".join(deltas) == t.decode(ids) == d.text, ids
        for n in range(1, len(ids)):  # what is released so far is a prefix of the final text
            assert t.decode(ids).startswith("".join(deltas[:n]))


def test_tokenizer_of_and_token_bytes(tok):
    assert Tokenizer.of(tok) is tok  # LlamaTokenizer is the one Tokenizer class
    t = Tokenizer.of(SimpleNamespace(model_proto=tok.model_proto))  # anything holding a model_proto
    text = "Hello, world! 123 é€"
    assert t.encode(text) == tok.encode(text) and t.decode(t.encode(text)) == text
    assert (t.bos_id, t.eos_id, t.vocab_size) == (tok.bos_id, tok.eos_id, tok.vocab_size)
    ids = t.encode(" the", add_bos=False)
    assert "".join(t.token_text(i) for i in ids) == " the"
    euro = t.encode("€", add_bos=False)  # byte fallback: one token per UTF-8 byte
    assert b"".join(t.token_bytes(i) for i in euro) == "€".encode()
    assert t.token_bytes(t.eos_id) == b""
    with pytest.raises(TypeError, match="no sentencepiece model_proto"):
        Tokenizer.of(object())
