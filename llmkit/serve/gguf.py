"""``llmkit export --format gguf``: a model directory as one GGUF file, for llama.cpp and Ollama.

Written with the ``gguf`` package (llama.cpp's own writer; ``pip install llmkit[gguf]``), in
llama.cpp's ``llama`` architecture:

- tensors under llama.cpp's names (``token_embd``, ``blk.N.attn_q`` ... ``output``; the gguf
  package's own name map), shapes as llama.cpp reads them (the writer stores numpy's row-major
  ``[out, in]`` as ``ne = [in, out]``), 1-D tensors (norms) always float32;
- q/k projections (weights and biases) with rows permuted from Hugging Face's rotate-half RoPE
  layout to llama.cpp's adjacent pairs (``rotary_permute``, the rule of llama.cpp's
  ``convert_hf_to_gguf.py``);
- ``llama.*`` hyperparameters, RoPE scaling (``rope.scaling.*`` for linear; for llama3 a
  ``rope_freqs`` tensor of per-frequency divisors, as llama.cpp's converter writes it);
- the tokenizer, as ``llmkit.tokenizer.Tokenizer`` reads the directory: a sentencepiece model as
  ``tokenizer.ggml.model = "llama"`` (pieces, scores, types), or a byte-level BPE
  ``tokenizer.json`` as ``"gpt2"`` (tokens, merges, types and the pre-tokenizer's llama.cpp name);
  its special ids, ``add_bos_token``/``add_eos_token`` and chat template (Llama 2's when it has
  none, ``llmkit.infer.chat``'s default).

Weights: float32 or float16 (``--dtype``); a model written by ``llmkit quantize`` keeps its codes
where its layout is exactly a GGUF block type: int8 or symmetric int4 in groups of 32 whose scales
are float16 numbers are Q8_0 or Q4_0 blocks (``llmkit quantize --group 32 --scale-dtype float16``
makes such models); such a layer whose rows are not whole blocks of 32 is written as its exact
float32 weights, as llama.cpp's converter falls back. Any other layout is refused in one line naming
the nearest exact options.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from llmkit.framework import nn
from llmkit.framework.files import atomic_path
from llmkit.framework.ops.quant import codes
from llmkit.infer.chat import LLAMA2_CHAT_TEMPLATE
from llmkit.tokenizer import JSON_FILE, Tokenizer, TokenizerError

INSTALL_HINT = "pip install llmkit[gguf]"
BLOCK = 32  # weights per Q8_0 / Q4_0 block
DTYPES = ("float32", "float16")  # --dtype of float tensors (quantized layers keep their blocks)

# tokenizer.json pre-tokenizer split pattern -> llama.cpp's `tokenizer.ggml.pre` name
PRE_TOKENIZERS = {
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
        r"\s*[\r\n]+|\s+(?!\S)|\s+"
    ): "llama-bpe",  # Llama 3.x
    "byte-level": "gpt-2",  # ByteLevel(use_regex=True) alone: GPT-2's own split
}


class GGUFExportError(ValueError):
    """A model that cannot be written as GGUF (printed as one line by the CLI)."""


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise GGUFExportError(
            f"--format gguf needs the gguf package (llama.cpp's GGUF writer): {INSTALL_HINT}"
        ) from None
    return gguf


def rotary_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a q or k projection [n_heads * D, ...] from Hugging Face's rotate-half RoPE layout to
    llama.cpp's: within each head, rows i and D/2 + i (one rotated pair) become rows 2i and 2i + 1."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _no_block_type(name: str, layer: nn.QuantizedLinear, why: str) -> GGUFExportError:
    kind = f"int{layer.bits}" + ("" if layer.sym else " asymmetric")
    groups = "per output channel" if layer.group_size == -1 else f"in groups of {layer.group_size}"
    return GGUFExportError(
        f"{name}: {kind} {groups} does not map exactly to a GGUF block type ({why}; Q8_0 is int8 and "
        f"Q4_0 symmetric int4, both in groups of 32 with float16 scales): re-quantize the float model "
        f"with `llmkit quantize --bits {layer.bits} --group 32 --scale-dtype float16`, or export the "
        f"dequantized weights with --dtype float32 (exact) or --dtype float16"
    )


def quantized_blocks(name: str, layer: nn.QuantizedLinear) -> tuple[np.ndarray, str]:
    """The layer's codes and scales as Q8_0 or Q4_0 blocks: uint8 [out, in / 32 * block bytes].

    A block is its float16 scale d, then 32 int8 codes (Q8_0: w = d * q) or 16 bytes of 4-bit codes,
    weight j in the low nibble of byte j and weight 16 + j in its high one (Q4_0: w = d * (q - 8)),
    which are llmkit's int8 and symmetric int4 (zero point 8) codes as they are.
    """
    if not layer.sym:
        raise _no_block_type(name, layer, "a zero point per group")
    if layer.group_size != BLOCK or layer.in_features % BLOCK:
        raise _no_block_type(name, layer, "not whole blocks of 32 input columns")
    scales = layer.scales.numpy()  # (out, in / 32)
    d = scales.astype(np.float16)
    if not np.array_equal(d.astype(scales.dtype), scales):
        raise _no_block_type(name, layer, "its scales are not float16 numbers")
    q = codes(np, layer.qweight.numpy(), layer.bits).astype(np.int64)
    q = q.reshape(q.shape[0], -1, BLOCK)  # (out, blocks, 32)
    if layer.bits == 8:
        qs, qtype = q.astype(np.int8).view(np.uint8), "Q8_0"
    else:
        qs, qtype = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8), "Q4_0"
    blocks = np.concatenate([d[..., None].view(np.uint8), qs], axis=-1)  # (out, blocks, 2 + ...)
    return blocks.reshape(len(blocks), -1), qtype


def _whole_rows_only(layer: nn.QuantizedLinear) -> bool:
    """A layer that would be Q8_0/Q4_0 but for rows that are not whole blocks (tiny's 344-wide MLP):
    written as its dequantized float32 weights, exact, as llama.cpp's own converter falls back."""
    return layer.sym and layer.group_size == BLOCK and layer.in_features % BLOCK != 0


def _tensors(
    model: Any, dtype: str, quantized: bool
) -> tuple[list[tuple[str, np.ndarray, str | None]], list[str]]:
    """(HF name, array, GGUF block type or None) of every tensor, q/k rows in llama.cpp's order, and
    the quantized layers written as float32 (``_whole_rows_only``)."""
    cfg = model.config
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    out, as_float = [], []
    for path, layer in model.named_sublayers():
        # a quantized embedding holds its table as a quantized weight [vocab -> hidden]: the same blocks
        coded = isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        if coded and quantized and _whole_rows_only(layer):
            as_float.append(path)
            arrays = [("weight", layer.weight.numpy().astype(np.float32), None)]
        elif coded and quantized:
            arrays = [("weight", *quantized_blocks(path, layer))]
        elif coded or isinstance(layer, (nn.Linear, nn.Embedding, nn.RMSNorm)):
            arrays = [("weight", layer.weight.numpy().astype(np.float32), None)]
        else:
            continue
        if getattr(layer, "bias", None) is not None:
            arrays.append(("bias", layer.bias.numpy().astype(np.float32), None))
        for suffix, a, qtype in arrays:
            n = heads.get(path.rpartition(".")[2])
            if n is not None:
                a = rotary_permute(a, n)
            if qtype is None and a.ndim == 2 and path not in as_float:
                a = a.astype(dtype)
            out.append((f"{path}.{suffix}", np.ascontiguousarray(a), qtype))
    return out, as_float


class GGUFFile(NamedTuple):
    """What ``write_gguf`` wrote."""

    path: Path
    file_type: str  # llama.cpp's LlamaFileType name: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0, MOSTLY_Q4_0
    float_layers: list[str]  # quantized layers written as float32 (rows not whole blocks of 32)


def _sentencepiece(w: Any, gguf: Any, tok: Tokenizer) -> tuple[list[str], list[int], list[float] | None]:
    """Pieces, piece types and scores of a sentencepiece model (``tokenizer.ggml.model`` "llama")."""
    import sentencepiece as spm

    T = gguf.TokenType
    sp = spm.SentencePieceProcessor(model_proto=tok.model_proto)
    n = sp.get_piece_size()
    kinds = ((sp.is_unknown, T.UNKNOWN), (sp.is_control, T.CONTROL), (sp.is_unused, T.UNUSED))
    kinds += ((sp.is_byte, T.BYTE),)
    types = [next((t for test, t in kinds if test(i)), T.NORMAL) for i in range(n)]
    pieces, scores = [sp.id_to_piece(i) for i in range(n)], [sp.get_score(i) for i in range(n)]
    for i in range(n, tok.vocab_size):  # added tokens past the pieces (tokenizer_config.json's)
        pieces.append(tok.id_to_piece(i))
        scores.append(0.0)
        types.append(T.CONTROL if tok.is_control(i) else T.USER_DEFINED)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    # sentencepiece's add_dummy_prefix (llmkit's tokenizers are trained without it): the model says
    # it by how it encodes a lone letter
    w.add_add_space_prefix(sp.encode("a", out_type=str)[0].startswith("\u2581"))
    return pieces, types, scores


def _pre_tokenizer(pre: Any) -> str:
    steps = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else []
    splits = [s["pattern"].get("Regex") for s in steps if s.get("type") == "Split" and "pattern" in s]
    key = splits[0] if len(splits) == 1 else None
    if not splits and any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps):
        key = "byte-level"
    if key not in PRE_TOKENIZERS:
        raise GGUFExportError(
            f"{JSON_FILE}: pre_tokenizer {json.dumps(pre)[:200]} is not one llama.cpp knows by name here "
            f"(known: Llama 3's split, GPT-2's byte-level)"
        )
    return PRE_TOKENIZERS[key]


