"""Static auto-parallel: a program traced with distributed inputs becomes one program per rank.

``to_static`` of a function whose inputs (arguments or captured parameters) are distributed tensors
traces the global program as usual; the passes below then run, each a function of the program:

1. :func:`annotate`: the function's ``mesh`` and each input's ``arg_placements``;
2. :func:`propagate_forward`: every op's result ``placements`` from the op's SPMD rule, in
   program order (ops whose rule asks for it are replaced by their decomposition, and a
   ``reshard_like`` by the reshard it means);
3. :func:`fold_reshards`: reshards that change nothing go, chains become one, equal ones merge;
4. :func:`propagate_backward`: an op whose every consumer wants its replicated result sharded
   computes it sharded, when its inputs can be sliced for free;
5. :func:`insert_reshards`: a ``dist.reshard`` before each operand whose placements differ from
   what its op's rule needs (then folded again);
6. :func:`partition` (per rank): local shapes, attributes made local, reshards lowered to
   ``slice``/``zeros_like`` and the ``dist.*`` collectives (``reshard.step_op``).

The per-rank programs are compiled like any (collectives are fusion barriers) and run by the
executor: under ``sim`` one thread per rank, under ``mpi`` this process's rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..ir import BlockArgument, Builder, FuncOp, Operation, Program, TensorType, Value
from ..ir.attributes import ArrayAttr, MeshAttr, PlacementAttr, ShapeAttr
from ..ir.dialects.llm import DIST_ATTR
from ..jit.static_function import register_payload_kind
from ..ops.spmd import RESHARD, RESHARD_LIKE, decide, dense, local_attrs
from ..placement import Placement, ProcessMesh, Replicate, Shard, local_region, local_shape
from ..tensor import Tensor
from ..tracer import Trace, tracing
from .comm import SimBackend, get_backend, run_ranks
from .dist_array import DistArray
from .reshard import plan, step_op


class PartitionError(ValueError):
    """A program the auto-parallel passes cannot partition; the message names the op."""


# ---- placements as attributes ---------------------------------------------------------------------


def _attr(ps: Any) -> ArrayAttr:
    return ArrayAttr(PlacementAttr(p) for p in ps)


def func_mesh(f: FuncOp) -> ProcessMesh:
    a = f.op.attributes.get("mesh")
    if a is None:
        raise PartitionError(f"@{f.name} has no mesh attribute: run annotate first")
    return a.value


def placements(v: Value) -> tuple[Placement, ...]:
    """The placements of a value of an annotated program."""
    if isinstance(v, BlockArgument):
        f = v.owner.parent_op
        return f.attributes["arg_placements"].value[v.index]
    op = v.owner
    if op.name in ("builtin.constant", "builtin.parameter"):  # the same on every rank
        f = op.parent_op
        return (Replicate(),) * f.attributes["mesh"].value.ndim
    a = op.attributes.get(DIST_ATTR)
    if a is None:
        raise PartitionError(f"{op.name} has no placements: run propagate first")
    return a.value if len(op.results) == 1 else a.value[v.index]


def _set(op: Operation, outs: list[tuple]) -> None:
    if op.name == "dist.reshard":
        return  # its placements attribute is its result's
    op.set_attr(DIST_ATTR, _attr(outs[0]) if len(outs) == 1 else ArrayAttr(_attr(p) for p in outs))


# ---- 1. annotate ----------------------------------------------------------------------------------


def annotate(
    program: Program, payloads: list[Any], func: str | None = None, params: Sequence[int] = ()
) -> ProcessMesh:
    """Record the mesh, the inputs' placements (plain arrays: replicated) and which inputs are
    parameters (``param_args``: the SPMD choice moves them last) on the function."""
    f = program.function(func)
    meshes = {p.mesh for p in payloads if isinstance(p, DistArray)}
    if len(meshes) != 1:
        raise PartitionError(
            f"@{f.name}: a static program runs on one mesh; its inputs are on {len(meshes)} "
            f"({', '.join(map(repr, meshes))}): reshard them onto one first"
        )
    (mesh,) = meshes
    ps = [p.placements if isinstance(p, DistArray) else (Replicate(),) * mesh.ndim for p in payloads]
    f.op.set_attr("mesh", MeshAttr(mesh))
    f.op.set_attr("arg_placements", ArrayAttr(_attr(p) for p in ps))
    f.op.set_attr("param_args", ShapeAttr(tuple(params)))
    return mesh


# ---- 2. propagate -----------------------------------------------------------------------------------


def _decision(op: Operation, mesh: ProcessMesh, want: tuple | None = None):
    """The op's SPMD decision; once annotated, the one that gives its annotated placements (the
    backward pass may have chosen a free strategy for them)."""
    spec = op.opdef.spec
    if want is None and DIST_ATTR in op.attributes:
        want = placements(op.results[0])
    attrs = {k: v for k, v in op.plain_attrs.items() if k != DIST_ATTR}
    ps = [placements(v) for v in op.operands]
    return decide(spec, list(op.operands), ps, attrs, mesh.shape, want=want, fixed=_params(op))


def _params(op: Operation) -> list[int]:
    """The operands of ``op`` that are parameters (arguments named by ``param_args``)."""
    a = op.parent_op.attributes.get("param_args")
    params = set(a.value) if a is not None else set()
    return [i for i, v in enumerate(op.operands) if isinstance(v, BlockArgument) and v.index in params]


def _decompose(op: Operation, program: Program, f: FuncOp) -> Operation | None:
    """Replace ``op`` by its decomposition (traced in place); return the first new op."""
    prev = op.prev
    spec = op.opdef.spec
    trace = Trace(program, f.name, builder=Builder.before_op(op))
    attrs = {k: v for k, v in op.plain_attrs.items() if k != DIST_ATTR}
    with tracing(trace):
        out = spec.decompose(*[Tensor(v) for v in op.operands], **attrs)
    outs = out if spec.multi_output else (out,)
    for r, o in zip(op.results, outs):
        r.replace_all_uses_with(o._data)
    op.erase()
    return prev.next if prev is not None else f.body.first


def propagate_forward(program: Program, func: str | None = None) -> Program:
    """Each op's result placements from its rule and its inputs' placements, in program order."""
    f = program.function(func)
    mesh = func_mesh(f)
    op = f.body.first
    while op is not None and op.name != "builtin.return":
        nxt = op.next
        spec = op.opdef.spec
        if op.name in ("builtin.constant", "builtin.parameter"):
            pass  # replicated (see placements())
        elif spec is None:
            raise PartitionError(f"{op.name}: not an op-table op; auto-parallel runs on traced programs")
        elif spec.spmd is RESHARD:
            if op.plain_attrs["mesh"] != mesh:
                raise PartitionError(
                    f"dist.reshard to {op.plain_attrs['mesh']!r}: static programs stay on their mesh "
                    f"{mesh!r} (move values between meshes eagerly, with dist.reshard outside to_static)"
                )
        elif spec.spmd is RESHARD_LIKE:  # reshard's gradient: a reshard to the layout it names
            x, like = op.operands
            attrs = {"mesh": mesh, "placements": dense(placements(like))}
            op.results[0].replace_all_uses_with(
                Builder.before_op(op).create("dist.reshard", [x], attrs).result
            )
            op.erase()
        else:
            d = _decision(op, mesh)
            if d.decompose:
                nxt = _decompose(op, program, f)
            else:
                _set(op, d.outputs)
        op = nxt
    return program


def propagate_backward(program: Program, func: str | None = None) -> Program:
    """Where every consumer of a replicated result needs it sharded along a mesh dim, the producer
    computes it sharded (its replicated inputs are then sliced, which costs nothing): slicing moves
    up towards the inputs, in reverse program order, and less is computed redundantly."""
    f = program.function(func)
    mesh = func_mesh(f)
    for op in reversed(f.body.ops):
        spec = op.opdef.spec
        if spec is None or spec.spmd is RESHARD or len(op.results) != 1 or not op.operands:
            continue
        r = op.results[0]
        cur = placements(r)
        needs = []
        for user, index in r.uses:
            if user.opdef.spec is None:
                break  # returned: its placements stay
            if user.opdef.spec.spmd is RESHARD:
                needs.append(user.plain_attrs["placements"])
            else:
                needs.append(_decision(user, mesh).inputs[index])
        else:
            if not needs or any(w is None or w != needs[0] for w in needs):
                continue
            want = tuple(w if c == Replicate() and isinstance(w, Shard) else c for c, w in zip(cur, needs[0]))
            if want == cur:
                continue
            d = _decision(op, mesh, want=want)
            if not d.decompose and d.outputs[0] == want:
                _set(op, d.outputs)
    return program


# ---- 3. insert reshards ---------------------------------------------------------------------------


def insert_reshards(program: Program, func: str | None = None) -> Program:
    """A ``dist.reshard`` before each operand whose placements differ from what its op needs."""
    f = program.function(func)
    mesh = func_mesh(f)
    for op in list(f.body):
        spec = op.opdef.spec
        if spec is None or spec.spmd is RESHARD or DIST_ATTR not in op.attributes:
            continue
        d = _decision(op, mesh)
        b = Builder.before_op(op)
        for i, (v, want) in enumerate(zip(op.operands, d.inputs)):
            if want is not None and placements(v) != want:
                r = b.create("dist.reshard", [v], {"mesh": mesh, "placements": want})
                op.set_operand(i, r.result)
    return program


# ---- 4. fold reshards -------------------------------------------------------------------------------


def fold_reshards(program: Program, func: str | None = None) -> Program:
    """Drop reshards to the placements their input has; make a reshard of a reshard one reshard;
    merge reshards of one value to the same placements."""
    f = program.function(func)
    seen: dict[tuple, Value] = {}
    for op in list(f.body):
        if op.name != "dist.reshard":
            continue
        (x,) = op.operands
        inner = x.owner if isinstance(x.owner, Operation) and x.owner.name == "dist.reshard" else None
        if inner is not None:  # reshard(reshard(y)): straight from y
            op.set_operand(0, inner.operands[0])
            if not inner.results[0].has_uses:
                seen = {k: v for k, v in seen.items() if v is not inner.results[0]}
                inner.erase()
            x = op.operands[0]
        target = op.plain_attrs["placements"]
        if placements(x) == target:
            op.results[0].replace_all_uses_with(x)
            op.erase()
            continue
        key = (x, target)
        if key in seen:
            op.results[0].replace_all_uses_with(seen[key])
            op.erase()
        else:
            seen[key] = op.results[0]
    return program


# ---- 5. partition ---------------------------------------------------------------------------------------


def partition(program: Program, rank: int, func: str | None = None) -> Program:
    """The program of ``rank``: local shapes, local attributes, reshards lowered to collectives."""
    f = program.function(func)
    mesh = func_mesh(f)
    coord = mesh.coord(rank)
    local = lambda v: local_shape(v.type.shape, mesh.shape, placements(v), coord)
    for v in f.args:
        if not all(isinstance(d, int) for d in v.type.shape):
            raise PartitionError(
                f"@{f.name}: input %{v.name} is {v.type}; distributed programs need static shapes "
                "(no symbolic InputSpec dims)"
            )
    out = Program()
    g = out.add_function(f.name, [(a.name, TensorType(local(a), a.type.dtype)) for a in f.args])
    env: dict[Value, Value] = dict(zip(f.args, g.args))
    b = Builder.at_end(g.body)
    trace = Trace(out, g.name, builder=b)
    for op in f.body:
        if op.name == "builtin.return":
            b.ret(*[env[v] for v in op.operands])
            break
        if op.name in ("builtin.constant", "builtin.parameter"):
            new = op.clone(env)
            b.insert(new)
            env.update(zip(op.results, new.results))
            continue
        spec = op.opdef.spec
        if spec.spmd is RESHARD:
            env[op.results[0]] = _lower_reshard(b, env[op.operands[0]], op, mesh, rank)
            continue
        d = _decision(op, mesh)
        attrs = {k: v for k, v in op.plain_attrs.items() if k != DIST_ATTR}
        metas = list(op.operands)
        outs = d.outputs
        if set(range(len(metas))) <= set(spec.spmd.shape_only):  # numel: a constant of the global shape
            fake = [np.broadcast_to(np.zeros((), v.type.dtype), v.type.shape) for v in metas]
            new_values = [b.constant(spec.kernel(np, *fake, **attrs))]
        elif d.local is not None:
            regions = [local_region(v.type.shape, mesh.shape, placements(v), coord) for v in op.operands]
            with tracing(trace):
                res = d.local(regions, *[Tensor(env[v]) for v in op.operands], **attrs)
            new_values = [t._data for t in (res if spec.multi_output else (res,))]
        else:
            here = local_attrs(spec, attrs, metas, op.results[0].type, outs[0], mesh.shape, coord)
            new = b.create(spec, [env[v] for v in op.operands], here)
            new_values = list(new.results)
        for r, v, ps in zip(op.results, new_values, outs):
            want = local_shape(r.type.shape, mesh.shape, ps, coord)
            if tuple(v.type.shape) != want:
                raise PartitionError(
                    f"{op.name} on rank {rank}: local result {v.type} but its placements need {list(want)} "
                    "(a bug in the op's SPMD rule)"
                )
            env[r] = v
    out.verify()
    return out


def _lower_reshard(b: Builder, x: Value, op: Operation, mesh: ProcessMesh, rank: int) -> Value:
    src = placements(op.operands[0])
    cur = list(src)
    shape = op.operands[0].type.shape
    for step in plan(src, op.plain_attrs["placements"]):
        name, attrs = step_op(step, shape, mesh, cur, rank)
        if name is not None:
            x = b.create(name if name in ("slice", "zeros_like") else f"dist.{name}", [x], attrs).result
        cur[step.dim] = step.dst
    return x


# ---- running ---------------------------------------------------------------------------------------


# The passes before partitioning, in order (the user's reshards are folded before the backward
# propagation reads them).
PASSES = (propagate_forward, fold_reshards, propagate_backward, insert_reshards, fold_reshards)


def prepare_global(program: Program, payloads: list[Any], params: Sequence[int] = ()) -> Program:
    """The annotated global program (a copy of ``program``) ready to partition."""
    p = program.clone()
    annotate(p, payloads, params=params)
    for run in PASSES:
        run(p)
    p.verify()
    return p


class DistRunner:
    """Runs a traced program on distributed inputs: partitioned per rank (once per rank), compiled,
    and run by the executor on this process's ranks (under sim one thread each)."""

    def __init__(
        self, program: Program, payloads: list[Any], compiler: str | None, params: Sequence[int] = ()
    ) -> None:
        self.program = prepare_global(program, payloads, params)
        f = self.program.function()
        self.mesh = func_mesh(f)
        self.compiler = compiler
        self.outputs = [(v.type, placements(v)) for v in f.outputs]
        self._executors: dict[int, Any] = {}

    def rank_program(self, rank: int) -> Program:
        return partition(self.program, rank)

    def executor(self, rank: int) -> Any:
        ex = self._executors.get(rank)
        if ex is None:
            from ..jit.compile import executor_for

            ex = self._executors[rank] = executor_for(self.rank_program(rank), self.compiler)
        return ex

    def run(self, inputs: list[Any]) -> list[Any]:
        comm = get_backend()
        hosted = comm.hosted(self.mesh.ranks)
        for r in hosted:
            self.executor(r)  # compiled before the ranks start waiting on each other

        def body(r: int) -> list[Any]:
            local = [x.shards[r] if isinstance(x, DistArray) else x for x in inputs]
            outs = self._executors[r].run(local)
            comm.flush()
            return outs

        if isinstance(comm, SimBackend) and comm.thread_rank is None and len(hosted) > 1:
            results = run_ranks(hosted, body)
        else:
            results = {r: body(r) for r in hosted}
        return [
            DistArray({r: results[r][k] for r in hosted}, self.mesh, ps, t.shape, t.dtype)
            for k, (t, ps) in enumerate(self.outputs)
        ]


class _StaticKind:
    """How ``to_static`` treats DistArray payloads (registered with jit)."""

    @staticmethod
    def signature(x: DistArray) -> tuple:
        return (x.mesh, x.placements)

    @staticmethod
    def prepare(
        program: Program, payloads: list[Any], compiler: str | None, params: Sequence[int]
    ) -> DistRunner:
        return DistRunner(program, payloads, compiler, params)


register_payload_kind(DistArray, _StaticKind())
