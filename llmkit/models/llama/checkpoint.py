"""Hugging Face checkpoint directories: ``config.json`` + ``model.safetensors`` (or shards).

A training checkpoint written by several processes holds ``rank-NNNNN.safetensors`` pieces instead
(see ``framework/distributed/shard_files.py``); it loads the same way, and
``llmkit checkpoint merge`` turns it into the plain layout.

Loading is lazy (memory-mapped safetensors), checks every name and shape against the config
before copying anything, and never unpickles. Saving writes the same layout transformers reads
(safetensors metadata ``{"format": "pt"}``, a ``model.safetensors.index.json`` when sharded),
atomically: the directory appears whole or not at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

import llmkit.framework as lf
from llmkit.framework import backend as B
from llmkit.framework.distributed.shard_files import RANK_FILES, ShardError, ShardReader
from llmkit.framework.files import atomic_dir, recover
from llmkit.framework.ops.quant import ACT_BITS as QUANT_ACT_BITS
from llmkit.framework.ops.quant import BITS as QUANT_BITS
from llmkit.tokenizer import write_generation_config

from .config import LlamaConfig

# quantization_config.version: 1 (no key; weight-only products), 2 (adds act_bits), the newest here
QUANT_VERSION = 2
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Keys some checkpoints carry that follow from the config (older transformers saved RoPE buffers).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory that does not match what the config says it holds."""


def derived_path(model_dir: str | os.PathLike[str], suffix: str) -> Path:
    """Where a command writes what it makes of ``model_dir`` by default: the run's directory with
    ``suffix`` appended, next to it, for a training or RLHF checkpoint's model
    (``runs/tiny/checkpoints/step-N/model`` -> ``runs/tiny<suffix>``), else the directory's
    (``runs/tiny-int4`` -> ``runs/tiny-int4<suffix>``)."""
    m = Path(model_dir)
    m = m if m.name else m.resolve()  # "." names no directory
    base = m.parent.parent.parent if m.name == "model" and m.parent.parent.name == "checkpoints" else m
    return base.parent / f"{base.name}{suffix}"


def weights(path: str | os.PathLike[str]) -> ShardReader:
    """The weights of a model directory, read by name (and by slice): ``model.safetensors``, the
    files of its index, or the ranks' pieces ``rank-NNNNN.safetensors`` of a training checkpoint
    written by several processes."""
    path = Path(path)
    index = path / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({path / file for file in weight_map.values()})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
    elif (path / WEIGHTS).exists():
        files = [path / WEIGHTS]
    else:
        files = sorted(path.glob(RANK_FILES))
        if not files:
            raise FileNotFoundError(
                f"{path}: no {WEIGHTS}, {INDEX} or {RANK_FILES} (is this a Hugging Face model directory?)"
            )
    try:
        return ShardReader(files)
    except ShardError as e:
        raise CheckpointError(f"{path}: {e}") from None


