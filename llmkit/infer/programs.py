"""The engine's programs, traced from a causal LM: ``prefill``, ``decode`` and ``score`` over a paged KV pool.

Both are ``to_static`` traces of the model's own forward with a :class:`PagedKVCache` as its
``kv_cache`` (the seam: model code only calls ``kv_cache.attend``), symbolic sizes, and the KV pool
as an explicit input and output (donated: the pool is written in place). Inputs, all int64 except
the pool::

    prefill(input_ids [1, N], positions [1, N], slots [N], block_tables [G, MB], kv_len [G],
            q_start [G], q_len [G], logit_rows [R], pool) -> (logits [R, V], pool)
    decode(input_ids [B, 1], positions [B, 1], slots [B], block_tables [B, MB], kv_len [B], pool)
            -> (logits [B, V], pool)
    score(<prefill's inputs but pool>, targets [N], pool)
            -> (logits [R, V], target_logprobs [N], top_logprobs [N, K], top_ids [N, K], pool)

``prefill`` runs N tokens of any number of sequences flattened into one row, in G segments (a
segment: a run of tokens of one sequence, see ``paged_attention``), and returns logits only at
``logit_rows``; ``decode`` runs one token per sequence. ``score`` is ``prefill`` that also scores every
row: with ``lse = logsumexp(z)`` of the row's logits ``z`` in float64, the log-prob ``z[t] - lse`` of
``targets[row]`` (the sequence's next token) and of the K most likely tokens (K =
``ModelSpec.score_top_k``), all by that one formula (a target that is the most likely token has
exactly the top-1 value). With a tile and an unquantized head, the head and all of that are one op,
``tiled_linear_logprobs``, whose C kernel takes ``z`` 256 columns at a time and reduces each block
while it is in cache (exp in float32, sums in float64): the (N, V) logits are never formed. Its
``logits`` at ``logit_rows`` are rows of the same tiled product, so prefill's bits (a scored prompt
samples the same first token). ``pool`` is ``[layers, 2, NB, BS, Hkv, D]``
with NB symbolic: the server sizes its pool at startup.

After tracing, passes rewrite them: ``tile-linear`` turns every ``linear`` into
``tiled_linear`` (BLAS calls of a fixed number of rows: 1 in decode, 8 in prefill), which is the
batch-invariance guarantee (docs/serve.md); ``quantize-linear`` turns those of quantized layers
(a dequantized weight) into ``quant_linear`` with the same tiles; ``transpose-weights`` makes the
float weights only those linears read ``[in, out]`` inputs (BLAS's fast layout), or, in compiled
programs, 16-column panels (the C kernel's), and ``group-quant-linear`` makes the quantized products
of one input (q/k/v, gate/up) one ``quant_linears`` (one kernel call). The programs capture the
model's parameters as inputs read at every call, so programs traced from a live model always use its
current weights (what RLHF rollouts need); :meth:`EngineProgram.capture_arrays` supplies the relaid
copies.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import llmkit.framework as lf
from llmkit.framework import backend as B
from llmkit.framework import jit
from llmkit.framework.compiler import available as compiler_available
from llmkit.framework.ir import Program, TensorType
from llmkit.framework.ir.core import OpResult
from llmkit.framework.ir.pass_manager import Pass, register_pass
from llmkit.framework.ir.passes import QuantizeLinear
from llmkit.framework.ir.rewriter import PatternRewriter, RewritePattern, apply_patterns
from llmkit.framework.jit.compile import default_compiler
from llmkit.framework.jit.model_file import trace_specs
from llmkit.framework.ops.paged import KV_SCALE_BYTES, PANEL, pack_panels
from llmkit.framework.ops.quant import float_scales, half_scales, pack_qweight, unpack_qweight, weight_inputs

O = lf.ops

BLOCK_SIZE = 16  # tokens per KV block (and per prefill chunk)
# Rows per BLAS call in the programs' linears with the reference kernels (0 = plain linear, not
# batch-invariant). Decode runs one row per call (a matrix-vector product: the fastest way to stream
# the weights once per token, and invariant by construction); prefill runs 8-row matrix products
# (see docs/serve.md). With the compiler, the C kernel computes each row alone whatever the tile.
PREFILL_TILE = 8
DECODE_TILE = 1
SCORE_TOP_K = 5  # most likely tokens the score program reports per position (OpenAI's logprobs <= 5)
PROGRAMS = ("prefill", "decode", "score")


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know about the programs it runs (stored in the static file)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int  # positions the model supports (its RoPE table)
    dtype: str  # of the weights (and the KV pool)
    block_size: int = BLOCK_SIZE
    prefill_tile: int = PREFILL_TILE
    decode_tile: int = DECODE_TILE
    score_top_k: int = SCORE_TOP_K  # K of the score program's top_logprobs (at most the vocabulary)
    # the KV pool's when not dtype: "int8" (codes and a float32 scale per row, see ops.paged)
    kv_dtype: str | None = None

    @property
    def pool_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    def pool_shape(self, num_blocks: Any) -> tuple[Any, ...]:
        d = self.head_dim + (KV_SCALE_BYTES if self.pool_dtype == "int8" else 0)
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, d)

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block in the pool (keys and values of every layer)."""
        return int(np.prod(self.pool_shape(1))) * np.dtype(B.dtype(self.pool_dtype)).itemsize

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class PagedKVCache:
    """The ``kv_cache`` a model sees while the engine's programs are traced.

    ``attend(layer, q, k, v)`` stores k/v [B, Hkv, S, D] in the pool at ``slots`` and attends q
    [B, Hq, S, D] to each segment's cached keys; the pool value it threads from layer to layer is
    the program's pool output.
    """

    def __init__(self, pool, slots, block_tables, kv_len, q_start=None, q_len=None) -> None:
        self.pool = pool
        self.slots, self.block_tables, self.kv_len = slots, block_tables, kv_len
        self.q_start, self.q_len = q_start, q_len

    @property
    def past_length(self) -> Any:
        raise TypeError("PagedKVCache has no single past length: pass position_ids to the model")

    def attend(self, layer: int, q, k, v):
        self.pool = O.paged_kv_write(self.pool, k, v, self.slots, layer=layer, inplace=True)
        return O.paged_attention(
            q, self.pool, self.block_tables, self.kv_len, self.q_start, self.q_len, layer=layer
        )


