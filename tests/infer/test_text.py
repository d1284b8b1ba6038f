"""Incremental detokenization with stop strings, the tokenizer wrapper, and chat templates."""

from __future__ import annotations

import pytest

from llmkit.infer import ChatTemplate, ChatTemplateError, Tokenizer
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


def test_tokenizer_wrapper_matches_llama_tokenizer(tok):
    t = Tokenizer.of(tok)
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


def test_llama2_chat_template(tok):
    t = Tokenizer.of(tok)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    ids = ChatTemplate().render(msgs, t)
    want = (
        [t.bos_id]
        + t.encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]", add_bos=False)
        + t.encode(" Hello ", add_bos=False)
        + [t.eos_id, t.bos_id]
        + t.encode("[INST] Bye [/INST]", add_bos=False)
    )
    assert ids == want
    assert ChatTemplate.from_dict(ChatTemplate().to_dict()) == ChatTemplate()


@pytest.mark.parametrize(
    "msgs, match",
    [
        ([], "at least one user message"),
        ([{"role": "assistant", "content": "x"}], r"messages\[0\]: expected a user message"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            r"messages\[1\]: expected an? assistant",
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            "last message must be from the user",
        ),
    ],
)
def test_chat_template_errors_name_the_message(tok, msgs, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate().render(msgs, Tokenizer.of(tok))
