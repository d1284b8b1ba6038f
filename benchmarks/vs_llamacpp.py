"""llmkit against llama.cpp on the same weights: decode, prefill, load time and resident memory.

The model: 134M parameters (hidden 768, 12 layers, 12 heads, MLP 2048, vocab 32000, untied head),
random weights (speed does not depend on the values), saved with the built-in tokenizer. Each
variant is quantized by llmkit (RTN, ``quantize_model`` + ``save_quantized`` as ``llmkit quantize``
writes it; float16 scales) and written by ``llmkit export`` as the static model file ``llmkit
serve`` runs. The GGUF file llama.cpp runs is made one of three ways (``gguf_made_by``):

- ``export``: ``llmkit export --format gguf`` of the same directory, where llmkit's layout is exactly
  a GGUF block type (int8 / symmetric int4 in groups of 32 with float16 scales: Q8_0 / Q4_0): the
  same weights on both sides;
- ``blocks32``: int4 in groups of 128 written as Q4_0 blocks, each group's codes as they are and its
  scale repeated over its four blocks (``as_blocks32``): the same weights again, llama.cpp reading
  4.5 bits a weight where llmkit reads 4.125 (the head and linears) or 4.25 (the embedding);
- ``q4_k_m``: llama.cpp's own quantizer (``llama_model_quantize``, as ``llama-quantize`` runs it) turns
  the float32 model's F32 GGUF into Q4_K_M: the same float weights, each tool's own method at about
  the same bits (Q4_K super-blocks of 256 with 6-bit sub-block scales and minima; Q6_K for the head
  and half the V and down projections): not the same quantized weights, so ``greedy_agree`` is low.

    variant             llmkit                               GGUF                          made by
    float32             float32                              F32                           export
    int8                int8 g32 linears                     Q8_0 linears; embd, head F32  export
    int4_g32            int4 g32 linears                     Q4_0 linears; embd, head F32  export
    int8_all            + lm_head and embedding quantized    Q8_0, all tensors             export
    int4_g32_all        + lm_head and embedding quantized    Q4_0, all tensors             export
    int4_g128_all       int4 g128 + lm_head and embedding    Q4_K_M                        q4_k_m
    int4_g128_all_q4_0  the same file as int4_g128_all       Q4_0, all tensors             blocks32

Every line carries both sides' bits per weight (``llmkit_bits_per_weight``: the static file's
weight matrices as the engine's decode reads them; ``gguf_bits_per_weight``: the GGUF's 2-D
tensors), over the float model's weights (linears, embedding, head; norms excluded).

llmkit: ``Engine.from_static`` on the exported file (``llmkit serve``'s engine; its ``step`` is what
``Engine.generate`` runs), default EngineConfig but ``max_batch``; greedy, EOS ignored. llama.cpp:
its Python bindings' C API (``llama-cpp-python``, an optional peer, never a dependency: ``pip
install llama-cpp-python==0.3.36``, see docs/quantize.md for the build flags) with one context of
``max_batch`` sequences, a ``llama_decode`` per step and greedy argmax over the logits it returns.
Both on ``--threads`` threads (llmkit: ``LLMKIT_CINN_THREADS`` and BLAS; llama.cpp: ``n_threads``,
``n_threads_batch``).

Figures (one JSON line each, every line with the 1-minute load average):

- ``<v>_decode_batch<B>``: tokens/s of decode steps (median step over a ``--prompt-len`` prompt and
  ``--new-tokens`` tokens) at batch 1 and 8, both sides, and their ratio (llmkit / llama.cpp, the
  median over alternated rounds of the two measured in the same round);
- ``<v>_prefill<P>``: prompt tokens/s of a ``--prefill`` token prompt to its first token;
- ``<v>_load``: a fresh process (imports excluded) to a loaded model and to its first answered
  one-token request, and the resident memory (VmRSS) then and at peak (VmHWM), both sides with a
  KV cache of ``--ctx`` tokens; the median of ``--rounds`` processes each.
- ``<v>_greedy_agree``: the fraction of the batch-1 greedy tokens the two sides chose alike (a check
  that the files hold the same model; near-ties of random weights can split them).

Without llama_cpp importable, one line says the peer is missing and llmkit is measured alone (the
Q4_K_M file, which llama.cpp makes, is then not written).

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/vs_llamacpp.py
(llama-cpp-python in another environment: ``--peer-python /work/venv-llamacpp/bin/python``
is not needed when that environment runs this script and sees llmkit through PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from _common import emit, emit_paired_ratio, llama_134m, load_average, machine


class Variant(NamedTuple):
    bits: int  # 0: float32
    group: int  # input columns per scale
    everything: bool  # lm_head and embedding quantized too
    gguf: str  # the GGUF side's name
    peer: str  # how its GGUF is made: "export" (llmkit export: the same weights), "blocks32" (the
    # same weights as Q4_0 blocks: each group's codes and float16 scale as its 128 / 32 blocks),
    # "q4_k_m" (llama.cpp quantizes the F32 GGUF itself: the same float source, its own method)


VARIANTS = {
    "float32": Variant(0, 0, False, "F32", "export"),
    "int8": Variant(8, 32, False, "Q8_0", "export"),
    "int4_g32": Variant(4, 32, False, "Q4_0", "export"),
    "int8_all": Variant(8, 32, True, "Q8_0_all", "export"),
    "int4_g32_all": Variant(4, 32, True, "Q4_0_all", "export"),
    "int4_g128_all": Variant(4, 128, True, "Q4_K_M", "q4_k_m"),
    "int4_g128_all_q4_0": Variant(4, 128, True, "Q4_0_all_from_g128", "blocks32"),
}
LLMKIT_FILE = {"int4_g128_all_q4_0": "int4_g128_all"}  # variants that share another's llmkit file


def set_threads(n: int) -> None:
    """Before llmkit (and numpy's OpenBLAS) load: kernels and BLAS on ``n`` threads."""
    os.environ.setdefault("LLMKIT_CINN_THREADS", str(n))
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(n))
    os.environ.setdefault("OMP_NUM_THREADS", str(n))


