"""The PIR core: Value, Operation, Block, Region.

SSA and MLIR-shaped. An :class:`Operation` has a name (``dialect.op``), operands (Values), results
(Values it defines), typed attributes and regions; a :class:`Region` holds :class:`Block` s; a Block
holds an ordered list of operations and has arguments. Every Value knows its type, its definition
(an op result or a block argument) and its uses, so rewrites are local and cheap:

- blocks are doubly linked lists of ops: insert, erase and move are O(1);
- a Value's uses are an insertion-ordered dict of ``(op, operand_index)``: adding and dropping a
  use is O(1), and ``replace_all_uses_with`` is O(number of uses).

Typed op classes (``FuncOp``, ``ConstantOp``, the generated ``llm`` ops) are thin views over this
one generic Operation; its :class:`~.opdef.OpDef` carries the traits, interfaces and verifier.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..types import Type
from .attributes import Attribute, to_attr
from .errors import IRError
from .opdef import OpDef, lookup
from .printer import format_op

Use = tuple  # (operation, operand index)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while building a large IR in bulk.

    Ops and their results refer to each other, so every op is a reference cycle the collector
    re-scans as a program grows: pausing it keeps parsing, cloning, passes and tracing linear in
    the program size (half the time at 40k ops). Nothing built then is garbage worth collecting
    early; the collector resumes afterwards (and the caller's disabled state is respected).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class Value:
    """An SSA value: defined once (by an op result or a block argument), used by operands.

    ``shape``, ``dtype`` and ``ndim`` come from the type, so a Value can stand where the op table
    expects a TensorType (``spec.infer_meta(value, ...)``) and serve as a tracer's tensor payload.
    """

    __slots__ = ("__weakref__", "_uses", "name", "type")

    def __init__(self, type: Type, name: str | None = None) -> None:
        self.type = type  # the value's Type (usually a TensorType)
        self.name = name  # the text form's name, without '%' (None: numbered when printed)
        self._uses: dict[Use, None] = {}  # (op, operand index) -> None, in insertion order

    # ---- metadata (the Meta protocol) ------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return self.type.shape

    @property
    def dtype(self) -> np.dtype:
        return self.type.dtype

    @property
    def ndim(self) -> int:
        return len(self.type.shape)

    # ---- uses ---------------------------------------------------------------------------------
    @property
    def uses(self) -> list[Use]:
        """``(op, operand_index)`` pairs, in the order the uses were made."""
        return list(self._uses)

    @property
    def users(self) -> list[Operation]:
        """The operations using this value (each once)."""
        return list(dict.fromkeys(op for op, _ in self._uses))

    @property
    def has_uses(self) -> bool:
        return bool(self._uses)

    def replace_all_uses_with(self, new: Value) -> None:
        """Make every use of this value use ``new`` instead (O(number of uses))."""
        if new is self:
            return
        nu = new._uses
        for use in self._uses:
            op, i = use
            op._operands[i] = new
            nu[use] = None
        self._uses = {}

    @property
    def owner(self) -> Operation | Block:
        """The defining operation, or the block for a block argument."""
        raise NotImplementedError

    def __repr__(self) -> str:
        nm = f"%{self.name}" if self.name is not None else f"<value {id(self):#x}>"
        return f"{nm}: {self.type}"


class OpResult(Value):
    """The ``index``-th result of ``op``."""

    __slots__ = ("index", "op")

    def __init__(self, type: Type, op: Operation, index: int, name: str | None = None) -> None:
        super().__init__(type, name)
        self.op = op
        self.index = index

    @property
    def owner(self) -> Operation:
        return self.op


class BlockArgument(Value):
    """The ``index``-th argument of ``block`` (a function input, for a function body)."""

    __slots__ = ("block", "index")

    def __init__(self, type: Type, block: Block, index: int, name: str | None = None) -> None:
        super().__init__(type, name)
        self.block = block
        self.index = index

    @property
    def owner(self) -> Block:
        return self.block


class Operation:
    """One operation: ``results = name(operands) {attributes} (regions)``.

    Build operations with a :class:`~.builder.Builder` (it infers result types); the constructor
    takes explicit result types. Mutators keep use lists consistent; they do not verify (call
    ``program.verify()``) and do not notify rewriters (go through the PatternRewriter in patterns).
    """

    __slots__ = (
        "__weakref__",
        "_next",
        "_operands",
        "_plain",
        "_prev",
        "attributes",
        "name",
        "opdef",
        "parent",
        "regions",
        "results",
    )

    def __init__(
        self,
        name: str,
        operands: Sequence[Value] = (),
        result_types: Sequence[Type] = (),
        attributes: Mapping[str, Any] | None = None,
        regions: Sequence[Region] = (),
        opdef: OpDef | None = None,
        result_names: Sequence[str | None] | None = None,
    ) -> None:
        if opdef is None:
            opdef = lookup(name)
            if opdef is None:
                raise IRError(f"unknown op {name!r}: no dialect defines it")
        self.name = name  # "dialect.op"
        self.opdef = opdef  # traits, interfaces, verifier of this kind of op
        self.parent: Block | None = None  # the block holding this op
        self._prev: Operation | None = None
        self._next: Operation | None = None
        self._plain: dict[str, Any] | None = None  # cached plain attribute values
        self.attributes: dict[str, Attribute] = (
            {k: to_attr(v) for k, v in attributes.items()} if attributes else {}
        )
        self._operands: list[Value] = list(operands)
        for i, v in enumerate(self._operands):
            v._uses[(self, i)] = None
        if result_names:
            names = list(result_names)[: len(result_types)]
            names += [None] * (len(result_types) - len(names))
            self.results: tuple[OpResult, ...] = tuple(
                OpResult(t, self, i, n) for i, (t, n) in enumerate(zip(result_types, names, strict=False))
            )
        else:
            self.results = tuple(OpResult(t, self, i) for i, t in enumerate(result_types))
        self.regions: tuple[Region, ...] = tuple(regions)
        for r in self.regions:
            if r.parent is not None:
                raise IRError("a region belongs to one operation; detach it first")
            r.parent = self

    # ---- operands ----------------------------------------------------------------------------
    @property
    def operands(self) -> tuple[Value, ...]:
        return tuple(self._operands)

    def operand(self, i: int) -> Value:
        return self._operands[i]

    @property
    def num_operands(self) -> int:
        return len(self._operands)

    def set_operand(self, i: int, v: Value) -> None:
        old = self._operands[i]
        del old._uses[(self, i)]
        self._operands[i] = v
        v._uses[(self, i)] = None

    def set_operands(self, values: Sequence[Value]) -> None:
        """Replace the whole operand list (its length may change)."""
        self._drop_uses()
        self._operands = list(values)
        for i, v in enumerate(self._operands):
            v._uses[(self, i)] = None

    def _drop_uses(self) -> None:
        for i, v in enumerate(self._operands):
            v._uses.pop((self, i), None)

    # ---- results and attributes -------------------------------------------------------------
    @property
    def result(self) -> OpResult:
        """The single result (an error for ops with zero or several)."""
        if len(self.results) != 1:
            raise IRError(f"{self.name} has {len(self.results)} results, not one")
        return self.results[0]

    @property
    def plain_attrs(self) -> dict[str, Any]:
        """``{name: plain value}`` (cached): what op-table kernels take. Do not mutate it."""
        p = self._plain
        if p is None:
            p = self._plain = {k: a.value for k, a in self.attributes.items()}
        return p

    def set_attr(self, key: str, value: Any) -> None:
        self.attributes[key] = to_attr(value)
        self._plain = None

    def del_attr(self, key: str) -> None:
        del self.attributes[key]
        self._plain = None

    def has_trait(self, trait: str) -> bool:
        return trait in self.opdef.traits

    def interface(self, name: str) -> Any:
        """The op's implementation of interface ``name`` (``"InferMeta"``, ``"VJP"``...) or None."""
        return self.opdef.interfaces.get(name)

    # ---- structure ---------------------------------------------------------------------------
    @property
    def next(self) -> Operation | None:
        return self._next

    @property
    def prev(self) -> Operation | None:
        return self._prev

    @property
    def parent_op(self) -> Operation | None:
        """The operation whose region holds this op's block."""
        b = self.parent
        return None if b is None or b.parent is None else b.parent.parent

    def walk(self) -> Iterator[Operation]:
        """This op, then every op nested in its regions, in program order (pre-order)."""
        yield self
        for r in self.regions:
            for b in r.blocks:
                for op in b:
                    if op.regions:
                        yield from op.walk()
                    else:
                        yield op

    def move_before(self, anchor: Operation) -> None:
        """Move this op (from wherever it is) to just before ``anchor``, in O(1)."""
        self.detach()
        if anchor.parent is None:
            raise IRError(f"move_before: {anchor.name} is not in a block")
        anchor.parent.insert_before(self, anchor)

    def move_after(self, anchor: Operation) -> None:
        self.detach()
        if anchor.parent is None:
            raise IRError(f"move_after: {anchor.name} is not in a block")
        anchor.parent.insert_after(self, anchor)

    def detach(self) -> Operation:
        """Unlink from the parent block (uses are kept: the op can be inserted elsewhere)."""
        b = self.parent
        if b is not None:
            b._unlink(self)
        return self

    def erase(self, *, drop_uses: bool = False) -> None:
        """Detach and destroy: drop the operand uses of this op and of every op nested in it.

        Raises if a result still has uses, unless ``drop_uses`` (then those uses dangle: only
        for erasing whole subgraphs whose users are erased too).
        """
        if not drop_uses:
            for r in self.results:
                if r._uses:
                    user = next(iter(r._uses))[0]
                    raise IRError(f"cannot erase {self.name}: its result is still used by {user.name}")
        self.detach()
        for op in self.walk():
            op._drop_uses()

    def clone(self, mapping: dict[Value, Value] | None = None) -> Operation:
        """A deep copy (regions included). Operands are looked up in ``mapping`` (kept when absent);
        the mapping is extended with this op's results and the values defined inside its regions."""
        mapping = {} if mapping is None else mapping
        regions = [r.clone(mapping) for r in self.regions]
        new = Operation(
            self.name,
            [mapping.get(v, v) for v in self._operands],
            [r.type for r in self.results],
            dict(self.attributes),
            regions,
            opdef=self.opdef,
            result_names=[r.name for r in self.results],
        )
        for old, r in zip(self.results, new.results, strict=False):
            mapping[old] = r
        return new

    def __repr__(self) -> str:
        try:
            return f"<Operation {format_op(self)}>"
        except Exception:  # never let repr fail while debugging a broken op
            return f"<Operation {self.name}>"


