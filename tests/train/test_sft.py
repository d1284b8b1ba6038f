"""Supervised fine-tuning on chat data: JSONL ``{"messages": [...]}`` rendered by the chat template,
with the loss on the assistant's tokens only."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmkit.cli import main as cli_main
from llmkit.train.data import IGNORE, BatchSampler, DataError, load_token_data
from llmkit.train.metrics import read_metrics

CHATS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "A mutable sequence."},
    ],
    [
        {"role": "user", "content": "Name a loop."},
        {"role": "assistant", "content": "for"},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "while"},
    ],
]


def chat_file(tmp_path, chats=CHATS, repeat=1):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats * repeat))
    return path


def expected(tok, messages):
    """Llama 2's format written out by hand (the default chat template, Meta's Jinja): (ids,
    is_target) of one conversation."""
    msgs = list(messages)
    system = msgs.pop(0)["content"] if msgs[0]["role"] == "system" else None
    ids, target = [], []
    for i in range(0, len(msgs), 2):
        user = msgs[i]["content"]
        if i == 0 and system is not None:
            user = f"<<SYS>>\n{system}\n<</SYS>>\n\n{user}"
        prompt = [tok.bos_id] + tok.encode(f"[INST] {user} [/INST]", add_bos=False)
        reply = tok.encode(f" {msgs[i + 1]['content']} ", add_bos=False) + [tok.eos_id]
        ids += prompt + reply
        target += [False] * len(prompt) + [True] * len(reply)
    return ids, target


def test_chat_data_masks_everything_but_the_assistants_tokens(tmp_path, tok):
    data = load_token_data([str(chat_file(tmp_path))], tok, 0.0, tmp_path / "cache")
    assert data.mask is not None and len(data.mask) == len(data.tokens)
    # the stream holds the two conversations in a fixed (sha256) order: find each one in it
    stream, mask = list(data.tokens), list(data.mask.astype(bool))
    pieces = [expected(tok, m) for m in CHATS]
    for ids, target in pieces:
        at = next(i for i in range(len(stream)) if stream[i : i + len(ids)] == ids)
        assert mask[at : at + len(ids)] == target
    assert len(stream) == sum(len(ids) for ids, _ in pieces)
    # windows: the labels are the next tokens where those are targets, IGNORE elsewhere
    sampler = BatchSampler(data.train, 4, 8, seed=0, mask=data.train_mask)
    x, y = sampler.batch(0)
    starts = [next(i for i in range(len(stream)) if stream[i : i + 8] == list(row)) for row in x]
    for row, s in zip(y, starts):
        want = [stream[s + 1 + j] if mask[s + 1 + j] else IGNORE for j in range(8)]
        assert list(row) == want
    assert (y == IGNORE).any() and (y != IGNORE).any()


def test_text_data_has_no_mask(tmp_path, tok):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"text": "plain text for the model"}) + "\n")
    assert load_token_data([str(f)], tok, 0.0, tmp_path / "cache").mask is None


@pytest.mark.parametrize(
    "messages,match",
    [
        ([{"role": "user", "content": "hi"}], "the last message must be the assistant's"),
        ([{"role": "user"}], r'messages\[0\] must be an object with string "role" and "content"'),
        ("hi", '"messages" must be a non-empty list'),
        (
            [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
            "a conversation: chat template: Conversation roles must alternate user/assistant",
        ),
    ],
)
def test_bad_conversations_name_the_line(tmp_path, tok, messages, match):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"messages": CHATS[0]}) + "\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(DataError, match=match) as e:
        load_token_data([str(f)], tok, 0.0, tmp_path / "cache")
    assert "c.jsonl" in str(e.value)


def test_sft_run_trains_on_chat_data(tmp_path, tok):
    cfg = tmp_path / "sft.yaml"
    raw = {
        "model": {"preset": "tiny", "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128},
        "tokenizer": {"path": "builtin", "vocab_size": 4096},
        "data": {"sources": [str(chat_file(tmp_path, repeat=20))], "val_fraction": 0.0},
        "optim": {"lr": 1e-2},
        "lr_schedule": {"name": "constant"},
        "train": {"steps": 30, "batch_size": 4, "seq_len": 32, "eval_every": 0, "log_every": 10},
        "out_dir": str(tmp_path / "run"),
    }
    cfg.write_text(json.dumps(raw))
    assert cli_main(["train", str(cfg), "--quiet"]) == 0
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < 0.5 * losses[0]  # the two replies are learned
    assert np.isfinite(losses).all()