def peer_available() -> str | None:
    """llama_cpp's version, or None when it cannot be imported."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return getattr(llama_cpp, "__version__", "?")


# ---- the files --------------------------------------------------------------------------------------


def _export(d: Path, out: Path, fmt: str, name: str) -> None:
    from llmkit.cli import main as cli_main

    args = ["export", "--model", str(d), "--format", fmt, "--out", str(out), "--name", name]
    if not out.exists() and cli_main(args) != 0:
        raise RuntimeError(f"llmkit {' '.join(args)} failed")


def _quiet_llama(L) -> object:
    """llama.cpp's log off; the callback returned must stay referenced."""
    import ctypes

    cb = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(cb, ctypes.c_void_p(0))
    return cb


def llama_quantize(src: Path, out: Path, ftype: int, threads: int) -> None:
    """llama.cpp's own quantizer (``llama-quantize``'s function) from ``src`` to ``out``, atomically."""
    import ctypes

    import llama_cpp as L

    from llmkit.framework.files import atomic_path

    keep = _quiet_llama(L)
    p = L.llama_model_quantize_default_params()
    p.ftype, p.nthread = ftype, threads
    with atomic_path(out) as tmp:
        if L.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(p)) != 0:
            raise RuntimeError(f"llama_model_quantize {src} -> {out} failed")
    del keep


