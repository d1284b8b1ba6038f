"""Choosing the next token from logits (host-side numpy, float64 for stable probabilities).

``SamplingParams`` holds one request's settings; :class:`Sampler` is one request's sampling state
(its random generator, the tokens it has seen for penalties). Each request is sampled on its own
row of logits, so sampling never depends on how requests are batched. The order of operations::

    raw logits -> logprobs (reported: the model's own distribution, as vLLM reports by default;
                  logprobs_mode="processed": of the penalized logits / temperature, full vocabulary)
    raw logits -> repetition / presence / frequency penalties
               -> greedy argmax (temperature 0; the lowest id wins ties)
               or / temperature -> top-k -> softmax -> min-p -> top-p -> one draw from the
                  request's generator (seeded: the same seed gives the same tokens)

``sample(logits, params, rng)`` is the same choice without penalties (eager generation uses it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import llmkit.framework as lf

MAX_LOGPROBS = 20
LOGPROBS_MODES = ("raw", "processed")
_LOG_SOFTMAX = lf.ops.table()["log_softmax"].kernel


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings. Invalid values raise ValueError naming the field."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens (0 = all)
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    min_p: float = 0.0  # drop tokens less likely than min_p * the most likely one
    repetition_penalty: float = 1.0  # CTRL / Hugging Face: logits of seen tokens (prompt + output) / p
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often it was generated
    seed: int | None = None  # per-request seed; None draws from entropy
    max_tokens: int = 16  # new tokens at most (0: score the prompt only; needs prompt_logprobs)
    stop: tuple[str, ...] = ()  # stop strings (not included in the output text)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the output (besides eos)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and the k most likely
    # "raw": of the model's logits; "processed": of the distribution before top-k/top-p/min-p
    # truncation (penalties and temperature applied; temperature 0 counts as 1): RLHF's log-probs
    logprobs_mode: str = "raw"
    # None: none; k: every prompt token's logprob (the first has none) and the k most likely at its
    # position, from the engine's score program (raw logits; the prompt is computed whole, never
    # read from the prefix cache)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_k", self.top_k >= 0, ">= 0 (0 = off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0 (1 = off)"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            (
                "max_tokens",
                self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None),
                ">= 1 (0 only with prompt_logprobs: score the prompt without generating)",
            ),
        ]
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            checks.append((name, v is None or 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"))
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def replace(self, **changes: Any) -> SamplingParams:
        return SamplingParams(**{**self.__dict__, **changes})


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from: temperature, top-k, min-p and top-p. [V] -> [V] float64."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.min_p > 0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
        p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # keep tokens up to and including the one that crosses top_p
        cut = int(np.searchsorted(cum, params.top_p) + 1)
        keep = np.zeros_like(p, dtype=bool)
        keep[order[:cut]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from a row of logits [V] (no penalties: they need the request's history)."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    p = probabilities(logits, params)
    return int(rng.choice(p.shape[0], p=p))


def log_softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Float64 log-probabilities of ``logits / temperature``: the op table's log_softmax kernel, the
    definition the ``token_logprobs`` op shares (so a trainer recomputes the sampler's bits)."""
    return _LOG_SOFTMAX(np, logits.astype(np.float64) / temperature)


def top_logprobs(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob), most likely first, lower ids first among equals."""
    if k <= 0:
        return []
    idx = np.argpartition(-logprobs, min(k, logprobs.shape[0]) - 1)[:k]
    idx = idx[np.lexsort((idx, -logprobs[idx]))]
    return [(int(i), float(logprobs[i])) for i in idx]


@dataclass
class TokenChoice:
    """One sampled token, with its logprob and the top alternatives when asked for."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


class PromptLogprobs(Sequence):
    """A scored prompt's log-probs as the score program's arrays, read as a list of TokenChoice
    (``None`` for the first token, which nothing predicts): ``logprobs[i]`` is token ``ids[i + 1]``'s,
    ``top_ids[i]``/``top_logprobs[i]`` the k most likely there. The server writes them out as
    arrays; nothing builds a TokenChoice per position unless it is read as one."""

    __slots__ = ("ids", "logprobs", "top_ids", "top_logprobs")

    def __init__(self, ids: Sequence[int], logprobs: Any, top_ids: Any, top_logprobs: Any) -> None:
        self.ids, self.logprobs, self.top_ids, self.top_logprobs = ids, logprobs, top_ids, top_logprobs

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]
        if i == 0:
            return None
        top = list(zip(self.top_ids[i - 1].tolist(), self.top_logprobs[i - 1].tolist()))
        return TokenChoice(int(self.ids[i]), float(self.logprobs[i - 1]), top)


class Sampler:
    """One request's sampler: ``sampler(logits_row) -> TokenChoice``, then ``accept(token)``.

    ``seed`` (default ``params.seed``) seeds the request's own generator: one uniform draw per
    sampled token, so a seeded request gives the same tokens wherever and with whatever it runs.
    """

    def __init__(
        self, params: SamplingParams, prompt_ids: Iterable[int] = (), seed: int | None = None
    ) -> None:
        self.params = params
        seed = params.seed if seed is None else seed
        self._seed = None if seed is None else seed % (1 << 64)
        self._rng: np.random.Generator | None = None
        self._seen = set(int(t) for t in prompt_ids) if params.repetition_penalty != 1.0 else set()
        self._counts: dict[int, int] = {}

    @property
    def rng(self) -> np.random.Generator:
        """The request's generator, made at its first draw (greedy requests never make one: 20-30
        us a request, on the thread that submits it)."""
        if self._rng is None:
            self._rng = np.random.default_rng(self._seed)
        return self._rng

    def penalize(self, logits: np.ndarray) -> np.ndarray:
        """The logits with this request's penalties applied (in float64; the row itself when no
        penalty applies: argmax and ``probabilities`` read it as it is)."""
        p = self.params
        rep = p.repetition_penalty != 1.0 and self._seen
        counted = (p.presence_penalty or p.frequency_penalty) and self._counts
        if not rep and not counted:
            return logits
        z = logits.astype(np.float64)
        if rep:
            ids = np.fromiter(self._seen, np.int64)
            v = z[ids]
            z[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if counted:
            ids = np.fromiter(self._counts, np.int64)
            counts = np.fromiter(self._counts.values(), np.float64)
            z[ids] -= p.presence_penalty + p.frequency_penalty * counts
        return z

    def __call__(self, logits: np.ndarray) -> TokenChoice:
        p = self.params
        z = self.penalize(logits)
        token = int(z.argmax()) if p.greedy else int(self.rng.choice(z.shape[0], p=probabilities(z, p)))
        choice = TokenChoice(token)
        if p.logprobs is not None:
            processed = p.logprobs_mode == "processed"
            lp = log_softmax(z, p.temperature or 1.0) if processed else log_softmax(logits)
            choice.logprob = float(lp[token])
            choice.top = top_logprobs(lp, p.logprobs)
        return choice

    def accept(self, token: int) -> None:
        """Record a generated token (for the penalties)."""
        if self.params.repetition_penalty != 1.0:
            self._seen.add(token)
        self._counts[token] = self._counts.get(token, 0) + 1


def merge_stop_ids(params: SamplingParams, eos_ids: Sequence[int]) -> frozenset[int]:
    """The token ids that end this request's output."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))
