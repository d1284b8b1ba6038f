"""The trainer's side of the policy: its forward, the log-prob programs, and the compiled train step.

Exact log-probs (``rlhf.exact_logprobs``, the default). The engine computes a sampled token's
log-prob as ``log_softmax(logits / T)[token]`` (``SamplingParams(logprobs_mode="processed")``)
from logits of its compiled programs, whose kernels compute each token alone: ``tiled_linear``
(every output one k-ordered FMA chain), ``paged_attention`` (each query token's scores, softmax
and weighted sum in position order), fused elementwise kernels. The trainer's forward here runs the
same kernels on the same weights: its linears become ``tiled_linear`` (the engine's ``tile-linear``
pass), its attention is ``paged_attention`` with every row of the batch one segment over a pool of
its own keys and values, and the log-prob is the ``token_logprobs`` op, the sampler's own kernel.
So before the first update the trainer's log-prob of every sampled token equals the engine's, bit
for bit, and the first importance ratio is exactly 1.0. The engine reads the parameters' own
``[out, in]`` arrays (``EngineConfig(relayout_weights=False)``), as the trainer does: nothing is
copied after an optimizer step. Gradients flow through the ops' vjp rules (``tiled_linear``'s,
``paged_attention_grad``).

With ``exact_logprobs: false`` the forward is the model's own (``linear``, ``scaled_dot_product_
attention``): the log-probs then differ from the engine's in the last bits (``logprob_diff_max``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import llmkit.framework as lf
from llmkit.framework import jit, nn, optim
from llmkit.framework.distributed.parallelize import all_reduce_grads
from llmkit.framework.ir.passes import QuantizeLinear
from llmkit.framework.jit import pytree
from llmkit.framework.jit.model_file import trace_specs
from llmkit.infer.programs import PREFILL_TILE, TileLinear
from llmkit.models.llama import LlamaForCausalLM
from llmkit.models.llama.lora import adapters_disabled, lora_layers
from llmkit.train.trainer import state_names

O = lf.ops

_I64, _F32, _F64 = "int64", "float32", "float64"


class SequenceCache:
    """The ``kv_cache`` of the trainer's exact forward over whole sequences [B, S]: row ``b`` is one
    segment of ``paged_attention`` (all its S query tokens, S keys), its keys and values one block
    of a pool made of this forward's own k and v (differentiable: stack, transpose, unsqueeze)."""

    past_length = 0  # whole sequences from position 0

    def __init__(self, tables: lf.Tensor, kv_len: lf.Tensor, q_start: lf.Tensor, q_len: lf.Tensor) -> None:
        self.tables, self.kv_len, self.q_start, self.q_len = tables, kv_len, q_start, q_len

    def attend(self, layer: int, q, k, v):
        kv = O.transpose(O.stack([k, v], axis=0), [0, 1, 3, 2, 4])  # (2, B, S, Hkv, D): a block per row
        pool = O.unsqueeze(kv, axis=0)  # (1, 2, B, S, Hkv, D)
        return O.paged_attention(q, pool, self.tables, self.kv_len, self.q_start, self.q_len, layer=0)


def segment_arrays(batch: int, seq: int) -> list[np.ndarray]:
    """The segment inputs of SequenceCache for a [batch, seq] batch: tables [B, 1], kv_len, q_start,
    q_len [B]."""
    rows = np.arange(batch, dtype=np.int64)
    full = np.full(batch, seq, dtype=np.int64)
    return [rows[:, None], full, rows * seq, full]