# ---- the tile-linear pass -------------------------------------------------------------------------


class _TileLinear(RewritePattern):
    roots = ("llm.linear", "llm.quant_linear")

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def match_and_rewrite(self, op, rewriter: PatternRewriter) -> None:
        if op.name == "llm.linear":
            rewriter.replace_op(
                op, rewriter.create("llm.tiled_linear", list(op.operands), {"rows": self.rows})
            )
        elif getattr(op.attributes.get("rows"), "value", 0) == 0:  # traced so (QLoRA's training forward)
            attrs = {**{k: a.value for k, a in op.attributes.items()}, "rows": self.rows}
            rewriter.replace_op(op, rewriter.create("llm.quant_linear", list(op.operands), attrs))


class _TileQuantLinear(RewritePattern):
    """A ``quant_linear`` traced as it is (int8 activations, or a QLoRA base whose input needs a
    gradient) takes the tiles too."""

    roots = ("llm.quant_linear",)

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def match_and_rewrite(self, op, rewriter: PatternRewriter) -> None:
        if op.plain_attrs["rows"] == 0:
            attrs = {**op.plain_attrs, "rows": self.rows}
            rewriter.replace_op(op, rewriter.create("llm.quant_linear", list(op.operands), attrs))


@register_pass
@dataclass
class TileLinear(Pass):
    """``linear`` -> ``tiled_linear{rows}`` (and ``quant_linear`` traced untiled -> ``{rows}``): each
    row's result independent of the batch size."""

    name = "tile-linear"
    rows: int = PREFILL_TILE

    def apply(self, program: Program) -> None:
        apply_patterns(program, [_TileLinear(self.rows), _TileQuantLinear(self.rows)], erase_dead=False)


