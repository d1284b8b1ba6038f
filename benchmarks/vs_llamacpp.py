"""llmkit against llama.cpp on the same weights: decode, prefill, load time and resident memory.

The model: 134M parameters (hidden 768, 12 layers, 12 heads, MLP 2048, vocab 32000, untied head),
random weights (speed does not depend on the values), saved with the built-in tokenizer. Each
variant is quantized by llmkit (RTN, ``quantize_model`` + ``save_quantized`` as ``llmkit quantize``
writes it) in the layout that is exactly a GGUF block type (int8 / symmetric int4 in groups of 32
with float16 scales: Q8_0 / Q4_0), then written by ``llmkit export`` twice: as the static model
file ``llmkit serve`` runs and as GGUF (``--format gguf``). Both sides run those files' weights:

    variant      llmkit                               GGUF
    float32      float32                              F32
    int8         int8 g32 linears                     Q8_0 linears; token_embd, output F32
    int4_g32     int4 g32 linears                     Q4_0 linears; token_embd, output F32
    int8_all     + lm_head and embedding quantized    Q8_0, all tensors
    int4_g32_all + lm_head and embedding quantized    Q4_0, all tensors

(llama.cpp's Q4_K_M has no llmkit layout that is the same weights: a line says so.)

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

Without llama_cpp importable, one line says the peer is missing and llmkit is measured alone.

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

from _common import emit, emit_paired_ratio, llama_134m, load_average, machine

VARIANTS = {  # name -> (bits, quantize lm_head and embedding) or None for float32
    "float32": None,
    "int8": (8, False),
    "int4_g32": (4, False),
    "int8_all": (8, True),
    "int4_g32_all": (4, True),
}
GGUF_NAMES = {"float32": "F32", "int8": "Q8_0", "int4_g32": "Q4_0", "int8_all": "Q8_0_all"}
GGUF_NAMES["int4_g32_all"] = "Q4_0_all"


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


def build_files(work: Path, variants: list[str], act_bits: int) -> dict[str, tuple[Path, Path]]:
    """Every variant's (static llmkit file, GGUF file), written once into ``work`` (kept across runs)."""
    import llmkit.framework as lf
    from llmkit.cli import main as cli_main
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
        d = base if VARIANTS[v] is None else work / f"{v}_act{act_bits}"
        if not (d / "config.json").is_file():
            bits, everything = VARIANTS[v]
            model = LlamaForCausalLM.from_pretrained(str(base))
            cfg = QuantConfig(bits, 32, True, "rtn", "float16", act_bits=act_bits)
            quantize_model(model, cfg, lm_head=everything, embed=everything, progress=False)
            save_quantized(model, base, d, {})
        files = (d.with_suffix(".llmkit"), d.with_suffix(".gguf"))
        if not files[0].exists():
            assert cli_main(["export", "--model", str(d), "--out", str(files[0]), "--name", v]) == 0
        if not files[1].exists():
            args = ["export", "--model", str(d), "--format", "gguf", "--out", str(files[1]), "--name", v]
            assert cli_main(args) == 0
        out[v] = files
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
        import ctypes

        import llama_cpp as L

        self.L = L
        self._log = L.llama_log_callback(lambda level, text, data: None)  # quiet; kept referenced
        L.llama_log_set(self._log, ctypes.c_void_p(0))
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
    sides = {"llmkit": Llmkit(files[0], max(batches), ctx)}
    if peer:
        sides["llamacpp"] = LlamaCpp(files[1], max(batches), ctx, a.threads)
    names = dict(info, gguf=GGUF_NAMES[v])
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
    names = dict(info, gguf=GGUF_NAMES[v], kv_cache_tokens=a.ctx)
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
    emit("vs_llamacpp", "Q4_K_M_skipped", 0, "", note="llama.cpp's Q4_K_M (6-bit-scaled super-blocks of "
         "256) is no llmkit layout: no same-weights pair")  # fmt: skip
    files = build_files(Path(a.work), a.variants, a.act_bits)
    for v in a.variants:
        if not a.skip_speed:
            speed(v, files[v], a, version is not None, info)
        if not a.skip_load:
            load_and_memory(v, files[v], a, version is not None, info)


if __name__ == "__main__":
    main()
