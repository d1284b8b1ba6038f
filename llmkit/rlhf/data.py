"""RLHF data: prompts (JSONL ``{"prompt"}``) and preference pairs (JSONL ``{"prompt", "chosen",
"rejected"}``), or the built-in ones made by a task (``tasks.py``); and their token batches.

A prompt is a text (tokenized with BOS, as ``llmkit generate`` does) or, in TRL's conversational
format, a list of ``{"role", "content"}`` messages, rendered by the model's chat template with its
generation prompt (``tokenizer.chat_template``, else the Llama 2 default; ``llmkit.infer.ChatTemplate``):
the prompt ids ``/v1/chat/completions`` would give the policy. Completions (sampled, chosen,
rejected) are texts, tokenized on their own.

A step's data is a function of ``(seed, step)``, so a resumed run draws what it would have drawn.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.infer.chat import ChatTemplate, ChatTemplateError
from llmkit.train.data import DataError, check_messages, jsonl_records

from .tasks import corpus_prompts, make_task, preference_pairs

BUILTIN = "builtin:"
BUILTIN_PROMPTS = 2048  # prompts of a task's built-in set
BUILTIN_PAIRS = 2000  # pairs of a built-in preference set


Prompt = str | list  # a text, or a conversation: [{"role", "content"}, ...]


def read_jsonl(path: str, fields: Sequence[str], key: str) -> list[dict[str, Any]]:
    """Rows of a JSONL file, each an object whose ``fields`` are strings, the ``"prompt"`` a string
    or a conversation (other fields are kept)."""
    if not Path(path).is_file():
        raise DataError(f"{key}: file {path!r} not found")
    rows = []
    for i, row in jsonl_records(path):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
        for f in fields:
            if f == "prompt" and isinstance(row.get(f), list):
                check_messages(row[f], f"{path}:{i}: field 'prompt'")
            elif not isinstance(row.get(f), str) or not row[f]:
                kind = "string or a list of messages" if f == "prompt" else "string"
                raise DataError(f"{path}:{i}: field {f!r} must be a non-empty {kind}")
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A text prompt's ids with BOS, or a conversation's as the chat template renders it for the
    model to write the next assistant message."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_bos=True)
    try:
        return ChatTemplate.of(tokenizer).render(prompt, tokenizer, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise DataError(f"a prompt: {e}") from None


def load_prompts(path: str | None, seed: int = 0) -> list[dict[str, Any]]:
    """Prompt rows ``{"prompt", ...}``: a JSONL file, or (None) the built-in corpus prompts."""
    if path is None:
        return [{"prompt": p} for p in corpus_prompts(BUILTIN_PROMPTS, seed)]
    return read_jsonl(path, ("prompt",), "data.prompts")


def load_pairs(spec: str, seed: int = 0) -> list[dict[str, Any]]:
    """Preference rows: a JSONL file, or ``builtin:<task>`` (pairs ranked by the task's reward)."""
    if spec.startswith(BUILTIN):
        try:
            task = make_task(spec[len(BUILTIN) :])
        except ValueError as e:
            raise DataError(f"data.pairs: {e}".replace("reward.task: ", "")) from None
        return preference_pairs(task, BUILTIN_PAIRS, seed)
    return read_jsonl(spec, ("prompt", "chosen", "rejected"), "data.pairs")


def split_heldout(rows: list[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """(train, held-out): a seeded shuffle, the last ``fraction`` held out (at least one row when
    fraction > 0 and there are two rows)."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_val = min(len(rows) - 1, max(1, round(fraction * len(rows)))) if fraction > 0 else 0
    cut = len(rows) - n_val
    return [rows[i] for i in order[:cut]], [rows[i] for i in order[cut:]]


def step_rows(rows: Sequence[Any], count: int, seed: int, step: int) -> list[Any]:
    """The ``count`` rows of step ``step`` (0-based): epochs of seeded permutations, so every row
    comes once per epoch and the choice depends only on (seed, step)."""
    out = []
    for k in range(step * count, (step + 1) * count):
        epoch, i = divmod(k, len(rows))
        perm = np.random.default_rng([seed, epoch]).permutation(len(rows))
        out.append(rows[perm[i]])
    return out


@dataclass
class TokenBatch:
    """Right-padded sequences: ``ids`` [B, S] (pad 0), ``mask`` [B, S] float32 over the response
    tokens as predicted, i.e. ``mask[b, s] = 1`` when token ``s + 1`` is a response token (the
    position whose logits predict it), and ``lengths`` [B]."""

    ids: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(
        cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_to: int = 1
    ) -> TokenBatch:
        lengths = np.array([len(p) + len(r) for p, r in zip(prompts, responses)], dtype=np.int64)
        width = -(-int(lengths.max()) // pad_to) * pad_to
        ids = np.zeros((len(lengths), width), np.int64)
        mask = np.zeros((len(lengths), width), np.float32)
        for b, (p, r) in enumerate(zip(prompts, responses)):
            ids[b, : len(p) + len(r)] = list(p) + list(r)
            mask[b, len(p) - 1 : len(p) + len(r) - 1] = 1.0
        return cls(ids, mask, lengths)

    @property
    def targets(self) -> np.ndarray:
        """The token each position predicts (the next one; 0 past the end): [B, S]."""
        out = np.zeros_like(self.ids)
        out[:, :-1] = self.ids[:, 1:]
        return out


def encode_pair(
    tokenizer: Any, row: dict[str, Any], max_length: int
) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids (:func:`encode_prompt`), chosen ids, rejected ids), responses cut so that
    prompt + response fits ``max_length`` (the prompt keeps at least one token)."""
    prompt = encode_prompt(tokenizer, row["prompt"])[: max_length - 1]
    room = max_length - len(prompt)
    # Responses are tokenized on their own, as a policy's completions are tokens of their own (the
    # tokenizer adds no dummy prefix: " of this" -> " of", " this").
    chosen, rejected = (tokenizer.encode(row[k], add_bos=False)[:room] for k in ("chosen", "rejected"))
    return prompt, chosen, rejected
