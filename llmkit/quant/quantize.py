"""Quantizing a Llama model in place, and writing it as a quantized checkpoint directory.

Which weights: every ``Linear`` of the decoder layers (attention q/k/v/o, MLP gate/up/down), the
``lm_head`` when asked (``lm_head=True``, untied models), and the token embedding when asked
(``embed=True``, untied models: GGUF's all-tensor variants; always RTN, a lookup has no Hessian, and
first, so GPTQ's calibration runs on the quantized embedding's rows). Norms stay float: a few
vectors.

GPTQ runs the decoder layers in order (as the paper does): the calibration batches' inputs to
layer ``l`` are the outputs of the already quantized layers before it, each linear's Hessian is
accumulated from its own inputs (forward pre-hooks) while layer ``l`` runs in float, its weights
are quantized, and layer ``l`` runs again, quantized, to make the next layer's inputs.

``ranks`` (``llmkit.quant.multirank.Ranks``) share the Hessians' and the weights' row blocks; the
result is the same bits on any number of ranks. The work runs on ``BLAS_THREADS`` BLAS threads
whatever the process had: OpenBLAS's float32 products (the forward, ``XᵀX``) can round differently
with the thread count on some CPUs, and one process and N ranks on one machine start with different
counts (``--nproc`` shares the cores out).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import llmkit.framework as lf
from llmkit.framework import nn
from llmkit.framework.blas import blas_threads
from llmkit.framework.distributed.parallel_plan import PLAN_FILE, ParallelPlan
from llmkit.framework.files import atomic_dir
from llmkit.tokenizer import GENERATION_FILE, Tokenizer
from llmkit.train.metrics import QUANT_REPORT

from .format import QuantConfig, QuantError, QuantizedWeight, check_shape, join, quantize_rtn
from .gptq import Hessian, gptq
from .multirank import Ranks

REPORT = QUANT_REPORT  # what llmkit plot reads
CALIB_BATCH = 16  # calibration sequences per forward
BLAS_THREADS = 1  # while quantizing, in every process: the bits must not depend on the rank count


EMBED = "model.embed_tokens"


def targets(model: Any, lm_head: bool = False, embed: bool = False) -> list[str]:
    """The dotted paths of the layers to quantize (see the module docstring)."""
    if embed and model.config.tie_word_embeddings:
        raise QuantError("--embed: this model's embeddings are tied to its lm_head; quantize an untied model")
    paths = [EMBED] if embed else []
    decoder = model.model.layers.named_sublayers("model.layers")
    paths += [p for p, sub in decoder if isinstance(sub, nn.Linear)]
    if lm_head:
        if model.config.tie_word_embeddings:
            raise QuantError("--lm-head: this model's lm_head is tied to the embeddings, which stay float")
        paths.append("lm_head")
    return paths


def install(model: Any, weights: dict[str, QuantizedWeight], cfg: QuantConfig) -> None:
    """Replace the linears at ``weights``' paths by ``QuantizedLinear`` layers holding them, and mark
    the model's config quantized (its ``quantization_config``)."""
    made = nn.quantize_linears(model, list(weights), cfg.bits, cfg.group_size, cfg.sym, cfg.act_bits)
    for path, layer in made.items():
        qw = weights[path]
        layer.qweight.set_value(qw.qweight)
        layer.scales.set_value(qw.scales.astype(layer.scales.dtype))
        if qw.zeros is not None:
            layer.zeros.set_value(qw.zeros)
    model.config.extra["quantization_config"] = cfg.to_hf()


def set_act_bits(model: Any, act_bits: int) -> None:
    """Switch every quantized linear of ``model`` to float (0) or int8 (8) activations, and its
    config's ``quantization_config`` with them (the codes stay as they are)."""
    for layer in model.sublayers():
        if isinstance(layer, nn.QuantizedLinear):
            layer.act_bits = act_bits
    qc = model.config.extra.get("quantization_config")
    if qc is not None:
        qc["act_bits"] = act_bits


class _Captured(Exception):
    """Raised by the hook that records layer 0's inputs: nothing after it needs to run."""


def _layer_inputs(model: Any, ids: np.ndarray) -> list[tuple]:
    """The positional arguments of ``model.model.layers[0]`` for each calibration batch."""
    got: list[tuple] = []

    def catch(layer: Any, args: tuple) -> None:
        got.append(args)
        raise _Captured

    handle = model.model.layers[0].register_forward_pre_hook(catch)
    try:
        for i in range(0, len(ids), CALIB_BATCH):
            with contextlib.suppress(_Captured):
                model.model(lf.tensor(ids[i : i + CALIB_BATCH]))
    finally:
        handle.remove()
    return got


def _hessians(paths: dict[str, Any], batches: list[Callable[[], Any]], ranks: Ranks) -> dict[str, np.ndarray]:
    """Each linear's Hessian 2 XᵀX / N over the inputs it sees while the ``batches`` run (linears
    that read one tensor, as q/k/v and gate/up do, share its XᵀX); the ranks' row blocks gathered."""
    acc = {p: Hessian(sub.in_features, ranks.rows(sub.in_features)) for p, sub in paths.items()}
    grams: dict[int, tuple[Any, tuple[np.ndarray, int]]] = {}  # id(input) -> (input, its XᵀX, N)

    def hook(path: str) -> Callable[..., None]:
        def add(_: Any, args: tuple) -> None:
            x = args[0]
            if id(x) not in grams:  # holding x keeps its id unique
                grams[id(x)] = (x, Hessian.gram(x.numpy(), acc[path].rows))
            acc[path].add_gram(*grams[id(x)][1])

        return add

    handles = [sub.register_forward_pre_hook(hook(p)) for p, sub in paths.items()]
    try:
        for run in batches:
            run()
            grams.clear()
    finally:
        for h in handles:
            h.remove()
    return {p: ranks.gather(h.value(), h.sum.shape[1]) for p, h in acc.items()}