_TILED = ("llm.tiled_linear", "llm.tiled_linear_logprobs")  # ops reading a weight as tiled_linear does


class _Relayout(RewritePattern):
    roots = (*_TILED, "llm.quant_linear")

    def __init__(self, layouts: dict) -> None:
        self.layouts = layouts  # weight value -> "T" | "P16" | "Q<bits>g<group>" | "H"

    def match_and_rewrite(self, op, rewriter: PatternRewriter) -> None:
        layout = self.layouts.get(op.operands[1])
        if op.name == "llm.quant_linear":
            if layout is not None and not op.plain_attrs["packed"]:
                attrs = {**op.plain_attrs, "packed": 2 if self.layouts.get(op.operands[2]) == "H" else 1}
                rewriter.replace_op(op, rewriter.create(op.name, list(op.operands), attrs))
            return
        if layout is None or op.plain_attrs["transposed"] or op.plain_attrs["panel"]:
            return
        attrs = {**op.plain_attrs, **({"panel": PANEL} if layout == "P16" else {"transposed": True})}
        rewriter.replace_op(op, rewriter.create(op.name, list(op.operands), attrs))


@register_pass
@dataclass
class TransposeWeights(Pass):
    """Function inputs used only as ``tiled_linear`` weights change layout: ``[in, out]`` ("T"), or,
    with ``panels`` (for executors that run the op's C kernel), ``[out / 16, in, 16]`` panels ("P16",
    ``ops.paged.pack_panels``) where out_features is a multiple of 16 and the dtype float32.

    BLAS reads a contiguous ``[in, out]`` matrix faster than the transposed view of ``[out, in]``
    (a third less time for the engine's small matrices); the C kernel reads panels fastest (about
    1.8x ``[in, out]`` at 8 rows, 1.3x at one row: its register tile streams one contiguous panel).
    With ``panels``, the codes of ``quant_linear`` weights with int8 activations become the panels
    its C kernel reads (``Q<bits>g<group>``, ``ops.quant.pack_qweight``; ``packed=1``), which it
    otherwise packs at every call; with ``half_scales`` (the model's scales are float16 numbers:
    ``scale_dtype="float16"``) their scales become float16 ("H", ``ops.quant.half_scales``;
    ``packed=2``): the same products from 4.5 bits a weight in groups of 32 instead of 5.
    Whoever feeds the program passes those weights so: ``layouts`` maps their argument positions
    after ``apply`` to the layout (:func:`relayout` makes it).
    """

    name = "transpose-weights"
    panels: bool = False
    half_scales: bool = False
    layouts: dict[int, str] = field(default_factory=dict)

    def apply(self, program: Program) -> None:
        f = program.function()
        chosen: dict = {}
        for a in f.args:
            uses = a.uses
            if uses and a.ndim == 2 and all(op.name in _TILED and i == 1 for op, i in uses):
                n, k = a.shape
                packed = self.panels and isinstance(n, int) and n % PANEL == 0 and a.dtype == np.float32
                chosen[a] = "P16" if packed else "T"
            elif self.panels and uses and all(op.name == "llm.quant_linear" and i == 1 for op, i in uses):
                kinds = {(op.plain_attrs["bits"], op.plain_attrs["group_size"], op.plain_attrs["act_bits"])
                         for op, _ in uses}  # fmt: skip
                (bits, group, act), *more = kinds
                fresh = not any(op.plain_attrs["packed"] for op, _ in uses)
                if not more and act == 8 and fresh and all(isinstance(d, int) for d in a.shape):
                    chosen[a] = f"Q{bits}g{group}"
        if self.half_scales:  # scales read only by packed products: float16
            args = set(f.args)
            for op, _ in [u for a, layout in chosen.items() if layout[0] == "Q" for u in a.uses]:
                s = op.operands[2]
                if (
                    s in args
                    and s.dtype == np.float32
                    and all(
                        o.name == "llm.quant_linear" and i == 2 and o.operands[1] in chosen for o, i in s.uses
                    )
                ):
                    chosen[s] = "H"
        for a, layout in chosen.items():
            if layout == "H":
                a.type = TensorType(a.shape, np.dtype(np.float16))
                continue
            n, k = a.shape
            if layout[0] == "Q":
                shape = pack_qweight(np.zeros((1, k), a.dtype), *map(int, layout[1:].split("g"))).shape
                a.type = TensorType((-(-n // 16), shape[1]), np.dtype(np.uint8))
                continue
            a.type = TensorType((n // PANEL, k, PANEL) if layout == "P16" else (k, n), a.dtype)
        apply_patterns(program, [_Relayout(chosen)], erase_dead=False)
        self.layouts = {a.index: layout for a, layout in sorted(chosen.items(), key=lambda kv: kv[0].index)}


def relayout(a: np.ndarray, layout: str) -> np.ndarray:
    """An ``[out, in]`` weight as a program wants it (see :class:`TransposeWeights`)."""
    if layout == "T":
        return B.xp_of(a).ascontiguousarray(a.T)
    if layout == "P16":
        return pack_panels(a.T)
    if layout[0] == "Q" and layout[1] in "48":
        return pack_qweight(a, *map(int, layout[1:].split("g")))
    if layout == "H":
        return half_scales(B.to_numpy(a))
    raise ValueError(f"unknown weight layout {layout!r}")


class _Unpanel(RewritePattern):
    roots = (*_TILED, "llm.tiled_linear_swiglu", "llm.quant_linear")

    def __init__(self, args: set) -> None:
        self.args = args

    def match_and_rewrite(self, op, rewriter: PatternRewriter) -> None:
        if op.name == "llm.quant_linear":
            if op.operands[1] in self.args and op.plain_attrs["packed"]:
                rewriter.replace_op(
                    op, rewriter.create(op.name, list(op.operands), {**op.plain_attrs, "packed": 0})
                )
            return
        if op.operands[1] in self.args and op.plain_attrs["panel"]:
            attrs = {**op.plain_attrs, "panel": 0, "transposed": True}
            rewriter.replace_op(op, rewriter.create(op.name, list(op.operands), attrs))


class _FusedSwiGLU(RewritePattern):
    roots = ("llm.swiglu",)

    def match_and_rewrite(self, op, rewriter: PatternRewriter) -> None:
        gate, up = (v.op if isinstance(v, OpResult) else None for v in op.operands)
        for lin, v in ((gate, op.operands[0]), (up, op.operands[1])):
            if lin is None or lin.name != "llm.tiled_linear" or len(lin.operands) != 2:
                return
            if lin.plain_attrs["panel"] != PANEL or len(v.uses) != 1:
                return
        if gate is up or gate.operands[0] is not up.operands[0] or gate.plain_attrs != up.plain_attrs:
            return
        attrs = {k: gate.plain_attrs[k] for k in ("rows", "transposed", "panel")}
        operands = [gate.operands[0], gate.operands[1], up.operands[1]]
        rewriter.replace_op(op, rewriter.create("llm.tiled_linear_swiglu", operands, attrs))
        rewriter.erase_op(gate)
        rewriter.erase_op(up)


@register_pass
@dataclass
class FuseSwiGLU(Pass):
    """``swiglu(tiled_linear(x, Wg), tiled_linear(x, Wu))`` with both weights in panels ->
    ``tiled_linear_swiglu(x, Wg, Wu)``: one C kernel whose threads finish their own columns (run
    apart, the SwiGLU kernel read the gate and up halves the other core had just written)."""

    name = "fuse-swiglu"

    def apply(self, program: Program) -> None:
        apply_patterns(program, [_FusedSwiGLU()], erase_dead=False)


@register_pass
@dataclass
class GroupQuantLinear(Pass):
    """``quant_linear``s of one x with one set of attributes and packed weights (the program's
    inputs, as ``transpose-weights`` packs them: q/k/v, gate/up) -> one ``quant_linears``: its C
    kernel quantizes x once and runs all their panels in one parallel loop; each output the same
    bits. ``unpack_panel_weights`` splits them again."""

    name = "group-quant-linear"

    def apply(self, program: Program) -> None:
        groups: dict = {}
        for op in program.function().walk():
            if op.name == "llm.quant_linear" and op.plain_attrs["packed"]:
                key = (op.parent, op.operands[0], len(op.operands), *sorted(op.plain_attrs.items()))
                groups.setdefault(key, []).append(op)
        rewriter = PatternRewriter()
        for (_, x, n, *_), ops in ((k, v) for k, v in groups.items() if len(v) > 1):
            attrs = {**ops[0].plain_attrs, "zeros": n == 4}
            weights = [w for op in ops for w in op.operands[1:]]
            new = rewriter.create("llm.quant_linears", [x, *weights], attrs, before=ops[0])
            for op, y in zip(ops, new.results, strict=True):
                rewriter.replace_op(op, [y])


class _Ungroup(RewritePattern):
    roots = ("llm.quant_linears",)

    def match_and_rewrite(self, op, rewriter: PatternRewriter) -> None:
        attrs = dict(op.plain_attrs)
        x, weights = weight_inputs(op.operands, attrs.pop("zeros"))
        rewriter.replace_op(
            op, [rewriter.create("llm.quant_linear", [x, *w], attrs).results[0] for w in weights]
        )


def runs_native(compiler: str | None) -> bool:
    """Whether programs run with ``compiler`` run the ops' C kernels (``tiled_linear`` over panels):
    compiled ("cinn", the default) where a C compiler works."""
    return (compiler or default_compiler()) == "cinn" and compiler_available()


_PANEL_OPS = {
    **dict.fromkeys(_TILED, (1,)),
    "llm.tiled_linear_swiglu": (1, 2),
}  # ops reading panels: operands


def unpack_panel_weights(functions: Any) -> int:
    """Loaded programs (``jit.load``'s functions) that will run without ``tiled_linear``'s C kernel
    (``compiler="none"``, or no C compiler here) take their panel-packed weights as ``[in, out]``
    again, packed quantized codes (``packed=1`` or 2) as ``[out, in / PACK]`` and float16 scales
    (``packed=2``) as float32 (exactly), unpacked once here rather than by the reference kernel at
    every call. Returns how many weights were unpacked (a weight two programs share is unpacked
    once)."""
    done: dict[int, np.ndarray] = {}
    for fn in functions:
        apply_patterns(fn.program, [_Ungroup()], erase_dead=False)  # the reference kernels, weight by weight
        f = fn.program.function(fn.entry["function"])
        n_in = len(fn.input_specs)
        chosen, codes = set(), {}
        for a in f.args[n_in:]:
            uses = a.uses
            if uses and all(i in _PANEL_OPS.get(op.name, ()) and op.plain_attrs["panel"] for op, i in uses):
                chosen.add(a)
            elif uses and all(
                op.name == "llm.quant_linear" and i == 1 and op.plain_attrs["packed"] for op, i in uses
            ):
                codes[a] = uses[0][0]
        for a, op in codes.items():
            w, at = fn.weights[a.index - n_in], op.plain_attrs
            if id(w) not in done:
                n, k = op.operands[2].shape[0], op.operands[0].shape[-1]
                done[id(w)] = unpack_qweight(np, w, n, k, at["bits"], at["group_size"])
            fn.weights[a.index - n_in] = done[id(w)]
            a.type = TensorType(done[id(w)].shape, done[id(w)].dtype)
            s = op.operands[2]
            if at["packed"] == 2 and s.dtype == np.float16:
                w = fn.weights[s.index - n_in]
                if id(w) not in done:
                    done[id(w)] = float_scales(np, np.asarray(w))
                fn.weights[s.index - n_in] = done[id(w)]
                s.type = TensorType(s.shape, done[id(w)].dtype)
        for a in chosen:
            p, k, c = a.shape
            a.type = TensorType((k, p * c), a.dtype)
            w = fn.weights[a.index - n_in]
            if id(w) not in done:
                done[id(w)] = np.ascontiguousarray(w.transpose(1, 0, 2).reshape(k, p * c))
            fn.weights[a.index - n_in] = done[id(w)]
        apply_patterns(fn.program, [_Unpanel(chosen | set(codes))], erase_dead=False)
        fn.program.verify()
    return len(done)


def retype_pool(functions: Any, spec: ModelSpec) -> None:
    """Loaded programs (``jit.load``'s functions) made to take ``spec``'s KV pool (an int8 one): the
    pool argument and the pools ``paged_kv_write`` returns change type (the ops' kernels follow);
    a program whose pool has that type already stays as it is."""
    dtype = np.dtype(B.dtype(spec.pool_dtype))
    for fn in functions:
        if fn.program.function(fn.entry["function"]).args[len(fn.input_specs) - 1].dtype == dtype:
            continue

        def edit(program: Program, fn: Any = fn) -> None:
            f = program.function(fn.entry["function"])
            pool = f.args[len(fn.input_specs) - 1]
            pool.type = TensorType(spec.pool_shape(pool.shape[2]), dtype)  # (blocks stay symbolic)
            for op in f.walk():
                if op.name == "llm.paged_kv_write":
                    op.results[0].type = pool.type

        fn.rewrite(f"retype_pool {dtype}{spec.pool_shape('NB')}", edit)


# ---- tracing --------------------------------------------------------------------------------------

_I64 = "int64"


def input_specs(spec: ModelSpec) -> dict[str, list[jit.InputSpec]]:
    """The InputSpecs of the programs (names as they appear in the PIR and the manifest)."""
    pool = jit.InputSpec(list(spec.pool_shape("NB")), spec.pool_dtype, "pool")
    prefill = [
        jit.InputSpec([1, "N"], _I64, "input_ids"),
        jit.InputSpec([1, "N"], _I64, "positions"),
        jit.InputSpec(["N"], _I64, "slots"),
        jit.InputSpec(["G", "MB"], _I64, "block_tables"),
        jit.InputSpec(["G"], _I64, "kv_len"),
        jit.InputSpec(["G"], _I64, "q_start"),
        jit.InputSpec(["G"], _I64, "q_len"),
        jit.InputSpec(["R"], _I64, "logit_rows"),
    ]
    return {
        "prefill": [*prefill, pool],
        "score": [*prefill, jit.InputSpec(["N"], _I64, "targets"), pool],
        "decode": [
            jit.InputSpec(["B", 1], _I64, "input_ids"),
            jit.InputSpec(["B", 1], _I64, "positions"),
            jit.InputSpec(["B"], _I64, "slots"),
            jit.InputSpec(["B", "MB"], _I64, "block_tables"),
            jit.InputSpec(["B"], _I64, "kv_len"),
            pool,
        ],
    }


def model_spec(
    model: Any,
    block_size: int = BLOCK_SIZE,
    prefill_tile: int = PREFILL_TILE,
    decode_tile: int = DECODE_TILE,
    kv_dtype: str | None = None,
) -> ModelSpec:
    """The ModelSpec of a Llama-style causal LM (``model.config`` with Hugging Face field names)."""
    c = model.config
    return ModelSpec(
        num_layers=c.num_hidden_layers,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        max_model_len=c.max_position_embeddings,
        dtype=B.dtype_name(model.lm_weight().dtype),
        block_size=block_size,
        prefill_tile=prefill_tile,
        decode_tile=decode_tile,
        score_top_k=min(SCORE_TOP_K, c.vocab_size),
        kv_dtype=kv_dtype,
    )


@dataclass
class EngineProgram:
    """A traced program, its captured tensors, and which of them it takes in another layout."""

    concrete: jit.ConcreteProgram
    layouts: dict[int, str]  # positions in ``concrete.captures`` -> layout (see relayout)

    def capture_arrays(self, cache: dict[tuple[int, str], tuple[Any, Any]]) -> list[Any]:
        """The captured tensors' current values, in the layouts the program wants.

        ``cache`` ((id of a captured tensor, layout) -> (source array, copy in that layout)) may be
        shared by programs capturing the same tensors; an entry is refreshed whenever its tensor was
        rebound (set_value, an optimizer step), so live weights stay live.
        """
        arrays = [t._data for t in self.concrete.captures]
        last = cache.get((id(self), ""))  # the last call's (arrays, result): weights seldom change
        if last is not None and len(last[0]) == len(arrays) and all(map(operator.is_, arrays, last[0])):
            return last[1]
        out = []
        for i, t in enumerate(self.concrete.captures):
            a = t._data
            layout = self.layouts.get(i)
            if layout is not None:
                hit = cache.get((id(t), layout))
                if hit is None or hit[0] is not a:
                    hit = cache[(id(t), layout)] = (a, relayout(a, layout))
                a = hit[1]
            out.append(a)
        cache[(id(self), "")] = (arrays, out)
        return out


def trace_programs(
    model: Any,
    block_size: int = BLOCK_SIZE,
    prefill_tile: int = PREFILL_TILE,
    decode_tile: int = DECODE_TILE,
    compiler: str | None = None,
    relayout: bool = True,
    programs: tuple[str, ...] = PROGRAMS,
    kv_dtype: str | None = None,
) -> tuple[dict[str, EngineProgram], ModelSpec]:
    """Trace ``programs`` (of :data:`PROGRAMS`) from ``model`` (its parameters stay live program inputs).

    The model must provide ``model.model(input_ids, position_ids, attention_mask, kv_cache) ->
    hidden [B, S, H]`` (final norm applied), ``model.lm_weight() -> [V, H]`` and ``model.config``.
    With a tile (rows per BLAS call) the program's linears become ``tiled_linear`` and take their
    weights relaid (see the passes above); with ``relayout=False`` they read the parameters'
    own ``[out, in]`` arrays (no copies to refresh when training changes them: RLHF).
    ``compiler`` is passed to ``to_static`` ("cinn", "none"; None: to_static's default); ``kv_dtype``
    is the pool's (None: the model's dtype; "int8").
    """
    spec = model_spec(model, block_size, prefill_tile, decode_tile, kv_dtype)
    tiles = {"prefill": prefill_tile, "decode": decode_tile, "score": prefill_tile}
    native = runs_native(compiler)  # panel-packed weights where the executor runs the C kernel
    qc = getattr(model.config, "extra", {}).get("quantization_config") or {}
    half = qc.get("scale_dtype") == "float16"  # scales that are float16 numbers, stored so (packed=2)
    lm_weight = model.lm_weight
    head = None if model.config.tie_word_embeddings else getattr(model, "lm_head", None)

    def logits(rows):  # (R, H) -> (R, V); a quantized lm_head as its layer runs (int8 activations)
        return head(rows) if isinstance(head, lf.nn.QuantizedLinear) else O.linear(rows, lm_weight())

    def prefill(input_ids, positions, slots, block_tables, kv_len, q_start, q_len, logit_rows, pool):
        cache = PagedKVCache(pool, slots, block_tables, kv_len, q_start, q_len)
        hidden = model.model(input_ids, positions, None, cache)  # (1, N, H)
        rows = O.index_select(O.reshape(hidden, [-1, hidden.shape[-1]]), logit_rows)  # (R, H)
        return logits(rows), cache.pool  # (R, V)

    # the fused head where its C kernel reads the weight (panels, or the tied embedding's rows); a
    # quantized head, or one whose vocabulary is not in 16-column panels, keeps the separate ops
    panels_or_rows = not native or model.config.tie_word_embeddings or spec.vocab_size % PANEL == 0
    fused = bool(tiles["score"]) and not isinstance(head, lf.nn.QuantizedLinear) and panels_or_rows

    def score(input_ids, positions, slots, block_tables, kv_len, q_start, q_len, logit_rows, targets, pool):
        cache = PagedKVCache(pool, slots, block_tables, kv_len, q_start, q_len)
        hidden = model.model(input_ids, positions, None, cache)  # (1, N, H)
        flat = O.reshape(hidden, [-1, hidden.shape[-1]])  # (N, H)
        if fused:
            # the head, logsumexp, top-k and the picks in one op: its C kernel takes the (N, V)
            # logits a block of columns at a time while in cache, never whole
            top = O.tiled_linear_logprobs(flat, lm_weight(), targets, logit_rows, k=spec.score_top_k,
                                          rows=tiles["score"])  # fmt: skip
            return (*top, cache.pool)
        every = logits(flat)  # (N, V): prefill's head (a quantized one with its int8 activations)
        # (R, V): prefill's bits, picked from every's rows (a tiled linear's row does not depend on
        # the rows beside it: the batch-invariance guarantee), not a second product
        picked = O.index_select(every, logit_rows)
        lse = O.logsumexp(O.cast(every, np.float64), axis=-1, keepdim=True)  # (N, 1), one fused pass
        top, top_ids = O.topk(every, k=spec.score_top_k)  # (N, K): the order of z, on the narrower type
        # z[t] is cast(every[t]) (exact): picked before the cast, so the float64 (N, V) is never
        # written out (it doubled the bytes the score program wrote per step)
        target = O.gather(every, O.reshape(targets, [-1, 1]), axis=-1)  # (N, 1)
        target_lp = O.reshape(O.cast(target, np.float64) - lse, [-1])  # (N,)
        top_lp = O.cast(top, np.float64) - lse  # (N, K), by the same formula as target_lp
        return picked, target_lp, top_lp, top_ids, cache.pool

    def decode(input_ids, positions, slots, block_tables, kv_len, pool):
        cache = PagedKVCache(pool, slots, block_tables, kv_len)
        hidden = model.model(input_ids, positions, None, cache)  # (B, 1, H)
        return logits(O.reshape(hidden, [-1, hidden.shape[-1]])), cache.pool  # (B, V)

    names = {id(t): n for n, t in model.named_parameters()}
    names.update({id(t): n for n, t in model.named_buffers()})
    out: dict[str, EngineProgram] = {}
    fns = {"prefill": prefill, "decode": decode, "score": score}
    for pname in programs:
        sf = jit.to_static(fns[pname], input_spec=input_specs(spec)[pname], compiler=compiler, names=names)
        with lf.no_grad():
            cp = trace_specs(sf)
        layouts: dict[int, str] = {}
        if tiles[pname]:
            TileLinear(tiles[pname]).apply(cp.program)
        QuantizeLinear().apply(cp.program)  # quantized layers: quant_linear, with the tiles
        if tiles[pname] and relayout:
            relayout_pass = TransposeWeights(panels=native, half_scales=half)
            relayout_pass.apply(cp.program)
            layouts = {i - cp.n_args: v for i, v in relayout_pass.layouts.items()}
            FuseSwiGLU().apply(cp.program)
            GroupQuantLinear().apply(cp.program)
        cp.program.verify()
        out[pname] = EngineProgram(cp, layouts)
    return out, spec
