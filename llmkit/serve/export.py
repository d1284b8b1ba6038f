"""``llmkit export --model DIR [--out FILE] [--format llmkit|gguf]``: the static model file the
server runs, or (``--format gguf``, ``llmkit.serve.gguf``) one GGUF file for llama.cpp and Ollama.

``--out`` defaults to the model directory's name with ``.llmkit`` appended, next to it
(``runs/tiny-int4`` -> ``runs/tiny-int4.llmkit``; a checkpoint's ``runs/tiny/checkpoints/step-N/model``
-> ``runs/tiny.llmkit``), so ``llmkit serve runs/tiny-int4.llmkit`` follows without editing a path.

It reads a Hugging Face layout model directory (as the trainer writes it: ``config.json``,
``model.safetensors``, the tokenizer's files, optionally ``generation_config.json``), traces the
engine's ``prefill``, ``decode`` and ``score`` programs from it, and writes them with ``jit.save``'s
format: one PIR file per program, ``weights.safetensors``, the tokenizer's files
(``Tokenizer.files()``: ``tokenizer.json``, ``tokenizer.model`` for sentencepiece,
``tokenizer_config.json``, ...), and a manifest with the
sha256 of every part. The manifest's metadata holds what the server needs besides the programs:
``engine`` (cache geometry, context length, dtype), ``chat_template`` (the Jinja source: the
tokenizer's, else the Llama 2 default), ``generation`` defaults, ``eos_token_ids``, and the model's
``config``.

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
from llmkit.infer.chat import ChatTemplate, ChatTemplateError
from llmkit.infer.programs import BLOCK_SIZE, PROGRAMS, relayout, trace_programs
from llmkit.infer.sampling import SamplingParams
from llmkit.tokenizer import Tokenizer

SUFFIX = ".llmkit"  # the default --out: the model's directory (or run) with this appended
SUFFIXES = {"llmkit": SUFFIX, "gguf": ".gguf"}  # per --format


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
    template = (chat_template or ChatTemplate.of(tokenizer)).check()
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
    eos_ids = sorted({*tokenizer.eos_ids, *model.config.eos_ids})
    metadata = {
        "model_name": model_name,
        "architecture": "llama",
        "llmkit_version": llmkit.__version__,
        "engine": spec.to_dict(),
        "config": model.config.to_dict(),
        "chat_template": template.to_metadata(),
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
        "--format",
        default="llmkit",
        choices=sorted(SUFFIXES),
        help="llmkit: the static model file `llmkit serve` runs; gguf: one file for llama.cpp / Ollama",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="weights (and KV cache) dtype: float32 or bfloat16 for llmkit, float32 or float16 for gguf "
        "(default float32; a quantized model's gguf keeps its Q8_0/Q4_0 blocks unless --dtype is given)",
    )
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="tokens per KV cache block")
    p.add_argument(
        "--name", default=None, help="model id the server reports (default: the model directory's name)"
    )
    a = p.parse_args(argv)
    from llmkit.models.llama import LlamaForCausalLM, LlamaTokenizer
    from llmkit.models.llama.checkpoint import derived_path

    src = Path(a.model)
    out = Path(a.out) if a.out else derived_path(src, SUFFIXES[a.format])
    if not (src / "config.json").is_file() and (src / "checkpoints").is_dir():
        raise ExportError(
            f"--model {src} is a run directory: give one of its checkpoints' model directories "
            f"({src}/checkpoints/step-NNNNNNNN/model)"
        )
    if a.format == "llmkit" and out.exists() and not (out / MANIFEST).is_file():
        raise ExportError(f"--out {out} exists and is not a static model file; refusing to replace it")
    if a.format == "gguf" and out.is_dir():
        raise ExportError(f"--out {out} is a directory; a GGUF export is one file")
    if out.parent.exists() and not out.parent.is_dir():
        raise ExportError(f"--out {out}: {out.parent} is a file, not a directory")
    if out.resolve() == src.resolve():
        raise ExportError("--out must differ from --model")
    if a.block_size < 1:
        raise ExportError(f"--block-size must be >= 1, got {a.block_size}")
    name = a.name or (src.name if src.name != "model" else src.parent.name if src.parent.name else "model")
    if a.format == "gguf":
        return _export_gguf(src, out, name, a.dtype)
    if a.dtype == "float16":
        raise ExportError(
            "--dtype float16 is for --format gguf; the static model file is float32 or bfloat16"
        )
    model = LlamaForCausalLM.from_pretrained(str(src), dtype=a.dtype or "float32")
    model.eval()
    tok = LlamaTokenizer.from_pretrained(src)
    tok.check_fits(model.config.vocab_size, str(src))
    try:
        path = export_model(
            model, tok, out, model_name=name, block_size=a.block_size, generation=_generation_defaults(src)
        )
    except ChatTemplateError as e:
        raise ExportError(f"{src}: the tokenizer's {e}") from None
    size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    programs = ", ".join(PROGRAMS)
    print(f"llmkit export: wrote {path} ({size:.1f} MB; programs {programs}; model {name!r})")
    return 0


def _export_gguf(src: Path, out: Path, name: str, dtype: str | None) -> int:
    from llmkit.models.llama import LlamaForCausalLM
    from llmkit.serve.gguf import GGUFExportError, write_gguf

    if dtype == "bfloat16":
        raise ExportError("--dtype bfloat16 is for the llmkit format; GGUF weights are float32 or float16")
    model = LlamaForCausalLM.from_pretrained(str(src))
    try:
        f = write_gguf(model, src, out, name=name, dtype=dtype or "float32", dequantize=dtype is not None)
    except GGUFExportError as e:
        raise ExportError(str(e)) from None
    size = f.path.stat().st_size / 1e6
    print(f"llmkit export: wrote {f.path} ({size:.1f} MB; GGUF {f.file_type}, model {name!r})")
    if f.float_layers:
        print(
            f"llmkit export: {len(f.float_layers)} quantized linears as float32, exactly their dequantized "
            f"weights (input columns not whole blocks of 32): {', '.join(f.float_layers)}"
        )
    return 0
