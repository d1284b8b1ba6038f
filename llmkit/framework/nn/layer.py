"""``Layer`` (alias ``Module``): the base class of every model part.

A Layer owns Parameters, buffers (non-trainable tensors such as rotary tables) and sublayers, all
registered by plain attribute assignment (``self.proj = Linear(...)``), and names them with dotted
paths (``blocks.0.attn.q_proj.weight``) for state dicts, parallel plans and checkpoints. The API
follows Paddle's names (``sublayers``, ``add_sublayer``) with PyTorch's spellings where users
reach for them (``Module``, ``modules``, ``named_modules``, ``add_module``).

Parameters are never mutated: every change of values (loading, casting, optimizer steps) rebinds
the tensor's payload, so the same code keeps working when the payload is a tracer value.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from .. import backend as B
from .. import ops
from ..autograd import checkpoint
from ..tensor import Parameter, Tensor

ForwardPreHook = Callable[["Layer", tuple], Any]
ForwardHook = Callable[["Layer", tuple, Any], Any]


class StateDictError(ValueError):
    """A state dict does not fit a layer: the message lists every offending key at once."""


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` skipped: keys the layer has but the dict lacks, and the reverse."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class HookHandle:
    """Returned by ``register_forward_*hook``; ``remove()`` unregisters the hook (idempotent)."""

    _ids = itertools.count()

    def __init__(self, hooks: dict[int, Callable[..., Any]], hook: Callable[..., Any]) -> None:
        self._hooks = hooks
        self.id = next(HookHandle._ids)
        hooks[self.id] = hook

    def remove(self) -> None:
        self._hooks.pop(self.id, None)


def replace_payload(t: Tensor, data: Any) -> None:
    """Rebind ``t`` to ``data`` even when the dtype or device changes (``set_value`` forbids that).

    Only ``Layer.to`` needs this: a cast must keep each Parameter's identity, because optimizers
    and tied layers hold references to it.
    """
    t._data = data


class Layer:
    """Base class of layers: subclasses set attributes in ``__init__`` and define ``forward``.

    Calling a layer runs its forward pre-hooks, ``forward``, then its forward hooks.
    """

    training: bool

    def __init__(self) -> None:
        # object.__setattr__: our __setattr__ needs these dicts to exist already.
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_sublayers", {})
        object.__setattr__(self, "_forward_pre_hooks", {})
        object.__setattr__(self, "_forward_hooks", {})
        object.__setattr__(self, "training", True)

    # ---- calling -----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} defines no forward(); override it to call the layer"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for hook in list(self._forward_pre_hooks.values()):
            new = hook(self, args)
            if new is not None:
                args = new if isinstance(new, tuple) else (new,)
        if self.__dict__.get("_recompute"):
            out = checkpoint(self.forward, *args, params=self.parameters(), **kwargs)
        else:
            out = self.forward(*args, **kwargs)
        for hook in list(self._forward_hooks.values()):
            new = hook(self, args, out)
            if new is not None:
                out = new
        return out

    def recompute(self, enable: bool = True) -> Layer:
        """Activation checkpointing: keep only this layer's inputs for backward and recompute the
        rest there (less memory, about one more forward of compute). Works eagerly and traced."""
        object.__setattr__(self, "_recompute", enable)
        return self

    def register_forward_pre_hook(self, hook: ForwardPreHook) -> HookHandle:
        """``hook(layer, args)`` runs before forward; returning non-None replaces the positional args."""
        return HookHandle(self._forward_pre_hooks, hook)

    def register_forward_hook(self, hook: ForwardHook) -> HookHandle:
        """``hook(layer, args, output)`` runs after forward; returning non-None replaces the output."""
        return HookHandle(self._forward_hooks, hook)

    # ---- registration ------------------------------------------------------------------------
    def _registry(self) -> dict[str, Any]:
        reg = self.__dict__.get("_parameters")
        if reg is None:
            raise AttributeError(
                f"{type(self).__name__}: call super().__init__() before assigning attributes"
            )
        return reg

    def _forget(self, name: str) -> None:
        """Remove ``name`` from every registry, so one name never means two things."""
        self.__dict__.pop(name, None)
        for reg in (self._parameters, self._buffers, self._sublayers):
            reg.pop(name, None)
        self._non_persistent.discard(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, (Parameter, Layer)):
            self._registry()
            self._forget(name)
            (self._parameters if isinstance(value, Parameter) else self._sublayers)[name] = value
            return
        for reg, what, cls in _REGISTRIES:  # a registered name keeps its kind: its class or None
            if name in self.__dict__.get(reg, ()):
                if value is not None and not isinstance(value, cls):
                    got = type(value).__name__
                    raise TypeError(f"cannot assign {got} to {what} {name!r}: use a {cls.__name__} or None")
                self.__dict__[reg][name] = value
                return
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: registered members live in the registries.
        d = self.__dict__
        for reg in ("_parameters", "_buffers", "_sublayers"):
            if reg in d and name in d[reg]:
                return d[reg][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        if self._owns(name):
            self._forget(name)
        else:
            object.__delattr__(self, name)

    def _check_name(self, name: str, what: str) -> None:
        if not isinstance(name, str) or not name or "." in name:
            raise KeyError(f"{what} name must be a non-empty string without '.', got {name!r}")
        if name in self.__dict__ or (hasattr(type(self), name) and not self._owns(name)):
            raise KeyError(
                f"cannot register {what} {name!r}: {type(self).__name__} already has that attribute"
            )

    def _owns(self, name: str) -> bool:
        return any(name in reg for reg in (self._parameters, self._buffers, self._sublayers))

    def _register(self, reg: str, what: str, cls: type, name: str, value: Any) -> None:
        self._registry()
        self._check_name(name, what)
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"{what} {name!r} must be a {cls.__name__} or None, got {type(value).__name__}")
        self._forget(name)
        self.__dict__[reg][name] = value

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        self._register("_parameters", "parameter", Parameter, name, param)

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        """A tensor that moves and casts with the layer but is not trained.

        Persistent buffers appear in ``state_dict``; non-persistent ones (caches derivable from the
        config, such as rotary tables) do not.
        """
        self._register("_buffers", "buffer", Tensor, name, tensor)
        if not persistent:
            self._non_persistent.add(name)

    def add_sublayer(self, name: str, layer: Layer | None) -> Layer | None:
        self._register("_sublayers", "sublayer", Layer, name, layer)
        return layer

    add_module = add_sublayer

    # ---- traversal ---------------------------------------------------------------------------
    def _walk(self, prefix: str = "") -> Iterator[tuple[str, Layer]]:
        """Every (path, layer) pair, pre-order; a shared layer appears once per path."""
        yield prefix, self
        for name, sub in self._sublayers.items():
            if sub is not None:
                yield from sub._walk(f"{prefix}.{name}" if prefix else name)

    def named_sublayers(self, prefix: str = "", include_self: bool = False) -> Iterator[tuple[str, Layer]]:
        """(dotted path, layer) for every distinct layer below (and with ``include_self``, this one)."""
        seen: set[int] = set()
        for path, layer in self._walk(prefix):
            if id(layer) in seen or (layer is self and not include_self):
                continue
            seen.add(id(layer))
            yield path, layer

    def sublayers(self, include_self: bool = False) -> list[Layer]:
        return [layer for _, layer in self.named_sublayers(include_self=include_self)]

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Layer]]:
        """PyTorch's spelling: like ``named_sublayers`` but including this layer."""
        return self.named_sublayers(prefix, include_self=True)

    def modules(self) -> list[Layer]:
        return self.sublayers(include_self=True)

    def named_children(self) -> Iterator[tuple[str, Layer]]:
        seen: set[int] = set()
        for name, sub in self._sublayers.items():
            if sub is not None and id(sub) not in seen:
                seen.add(id(sub))
                yield name, sub

    def children(self) -> Iterator[Layer]:
        return (sub for _, sub in self.named_children())

    def _named_members(self, registry: str, prefix: str, recurse: bool) -> Iterator[tuple[str, Tensor]]:
        layers = self._walk(prefix) if recurse else iter([(prefix, self)])
        seen: set[int] = set()
        for path, layer in layers:
            for name, t in getattr(layer, registry).items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                yield (f"{path}.{name}" if path else name), t

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, Parameter) pairs; a shared parameter appears once, under its first name."""
        return self._named_members("_parameters", prefix, recurse)  # type: ignore[return-value]

    def parameters(self, recurse: bool = True) -> list[Parameter]:
        return [p for _, p in self.named_parameters(recurse=recurse)]

    def named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Tensor]]:
        return self._named_members("_buffers", prefix, recurse)

    def buffers(self, recurse: bool = True) -> list[Tensor]:
        return [b for _, b in self.named_buffers(recurse=recurse)]

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Number of scalars in the distinct parameters (shared ones counted once)."""
        return sum(p.size for p in self.parameters() if p.requires_grad or not trainable_only)

    # ---- state -------------------------------------------------------------------------------
    def _state_items(self) -> dict[str, Tensor]:
        """Every name a state dict holds: each path of a shared tensor, as PyTorch does."""
        out: dict[str, Tensor] = {}
        for path, layer in self._walk():
            pre = f"{path}." if path else ""
            for name, t in [*layer._parameters.items(), *layer._buffers.items()]:
                if t is not None and name not in layer._non_persistent:  # (only buffers are)
                    out[pre + name] = t
        return out

    def state_dict(self) -> dict[str, Tensor]:
        """Parameters and persistent buffers by dotted name.

        The values share the current payloads without copying. Because updates rebind payloads
        (never write into them), the dict is a snapshot: later optimizer steps do not change it.
        """
        return {name: t.detach() for name, t in self._state_items().items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Copy values into the existing tensors (cast to each one's dtype, moved to its device).

        Shape mismatches always raise; with ``strict``, missing and unexpected keys raise too.
        Either way the error lists every problem, and nothing is loaded unless everything fits.
        """
        own = self._state_items()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        values: dict[str, Any] = {}
        misshaped: list[str] = []
        for k, t in own.items():
            if k not in state_dict:
                continue
            v = _payload(k, state_dict[k])
            if tuple(v.shape) != t.shape:
                misshaped.append(
                    f"{k!r}: {type(self).__name__} has {list(t.shape)}, state dict has {list(v.shape)}"
                )
            values[k] = v
        if misshaped or (strict and (missing or unexpected)):
            lines = [f"cannot load the state dict into {type(self).__name__}:"]
            for label, items in (
                ("missing keys", [repr(k) for k in missing] if strict else []),
                ("unexpected keys", [repr(k) for k in unexpected] if strict else []),
                ("mis-shaped keys", misshaped),
            ):
                if items:
                    lines.append(f"  {label} ({len(items)}): {', '.join(items)}")
            if strict and (missing or unexpected):
                lines.append("  pass strict=False to load the keys that match")
            raise StateDictError("\n".join(lines))
        for k, v in values.items():
            t = own[k]
            # astype copies: the layer must not alias the caller's (possibly memory-mapped) arrays.
            t.set_value(B.to_device(v, t.device).astype(t.dtype))
        return IncompatibleKeys(missing, unexpected)

    # ---- modes, dtypes, devices --------------------------------------------------------------
    def train(self, mode: bool = True) -> Layer:
        """Set the ``training`` flag of this layer and every sublayer (dropout reads it)."""
        for layer in self.sublayers(include_self=True):
            object.__setattr__(layer, "training", mode)
        return self

    def eval(self) -> Layer:
        return self.train(False)

    def to(self, target: Any) -> Layer:
        """Cast floating parameters and buffers to a dtype, or move all of them to a device, in place.

        Each tensor keeps its identity (optimizers and tied layers still see it); gradients follow.
        """
        if isinstance(target, str) and target in B.DEVICES:
            B.xp_for(target)  # fail before changing anything

            def convert(a: Any) -> Any:
                return B.to_device(a, target)
        else:
            dt = B.dtype(target)

            def convert(a: Any) -> Any:
                return a.astype(dt) if B.is_floating(a.dtype) and a.dtype != dt else a

        for t in [*self.parameters(), *self.buffers()]:
            replace_payload(t, convert(t._data))
            if t.grad is not None:
                replace_payload(t.grad, convert(t.grad._data))
        for layer in self.sublayers(include_self=True):
            layer.converted()
        return self

    def converted(self) -> None:
        """Called on every layer after ``to()``: a layer whose buffers derive from its config (RoPE
        tables) recomputes them here at full precision rather than casting the old values."""

    def apply(self, fn: Callable[[Layer], Any]) -> Layer:
        """Call ``fn`` on every sublayer (children first), then on this layer; e.g. custom init."""
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad = None if set_to_none else ops.zeros_like(p.grad)

    # ---- printing ----------------------------------------------------------------------------
    def extra_repr(self) -> str:
        """The configuration shown between the parentheses of this layer's repr."""
        return ""

    def __repr__(self) -> str:
        children = [(name, sub) for name, sub in self._sublayers.items() if sub is not None]
        if not children:
            return f"{type(self).__name__}({self.extra_repr()})"
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, sub in children:
            body = repr(sub).replace("\n", "\n  ")
            lines.append(f"  ({name}): {body}")
        lines.append(")")
        return "\n".join(lines)


Module = Layer


# registry attribute, its kind in messages, the class a member must have (None always may)
_REGISTRIES = (
    ("_parameters", "parameter", Parameter),
    ("_sublayers", "sublayer", Layer),
    ("_buffers", "buffer", Tensor),
)


def _payload(key: str, value: Any) -> Any:
    """The array behind a state-dict value (a Tensor or an array)."""
    if isinstance(value, Tensor):
        if not value.is_concrete:
            raise TypeError(f"state dict value {key!r} holds no concrete values ({value._data!r})")
        return value._data
    if B.is_array(value):
        return value
    if isinstance(value, (list, tuple, int, float, np.generic)):
        return np.asarray(value)
    raise TypeError(f"state dict value {key!r} must be a Tensor or an array, got {type(value).__name__}")