class ValueHead(nn.Layer):
    """PPO's critic on the policy's last hidden states: one linear unit, zero at the start."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = lf.Parameter(np.zeros((1, hidden_size), np.float32))
        self.bias = lf.Parameter(np.zeros((1,), np.float32))

    def forward(self, hidden):
        return O.reshape(O.linear(hidden, self.weight, self.bias), list(hidden.shape[:-1]))  # (B, S)


def _specs(names_dtypes: list[tuple[str, list, str]]) -> list[jit.InputSpec]:
    return [jit.InputSpec(shape, dt, name) for name, shape, dt in names_dtypes]


_SEQ = [("ids", ["B", "S"], _I64), ("targets", ["B", "S"], _I64)]
_SEG = [("tables", ["B", 1], _I64), ("kv_len", ["B"], _I64), ("q_start", ["B"], _I64), ("q_len", ["B"], _I64)]


class PolicyForward:
    """``hidden(ids, *segments)`` and ``logits(hidden)`` of a causal LM, exact or not (see above)."""

    def __init__(self, model: Any, exact: bool) -> None:
        self.model, self.exact = model, exact

    def hidden(self, ids, tables, kv_len, q_start, q_len):
        cache = SequenceCache(tables, kv_len, q_start, q_len) if self.exact else None
        return self.model.model(ids, None, None, cache)  # (B, S, H)

    def logits(self, hidden):
        return O.linear(hidden, self.model.lm_weight())  # (B, S, V)


def compile_function(
    fn: Callable, specs: list[jit.InputSpec], names: dict[int, str], tile: bool = False
) -> Callable:
    """``fn`` traced once (symbolic dims) and compiled; ``tile``: the engine's ``tile-linear`` and
    ``quantize-linear`` passes (exact forwards). Returns a function of numpy arrays -> the outputs
    as numpy arrays / floats."""
    cp = trace_specs(jit.to_static(fn, input_spec=specs, names=names))
    if tile:
        TileLinear(PREFILL_TILE).apply(cp.program)
        QuantizeLinear().apply(cp.program)  # a quantized base (QLoRA): the engine's quant_linear
        cp.program.verify()

    def run(*arrays: np.ndarray) -> Any:
        return _to_host(cp.run([lf.Tensor(np.asarray(a)) for a in arrays]))

    run.program, run.captures = cp.program, cp.captures  # captures: the tensors it reads (weights)
    return run


def _to_host(x: Any) -> Any:
    """Outputs with their tensors as numpy arrays, a 0-d one as a float."""
    leaves, tree = pytree.flatten(x)
    arrays = [t.numpy() for t in leaves]
    return pytree.unflatten(tree, [float(a) if a.ndim == 0 else a for a in arrays])


def scorer(model: Any, exact: bool, temperature: float, value_head: ValueHead | None = None) -> Callable:
    """A compiled no-grad forward: ``(ids, targets, *segments) -> logp [B, S] float64`` (and
    ``values`` [B, S] with a value head): the reference model's log-probs, PPO's pre-update pass."""
    fwd = PolicyForward(model, exact)

    def score(ids, targets, tables, kv_len, q_start, q_len):
        with lf.no_grad():
            h = fwd.hidden(ids, tables, kv_len, q_start, q_len)
            out = {"logp": O.token_logprobs(fwd.logits(h), targets, temperature=temperature)}
            if value_head is not None:
                out["values"] = value_head(h)
            return out

    extra = {"value_head": value_head} if value_head is not None else None
    return compile_function(score, _specs(_SEQ + _SEG), state_names(model, extra=extra), tile=exact)


def reference_scorer(model: Any, src: Path, exact: bool, temperature: float) -> Callable:
    """The frozen reference's compiled log-probs: the policy as it starts. With adapters, the policy
    itself with them off (traced under ``adapters_disabled``: the program reads the policy's own
    frozen base and no adapter, so there is no second copy of the weights); without, the checkpoint
    at ``src`` loaded again (the policy's own weights move)."""
    if lora_layers(model):
        with adapters_disabled(model):
            return scorer(model, exact, temperature)
    return scorer(LlamaForCausalLM.from_pretrained(src), exact, temperature)


# Inputs of a train step besides ids, targets and segments: name -> (shape, dtype); float64 where
# the loss math meets the float64 log-probs. P: preference pairs (DPO).
_TOKENS = ["B", "S"]
STEP_INPUTS: dict[str, tuple[list, str]] = {
    "mask": (_TOKENS, _F64),
    "old_logp": (_TOKENS, _F64),
    "advantages": (_TOKENS, _F64),
    "ref_logp": (_TOKENS, _F64),
    "old_values": (_TOKENS, _F64),
    "returns": (_TOKENS, _F64),
    "ref_seq_logp": (["B"], _F64),  # the reference's log-prob of each whole response
    "chosen": (["P", "B"], _F64),  # row p: 1 at pair p's chosen sequence
    "rejected": (["P", "B"], _F64),
    "tokens": ([], _F64),  # the whole batch's masked tokens (a data-parallel rank sees a share)
    "sequences": ([], _F64),  # the whole batch's sequences
}


def train_step(
    model: Any,
    optimizer: optim.Optimizer,
    loss_fn: Callable[..., tuple[Any, dict[str, Any]]],
    inputs: tuple[str, ...],
    exact: bool,
    temperature: float,
    grad_clip: float | None,
    value_head: ValueHead | None = None,
    group: tuple[int, ...] | None = None,
) -> Callable:
    """The whole update as one compiled program (:func:`compile_update`) of the loss ``loss_fn(logp=...,
    logits=..., values=..., **inputs) -> (loss, stats)`` on the forward's ``token_logprobs``. Returns
    ``step(ids, targets, *segments, *inputs) -> {"loss", "grad_norm", "logp", **stats}`` (logp: the
    trainer's log-probs before this update)."""
    fwd = PolicyForward(model, exact)
    layers = [model] + ([value_head] if value_head is not None else [])

    def forward(ids, targets, tables, kv_len, q_start, q_len, *extra):
        h = fwd.hidden(ids, tables, kv_len, q_start, q_len)
        logits = fwd.logits(h)
        logp = O.token_logprobs(logits, targets, temperature=temperature)
        values = value_head(h) if value_head is not None else None
        loss, stats = loss_fn(logp=logp, logits=logits, values=values, **dict(zip(inputs, extra)))
        return loss, {"logp": logp.detach(), **{k: v.detach() for k, v in stats.items()}}

    specs = _specs(_SEQ + _SEG + [(n, *STEP_INPUTS[n]) for n in inputs])
    extra = {"value_head": value_head} if value_head is not None else None
    names = state_names(model, optimizer, extra)
    return compile_update(forward, specs, names, layers, optimizer, grad_clip, group, tile=exact)


def compile_update(
    forward: Callable[..., tuple[Any, dict[str, Any]]],
    specs: list[jit.InputSpec],
    names: dict[int, str],
    layers: list[Any],
    optimizer: optim.Optimizer,
    grad_clip: float | None,
    group: tuple[int, ...] | None = None,
    tile: bool = False,
) -> Callable:
    """A job's whole update as one compiled program: ``forward(*inputs) -> (loss, outputs)``, the
    backward, the gradients of the trained parameters of ``layers`` summed over the data-parallel
    ranks of ``group`` (each rank's loss its rows' share), global-norm clipping and the optimizer
    step. Returns ``step(*arrays) -> {"loss", "grad_norm", **outputs}``, the lr synced before each."""
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]  # LoRA: adapters
    clip = grad_clip if grad_clip is not None else math.inf

    def step(*inputs):
        loss, outputs = forward(*inputs)
        loss.backward()
        if group is not None and len(group) > 1:
            all_reduce_grads(params, group)
        norm = optim.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad()
        return {"loss": loss, "grad_norm": norm, **outputs}

    run = compile_function(step, specs, names, tile)

    def call(*arrays: np.ndarray) -> dict[str, Any]:
        optimizer.sync_lr()
        return run(*arrays)

    call.program = run.program
    return call
