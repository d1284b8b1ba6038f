"""Loading: how soon a static model file answers, in a fresh process, and what the server holds.

The 134M model (hidden 768, 12 layers, 12 heads, MLP 2048, vocab 32000, untied head, random
weights; the built-in 4096-piece tokenizer) exported as float32, int8 (per channel) and int4
(groups of 32) static model files (``--files``: kept and reused across runs). Every figure is
measured in fresh processes (the kernel cache and the page cache warm: one unmeasured process
first; and Python's bytecode cache, as an installed package has it: ``compileall`` writes each
tree's ``__pycache__`` even under ``PYTHONDONTWRITEBYTECODE``, without which every process compiles
llmkit's source again, about 0.25 s of a server's start on a Zen 3 core), medians over ``--rounds``:

- ``import_s``: ``from llmkit.infer import Engine``;
- ``load_s``: ``Engine.from_static`` (``--max-batch`` 32);
- ``first_answer_s``: then the first request (a 3-token prompt, 2 new tokens: prefill and decode);
- ``ready_s``: load + first answer, the issue's "ready to answer" (target 0.5 s);
- ``serve_cold_start_s``: ``llmkit serve`` spawned -> its first answered completion over HTTP
  (target 1 s), per variant;
- ``serve_rss_MiB`` after start, and ``serve_rss_32_MiB`` after 32 concurrent streams (32-token
  prompts, ``--max-tokens`` new tokens, ``--max-batch 32``) with ``serve_peak_rss_MiB`` (VmHWM).

``--kv-int8``: each server also started with ``--kv-dtype int8`` (its figures ``<variant>_kv_int8_*``,
with the ratios to the float KV cache's of the same round).

``--baseline PATH``: a second source tree (a worktree of main) measured in the same rounds,
alternated with this one (its subprocesses get ``PYTHONPATH=PATH``), with the ratios this / that.
Every line carries the 1-minute load average.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/load.py [--baseline ../main]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from _common import emit, emit_paired_ratio, llama_134m, load_average, machine
from serve_load import free_port, level

VARIANTS = ("float32", "int8", "int4")
ROOT = str(Path(__file__).resolve().parent.parent)

_LOAD = """
import json, sys, time
import llmkit
assert llmkit.__file__.startswith(sys.argv[2]), (llmkit.__file__, sys.argv[2])
t0 = time.perf_counter()
from llmkit.infer import Engine, EngineConfig, SamplingParams
t1 = time.perf_counter()
engine = Engine.from_static(sys.argv[1], EngineConfig(max_batch=32))
t2 = time.perf_counter()
engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_answer_s": t3 - t2, "ready_s": t3 - t1}))
"""


def export(files: Path, variant: str) -> Path:
    out = files / f"{variant}.llmkit"
    if (out / "manifest.json").is_file():
        return out
    import llmkit.framework as lf
    from llmkit.models.llama import LlamaForCausalLM
    from llmkit.quant import QuantConfig, quantize_model
    from llmkit.serve.export import export_model
    from llmkit.train.corpus import builtin_tokenizer

    lf.seed(0)
    cfg = llama_134m()
    model = LlamaForCausalLM(cfg)
    model.eval()
    if variant != "float32":
        bits, group = {"int8": (8, -1), "int4": (4, 32)}[variant]
        quantize_model(model, QuantConfig(bits, group, True, "rtn"))
    return export_model(model, builtin_tokenizer(4096), out, model_name="bench")


def env_for(tree: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": tree}


def compile_bytecode(tree: str) -> None:
    env = {k: v for k, v in env_for(tree).items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", "llmkit"], env=env, cwd=tree, check=True)


def load_times(tree: str, model: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _LOAD, str(model), tree],
        env=env_for(tree),
        cwd=tree,  # python -c and -m put the working directory first on the path
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for process {pid}")


def serve(tree: str, model: Path, streams: int, max_tokens: int, extra: tuple = ()) -> dict[str, float]:
    """Spawn `llmkit serve`, time it to the first answered completion, then its memory before and
    after ``streams`` concurrent streams."""
    port = free_port()
    args = [sys.executable, "-m", "llmkit.cli", "serve", str(model), "--port", str(port)]
    args += ["--max-batch", str(streams), "--served-model-name", "bench", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        args, env=env_for(tree), cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        body = {"model": "bench", "prompt": [1, 2, 3], "max_tokens": 1}
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.01)
        res = {"serve_cold_start_s": time.perf_counter() - t0, "serve_rss_MiB": rss_mib(proc.pid)}
        asyncio.run(level(port, streams, 1, 32, max_tokens))
        res["serve_rss_32_MiB"] = rss_mib(proc.pid)
        res["serve_peak_rss_MiB"] = rss_mib(proc.pid, "VmHWM")
        return res
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=Path, default=Path.home() / ".cache" / "llmkit" / "bench-load")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--baseline", default=None, help="another source tree measured alternately")
    p.add_argument("--kv-int8", action="store_true", help="each server also with --kv-dtype int8")
    a = p.parse_args()
    a.files.mkdir(parents=True, exist_ok=True)
    models = {v: export(a.files, v) for v in a.variants}
    trees = {"this": ROOT, **({"baseline": str(Path(a.baseline).resolve())} if a.baseline else {})}
    for tree in trees.values():  # warm the caches (bytecode, kernels, compiled programs, verified files)
        compile_bytecode(tree)
        for m in models.values():
            load_times(tree, m)
    got: dict[tuple, list[float]] = {}
    loads: list[float] = []
    for _ in range(a.rounds):
        for v, m in models.items():
            for name, tree in trees.items():
                figures = {**load_times(tree, m), **serve(tree, m, a.streams, a.max_tokens)}
                if a.kv_int8:
                    kv8 = serve(tree, m, a.streams, a.max_tokens, ("--kv-dtype", "int8"))
                    figures.update({f"kv_int8_{k}": x for k, x in kv8.items()})
                for k, x in figures.items():
                    got.setdefault((v, k, name), []).append(x)
                loads.append(load_average())
                print(v, name, {k: round(x, 3) for k, x in figures.items()}, file=sys.stderr, flush=True)
    info = {**machine(), "rounds": a.rounds, "load_avg": statistics.median(loads)}
    for (v, k, name), xs in got.items():
        unit = "MiB" if k.endswith("MiB") else "s"
        emit(
            "load",
            f"{v}_{k}",
            statistics.median(xs),
            unit,
            tree=name,
            samples=[round(x, 3) for x in xs],
            **info,
        )
        if k.startswith("kv_int8_"):
            emit_paired_ratio("load", f"{v}_{k}_vs_float_kv", xs, got[(v, k[8:], name)], tree=name, **info)
        if name == "this" and a.baseline:
            emit_paired_ratio("load", f"{v}_{k}_vs_baseline", xs, got[(v, k, "baseline")], **info)


if __name__ == "__main__":
    main()