def _bpe(w: Any, gguf: Any, tok: Tokenizer) -> tuple[list[str], list[int], list[float] | None]:
    """Tokens, merges and token types of a byte-level BPE ``tokenizer.json`` ("gpt2")."""
    T = gguf.TokenType
    tj = json.loads(tok.files()[JSON_FILE])
    model = tj["model"]
    if model.get("type") != "BPE" or not _byte_level(tj.get("pre_tokenizer")):
        raise GGUFExportError(
            f"{JSON_FILE}: a {model.get('type')} model without a byte-level pre-tokenizer; GGUF export "
            f"writes byte-level BPE (and sentencepiece tokenizer.model) vocabularies"
        )
    pre = _pre_tokenizer(tj.get("pre_tokenizer"))
    tokens = [tok.id_to_piece(i) for i in range(tok.vocab_size)]
    types = [T.CONTROL if tok.is_control(i) else T.NORMAL for i in range(tok.vocab_size)]
    for a in tj.get("added_tokens") or []:
        if not a.get("special"):
            types[a["id"]] = T.USER_DEFINED
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])])
    return tokens, types, None


def _byte_level(pre: Any) -> bool:
    steps = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else []
    return any(isinstance(s, dict) and s.get("type") == "ByteLevel" for s in steps)


def _add_tokenizer(w: Any, gguf: Any, model_dir: Path, cfg: Any) -> None:
    """The vocabulary, special ids, bos/eos flags and chat template, as llmkit's Tokenizer reads the
    model directory's files (tokenizer.model / tokenizer.json, tokenizer_config.json, ...)."""
    try:
        tok = Tokenizer.from_pretrained(model_dir)
    except (FileNotFoundError, TokenizerError) as e:
        raise GGUFExportError(str(e)) from None
    if tok.vocab_size > cfg.vocab_size:
        raise GGUFExportError(
            f"{model_dir}: the tokenizer has {tok.vocab_size} tokens, more than the model's vocab_size "
            f"{cfg.vocab_size}"
        )
    tokens, types, scores = (_sentencepiece if tok.kind == "sentencepiece" else _bpe)(w, gguf, tok)
    # embedding rows the tokenizer never emits, named as llama.cpp's converter names them
    tokens += [f"[PAD{i}]" for i in range(tok.vocab_size, cfg.vocab_size)]
    types += [gguf.TokenType.UNUSED] * (cfg.vocab_size - tok.vocab_size)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores + [0.0] * (cfg.vocab_size - tok.vocab_size))
    ids = {"bos": tok.bos_id, "eos": tok.eos_id, "unk": tok.unk_id, "pad": tok.pad_id}
    adders = {"bos": w.add_bos_token_id, "eos": w.add_eos_token_id}
    adders |= {"unk": w.add_unk_token_id, "pad": w.add_pad_token_id}
    for key, i in ids.items():
        if i is not None:
            adders[key](i)
    w.add_add_bos_token(tok.add_bos_token)
    w.add_add_eos_token(tok.add_eos_token)
    w.add_chat_template(tok.chat_template or LLAMA2_CHAT_TEMPLATE)