def as_blocks32(model, base: Path):
    """Quantized ``model`` (symmetric int4 in groups of 128) in groups of 32: each group's codes as
    they are and its scale repeated over its four blocks, the rest from the float model ``base``:
    the same weights in Q4_0's layout."""
    import dataclasses

    from llmkit.framework import nn
    from llmkit.models.llama import LlamaForCausalLM
    from llmkit.quant import QuantConfig
    from llmkit.quant.format import QuantizedWeight
    from llmkit.quant.quantize import install

    cfg = QuantConfig.from_hf(model.config.extra["quantization_config"])
    if cfg.bits != 4 or not cfg.sym or cfg.group_size % 32:
        raise ValueError(f"as_blocks32: symmetric int4 in groups of a multiple of 32, not {cfg}")
    weights = {
        p: QuantizedWeight(m.qweight.numpy(), m.scales.numpy().repeat(cfg.group_size // 32, axis=1), None)
        for p, m in model.named_sublayers()
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)
    }
    copy = LlamaForCausalLM.from_pretrained(str(base))
    install(copy, weights, dataclasses.replace(cfg, group_size=32))
    return copy


def build_files(
    work: Path, variants: list[str], act_bits: int, peer: bool, threads: int
) -> dict[str, tuple[Path, Path | None]]:
    """Every variant's (static llmkit file, GGUF file or None: made by llama.cpp, which is missing),
    written once into ``work`` (kept across runs)."""
    import llmkit.framework as lf
    from llmkit.models.llama import LlamaForCausalLM
    from llmkit.quant import QuantConfig, quantize_model
    from llmkit.quant.quantize import save_quantized
    from llmkit.train.corpus import builtin_tokenizer

    work.mkdir(parents=True, exist_ok=True)
    base = work / "float32"
    if not (base / "config.json").is_file():
        lf.seed(0)
        model = LlamaForCausalLM(llama_134m())
        model.save_pretrained(str(base))
        builtin_tokenizer(4096, cache_dir=work / "cache").save_pretrained(base)
    out = {}
    for v in variants:
        spec, name = VARIANTS[v], LLMKIT_FILE.get(v, v)
        d = base if spec.bits == 0 else work / f"{name}_act{act_bits}"
        if not (d / "config.json").is_file():
            model = LlamaForCausalLM.from_pretrained(str(base))
            cfg = QuantConfig(spec.bits, spec.group, True, "rtn", "float16", act_bits=act_bits)
            quantize_model(model, cfg, lm_head=spec.everything, embed=spec.everything, progress=False)
            save_quantized(model, base, d, {})
        _export(d, d.with_suffix(".llmkit"), "llmkit", name)
        gguf = d.with_suffix(".gguf")
        if spec.peer == "blocks32":
            gguf = work / f"{v}.gguf"
            d32 = work / f"{v}_blocks32"
            if not gguf.exists() and not (d32 / "config.json").is_file():
                save_quantized(as_blocks32(LlamaForCausalLM.from_pretrained(str(d)), base), base, d32, {})
            _export(d32, gguf, "gguf", v)
        elif spec.peer == "q4_k_m":
            gguf = work / f"{v}_{spec.gguf}.gguf"
            if not gguf.exists() and peer:
                import llama_cpp

                _export(base, base.with_suffix(".gguf"), "gguf", "float32")
                llama_quantize(base.with_suffix(".gguf"), gguf, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, threads)
        else:
            _export(d, gguf, "gguf", name)
        out[v] = (d.with_suffix(".llmkit"), gguf if gguf.exists() else None)
    return out


def _matrices(path: Path) -> dict:
    """A safetensors file's 2-D tensors but the rotary tables, by name (memory-mapped)."""
    from llmkit.framework.serialization import safe_open

    with safe_open(path) as f:
        return {k: f[k].numpy() for k in f if len(f.shape(k)) == 2 and "rope_" not in k}


def llmkit_bits(path: Path, base: Path) -> float:
    """Bits per weight of the static file ``path``'s weight matrices (linears, lm_head, embedding;
    ``base``: the float model's directory, whose matrices are the weights counted) as the engine's
    decode reads them: a weight relaid for the kernels (``X.qweight.Q4g128``, ``X.scales.H``: codes
    in panels, float16 scales) counted in that form, not the plain one kept beside it for others."""
    arrays = _matrices(path / "weights.safetensors")
    relaid = {k.rsplit(".", 1)[0] for k in arrays if not k.endswith((".qweight", ".scales", ".weight"))}
    nbytes = sum(a.nbytes for k, a in arrays.items() if k not in relaid)
    return nbytes * 8 / sum(a.size for a in _matrices(base / "model.safetensors").values())


def gguf_bits(path: Path) -> float:
    """Bits per weight of the GGUF file's matrices (its 2-D tensors), in their block types."""
    import gguf

    ts = [t for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2]
    return sum(int(t.n_bytes) for t in ts) * 8 / sum(int(t.n_elements) for t in ts)


def describe(v: str, files: tuple[Path, Path | None]) -> dict:
    """What every figure of variant ``v`` carries: the GGUF, how it was made, both bits/weight."""
    spec = VARIANTS[v]
    out = dict(
        gguf=spec.gguf,
        gguf_made_by=spec.peer,
        llmkit_bits_per_weight=round(llmkit_bits(files[0], files[0].parent / "float32"), 3),
    )
    if files[1] is not None:
        out["gguf_bits_per_weight"] = round(gguf_bits(files[1]), 3)
    return out


# ---- the two sides ------------------------------------------------------------------------------


class Llmkit:
    """``llmkit serve``'s engine over the static model file."""

    def __init__(self, path: Path, max_batch: int, ctx: int) -> None:
        from llmkit.framework.compiler.build import spin_between_kernels
        from llmkit.infer import Engine, EngineConfig

        spin_between_kernels()  # as llmkit serve and generate run
        blocks = max_batch * -(-ctx // 16)
        self.engine = Engine.from_static(path, EngineConfig(max_batch=max_batch, num_blocks=blocks))

    def _params(self, n: int):
        from llmkit.infer import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def generate(self, prompt: list[int], n: int) -> list[int]:
        out = self.engine.generate([prompt], self._params(n))[0]
        self.engine.reset_prefix_cache()
        return list(out.token_ids)

    def decode_steps(self, prompts: list[list[int]], n: int) -> list[float]:
        """Seconds of each decode step of ``len(prompts)`` sequences (their prefill step excluded)."""
        for p in prompts:
            self.engine.add_request(p, self._params(n))
        self.engine.step()
        times = []
        while self.engine.has_work():
            t = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - t)
        self.engine.reset_prefix_cache()
        return times[:-1] or times


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: one context of ``max_batch`` sequences."""

    def __init__(self, path: Path, max_batch: int, ctx: int, threads: int) -> None:
        import llama_cpp as L

        self.L = L
        self._log = _quiet_llama(L)
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max = ctx * max_batch, max_batch
        cp.n_batch = cp.n_ubatch = 512
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(max(512, max_batch), 0, 1)

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits) rows; argmax of each wanted."""
        import numpy as np

        b = self.batch
        for start in range(0, len(rows), 512):
            chunk = rows[start : start + 512]
            b.n_tokens = len(chunk)
            for i, (tok, pos, seq, want) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
                b.seq_id[i][0] = seq
            if self.L.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
        last = rows[-512:] if len(rows) % 512 == 0 else rows[len(rows) // 512 * 512 :]
        wanted = [i for i, r in enumerate(last) if r[3]]
        return [
            int(np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,)).argmax())
            for i in wanted
        ]

    def _clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def generate(self, prompt: list[int], n: int) -> list[int]:
        rows = [(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)]
        out = self._decode(rows)
        while len(out) < n:
            out += self._decode([(out[-1], len(prompt) + len(out) - 1, 0, True)])
        self._clear()
        return out

    def decode_steps(self, prompts: list[list[int]], n: int) -> list[float]:
        rows = [(t, p, s, p == len(pr) - 1) for s, pr in enumerate(prompts) for p, t in enumerate(pr)]
        last = self._decode(rows)
        times = []
        for k in range(n - 1):
            t = time.perf_counter()
            last = self._decode([(tok, len(prompts[s]) + k, s, True) for s, tok in enumerate(last)])
            times.append(time.perf_counter() - t)
        self._clear()
        return times