def check_weights(
    reader: ShardReader,
    expected: dict[str, tuple[int, ...]],
    where: Path,
    tied: bool,
    dtypes: dict[str, np.dtype] | None = None,
) -> list[str]:
    """The names of ``expected`` to read from ``reader``; CheckpointError lists every missing,
    unexpected or mis-shaped tensor, and every one of ``dtypes`` (quantized codes, whose dtype is
    part of the format) stored in another dtype."""
    ignored = {"lm_head.weight"} if tied else set()  # a tied head is the embedding
    names = {n for n in reader.names() if not n.endswith(_IGNORED_SUFFIXES) and n not in ignored}
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected))
    wrong = [
        f"{n}: checkpoint {list(reader.shapes[n])} vs config {list(expected[n])}"
        for n in sorted(names & set(expected))
        if reader.shapes[n] != tuple(expected[n])
    ]
    wrong_dtype = [
        f"{n}: checkpoint {B.dtype_name(reader.dtypes[n])} vs {B.dtype_name(dt)}"
        for n, dt in sorted((dtypes or {}).items())
        if n in names and reader.dtypes[n] != dt
    ]
    if missing or unexpected or wrong or wrong_dtype:

        def some(names: list[str]) -> str:
            return ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")

        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {some(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {some(unexpected)}")
        if wrong:
            parts.append("shape mismatch: " + "; ".join(wrong[:8]))
        if wrong_dtype:
            parts.append("dtype mismatch: " + "; ".join(wrong_dtype[:8]))
        raise CheckpointError(f"{where}: checkpoint does not match config.json ({'; '.join(parts)})")
    return sorted(names)


def load_pretrained(cls: type, path: str | os.PathLike[str], dtype: Any = None) -> Any:
    """Build ``cls(config)`` from a checkpoint directory; weights cast to ``dtype`` (default float32)."""
    path = Path(path)
    recover(path)  # a save that a crash interrupted
    if not path.is_dir():
        if path.exists():
            raise NotADirectoryError(f"{path} is a file, not a model directory")
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not (path / "config.json").exists() and (path / "manifest.json").is_file():
        raise CheckpointError(
            f"{path} is a static model file (written by `llmkit export`), not a model directory: "
            "`llmkit serve` runs it; export and generate read the trainer's model directory"
        )
    config = LlamaConfig.from_json_file(path / "config.json")
    reader = weights(path)
    target = B.dtype(dtype or "float32")
    with lf.nn.init.skip_init():  # every weight is loaded below: drawing them would touch their memory
        model = cls(config)  # (a quantized model's float linears would be resident before quantize_linears)
    _quantized_layers(path, model, set(reader.names()))
    state = model.state_dict()
    expected = {k: tuple(v.shape) for k, v in state.items()}
    codes = {k: v.dtype for k, v in state.items() if not B.is_floating(v.dtype)}  # never cast
    names = check_weights(reader, expected, path, config.tie_word_embeddings, codes)
    model.load_state_dict(
        {n: reader.read(n, copy=False).astype(codes.get(n, target), copy=False) for n in names}, strict=True
    )
    if target != model.model.norm.weight.dtype:
        model.to(target)
    return model


def _quantized_layers(path: Path, model: Any, names: set[str]) -> None:
    """A quantized checkpoint (``quantization_config``, docs/quantize.md): each linear ``P`` stored
    as ``P.qweight`` becomes a ``QuantizedLinear`` of the config's bits, group size and symmetry."""
    qc = model.config.extra.get("quantization_config")
    if qc is None:
        return
    where = f"{path / 'config.json'}: quantization_config"
    if not isinstance(qc, dict) or qc.get("quant_method") != "llmkit":
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise CheckpointError(f"{where}: quant_method {method!r} is not supported (llmkit reads 'llmkit')")
    bits, group, sym = qc.get("bits"), qc.get("group_size"), qc.get("sym")
    version, act_bits = qc.get("version", 1), qc.get("act_bits", 0)
    if version not in (1, QUANT_VERSION):
        raise CheckpointError(
            f"{where}: version {version!r} is not one this llmkit reads (1 .. {QUANT_VERSION}): "
            "upgrade llmkit"
        )
    if act_bits not in QUANT_ACT_BITS:
        raise CheckpointError(f"{where}: act_bits must be one of {list(QUANT_ACT_BITS)}, got {act_bits!r}")
    if bits not in QUANT_BITS:
        raise CheckpointError(f"{where}: bits must be one of {list(QUANT_BITS)}, got {bits!r}")
    if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or group >= 1):
        raise CheckpointError(f"{where}: group_size must be a positive integer or -1, got {group!r}")
    if not isinstance(sym, bool) or (bits == 8 and not sym):
        raise CheckpointError(f"{where}: sym must be true or false (true for 8 bits), got {sym!r}")
    paths = sorted(n.removesuffix(".qweight") for n in names if n.endswith(".qweight"))
    if model.config.tie_word_embeddings and "model.embed_tokens" in paths:
        raise CheckpointError(f"{path}: model.embed_tokens.qweight in a model whose embeddings are tied")
    if model.config.tie_word_embeddings and "lm_head" in paths:
        raise CheckpointError(f"{path}: lm_head.qweight in a model whose lm_head is tied to the embeddings")
    try:
        lf.nn.quantize_linears(model, paths, bits, group, sym, act_bits)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def write_config(
    config: LlamaConfig, dtype: Any, directory: Path, architecture: str = "LlamaForCausalLM"
) -> None:
    """``directory/config.json`` of a model (``architecture``: transformers' class name of its
    head) whose weights are stored in ``dtype``."""
    cfg = config.to_dict()
    cfg["architectures"] = [architecture]
    cfg["torch_dtype"] = B.dtype_name(dtype)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def save_pretrained(
    model: Any, path: str | os.PathLike[str], dtype: Any = None, max_shard_size: int | None = None
) -> None:
    """Write config.json, generation_config.json (the config's bos/eos/pad ids, merged into one
    already there) and safetensors weights (sharded above ``max_shard_size`` bytes), atomically.

    Files other llmkit writers put in ``path`` earlier (the tokenizer's) are kept.
    """
    path = Path(path)
    target = B.dtype(dtype) if dtype is not None else None
    state = {  # floating tensors in ``dtype``; quantized codes as they are
        k: (v.numpy() if target is None or not B.is_floating(v.dtype) else v.numpy().astype(target))
        for k, v in model.state_dict().items()
    }
    with atomic_dir(path) as tmp:
        if path.is_dir():  # keep companions such as tokenizer.model (not the old weights and config)
            own = (WEIGHTS, INDEX, "config.json")
            for f in path.iterdir():
                if f.is_file() and f.name not in own and not f.name.startswith("model-"):
                    (tmp / f.name).write_bytes(f.read_bytes())
        arch = getattr(model, "architecture", "LlamaForCausalLM")
        floats = [a.dtype for a in state.values() if B.is_floating(a.dtype)]  # codes come first if quantized
        write_config(model.config, floats[0] if floats else next(iter(state.values())).dtype, tmp, arch)
        c = model.config
        write_generation_config(tmp, c.bos_token_id, c.eos_ids, c.pad_token_id)
        total = sum(a.nbytes for a in state.values())
        if max_shard_size is None or total <= max_shard_size:
            lf.save(state, tmp / WEIGHTS, metadata={"format": "pt"})
            return
        shards: list[dict[str, np.ndarray]] = [{}]
        for name, a in state.items():
            if shards[-1] and sum(x.nbytes for x in shards[-1].values()) + a.nbytes > max_shard_size:
                shards.append({})
            shards[-1][name] = a
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            lf.save(shard, tmp / fname, metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        (tmp / INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
