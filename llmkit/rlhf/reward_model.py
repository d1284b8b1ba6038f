"""The reward model: a Llama with a scalar head, trained with the Bradley-Terry loss on preference
pairs (``llmkit rlhf reward cfg.yaml``), and scoring completions through a compiled program.

Its checkpoint is transformers' ``LlamaForSequenceClassification`` with ``num_labels: 1`` (the
backbone under ``model.*``, the head as ``score.weight``), so transformers loads it as is. It starts
from a causal LM checkpoint (``llmkit train``'s): the backbone's weights, and a fresh head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

import llmkit.framework as lf
from llmkit.framework import jit, nn
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM, LlamaTokenizer
from llmkit.models.llama.checkpoint import load_pretrained, save_pretrained
from llmkit.models.llama.model import LlamaModel
from llmkit.train.checkpoint import model_dir
from llmkit.train.loop import build_optimizer
from llmkit.train.trainer import state_names

from . import algorithms
from .config import RewardModelConfig
from .data import Prompt, TokenBatch, encode_pair, encode_prompt, load_pairs, split_heldout
from .policy import compile_function, compile_update
from .run import Run

O = lf.ops
ARCHITECTURE = "LlamaForSequenceClassification"
SCORE_INPUTS = [jit.InputSpec(["B", "S"], "int64", "ids"), jit.InputSpec(["B"], "int64", "rows")]  # score's


class LlamaRewardModel(nn.Layer):
    """``score(ids [B, S], rows [B]) -> [B]``: the head on the hidden state of each sequence's last
    token (``rows``: its index in the flattened B*S tokens; the model is causal, so padding after
    it plays no part)."""

    architecture = ARCHITECTURE

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.score = nn.Linear(config.hidden_size, 1, bias=False)
        LlamaForCausalLM.reset_parameters(self)

    def forward(self, input_ids, rows):
        hidden = self.model(input_ids)  # (B, S, H)
        last = O.index_select(O.reshape(hidden, [-1, hidden.shape[-1]]), rows)  # (B, H)
        return O.squeeze(self.score(last), axis=-1)  # (B,)

    @classmethod
    def from_pretrained(cls, path: str | Path, seed: int = 0) -> LlamaRewardModel:
        """A reward model checkpoint, or a causal LM's: its backbone, and a fresh head drawn from
        N(0, initializer_range) by a generator of its own seeded with ``seed`` (so every data-parallel
        rank, and every run with that seed, starts from the same head)."""
        path = Path(path)
        arch = json.loads((path / "config.json").read_text()).get("architectures") or []
        if ARCHITECTURE in arch:
            return load_pretrained(cls, path)
        lm = LlamaForCausalLM.from_pretrained(path)
        config = LlamaConfig.from_dict({**lm.config.to_dict(), "num_labels": 1})
        rm = cls(config)
        rm.model.load_state_dict(lm.model.state_dict())
        w = rm.score.weight
        head = np.random.default_rng(seed).normal(0.0, config.initializer_range, w.shape)
        w.set_value(head.astype(w.dtype))
        return rm

    def save_pretrained(self, path: str | Path) -> None:
        save_pretrained(self, path)


def _batch(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ``ids`` [B, S] and each sequence's last token in the flattened batch (``rows``)."""
    tb = TokenBatch.of(seqs, [[]] * len(seqs))
    return tb.ids, np.arange(len(seqs), dtype=np.int64) * tb.ids.shape[1] + tb.lengths - 1


class RewardModelScorer:
    """A reward model as a reward function (TRL's signature): the text of prompt + completion,
    tokenized with the reward model's tokenizer, scored by a compiled forward."""

    def __init__(self, model: LlamaRewardModel, tokenizer: Any, batch_size: int = 64) -> None:
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size

        def score(ids, rows):
            with lf.no_grad():
                return model(ids, rows)

        self.program = compile_function(score, SCORE_INPUTS, state_names(model))

    @classmethod
    def load(cls, path: str, tokenizer: Any = None) -> RewardModelScorer:
        src = model_dir(path, "reward.model")
        return cls(LlamaRewardModel.from_pretrained(src), LlamaTokenizer.from_pretrained(src))

    def scores(self, seqs: list[list[int]]) -> np.ndarray:
        out = []
        for i in range(0, len(seqs), self.batch_size):
            out.append(np.asarray(self.program(*_batch(seqs[i : i + self.batch_size])), dtype=np.float64))
        return np.concatenate(out) if out else np.zeros(0)

    def __call__(self, prompts: list[Prompt], completions: list[str], **kwargs: Any) -> list[float]:
        limit = self.model.config.max_position_embeddings
        seqs = [
            (encode_prompt(self.tokenizer, p) + self.tokenizer.encode(c, add_bos=False))[:limit]
            for p, c in zip(prompts, completions)
        ]
        return self.scores(seqs).tolist()