@lf.no_grad()
@blas_threads(BLAS_THREADS)
def quantize_model(
    model: Any,
    cfg: QuantConfig,
    calib: np.ndarray | None = None,
    lm_head: bool = False,
    act_order: bool = False,
    damp: float = 0.01,
    progress: bool = True,
    ranks: Ranks | None = None,
    embed: bool = False,
) -> list[str]:
    """Quantize ``model`` (a LlamaForCausalLM, float) in place; returns the quantized paths.

    ``calib`` [N, S] int64 token ids: GPTQ's calibration sequences (unused by RTN). ``ranks``: who
    shares the work (default: this process alone under ``sim``, every process under ``mpi``).
    """
    ranks = Ranks() if ranks is None else ranks
    paths = targets(model, lm_head, embed)
    layers = dict(model.named_sublayers())
    for p in paths:
        w = layers[p].weight
        check_shape(p, w.shape[0], w.shape[1], cfg)
    if cfg.method == "gptq" and (calib is None or len(calib) == 0):
        raise QuantError("GPTQ needs calibration token ids")
    decoder = model.model.layers
    bar = tqdm(
        total=len(decoder) + lm_head,
        desc=f"quantize {cfg.method}",
        unit="layer",
        disable=not (progress and ranks.is_first),
    )

    def rtn(m: Any) -> QuantizedWeight:
        w = m.weight.numpy()
        return ranks.gather_weight(
            join([quantize_rtn(w[b], cfg) for b in ranks.rows(len(w))], w.shape[1], cfg), len(w)
        )

    def gptq_(m: Any, h: np.ndarray) -> QuantizedWeight:
        w = m.weight.numpy()
        try:
            return ranks.gather_weight(gptq(w, h, cfg, act_order, damp, ranks.rows(len(w))), len(w))
        except QuantError as e:  # name the linear
            raise QuantError(f"{next(p for p, x in layers.items() if x is m)}: {e}") from e

    if embed:
        install(model, {EMBED: rtn(layers[EMBED])}, cfg)
    inputs = _layer_inputs(model, calib) if cfg.method == "gptq" else []
    for i, layer in enumerate(decoder):
        mine = {p: layers[p] for p in paths if p.startswith(f"model.layers.{i}.")}
        if cfg.method == "gptq":
            hess = _hessians(mine, [lambda a=a: layer(*a) for a in inputs], ranks)
            install(model, {p: gptq_(m, hess[p]) for p, m in mine.items()}, cfg)
            inputs = [(layer(*a), *a[1:]) for a in inputs]  # the next layer's inputs, from this one quantized
        else:
            install(model, {p: rtn(m) for p, m in mine.items()}, cfg)
        bar.update()
    if lm_head:
        head = layers["lm_head"]
        if cfg.method == "gptq":
            batches = [lambda a=a: head(model.model.norm(a[0])) for a in inputs]
            install(
                model, {"lm_head": gptq_(head, _hessians({"lm_head": head}, batches, ranks)["lm_head"])}, cfg
            )
        else:
            install(model, {"lm_head": rtn(head)}, cfg)
        bar.update()
    bar.close()
    return paths


def weight_bytes(float_model: Any, quant_model: Any, paths: list[str]) -> dict[str, int]:
    """Bytes of the quantized linears before (float) and after (codes, scales, zeros), and of the
    whole state of each model."""
    fl, qu = dict(float_model.named_sublayers()), dict(quant_model.named_sublayers())

    def state(m: Any) -> int:
        return sum(t.numpy().nbytes for t in m.state_dict().values())

    return {
        "layers_float": sum(fl[p].weight.numpy().nbytes for p in paths),
        "layers_quant": sum(sum(b.numpy().nbytes for b in qu[p].buffers()) for p in paths),
        "model_float": state(float_model),
        "model_quant": state(quant_model),
    }


def save_quantized(
    model: Any, src: str | Path, out: str | Path, report: dict[str, Any], plan: ParallelPlan | None = None
) -> Path:
    """Write ``model`` as an HF-layout quantized directory ``out`` (atomically), with the source
    directory's tokenizer and generation config, ``quant_report.json`` and the parallel ``plan``
    (``parallel.derive``'s), if any."""
    src, out = Path(src), Path(out)
    with atomic_dir(out) as tmp:
        if (src / GENERATION_FILE).is_file():  # its sampling settings; the model's ids merge in
            shutil.copyfile(src / GENERATION_FILE, tmp / GENERATION_FILE)
        model.save_pretrained(str(tmp))
        Tokenizer.from_pretrained(src).save_pretrained(tmp)
        if plan is not None:
            plan.save(tmp / PLAN_FILE)
        (tmp / REPORT).write_text(json.dumps(report, indent=1) + "\n")
    return out
