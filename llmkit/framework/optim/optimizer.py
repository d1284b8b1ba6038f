"""The optimizer base, in the MLX style: subclasses write only ``init_state`` and ``update``.

``update`` is a pure function from (parameter, gradient, state, hyperparameters) to the new
parameter and state, written with framework ops; the base class rebinds the tensors with
``set_value``. No step reads a tensor value back to Python, so a whole ``step()`` can be traced
into a static program whose inputs are the parameters, gradients, optimizer state, the learning
rate and the step counter (the latter two are 0-d tensors owned here, not baked constants).

State lives in a list aligned with the flattened parameters of all groups (``param_index`` in
``state_dict``). It is created when a parameter joins, so it exists before any step is traced.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .. import backend as B
from .. import ops
from ..tape import no_grad
from ..tensor import Tensor

StateDict = dict[str, Any]


def compute_dtype(param: Tensor) -> np.dtype:
    """Optimizer math and state run in float32 for half-precision parameters, else in their dtype.

    bfloat16 cannot even represent beta2 = 0.999 (it rounds to 1.0), so moments kept in it are useless.
    """
    return B.DTYPES["float32"] if param.dtype.itemsize < 4 else param.dtype


class Optimizer:
    """Base class: holds ``param_groups`` and per-parameter state, runs ``step()``.

    ``params`` is an iterable of Parameters, or of dicts ``{"params": [...], **overrides}`` whose
    keys override ``defaults`` for that group. ``group["lr"]`` is a plain float the user (or a
    schedule) may set at any time; each step copies it into the group's 0-d lr tensor.
    """

    def __init__(
        self, params: Iterable[Tensor] | Iterable[Mapping[str, Any]], defaults: Mapping[str, Any]
    ) -> None:
        self.defaults = dict(defaults)
        self.param_groups: list[dict[str, Any]] = []
        self._params: list[Tensor] = []
        self._state: list[dict[str, Tensor]] = []
        self._lr: list[Tensor] = []
        self._step: Tensor | None = None
        groups = list(params)
        if not groups:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        for g in [{"params": groups}] if not isinstance(groups[0], Mapping) else groups:
            self.add_param_group(g)

    # ---- what subclasses write ---------------------------------------------------------------
    def init_state(self, param: Tensor, group: Mapping[str, Any]) -> dict[str, Tensor]:
        """Fresh state for ``param`` (e.g. zero moments); ``group`` holds its hyperparameters."""
        return {}

    def update(
        self, param: Tensor, grad: Tensor, state: Mapping[str, Tensor], group: Mapping[str, Any]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The new parameter and state, computed with ops.

        ``group`` holds the group's hyperparameters with ``"lr"`` as a 0-d float64 tensor and
        ``"step"`` as the 0-d int64 count of steps taken, this one included (1 on the first step).
        """
        raise NotImplementedError

    def validate(self, group: Mapping[str, Any]) -> None:
        """Raise ValueError for bad hyperparameters in a group (subclasses extend)."""
        if not group["lr"] >= 0:
            raise ValueError(f"{type(self).__name__}: lr must be >= 0, got {group['lr']}")

    # ---- groups ------------------------------------------------------------------------------
    def add_param_group(self, group: Mapping[str, Any]) -> None:
        """Add parameters with their own hyperparameters (missing keys come from ``defaults``)."""
        if "params" not in group:
            raise ValueError(f"{type(self).__name__}: a parameter group needs a 'params' entry")
        unknown = set(group) - set(self.defaults) - {"params"}
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: unknown hyperparameters {sorted(unknown)}; "
                f"known: {sorted(self.defaults)}"
            )
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        owned = {id(p) for p in self._params}
        for p in params:
            if not isinstance(p, Tensor) or not B.is_floating(p.dtype):
                raise TypeError(f"{type(self).__name__}: can only optimize floating tensors, got {p!r}")
            if id(p) in owned:
                raise ValueError(f"{type(self).__name__}: a parameter appears twice (in one group or in two)")
            owned.add(id(p))
        g = {**self.defaults, **group, "params": params}
        self.validate(g)
        device = params[0].device if params else B.get_device()
        xp = B.xp_for(device)
        if self._step is None:
            self._step = Tensor(xp.zeros((), dtype=np.int64))
        for p in params:
            self._params.append(p)
            self._state.append(self.init_state(p, g))
        self._lr.append(Tensor(xp.asarray(float(g["lr"]), dtype=np.float64)))
        self.param_groups.append(g)

    # ---- stepping ----------------------------------------------------------------------------
    @property
    def step_count(self) -> Tensor:
        """The 0-d int64 number of steps taken."""
        assert self._step is not None
        return self._step

    @property
    def params(self) -> list[Tensor]:
        """Every optimized parameter, in group order (the order of ``states``)."""
        return list(self._params)

    @property
    def states(self) -> list[dict[str, Tensor]]:
        """Per-parameter state tensors (moments...), aligned with ``params``."""
        return list(self._state)

    @property
    def lr_tensors(self) -> list[Tensor]:
        """One 0-d float64 lr tensor per group: what ``update`` reads (a traced step's inputs)."""
        return list(self._lr)

    def sync_lr(self) -> None:
        """Copy each group's ``lr`` (a float, or a 0-d tensor) into its lr tensor.

        ``step()`` does this first; a compiled step, which replays only the tensor math, must call it
        before each run so that schedule changes reach the program.
        """
        with no_grad():
            for group, lr in zip(self.param_groups, self._lr, strict=True):
                value = group["lr"]
                if isinstance(value, Tensor):
                    lr.set_value(value.astype(np.float64))
                else:
                    lr.set_value(B.xp_for(lr.device).asarray(float(value), dtype=np.float64))

    def step(self) -> None:
        """Update every parameter that has a gradient (those without one, and their state, stay put)."""
        self.sync_lr()
        with no_grad():
            step = self.step_count
            step.set_value(step + 1)
            i = 0
            for group, lr in zip(self.param_groups, self._lr, strict=True):
                hp = {**group, "lr": lr, "step": step}
                for p in group["params"]:
                    state = self._state[i]
                    i += 1
                    if p.grad is None:
                        continue
                    new_p, new_state = self.update(p, p.grad, state, hp)
                    p.set_value(new_p.astype(p.dtype))
                    for name, value in new_state.items():
                        state[name].set_value(value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            if p.grad is not None:
                p.grad = None if set_to_none else ops.zeros_like(p.grad)

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> StateDict:
        """``{"state": {param_index: {name: Tensor}}, "param_groups": [...], "step": int}``.

        Groups hold their hyperparameters and ``"params"``: the indices of their parameters in the
        flattened order. ``flatten_state_dict`` turns this into tensors + JSON for a checkpoint.
        """
        groups, i = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + n))})
            i += n
        return {
            "state": {j: {k: v.detach() for k, v in s.items()} for j, s in enumerate(self._state) if s},
            "param_groups": groups,
            "step": int(self.step_count.item()),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore state, hyperparameters and the step count saved from an optimizer built alike.

        Everything is checked before anything changes; values are copied and cast to this
        optimizer's state dtypes, so resuming continues bit-identically.
        """
        name = type(self).__name__
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{name}.load_state_dict: {len(saved_groups)} parameter groups saved, "
                f"this optimizer has {len(self.param_groups)}"
            )
        for k, (saved, own) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(saved["params"]) != len(own["params"]):
                raise ValueError(
                    f"{name}.load_state_dict: group {k} saved {len(saved['params'])} parameters, "
                    f"this optimizer's group has {len(own['params'])}"
                )
            unknown = set(saved) - set(self.defaults) - {"params"}
            if unknown:
                raise ValueError(
                    f"{name}.load_state_dict: group {k} saved unknown hyperparameters {sorted(unknown)}"
                )
        saved_state = {int(j): s for j, s in state_dict["state"].items()}
        updates: list[tuple[Tensor, Any]] = []
        for j, own_state in enumerate(self._state):
            got = saved_state.get(j, {})
            if set(got) != set(own_state):
                raise ValueError(
                    f"{name}.load_state_dict: parameter {j} has state {sorted(own_state)}, "
                    f"saved {sorted(got)}"
                )
            for k, t in own_state.items():
                v = got[k] if isinstance(got[k], Tensor) else Tensor(np.asarray(got[k]))
                if tuple(v.shape) != t.shape:
                    raise ValueError(
                        f"{name}.load_state_dict: state {k!r} of parameter {j} is "
                        f"{list(t.shape)}, saved {list(v.shape)}"
                    )
                if v.is_concrete:  # copied: the state must not alias the caller's (mapped) arrays
                    v = B.to_device(v._data, t.device).astype(t.dtype)
                else:  # a distributed value, cast with ops
                    v = v.astype(t.dtype)
                updates.append((t, v))
        for t, v in updates:
            t.set_value(v)
        for saved, own in zip(saved_groups, self.param_groups, strict=True):
            for k, v in saved.items():
                if k != "params":
                    own[k] = tuple(v) if isinstance(own.get(k), tuple) else v
        step = self.step_count
        step.set_value(B.xp_for(step.device).asarray(int(state_dict["step"]), dtype=np.int64))

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}("]
        for k, g in enumerate(self.param_groups):
            hp = ", ".join(f"{key}={v}" for key, v in g.items() if key != "params")
            lines.append(f"  group {k} ({len(g['params'])} params): {hp}")
        return "\n".join([*lines, ")"])


def flatten_state_dict(state_dict: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Split an optimizer state dict into tensors named ``state.<param_index>.<name>`` and JSON-able metadata.

    The tensors go to ``lf.save``; the metadata (groups and step) to JSON, e.g. inside the same
    file's safetensors metadata: ``lf.save(tensors, path, {"optimizer": json.dumps(meta)})``.
    """
    tensors = {f"state.{j}.{k}": v for j, s in state_dict["state"].items() for k, v in s.items()}
    groups = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in state_dict["param_groups"]
    ]
    return tensors, {"param_groups": groups, "step": int(state_dict["step"])}


def unflatten_state_dict(tensors: Mapping[str, Any], metadata: Mapping[str, Any]) -> StateDict:
    """The inverse of :func:`flatten_state_dict`."""
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        head, j, name = key.split(".", 2) if key.count(".") >= 2 else (key, "", "")
        if head != "state" or not j.isdigit() or not name:
            raise ValueError(f"unflatten_state_dict: {key!r} is not a 'state.<param_index>.<name>' key")
        state.setdefault(int(j), {})[name] = v
    return {
        "state": state,
        "param_groups": [dict(g) for g in metadata["param_groups"]],
        "step": metadata["step"],
    }
