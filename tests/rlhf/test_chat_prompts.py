"""RLHF prompts in TRL's conversational format: read from JSONL, rendered by the chat template with
its generation prompt (the ids /v1/chat/completions gives), text prompts unchanged."""

from __future__ import annotations

import json

import pytest

from llmkit.infer import ChatTemplate
from llmkit.rlhf.data import encode_pair, encode_prompt, load_pairs, load_prompts
from llmkit.train.data import DataError

CONVERSATION = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tell a story."}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_conversational_and_text_prompts_are_read_and_encoded(tmp_path, tok):
    rows = load_prompts(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Once"}, {"prompt": CONVERSATION}]))
    assert [r["prompt"] for r in rows] == ["Once", CONVERSATION]
    assert encode_prompt(tok, "Once") == tok.encode("Once", add_bos=True)
    ids = encode_prompt(tok, CONVERSATION)
    assert ids == ChatTemplate.of(tok).render(CONVERSATION, tok, add_generation_prompt=True)
    # the Llama 2 default, written out: the system message folded into the first user turn
    text = ChatTemplate().render_text(CONVERSATION, special_tokens={"bos_token": "", "eos_token": ""})
    assert text == "[INST] <<SYS>>\nBe kind.\n<</SYS>>\n\nTell a story. [/INST]"


def test_preference_pairs_with_a_conversational_prompt(tmp_path, tok):
    row = {"prompt": CONVERSATION, "chosen": " Once upon a time.", "rejected": " No."}
    (pair,) = load_pairs(write_jsonl(tmp_path / "pairs.jsonl", [row]))
    prompt, chosen, rejected = encode_pair(tok, pair, max_length=256)
    assert prompt == encode_prompt(tok, CONVERSATION)
    assert chosen == tok.encode(" Once upon a time.", add_bos=False)
    assert rejected == tok.encode(" No.", add_bos=False)


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([], r"p.jsonl:1: field 'prompt': a conversation needs at least one message"),
        ([{"role": "user"}], r"p.jsonl:1: field 'prompt': messages\[0\] must be an object with string"),
        (["hi"], r"messages\[0\] must be an object"),
        (7, r"p.jsonl:1: field 'prompt' must be a non-empty string or a list of messages"),
    ],
)
def test_bad_conversational_prompts_name_the_line_and_message(tmp_path, prompt, match):
    with pytest.raises(DataError, match=match):
        load_prompts(write_jsonl(tmp_path / "p.jsonl", [{"prompt": prompt}]))


def test_a_prompt_the_template_refuses_is_a_data_error(tok):
    with pytest.raises(DataError, match="a prompt: chat template: Conversation roles must alternate"):
        encode_prompt(tok, [{"role": "assistant", "content": "x"}])
