"""Built-in verifiable tasks: prompts from the built-in corpus, rewards computed from the text.

A model trained on the built-in corpus (``llmkit train configs/tiny.yaml``) continues text; it
cannot read instructions. So a task's goal is fixed by the task, never written in the prompt, and
the policy finds it from the reward alone, as in verifiable-reward RL. The goals are properties of
every token the policy writes (which letters its words use, how long it goes on, how it ends), so a
1.8M-parameter model moves its reward within about a hundred steps.

Each task is a reward function with TRL's signature, made from its settings::

    reward = make_task("avoid_letter", {"letter": "e"})
    reward(prompts=["The value"], completions=[" of this is big"])  # -> [0.75]

==================  ================================================================  ============
task                reward of a completion (in [0, 1])                                settings
==================  ================================================================  ============
``avoid_letter``    share of its words without the letter                             ``letter``
``use_letter``      share of its words with the letter                                ``letter``
``target_length``   ``max(0, 1 - |words - target| / target)``                         ``words``
``end_word``        1 if its last word is the word, 0.5 if the word occurs, else 0    ``word``
==================  ================================================================  ============

Words are runs of letters (``[A-Za-z]+``); a completion without any gets 0.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from collections.abc import Callable, Sequence
from typing import Any

RewardFn = Callable[..., list[float]]  # fn(prompts, completions, **kwargs) -> one float per completion

_WORD = re.compile(r"[A-Za-z]+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


@dataclasses.dataclass(frozen=True)
class AvoidLetter:
    """Share of the completion's words without ``letter`` (a lipogram)."""

    letter: str = "e"
    wanted = False  # whether the words scored are those with the letter (UseLetter)

    def score(self, text: str) -> float:
        words = _words(text)
        return sum((self.letter in w.lower()) == self.wanted for w in words) / len(words) if words else 0.0


@dataclasses.dataclass(frozen=True)
class UseLetter(AvoidLetter):
    """Share of the completion's words containing ``letter``."""

    letter: str = "s"
    wanted = True


@dataclasses.dataclass(frozen=True)
class TargetLength:
    """How close the completion's word count is to ``words``."""

    words: int = 8

    def score(self, text: str) -> float:
        n = len(_words(text))
        return max(0.0, 1.0 - abs(n - self.words) / self.words) if n else 0.0


@dataclasses.dataclass(frozen=True)
class EndWord:
    """1 when the completion's last word is ``word`` (any case), 0.5 when the word occurs, else 0."""

    word: str = "the"

    def score(self, text: str) -> float:
        words = [w.lower() for w in _words(text)]
        if not words:
            return 0.0
        return 1.0 if words[-1] == self.word.lower() else 0.5 if self.word.lower() in words else 0.0


TASKS: dict[str, type] = {
    "avoid_letter": AvoidLetter,
    "use_letter": UseLetter,
    "target_length": TargetLength,
    "end_word": EndWord,
}


@dataclasses.dataclass(frozen=True)
class Task:
    """A task as a reward function with TRL's signature (the prompt plays no part in its reward)."""

    name: str
    rule: Any  # one of TASKS' classes, with its settings

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **kwargs: Any) -> list[float]:
        return [self.rule.score(c) for c in completions]

    def score(self, completion: str) -> float:
        return self.rule.score(completion)


def make_task(name: str, args: dict[str, Any] | None = None) -> Task:
    """The task ``name`` with its settings; ValueError naming ``reward.task`` / ``reward.task_args``."""
    if name not in TASKS:
        raise ValueError(f"reward.task: unknown task {name!r} (known: {', '.join(TASKS)})")
    cls = TASKS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    args = dict(args or {})
    for key, value in args.items():
        if key not in fields:
            raise ValueError(
                f"reward.task_args.{key}: {name} has no setting {key!r} (it has: {', '.join(fields)})"
            )
        want = type(fields[key].default)
        if type(value) is not want:
            raise ValueError(f"reward.task_args.{key}: expected {want.__name__}, got {value!r}")
    rule = cls(**args)
    for key in ("letter",):
        if key in fields and (len(getattr(rule, key)) != 1 or not getattr(rule, key).isalpha()):
            raise ValueError(f"reward.task_args.{key}: expected one letter, got {getattr(rule, key)!r}")
    if getattr(rule, "words", 1) < 1:
        raise ValueError("reward.task_args.words: expected a positive number of words")
    return Task(name, rule)


# ---- prompts and preference pairs from the built-in corpus -------------------------------------------

_PROSE = re.compile(r"[A-Z][a-z]+(?: [A-Za-z]+,?){5,29}\.")  # plain sentences of 6-30 words


@functools.lru_cache(maxsize=1)
def corpus_sentences() -> tuple[str, ...]:
    """Plain prose sentences of the built-in corpus (letters, spaces and commas), in corpus order."""
    from llmkit.train.corpus import builtin_documents

    sentences = (s for doc in builtin_documents() for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())))
    return tuple(dict.fromkeys(s for s in sentences if _PROSE.fullmatch(s)))


def _split(sentence: str, words: int) -> tuple[str, str]:
    """A sentence's first ``words`` words (the prompt) and the rest, with its leading space."""
    parts = sentence.split(" ")
    return " ".join(parts[:words]), " " + " ".join(parts[words:])


def corpus_prompts(n: int, seed: int = 0, words: tuple[int, int] = (2, 4)) -> list[str]:
    """``n`` prompts: the first 2-4 words of corpus sentences, drawn without repeats by ``seed``."""
    rng = random.Random(seed)
    sentences = corpus_sentences()
    picks = rng.sample(range(len(sentences)), min(n, len(sentences)))
    return [_split(sentences[i], rng.randint(*words))[0] for i in picks]


def preference_pairs(task: Task, n: int, seed: int = 0, min_gap: float = 0.5) -> list[dict[str, str]]:
    """``n`` pairs ``{"prompt", "chosen", "rejected"}`` ranked by ``task``: a prompt is a corpus
    sentence's first words, chosen and rejected are corpus continuations (of this sentence or
    another) whose rewards differ by at least ``min_gap``, the better one chosen."""
    rng = random.Random(seed)
    sentences = corpus_sentences()
    split = [_split(s, rng.randint(2, 4)) for s in sentences]
    rest = [r for _, r in split]
    scores = [task.score(r) for r in rest]
    order = sorted(range(len(rest)), key=lambda i: scores[i])
    low, high = order[: len(order) // 3], order[-(len(order) // 3) :]
    pairs = []
    for _ in range(50 * n):
        if len(pairs) == n:
            break
        good, bad = rng.choice(high), rng.choice(low)
        if scores[good] - scores[bad] < min_gap:
            continue
        prompt = split[rng.randrange(len(split))][0]
        pairs.append({"prompt": prompt, "chosen": rest[good], "rejected": rest[bad]})
    if len(pairs) < n:
        raise ValueError(f"{task.name}: the corpus gives only {len(pairs)} pairs {min_gap} apart, not {n}")
    return pairs
