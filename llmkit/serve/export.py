"""``llmkit export --model DIR [--out FILE]``: the static model file the server runs.

``--out`` defaults to the model directory's name with ``.llmkit`` appended, next to it
(``runs/tiny-int4`` -> ``runs/tiny-int4.llmkit``; a checkpoint's ``runs/tiny/checkpoints/step-N/model``
-> ``runs/tiny.llmkit``), so ``llmkit serve runs/tiny-int4.llmkit`` follows without editing a path.

It reads a Hugging Face layout model directory (as the trainer writes it: ``config.json``,
``model.safetensors``, the tokenizer's files, optionally ``generation_config.json``), traces the
engine's ``prefill`` and ``decode`` programs from it, and writes them with ``jit.save``'s format:
one PIR file per program, ``weights.safetensors``, the tokenizer's files (``Tokenizer.files()``:
``tokenizer.json``, ``tokenizer.model`` for sentencepiece, ``tokenizer_config.json``, ...), and a
manifest with the
sha256 of every part. The manifest's metadata holds what the server needs besides the programs:
``engine`` (cache geometry, context length, dtype), ``chat_template``, ``generation`` defaults,
``eos_token_ids``, and the model's ``config``.

Weights that the programs use only as ``tiled_linear`` weights are stored in the layout the programs
read (``transpose-weights``): 16-column panels (``<parameter>.P16``) where the exporting machine
compiles programs (a C compiler works; the server then runs the op's C kernel on them), else
transposed (``[in, out]``, ``<parameter>.T``, BLAS's fastest). Done once here, not at every load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import llmkit
from llmkit.framework import jit
from llmkit.framework.jit.model_file import MANIFEST, save_programs
from llmkit.framework.tensor import Tensor
from llmkit.infer.chat import ChatTemplate
from llmkit.infer.programs import BLOCK_SIZE, relayout, trace_programs
from llmkit.infer.sampling import SamplingParams
from llmkit.tokenizer import Tokenizer

SUFFIX = ".llmkit"  # the default --out: the model's directory (or run) with this appended


class ExportError(ValueError):
    """A model directory or an --out path that cannot be exported (printed as one line)."""


def _generation_defaults(model_dir: Path) -> dict[str, Any]:
    """Sampling defaults from ``generation_config.json`` (Hugging Face's names), when present."""
    f = model_dir / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        g = json.loads(f.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{f}: not valid JSON text ({e})") from None
    if not isinstance(g, dict):
        raise ExportError(f"{f}: expected a JSON object, got {type(g).__name__}")
    out: dict[str, Any] = {k: g[k] for k in ("temperature", "top_p", "top_k") if g.get(k) is not None}
    if g.get("do_sample") is False:
        out["temperature"] = 0.0
    for k, v in out.items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ExportError(f"{f}: {k}: expected a number, got {v!r}")
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ExportError(f"{f}: {e}") from None
    return out


def export_model(
    model: Any,
    tokenizer: Any,
    out: str | Path,
    *,
    model_name: str,
    block_size: int = BLOCK_SIZE,
    generation: dict[str, Any] | None = None,
    chat_template: ChatTemplate | None = None,
) -> Path:
    """Write ``model`` (a LlamaForCausalLM) and ``tokenizer`` as a static inference model file."""
    programs, spec = trace_programs(model, block_size)
    names = {id(t): n for n, t in model.named_parameters()}
    names.update({id(t): n for n, t in model.named_buffers()})
    relaid: dict[tuple[int, str], Tensor] = {}  # one stored copy per parameter and layout
    concrete = {}
    for pname, p in programs.items():
        cp = p.concrete
        caps = []
        for i, t in enumerate(cp.captures):
            layout = p.layouts.get(i)
            if layout is not None:
                tt = relaid.get((id(t), layout))
                if tt is None:
                    tt = relaid[(id(t), layout)] = Tensor(relayout(t.numpy(), layout))
                    names[id(tt)] = f"{names.get(id(t), t.name or 'weight')}.{layout}"
                t = tt
            caps.append(t)
        concrete[pname] = jit.ConcreteProgram(
            cp.program, cp.n_args, caps, [], cp.out_tree, cp.n_outputs, cp.compiler
        )
    eos = model.config.eos_token_id
    eos_ids = sorted({*tokenizer.eos_ids, *(eos if isinstance(eos, list) else [] if eos is None else [eos])})
    metadata = {
        "model_name": model_name,
        "architecture": "llama",
        "llmkit_version": llmkit.__version__,
        "engine": spec.to_dict(),
        "config": model.config.to_dict(),
        "chat_template": (chat_template or ChatTemplate()).to_dict(),
        "generation": dict(generation or {}),
        "bos_token_id": tokenizer.bos_id,
        "eos_token_ids": eos_ids,
    }
    return save_programs(out, concrete, names, metadata, Tokenizer.of(tokenizer).files())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="llmkit export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", required=True, help="model directory (config.json, model.safetensors, tokenizer.model)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="the static model file to write (a directory; default: <model or run dir>.llmkit next to it)",
    )
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and KV cache dtype"
    )
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="tokens per KV cache block")
    p.add_argument(
        "--name", default=None, help="model id the server reports (default: the model directory's name)"
    )
    a = p.parse_args(argv)
    from llmkit.models.llama import LlamaForCausalLM, LlamaTokenizer
    from llmkit.models.llama.checkpoint import derived_path

    src = Path(a.model)
    out = Path(a.out) if a.out else derived_path(src, SUFFIX)
    if not (src / "config.json").is_file() and (src / "checkpoints").is_dir():
        raise ExportError(
            f"--model {src} is a run directory: give one of its checkpoints' model directories "
            f"({src}/checkpoints/step-NNNNNNNN/model)"
        )
    if out.exists() and not (out / MANIFEST).is_file():
        raise ExportError(f"--out {out} exists and is not a static model file; refusing to replace it")
    if out.parent.exists() and not out.parent.is_dir():
        raise ExportError(f"--out {out}: {out.parent} is a file, not a directory")
    if out.resolve() == src.resolve():
        raise ExportError("--out must differ from --model")
    if a.block_size < 1:
        raise ExportError(f"--block-size must be >= 1, got {a.block_size}")
    model = LlamaForCausalLM.from_pretrained(str(src), dtype=a.dtype)
    model.eval()
    tok = LlamaTokenizer.from_pretrained(src)
    tok.check_fits(model.config.vocab_size, str(src))
    name = a.name or (src.name if src.name != "model" else src.parent.name if src.parent.name else "model")
    path = export_model(
        model, tok, out, model_name=name, block_size=a.block_size, generation=_generation_defaults(src)
    )
    size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    print(f"llmkit export: wrote {path} ({size:.1f} MB; programs prefill, decode; model {name!r})")
    return 0