# ---- figures --------------------------------------------------------------------------------------


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, 4096, length).tolist() for _ in range(batch)]


def speed(v: str, files: tuple[Path, Path], a: argparse.Namespace, peer: bool, info: dict) -> None:
    batches = sorted(set(a.batches))
    ctx = max(a.prefill, a.prompt_len + a.new_tokens) + 16
    peer = peer and files[1] is not None
    sides = {"llmkit": Llmkit(files[0], max(batches), ctx)}
    if peer:
        sides["llamacpp"] = LlamaCpp(files[1], max(batches), ctx, a.threads)
    names = dict(info, **describe(v, files))
    long_prompt = prompts(1, a.prefill, 1)[0]
    for s in sides.values():  # warm: plan the programs, touch the caches
        s.generate(long_prompt, 2)
        s.decode_steps(prompts(max(batches), a.prompt_len, 2), 4)
    decode = {(b, k): [] for b in batches for k in sides}
    prefill = {k: [] for k in sides}
    loads, agree = [], []
    for r in range(a.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))  # alternate who goes first
        for b in batches:
            ps = prompts(b, a.prompt_len, 10 + r)
            for k in order:
                decode[(b, k)].append(b / statistics.median(sides[k].decode_steps(ps, a.new_tokens)))
        for k in order:
            t = time.perf_counter()
            sides[k].generate(long_prompt, 1)
            prefill[k].append(a.prefill / (time.perf_counter() - t))
        loads.append(load_average())
        if peer:
            p = prompts(1, a.prompt_len, 20 + r)[0]
            x, y = (sides[k].generate(p, a.new_tokens) for k in ("llmkit", "llamacpp"))
            agree.append(sum(i == j for i, j in zip(x, y)) / len(x))
    for b in batches:
        for k in sides:
            emit("vs_llamacpp", f"{v}_decode_batch{b}_{k}", statistics.median(decode[(b, k)]), "tokens/s",
                 per_round=[round(t, 2) for t in decode[(b, k)]], load_1min=loads, **names)  # fmt: skip
        if peer:
            emit_paired_ratio("vs_llamacpp", f"{v}_decode_batch{b}_ratio", decode[(b, "llmkit")],
                              decode[(b, "llamacpp")], load_1min=loads, note="llmkit / llama.cpp tokens/s",
                              **names)  # fmt: skip
    for k in sides:
        emit("vs_llamacpp", f"{v}_prefill{a.prefill}_{k}", statistics.median(prefill[k]), "tokens/s",
             per_round=[round(t, 1) for t in prefill[k]], load_1min=loads, **names)  # fmt: skip
    if peer:
        emit_paired_ratio("vs_llamacpp", f"{v}_prefill{a.prefill}_ratio", prefill["llmkit"],
                          prefill["llamacpp"], load_1min=loads, note="llmkit / llama.cpp prompt tokens/s",
                          **names)  # fmt: skip
        emit("vs_llamacpp", f"{v}_greedy_agree", statistics.median(agree), "fraction",
             per_round=[round(x, 3) for x in agree], load_1min=loads, **names)  # fmt: skip
        sides["llamacpp"].close()


