"""Rewards: a user's Python function, a trained reward model, or a built-in task, behind one call.

Every source is a function with TRL's signature::

    fn(prompts: list[str], completions: list[str], **kwargs) -> list[float]

where ``kwargs`` holds, for each other field of the prompts' JSONL rows, the list of its values (as
TRL passes dataset columns), and ``completion_ids`` the completions' token ids. ``build_reward``
turns a config's ``reward`` section into such a function and checks what it returns.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .tasks import RewardFn, make_task


class RewardError(ValueError):
    """A reward source that cannot be loaded, or that returned something other than one number per
    completion; the message names the config key or the function."""


def load_function(spec: str, key: str = "reward.function") -> RewardFn:
    """``"package.module:function"`` or ``"path/to/file.py:function"`` -> the function."""
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name.isidentifier():
        raise RewardError(f"{key}: expected 'module:function' or 'file.py:function', got {spec!r}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise RewardError(f"{key}: file {module_name!r} not found")
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"{key}: cannot import {module_name!r}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"{key}: {module_name!r} has no function {name!r}")
    return fn


def check_rewards(values: Any, n: int, name: str) -> np.ndarray:
    """The rewards as float64 [n]; RewardError unless they are ``n`` finite numbers."""
    try:
        out = np.array([float(v) for v in values], dtype=np.float64)
    except (TypeError, ValueError):
        raise RewardError(f"{name} must return a list of numbers, got {type(values).__name__}") from None
    if out.shape != (n,):
        raise RewardError(f"{name} returned {out.size} rewards for {n} completions")
    bad = next((i for i, v in enumerate(out) if not math.isfinite(v)), None)
    if bad is not None:
        raise RewardError(f"{name} returned {out[bad]} for completion {bad}")
    return out


class Reward:
    """The run's reward: ``reward(prompts, completions, completion_ids, columns) -> [n] float64``.

    ``user``: the function is the user's (``reward.function``): an exception it raises becomes a
    RewardError of one line naming the function, where it was raised and the exception (the run
    stops before the step changes anything, so the newest checkpoint stays the last good state)."""

    def __init__(self, fn: RewardFn, name: str, user: bool = False) -> None:
        self.fn, self.name, self.user = fn, name, user

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        completion_ids: Sequence[Sequence[int]] = (),
        columns: dict[str, list[Any]] | None = None,
    ) -> np.ndarray:
        kwargs = dict(columns or {})
        kwargs["completion_ids"] = [list(c) for c in completion_ids]
        try:
            values = self.fn(prompts=list(prompts), completions=list(completions), **kwargs)
        except Exception as e:
            if not self.user:
                raise
            frame = traceback.extract_tb(e.__traceback__)[-1]  # where it was raised
            raise RewardError(
                f"reward.function {self.name} raised {type(e).__name__}: {e} "
                f"(in {frame.name}, {frame.filename}:{frame.lineno})"
            ) from None
        return check_rewards(values, len(completions), self.name)


def build_reward(section: Any, tokenizer: Any = None) -> Reward:
    """The ``reward`` config section as a Reward (exactly one source is set; the schema checks it)."""
    if section.task is not None:
        try:
            task = make_task(section.task, section.task_args)
        except ValueError as e:
            raise RewardError(str(e)) from None
        return Reward(task, f"task {section.task}")
    if section.function is not None:
        return Reward(load_function(section.function), section.function, user=True)
    from .reward_model import RewardModelScorer

    return Reward(RewardModelScorer.load(section.model, tokenizer), f"reward model {section.model}")
