"""Offline preference optimization: ``DPOTrainer(cfg).fit()`` (``algorithm: dpo``).

The reference model's log-prob of every response (train and held-out pairs) is computed once, at
the start, by a compiled forward; each step then runs one compiled program over ``train.batch_size``
pairs (chosen and rejected sequences in one batch): the policy's log-probs, the DPO (sigmoid) or IPO
loss of ``algorithms.dpo_loss``, backward and the optimizer step. ``eval_accuracy`` is the share of
held-out pairs whose chosen response gets the larger implicit reward ``beta (log pi - log ref)``.

Data parallel: every rank scores its share of the pairs and gathers the others' (the reference's
log-probs, the evaluation), takes its share of each step's pairs with the whole batch's pair count,
and the compiled step sums the gradients over the ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import llmkit.framework as lf
from llmkit.models.llama import LlamaForCausalLM
from llmkit.train.loop import build_optimizer

from . import algorithms, policy
from .config import RLHFConfig
from .data import TokenBatch, encode_pair, load_pairs, split_heldout
from .reward_model import pair_selectors
from .run import Run

O = lf.ops
INPUTS = ("mask", "ref_seq_logp", "chosen", "rejected")
SCORE_BATCH = 64  # sequences per reference / evaluation forward


class DPOTrainer(Run):
    desc = "dpo"
    shown = ("loss", "accuracy", "margin", "eval_accuracy")

    def __init__(self, cfg: RLHFConfig, resume: bool = False, quiet: bool = False) -> None:
        super().__init__(cfg, resume, quiet)
        self.model = LlamaForCausalLM.from_pretrained(self.src)
        self.add_adapters(self.model)
        self.exact, self.temperature = cfg.rlhf.exact_logprobs, 1.0
        t = cfg.train
        rows = load_pairs(cfg.data.pairs, t.seed)
        train, held = split_heldout(rows, cfg.data.val_fraction, t.seed)
        reference = policy.reference_scorer(self.model, self.src, self.exact, self.temperature)
        self.train_pairs, self.held_pairs = (
            self._with_reference([encode_pair(self.tokenizer, r, t.max_length) for r in rows], reference)
            for rows in (train, held)
        )
        self.optimizer = build_optimizer(cfg.optim, self.model)
        self.step_fn = policy.train_step(
            self.model,
            self.optimizer,
            self._loss,
            INPUTS,
            self.exact,
            self.temperature,
            cfg.optim.grad_clip,
            group=self.dp.group if self.dp.size > 1 else None,
        )
        self.policy_score = policy.scorer(self.model, self.exact, self.temperature)
        self.setup()

    def _loss(self, logp, logits, values, mask, ref_seq_logp, chosen, rejected):
        seq = O.unsqueeze((logp * mask).sum(axis=-1), axis=-1)  # (2P, 1) each response's log-prob
        ref = O.unsqueeze(ref_seq_logp, axis=-1)
        pick = lambda sel, x: O.squeeze(O.matmul(sel, x), axis=-1)
        r, count = self.cfg.rlhf, float(self.cfg.train.batch_size)  # the whole step's pairs
        # the policy's chosen and rejected log-probs, then the reference's
        logps = [pick(sel, x) for x in (seq, ref) for sel in (chosen, rejected)]
        return algorithms.dpo_loss(*logps, r.beta, r.dpo_loss, count)

    @staticmethod
    def _batch(pairs: list[tuple]) -> TokenBatch:
        """Chosen sequences (rows 0..P-1), then rejected (P..2P-1)."""
        prompts = [p for p, *_ in pairs] * 2
        return TokenBatch.of(prompts, [c for _, c, _, *_ in pairs] + [r for _, _, r, *_ in pairs])

    def _sequence_logps(self, score: Any, pairs: list[tuple]) -> np.ndarray:
        """[P, 2] log-probs (chosen, rejected) of each pair's responses under a compiled scorer (each
        rank scores its share of the pairs)."""
        mine = pairs[self.dp.rows(len(pairs))]
        out = [np.zeros((0, 2))]
        for i in range(0, len(mine), SCORE_BATCH // 2):
            chunk = mine[i : i + SCORE_BATCH // 2]
            tb = self._batch(chunk)
            logp = score(tb.ids, tb.targets, *policy.segment_arrays(*tb.ids.shape))["logp"]
            seq = (logp * tb.mask).sum(axis=1)
            out.append(np.stack([seq[: len(chunk)], seq[len(chunk) :]], axis=1))
        return self.dp.gather(np.concatenate(out), self.dp.sizes(len(pairs)), "sequence log-probs")

    def _with_reference(self, pairs: list[tuple], reference: Any) -> list[tuple]:
        ref = self._sequence_logps(reference, pairs)
        return [(*p, float(rc), float(rr)) for p, (rc, rr) in zip(pairs, ref)]

    def train_step(self) -> dict[str, Any]:
        pairs = self.step_pairs()
        tb = self._batch(pairs)
        ref = np.array([p[3] for p in pairs] + [p[4] for p in pairs])
        mask = tb.mask.astype(np.float64)
        segments = policy.segment_arrays(*tb.ids.shape)
        return self.update(tb.ids, tb.targets, *segments, mask, ref, *pair_selectors(len(pairs)))

    def evaluate(self) -> dict[str, float]:
        """Held-out ``eval_accuracy``, ``eval_margin`` and ``eval_loss``."""
        if not self.held_pairs:
            return {}
        pol = self._sequence_logps(self.policy_score, self.held_pairs)
        ref = np.array([p[3:5] for p in self.held_pairs])
        r = self.cfg.rlhf
        loss, stats = algorithms.dpo_loss(
            *(lf.tensor(a) for a in (pol[:, 0], pol[:, 1], ref[:, 0], ref[:, 1])), r.beta, r.dpo_loss
        )
        shown = {"loss": loss, "accuracy": stats["accuracy"], "margin": stats["margin"]}
        return {f"eval_{k}": float(v.item()) for k, v in shown.items()}