def _add_hyperparameters(w: Any, gguf: Any, cfg: Any) -> None:
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))


def rope_freq_factors(cfg: Any) -> np.ndarray | None:
    """llama3 RoPE scaling as llama.cpp reads it: the divisor of each base frequency (float32
    [head_dim / 2]), from the config's own scaled frequencies; None for other scalings."""
    if (cfg.rope_scaling or {}).get("rope_type") != "llama3":
        return None
    return (cfg.rope_inv_freq(scaled=False) / cfg.rope_inv_freq()).astype(np.float32)


def write_gguf(
    model: Any,
    model_dir: str | Path,
    out: str | Path,
    *,
    name: str,
    dtype: str = "float32",
    dequantize: bool = False,
) -> GGUFFile:
    """Write ``model`` (a LlamaForCausalLM loaded from ``model_dir``, whose tokenizer files are read)
    as the GGUF file ``out``, atomically: float tensors in ``dtype``, quantized layers as Q8_0/Q4_0
    blocks (or, with ``dequantize``, their dequantized weights in ``dtype``)."""
    gguf = _gguf()
    if dtype not in DTYPES:
        raise GGUFExportError(f"--dtype {dtype!r}: GGUF weights are one of {', '.join(DTYPES)}")
    cfg, model_dir = model.config, Path(model_dir)
    tensors, as_float = _tensors(model, dtype, quantized=not dequantize)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    qtypes = {q for _, _, q in tensors if q is not None}
    file_type = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0"}.get(min(qtypes, default=""))
    file_type = file_type or ("MOSTLY_F16" if dtype == "float16" else "ALL_F32")
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(tmp, "llama")
        w.add_name(name)
        w.add_file_type(int(gguf.LlamaFileType[file_type]))
        if qtypes:
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_hyperparameters(w, gguf, cfg)
        _add_tokenizer(w, gguf, model_dir, cfg)
        factors = rope_freq_factors(cfg)
        if factors is not None:
            w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)
        for hf_name, a, qtype in tensors:
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise GGUFExportError(f"{hf_name}: no llama.cpp tensor of that name")
            w.add_tensor(gguf_name, a, raw_dtype=None if qtype is None else gguf.GGMLQuantizationType[qtype])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return GGUFFile(Path(out), file_type, as_float)