def _rss() -> dict[str, float]:
    with open("/proc/self/status") as f:
        kv = dict(line.split(":", 1) for line in f)
    return {k: int(kv[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def child(a: argparse.Namespace) -> None:
    """One fresh process: load one side's file, answer one request; print what it took."""
    import numpy  # noqa: F401  (imports are not load time)

    if a.child == "llmkit":
        import llmkit.infer  # noqa: F401
    else:
        import llama_cpp  # noqa: F401
    t = time.perf_counter()
    path = Path(a.file)
    side = Llmkit(path, 1, a.ctx) if a.child == "llmkit" else LlamaCpp(path, 1, a.ctx, a.threads)
    loaded = time.perf_counter() - t
    side.generate(prompts(1, a.prompt_len, 3)[0], 1)
    first = time.perf_counter() - t
    rss = _rss()
    print(
        json.dumps(
            {"load_s": loaded, "first_answer_s": first, "rss_MB": rss["VmRSS"], "peak_MB": rss["VmHWM"]}
        )
    )


def load_and_memory(v: str, files: tuple[Path, Path], a: argparse.Namespace, peer: bool, info: dict) -> None:
    peer = peer and files[1] is not None
    sides = {"llmkit": files[0], **({"llamacpp": files[1]} if peer else {})}
    got: dict[str, list[dict]] = {k: [] for k in sides}
    loads = []
    for r in range(a.rounds):
        for k in list(sides) if r % 2 == 0 else list(reversed(sides)):
            cmd = [sys.executable, __file__, "--child", k, "--file", str(sides[k]), "--ctx", str(a.ctx),
                   "--threads", str(a.threads), "--prompt-len", str(a.prompt_len)]  # fmt: skip
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if res.returncode != 0:
                raise RuntimeError(f"{k} child failed: {res.stderr[-2000:]}")
            got[k].append(json.loads(res.stdout.strip().splitlines()[-1]))
        loads.append(load_average())
    names = dict(info, **describe(v, files), kv_cache_tokens=a.ctx)
    for key, unit in (("load_s", "s"), ("first_answer_s", "s"), ("rss_MB", "MB"), ("peak_MB", "MB")):
        for k in sides:
            vals = [g[key] for g in got[k]]
            emit("vs_llamacpp", f"{v}_{key}_{k}", statistics.median(vals), unit,
                 per_round=[round(x, 3) for x in vals], load_1min=loads, **names)  # fmt: skip
        if peer:
            emit_paired_ratio("vs_llamacpp", f"{v}_{key}_ratio", [g[key] for g in got["llmkit"]],
                              [g[key] for g in got["llamacpp"]], load_1min=loads,
                              note="llmkit / llama.cpp (lower is better)", **names)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill figure")
    p.add_argument("--ctx", type=int, default=1024, help="KV cache tokens of the load/memory processes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--act-bits", type=int, default=0, choices=[0, 8], help="llmkit's activations (8: int8)")
    p.add_argument("--work", default="/tmp/llmkit_vs_llamacpp", help="where the model files are kept")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-load", action="store_true")
    p.add_argument("--no-peer", action="store_true", help="measure llmkit alone")
    p.add_argument("--child", choices=["llmkit", "llamacpp"], help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    a = p.parse_args()
    set_threads(a.threads)
    if a.child:
        return child(a)
    version = None if a.no_peer else peer_available()
    info = dict(threads=a.threads, act_bits=a.act_bits, **machine())
    emit("vs_llamacpp", "load_average_1min", load_average(), "load", llama_cpp_python=version, **info)
    if version is None:
        emit("vs_llamacpp", "peer_missing", 0, "", note="llama_cpp not importable (pip install "
             "llama-cpp-python==0.3.36, docs/quantize.md) or --no-peer: llmkit measured alone")  # fmt: skip
    files = build_files(Path(a.work), a.variants, a.act_bits, version is not None, a.threads)
    for v in a.variants:
        if not a.skip_speed:
            speed(v, files[v], a, version is not None, info)
        if not a.skip_load:
            load_and_memory(v, files[v], a, version is not None, info)


if __name__ == "__main__":
    main()
