"""Perplexity and next-token agreement on held-out text (``llmkit eval``, quantize's report).

Text is cut into consecutive windows of ``seq_len + 1`` tokens that overlap by one (every token
after a window's first is predicted once). For models ``m`` evaluated side by side on the same
windows, with ``p_m`` each one's next-token distribution:

    perplexity(m) = exp(mean over predicted tokens of -log p_m(token))
    kl            = mean over positions of KL(p_0 || p_1) = sum_v p_0(v) (log p_0(v) - log p_1(v))
    top1          = fraction of positions where argmax p_0 == argmax p_1

all in float64 from each model's logits.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

import llmkit.framework as lf
from llmkit.train.config import DataSection
from llmkit.train.data import BUILTIN, load_token_data

SEQ_LEN = 128  # the tokens per window configs/tiny.yaml trains on
BATCH = 16  # windows per forward


class EvalError(ValueError):
    """Evaluation input that cannot work: too little text, a context the model cannot hold."""


def eval_tokens(tokenizer: Any, data: str | None = None, cache_dir: str | os.PathLike[str] | None = None):
    """The held-out split of the built-in corpus (the trainer's default ``data.val_fraction``), or
    every token of a text file (.jsonl: its "text" fields)."""
    if data is None:
        return load_token_data([BUILTIN], tokenizer, DataSection().val_fraction, cache_dir).val
    return load_token_data([data], tokenizer, 0.0, cache_dir).tokens


def windows(tokens: np.ndarray, seq_len: int = SEQ_LEN, max_tokens: int = 0) -> np.ndarray:
    """[n, seq_len + 1] int64 windows of ``tokens``, consecutive, overlapping by one; at most
    ``max_tokens`` predicted tokens when it is set (0: all)."""
    if seq_len < 1:
        raise EvalError(f"seq_len must be >= 1, got {seq_len}")
    n = (len(tokens) - 1) // seq_len
    if max_tokens:
        n = min(n, max(1, max_tokens // seq_len))
    if n < 1:
        raise EvalError(f"{len(tokens)} tokens are too few for one window of {seq_len} + 1")
    starts = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)
    return np.asarray(tokens[starts], np.int64)


def _log_probs(model: Any, ids: np.ndarray) -> np.ndarray:
    logits = model(lf.tensor(ids)).logits.numpy().astype(np.float64)  # (B, S, V)
    logits -= logits.max(axis=-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


@lf.no_grad()
def evaluate(
    models: Sequence[Any], tokens: np.ndarray, seq_len: int = SEQ_LEN, max_tokens: int = 0, batch: int = BATCH
) -> dict[str, Any]:
    """Perplexity of each model (``ppl``, a list), and with two models ``kl`` and ``top1`` of the
    second against the first (see the module docstring); ``tokens``: how many were predicted."""
    limit = min(m.config.max_position_embeddings for m in models)
    if seq_len > limit:
        raise EvalError(f"seq_len {seq_len} exceeds the model's max_position_embeddings ({limit})")
    w = windows(tokens, seq_len, max_tokens)
    nll = np.zeros(len(models))
    kl = agree = 0.0
    for i in range(0, len(w), batch):
        ids = w[i : i + batch]
        target = ids[:, 1:, None]
        lps = [_log_probs(m, ids[:, :-1]) for m in models]
        for k, lp in enumerate(lps):
            nll[k] -= np.take_along_axis(lp, target, axis=-1).sum()
        if len(lps) == 2:
            p0, p1 = lps
            kl += float((np.exp(p0) * (p0 - p1)).sum())
            agree += float((p0.argmax(-1) == p1.argmax(-1)).sum())
    n = w.shape[0] * seq_len
    out: dict[str, Any] = {"ppl": [math.exp(v / n) for v in nll], "tokens": n, "seq_len": seq_len}
    if len(models) == 2:
        out.update(kl=kl / n, top1=agree / n)
    return out