def pair_selectors(pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """[P, 2P] matrices picking each pair's chosen row (rows 0..P-1) and rejected row (P..2P-1)."""
    eye = np.eye(pairs)
    zero = np.zeros((pairs, pairs))
    return np.concatenate([eye, zero], axis=1), np.concatenate([zero, eye], axis=1)


class RewardModelTrainer(Run):
    """Bradley-Terry training; ``accuracy`` per step, ``eval_accuracy`` on the held-out pairs. Data
    parallel as DPO: each rank takes its share of a step's pairs (the loss over the whole step's
    count), the gradients summed over the ranks, the held-out pairs scored in shares."""

    desc = "reward"
    shown = ("loss", "accuracy", "eval_accuracy")

    def __init__(self, cfg: RewardModelConfig, resume: bool = False, quiet: bool = False) -> None:
        super().__init__(cfg, resume, quiet)
        self.model = LlamaRewardModel.from_pretrained(self.src, cfg.train.seed)
        if cfg.lora is not None:  # adapters on the backbone; the scalar head trains whole, saved beside
            self.add_adapters(self.model)
            self.model.score.weight.requires_grad = True
            self.extra_layers["score"] = self.model.score
        t = cfg.train
        rows = load_pairs(cfg.data.pairs, t.seed)
        train, held = split_heldout(rows, cfg.data.val_fraction, t.seed)
        self.train_pairs = [self._encode(r) for r in train]
        self.held_pairs = [self._encode(r) for r in held]
        self.optimizer = build_optimizer(cfg.optim, self.model)
        self.scorer = RewardModelScorer(self.model, self.tokenizer)
        self.step_fn = self._compile_step()
        self.setup()

    def _encode(self, row: dict[str, Any]) -> tuple[list[int], list[int]]:
        prompt, chosen, rejected = encode_pair(self.tokenizer, row, self.cfg.train.max_length)
        return prompt + chosen, prompt + rejected

    def _compile_step(self):
        model, count = self.model, float(self.cfg.train.batch_size)  # the whole step's pairs

        def forward(ids, rows, chosen, rejected):
            scores = model(ids, rows)  # (2P,)
            s = O.unsqueeze(O.cast(scores, "float64"), axis=-1)
            c, r = O.squeeze(O.matmul(chosen, s), axis=-1), O.squeeze(O.matmul(rejected, s), axis=-1)
            return algorithms.bradley_terry_loss(c, r, count)

        specs = SCORE_INPUTS + [jit.InputSpec(["P", "B"], "float64", n) for n in ("chosen", "rejected")]
        opt, clip = self.optimizer, self.cfg.optim.grad_clip  # LoRA: the adapters and the head train
        return compile_update(forward, specs, state_names(model, opt), [model], opt, clip, self.dp.group)

    def train_step(self) -> dict[str, Any]:
        pairs = self.step_pairs()
        seqs = [c for c, _ in pairs] + [r for _, r in pairs]  # chosen (rows 0..P-1), then rejected
        return self.update(*_batch(seqs), *pair_selectors(len(pairs)))

    def evaluate(self) -> dict[str, float]:
        """Held-out ``eval_accuracy`` (chosen scored above rejected) and ``eval_margin``."""
        if not self.held_pairs:
            return {}
        held, sizes = self.held_pairs[self.dp.rows(len(self.held_pairs))], self.dp.sizes(len(self.held_pairs))
        c = self.dp.gather(self.scorer.scores([c for c, _ in held]), sizes, "held-out scores")
        r = self.dp.gather(self.scorer.scores([r for _, r in held]), sizes, "held-out scores")
        _, stats = algorithms.bradley_terry_loss(lf.tensor(c), lf.tensor(r))
        return {f"eval_{k}": float(stats[k].item()) for k in ("accuracy", "margin")}