class Block:
    """A straight-line list of operations with arguments (the entry block of a function body
    has the function inputs). Iteration tolerates erasing the op just yielded."""

    __slots__ = ("__weakref__", "_first", "_last", "_len", "args", "parent")

    def __init__(self, arg_types: Iterable[Type] = (), arg_names: Iterable[str | None] | None = None) -> None:
        types = list(arg_types)
        names = list(arg_names) if arg_names is not None else [None] * len(types)
        self.args: list[BlockArgument] = [
            BlockArgument(t, self, i, n) for i, (t, n) in enumerate(zip(types, names, strict=False))
        ]
        self.parent: Region | None = None  # the region holding this block
        self._first: Operation | None = None
        self._last: Operation | None = None
        self._len = 0

    def add_argument(self, type: Type, name: str | None = None) -> BlockArgument:
        a = BlockArgument(type, self, len(self.args), name)
        self.args.append(a)
        return a

    # ---- the op list --------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Operation]:
        op = self._first
        while op is not None:
            nxt = op._next
            yield op
            op = nxt

    def reversed(self) -> Iterator[Operation]:
        """Ops last to first; tolerates erasing the op just yielded."""
        op = self._last
        while op is not None:
            prv = op._prev
            yield op
            op = prv

    def __len__(self) -> int:
        return self._len

    @property
    def ops(self) -> list[Operation]:
        return list(self)

    @property
    def first(self) -> Operation | None:
        return self._first

    @property
    def last(self) -> Operation | None:
        return self._last

    @property
    def parent_op(self) -> Operation | None:
        return None if self.parent is None else self.parent.parent

    def append(self, op: Operation) -> Operation:
        self._check_free(op)
        op.parent = self
        op._prev = self._last
        op._next = None
        if self._last is None:
            self._first = op
        else:
            self._last._next = op
        self._last = op
        self._len += 1
        return op

    def insert_before(self, op: Operation, anchor: Operation | None) -> Operation:
        """Insert ``op`` before ``anchor`` (at the end when anchor is None)."""
        if anchor is None:
            return self.append(op)
        if anchor.parent is not self:
            raise IRError("insert_before: the anchor is not in this block")
        self._check_free(op)
        op.parent = self
        op._next = anchor
        op._prev = anchor._prev
        if anchor._prev is None:
            self._first = op
        else:
            anchor._prev._next = op
        anchor._prev = op
        self._len += 1
        return op

    def insert_after(self, op: Operation, anchor: Operation) -> Operation:
        return self.insert_before(op, anchor._next) if anchor._next is not None else self.append(op)

    def _check_free(self, op: Operation) -> None:
        if op.parent is not None:
            raise IRError(f"{op.name} is already in a block; detach it first")

    def _unlink(self, op: Operation) -> None:
        if op._prev is None:
            self._first = op._next
        else:
            op._prev._next = op._next
        if op._next is None:
            self._last = op._prev
        else:
            op._next._prev = op._prev
        op._prev = op._next = None
        op.parent = None
        self._len -= 1

    def __repr__(self) -> str:
        return f"<Block with {len(self.args)} args and {self._len} ops>"


class Region:
    """A list of blocks owned by one operation (function bodies and fusion groups have one)."""

    __slots__ = ("__weakref__", "blocks", "parent")

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self.blocks: list[Block] = []
        self.parent: Operation | None = None  # the op owning this region
        for b in blocks:
            self.add_block(b)

    def add_block(self, block: Block) -> Block:
        if block.parent is not None:
            raise IRError("a block belongs to one region")
        block.parent = self
        self.blocks.append(block)
        return block

    @property
    def block(self) -> Block:
        """The only block (an error when the region has zero or several)."""
        if len(self.blocks) != 1:
            raise IRError(f"expected a region with one block, found {len(self.blocks)}")
        return self.blocks[0]

    def clone(self, mapping: dict[Value, Value]) -> Region:
        out = Region()
        for b in self.blocks:
            nb = Block([a.type for a in b.args], [a.name for a in b.args])
            for a, na in zip(b.args, nb.args, strict=False):
                mapping[a] = na
            out.add_block(nb)
            for op in b:
                nb.append(op.clone(mapping))
        return out
