"""Containers: Sequential (a pipeline), LayerList (indexed) and LayerDict (named).

Members are registered as sublayers, so their parameters get dotted names through the container:
``blocks.3.attn.q_proj.weight`` for ``self.blocks = LayerList(...)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, overload

from .layer import Layer


class _InOrder(Layer):
    """Layers in order (Sequential, LayerList): append, len and iteration over the layers."""

    def append(self, layer: Layer) -> Any:
        self.add_sublayer(str(len(self)), layer)
        return self

    def __len__(self) -> int:
        return len(self._sublayers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self._sublayers.values())


class Sequential(_InOrder):
    """Calls its layers in order, each on the previous one's output.

    ``Sequential(a, b, c)`` names them "0", "1", "2"; ``Sequential({"proj": a, "act": b})`` uses the keys.
    """

    def __init__(self, *layers: Layer | Mapping[str, Layer]) -> None:
        super().__init__()
        named = (
            layers[0].items() if len(layers) == 1 and isinstance(layers[0], Mapping) else enumerate(layers)
        )
        for name, layer in named:
            self.add_sublayer(str(name), layer)  # type: ignore[arg-type]

    def forward(self, x: Any) -> Any:
        for layer in self._sublayers.values():
            x = layer(x)
        return x

    @overload
    def __getitem__(self, index: int) -> Layer: ...
    @overload
    def __getitem__(self, index: slice) -> Sequential: ...
    def __getitem__(self, index: int | slice) -> Layer | Sequential:
        items = list(self._sublayers.items())
        if isinstance(index, slice):
            return Sequential(dict(items[index]))
        return items[_index(index, len(items))][1]


class LayerList(_InOrder):
    """A list of layers (PyTorch's ModuleList), named "0", "1", ... in order; it has no forward."""

    def __init__(self, layers: Iterable[Layer] | None = None) -> None:
        super().__init__()
        self.extend(layers or ())

    def _reset(self, layers: list[Layer]) -> None:
        """Renumber after an insert or a delete, so names stay "0".."n-1" in list order."""
        self._sublayers.clear()
        for i, layer in enumerate(layers):
            self.add_sublayer(str(i), layer)

    def extend(self, layers: Iterable[Layer]) -> LayerList:
        for layer in layers:
            self.append(layer)
        return self

    def insert(self, index: int, layer: Layer) -> None:
        layers = list(self)
        layers.insert(index, layer)
        self._reset(layers)

    @overload
    def __getitem__(self, index: int) -> Layer: ...
    @overload
    def __getitem__(self, index: slice) -> LayerList: ...
    def __getitem__(self, index: int | slice) -> Layer | LayerList:
        if isinstance(index, slice):
            return LayerList(list(self)[index])
        return self._sublayers[str(_index(index, len(self)))]

    def __setitem__(self, index: int, layer: Layer) -> None:
        self.add_sublayer(str(_index(index, len(self))), layer)

    def __delitem__(self, index: int | slice) -> None:
        layers = list(self)
        del layers[index]
        self._reset(layers)


ModuleList = LayerList


class LayerDict(Layer):
    """A dict of layers (PyTorch's ModuleDict) in insertion order; it has no forward."""

    def __init__(self, layers: Mapping[str, Layer] | Iterable[tuple[str, Layer]] | None = None) -> None:
        super().__init__()
        if layers is not None:
            self.update(layers)

    def update(self, layers: Mapping[str, Layer] | Iterable[tuple[str, Layer]]) -> None:
        items = layers.items() if isinstance(layers, Mapping) else layers
        for name, layer in items:
            self[name] = layer

    def __getitem__(self, name: str) -> Layer:
        return self._sublayers[name]

    def __setitem__(self, name: str, layer: Layer) -> None:
        self.add_sublayer(name, layer)

    def __delitem__(self, name: str) -> None:
        del self._sublayers[name]

    def pop(self, name: str) -> Layer:
        return self._sublayers.pop(name)

    def __contains__(self, name: object) -> bool:
        return name in self._sublayers

    def __len__(self) -> int:
        return len(self._sublayers)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sublayers)

    def keys(self) -> Iterable[str]:
        return self._sublayers.keys()

    def values(self) -> Iterable[Layer]:
        return self._sublayers.values()

    def items(self) -> Iterable[tuple[str, Layer]]:
        return self._sublayers.items()


ModuleDict = LayerDict


def _index(i: int, n: int) -> int:
    if not -n <= i < n:
        raise IndexError(f"index {i} is out of range for {n} layers")
    return i % n
