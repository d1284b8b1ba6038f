"""Training throughput (tokens/s, MFU) and peak memory of one train step on a config's model.

Random token batches of the config's batch_size x seq_len (throughput does not depend on the text).
Modes: eager (tape autograd); static (the whole step as one traced program, ``--compiler cinn``
fused and compiled, or ``none``), which also times eager in the same run for the ratio.
``--device gpu`` runs every variant on the GPU (cupy; PyTorch on CUDA), where one exists.
``--profile`` breaks one step of each mode down instead (one JSON line per part, seconds per step
and share; below).
``--set section.key=value`` overrides the config (``benchmarks/gpu_check.sh`` times a ~134M model:
``model.hidden_size=768 model.num_hidden_layers=12 ...``).
``--plain-gemms`` (static, cinn) also times the compiled step with its products as traced: without
the ``merge-gemms`` pass and on OpenBLAS's own threads (``compiler/native/products.py`` off),
interleaved, for the same-run ratio of both.
``--torch`` also times Hugging Face transformers on PyTorch in the same process (``--torch-model
small``: the small equivalent Llama of ``torch_llama.py`` instead), ``--torch-compile`` also the
same model under ``torch.compile``; ``--torch-tuned``
does so with PyTorch "at its best" as the issue measured it: MKL's check for an Intel CPU answered
yes (a one-function shim, built here with the C compiler and preloaded by re-executing this script;
MKL otherwise takes slow generic paths on AMD) and glibc's malloc thresholds raised (the executor
raises them for the whole process before any step is timed). ``--torch-tuned`` then also times
each alone, in a process of its own, ours and PyTorch alternated ``--rounds`` times so that both
see the same stretches of this drifting machine (``..._own_process``, medians).
``--paddle`` also times PaddlePaddle on the same model, optimizer, batches and thread count
(``paddle_llama.py``, dygraph and ``paddle.jit.to_static``) in a Python of its own
(``--paddle-python``, default ``/work/venv-paddle/bin/python``; missing: one ``paddle_peer_missing``
line), ours and Paddle's steps in ``--rounds`` alternated blocks; MKL, Paddle's CPU BLAS, gets the
same Intel-CPU shim (``--paddle-as-shipped``: not). Its warm-up losses (first ~ ln(vocab), then
falling) come as a sanity check; ratios ``eager_over_paddle_dygraph``, ``static_*_over_paddle_to_static``.

``--profile``: every op's kernel timed (``dispatch.profiling``; compiled steps then run op by op,
not replayed) and sorted into parts: ``matmul`` (BLAS; its GFLOP/s against a 2048-wide float32
numpy matmul timed in the same run), ``attention``, ``elementwise_norm`` (fused groups in static,
elementwise/reduce/normalization ops in eager), ``copies`` (movement ops: reshape, transpose,
gather...), ``optimizer`` (clip + AdamW: in eager timed around it, in static as the same step
compiled without its forward and backward), and ``overhead``: the profiled steps' time less every
kernel's (Python dispatch, autograd bookkeeping, the executor, allocation outside kernels). Shares
are of the profiled steps' time; ``step_s`` is the unprofiled (replayed) step's.
Page faults per step (minor: fresh pages the allocator asked the OS for) come with it.

Run:
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/train_throughput.py
"""

from __future__ import annotations

# _common first (stdlib only; puts the repository on sys.path), then llmkit before numpy: llmkit sets
# OpenBLAS's thread timeout, which OpenBLAS reads when numpy loads it
# isort: off
import _common  # noqa: F401
import llmkit  # noqa: F401

# isort: on
import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np
from _common import emit, emit_paired_ratio, machine

import llmkit.framework as lf
from llmkit.framework import optim
from llmkit.framework.memory import keep_freed_memory
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.train.config import load_config
from llmkit.train.metrics import matmul_peak_flops


def model_config(cfg) -> LlamaConfig:
    overrides = cfg.model.overrides()
    return LlamaConfig.from_preset(cfg.model.preset, **{"vocab_size": 4096, **overrides})


def eager_step_fn(llama: LlamaConfig, lr: float):
    lf.seed(0)
    model = LlamaForCausalLM(llama)
    opt = optim.AdamW(model.parameters(), lr=lr)

    def step(x, y):
        loss = model.loss(lf.tensor(x), lf.tensor(y))
        loss.backward()
        optim.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def static_step_fn(llama: LlamaConfig, lr: float, compiler: str):
    from llmkit.framework import jit

    lf.seed(0)
    model = LlamaForCausalLM(llama)
    opt = optim.AdamW(model.parameters(), lr=lr)
    params = model.parameters()

    def step(x, y):
        loss = model.loss(x, y)
        loss.backward()
        optim.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    spec = jit.InputSpec(["B", "S"], "int64")
    run = jit.to_static(step, input_spec=[spec, spec], compiler=compiler)

    def call(x, y):
        opt.sync_lr()  # a compiled step replays tensor math only: copy the (scheduled) lr in first
        return run(lf.tensor(x), lf.tensor(y)).item()

    return call


def reference_kernels(step):
    """``step`` with every eager op on its reference kernel (none of the compiler's C kernels): eager
    as it ran before eager ops took those up, timed in the same run for the ratio."""
    from llmkit.framework import dispatch

    def call(x, y):
        native, dispatch._native = dispatch._native, None
        try:
            return step(x, y)
        finally:
            dispatch._native = native

    return call


def torch_step_fn(
    llama: LlamaConfig,
    lr: float,
    device: str = "cpu",
    model_kind: str = "transformers",
    compile: bool = False,
):
    import torch

    torch.manual_seed(0)
    dev = "cuda" if device == "gpu" else "cpu"
    if model_kind == "small":
        from torch_llama import TorchLlama

        model = TorchLlama(llama).to(dev)
        forward = model
    else:
        import transformers

        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama.to_dict())).to(dev)
        forward = lambda ids: model(ids).logits
    if compile and model_kind == "small":
        for layer in model.layers:  # regional compilation: the identical blocks share one compiled graph
            layer.compile()
    elif compile:
        forward = torch.compile(forward)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    lossf = torch.nn.CrossEntropyLoss()

    def step(x, y):
        logits = forward(torch.from_numpy(x).to(dev))
        loss = lossf(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y).to(dev).reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


_MKL_SHIM = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"


def mkl_shim_env() -> dict[str, str]:
    """This process's environment with MKL's Intel-CPU check answered yes: the shim built with the C
    compiler and preloaded (LD_PRELOAD, read when a process starts)."""
    out = os.path.join(tempfile.mkdtemp(prefix="llmkit_mkl_shim"), "llmkit_mkl_shim.so")
    src = out[:-3] + ".c"
    with open(src, "w") as f:
        f.write(_MKL_SHIM)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", out, src], check=True)
    return dict(os.environ, LD_PRELOAD=":".join(filter(None, [out, os.environ.get("LD_PRELOAD")])))


def preload_mkl_shim() -> None:
    """Re-execute this script with the MKL shim preloaded; returns only when that is already the case."""
    if "llmkit_mkl_shim" in os.environ.get("LD_PRELOAD", ""):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], mkl_shim_env())


PADDLE_PYTHON = "/work/venv-paddle/bin/python"


class PaddlePeer:
    """``benchmarks/paddle_llama.py`` in ``python`` (a Python with paddle installed), the same model,
    optimizer, batches and thread count as ours: built and warmed up on start, then
    ``run(i, j)`` -> seconds per step of batches i..j-1 for ``paddle_dygraph`` and
    ``paddle_to_static``. MKL (Paddle's CPU BLAS) gets the Intel-CPU shim unless ``as_shipped``."""

    def __init__(
        self,
        python: str,
        llama: LlamaConfig,
        adamw: dict,
        batches,
        warmup: int,
        threads: int,
        as_shipped: bool,
    ) -> None:
        self.dir = tempfile.mkdtemp(prefix="llmkit_paddle_peer")
        data = os.path.join(self.dir, "batches.npz")
        np.savez(data, x=np.stack([x for x, _ in batches]), y=np.stack([y for _, y in batches]))
        model = {**llama.to_dict(), "rope_inv_freq": llama.rope_inv_freq().tolist()}
        spec = {"model": model, "optim": {**adamw, "clip": 1.0}, "warmup": warmup, "batches": data}
        spec_path = os.path.join(self.dir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        if as_shipped:  # without the shim, also where --torch-tuned preloaded it into this process
            kept = [
                x for x in os.environ.get("LD_PRELOAD", "").split(":") if x and "llmkit_mkl_shim" not in x
            ]
            env = dict(os.environ, LD_PRELOAD=":".join(kept))
        else:
            env = mkl_shim_env()
        n = str(threads)  # Paddle itself defaults to one thread (FLAGS_paddle_num_threads=1)
        env = dict(
            env, OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, FLAGS_paddle_num_threads=n, GLOG_minloglevel="2"
        )
        env.pop("PYTHONPATH", None)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paddle_llama.py")
        self.log = open(os.path.join(self.dir, "stderr.log"), "w+")  # noqa: SIM115 (the peer's lifetime)
        self.proc = subprocess.Popen(
            [python, script, spec_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.ready = self._answer()

    def _answer(self) -> dict:
        for line in self.proc.stdout:  # Paddle prints banners of its own: the answer is the JSON line
            if line.startswith("{"):
                return json.loads(line)
        self.log.seek(0)
        tail = self.log.read()[-2000:]
        raise RuntimeError(f"the Paddle peer ({self.proc.args[0]}) stopped without answering:\n{tail}")

    def run(self, i: int, j: int) -> dict[str, list[float]]:
        self.proc.stdin.write(json.dumps({"run": [i, j]}) + "\n")
        self.proc.stdin.flush()
        return {f"paddle_{k}": v for k, v in self._answer().items()}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.log.close()


def paddle_peer(a: argparse.Namespace, llama: LlamaConfig, lr: float, batches) -> PaddlePeer | None:
    """The Paddle peer started, or None (with one JSON line saying so) when its Python is missing."""
    import inspect

    from llmkit.framework.compiler.build import CPUS

    python = a.paddle_python or PADDLE_PYTHON
    if not os.path.isfile(python):
        emit(
            "train_throughput",
            "paddle_peer_missing",
            0.0,
            "",
            python=python,
            note="no Paddle peer: install paddlepaddle into a venv, pass its python as --paddle-python",
        )
        return None
    # our steps' AdamW: the lr given, the rest its defaults
    defaults = {k: v.default for k, v in inspect.signature(optim.AdamW).parameters.items() if k != "params"}
    adamw = {**defaults, "lr": lr, "betas": list(defaults["betas"])}
    t0 = time.perf_counter()
    peer = PaddlePeer(python, llama, adamw, batches, a.warmup, CPUS, a.paddle_as_shipped)
    r = peer.ready
    dy, st = r["losses"]["dygraph"], r["losses"]["to_static"]
    emit(
        "train_throughput",
        "paddle_first_loss",
        dy[0],
        "nats",
        ln_vocab=round(r["ln_vocab"], 4),
        dygraph_losses=[round(v, 4) for v in dy],
        to_static_losses=[round(v, 4) for v in st],
        decreasing=all(later < earlier for ls in (dy, st) for earlier, later in itertools.pairwise(ls)),
        dygraph_to_static_max_diff=max(abs(b - c) for b, c in zip(dy, st)),
        note="warm-up steps, all on batch 0: the first ~ ln(vocab), then falling",
    )
    emit(
        "train_throughput",
        "paddle_start_s",
        time.perf_counter() - t0,
        "s",
        paddle=r["paddle"],
        threads=r["threads"],
        cpu_per_wall=round(r["cpu_per_wall"], 2),
        mkl_intel_path=not a.paddle_as_shipped,
        first_step_s={k: round(v, 2) for k, v in r["first_step_s"].items()},
    )
    return peer


def alone(a: argparse.Namespace) -> None:
    """One variant's steps only, in this process (``--alone torch`` / ``--alone static``, started by
    --torch-tuned): prints its tokens/s."""
    keep_freed_memory()
    cfg = load_config(a.config, a.set)
    llama = model_config(cfg)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    rng = np.random.default_rng(0)
    if a.alone == "torch":
        step = torch_step_fn(llama, cfg.optim.lr, model_kind=a.torch_model)
    else:
        step = static_step_fn(llama, cfg.optim.lr, a.compiler)
    times = []
    for i in range(a.warmup + a.steps):
        x, y = rng.integers(0, llama.vocab_size, (b, s)), rng.integers(0, llama.vocab_size, (b, s))
        t = time.perf_counter()
        step(x, y)
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
    print(b * s / float(np.median(times)), flush=True)


def own_process(a: argparse.Namespace, which: str) -> float:
    """Tokens/s of one variant alone in a process of its own."""
    cmd = [sys.executable, sys.argv[0], "--alone", which, "--config", a.config, "--steps", str(a.steps)]
    cmd += ["--warmup", str(a.warmup), "--compiler", a.compiler, "--torch-model", a.torch_model]
    cmd += ["--set", *a.set] if a.set else []  # the same model as the same-run figures
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def alternated_alone(a: argparse.Namespace, rounds: int) -> tuple[list[float], list[float]]:
    """Ours (static + compiler) and PyTorch each alone in a process of its own, alternated
    ``rounds`` times, so that both see the same stretches of this drifting machine."""
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(own_process(a, "static"))
        theirs.append(own_process(a, "torch"))
    return ours, theirs


def _part(label: str) -> str:
    """The breakdown part of a profiled op label (``llm.matmul``, ``cinn.fusion[rms_norm]``...)."""
    from llmkit.framework.opspec import Kind, get

    if "attention" in label:
        return "attention"
    if label.startswith("cinn.fusion"):
        return "elementwise_norm"
    kind = get(label[4:].split("[")[0]).kind
    return {Kind.CONTRACTION: "matmul", Kind.MOVEMENT: "copies"}.get(kind, "elementwise_norm")


def _faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def profile(a: argparse.Namespace, llama: LlamaConfig, cfg, batches) -> None:
    """One JSON line per part of a step, for eager and for the compiled step (see the docstring)."""
    from llmkit.framework import dispatch, jit

    n = 2048
    m = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    m @ m
    peak = max(2 * n**3 / _timed(lambda: m @ m) for _ in range(3))
    emit("train_profile", "matmul_peak_gflops", peak / 1e9, "GFLOP/s", n=n, **machine())
    emit("train_profile", "load_average_1min", os.getloadavg()[0], "")
    b, s = cfg.train.batch_size, cfg.train.seq_len
    for mode in ("eager", "static"):
        lf.seed(0)
        model = LlamaForCausalLM(llama)
        params = model.parameters()
        opt = optim.AdamW(params, lr=cfg.optim.lr)

        def fwd_bwd(x, y):
            model.loss(x, y).backward()

        def opt_only():
            optim.clip_grad_norm_(params, 1.0)
            opt.step()

        def step(x, y):
            fwd_bwd(x, y)
            opt_only()
            opt.zero_grad()

        if mode == "static":
            spec = jit.InputSpec(["B", "S"], "int64")
            full = jit.to_static(step, input_spec=[spec, spec], compiler=a.compiler)
            opt_static = jit.to_static(opt_only, input_spec=[], compiler=a.compiler)

            def run(x, y):
                opt.sync_lr()
                full(lf.tensor(x), lf.tensor(y))

            def run_opt():
                opt.sync_lr()
                opt_static()
        else:

            def run(x, y):
                step(lf.tensor(x), lf.tensor(y))

            run_opt = opt_only
        for x, y in batches[: a.warmup]:
            run(x, y)
        plain, faults = [], []
        for x, y in batches[a.warmup :]:
            f0, t0 = _faults(), time.perf_counter()
            run(x, y)
            plain.append(time.perf_counter() - t0)
            faults.append(_faults() - f0)
        profiled = []  # wall time of the profiled steps: what their kernels are a part of
        with dispatch.profiling() as table:
            for x, y in batches[a.warmup :]:
                profiled.append(_timed(lambda: run(x, y)))
        # the optimizer alone (static: compiled alone), repeated on the gradients of one backward
        fwd_bwd(*map(lf.tensor, batches[0]))
        run_opt()
        opt_wall = [_timed(run_opt) for _ in batches[a.warmup :]]
        with dispatch.profiling() as opt_kernels:
            for _ in batches[a.warmup :]:
                run_opt()
        nsteps = len(batches) - a.warmup
        step_s = float(np.median(plain))
        parts: dict[str, float] = dict.fromkeys(("matmul", "attention", "elementwise_norm", "copies"), 0.0)
        flops = 0.0
        for label, (sec, _, fl) in table.items():
            parts[_part(label)] += sec / nsteps
            flops += fl / nsteps
        opt_k = sum(v[0] for v in opt_kernels.values()) / nsteps
        if mode == "static":  # its kernels ran inside the step too, counted as elementwise_norm
            parts["elementwise_norm"] = max(0.0, parts["elementwise_norm"] - opt_k)
            parts["optimizer"] = opt_k
        else:
            parts["optimizer"] = float(np.median(opt_wall))
            for k, v in opt_kernels.items():  # measured above inside the optimizer's time
                parts[_part(k)] -= v[0] / nsteps
        wall = float(np.mean(profiled))
        parts["overhead"] = wall - sum(parts.values())
        emit(
            "train_profile",
            f"{mode}_step_s",
            step_s,
            "s",
            tokens_per_s=round(b * s / step_s, 1),
            minor_page_faults=int(np.median(faults)),
            steps=nsteps,
        )
        for part, sec in parts.items():
            extra = {}
            if part == "matmul" and sec > 0:
                extra = {"gflops": round(flops / sec / 1e9, 1), "of_peak": round(flops / sec / peak, 3)}
            if part == "optimizer":
                extra = {"kernels_s": round(opt_k, 4)}
            emit("train_profile", f"{mode}_{part}_s", sec, "s", share=round(sec / wall, 3), **extra)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure_interleaved(
    steps: dict, batches, warmup: int, peer: PaddlePeer | None = None, rounds: int = 1
) -> dict[str, list[list[float]]]:
    """Seconds per step of each variant, per round, their steps interleaved batch by batch, so that
    every variant sees the same machine (this shared 2-core VM drifts by 10-30% between minutes).
    With a peer in another process, each round's batches run here and then there (after a pause in
    which the idle side's spinning threads go to sleep): ``rounds`` alternated blocks."""
    for x, y in batches[:warmup]:
        for step in steps.values():
            step(x, y)
    times: dict[str, list[list[float]]] = {name: [] for name in steps}
    for block in np.array_split(np.arange(warmup, len(batches)), rounds if peer else 1):
        for name in steps:
            times[name].append([])
        for k in block:
            for name, step in steps.items():
                t = time.perf_counter()
                step(*batches[k])
                times[name][-1].append(time.perf_counter() - t)
        if peer is not None:
            time.sleep(0.5)
            for name, ts in peer.run(int(block[0]), int(block[-1]) + 1).items():
                times.setdefault(name, []).append(ts)
            time.sleep(0.5)
    return times


def peak_memory(step, batch) -> float:
    """Peak traced allocation (MiB) over one step after a warm-up step."""
    step(*batch)
    tracemalloc.start()
    step(*batch)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/bench.yaml")
    p.add_argument("--mode", default="eager", choices=["eager", "static"])
    p.add_argument("--compiler", default="cinn", choices=["cinn", "none"], help="for --mode static")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--torch", action="store_true", help="also time transformers on PyTorch (same process)")
    p.add_argument("--torch-model", default="transformers", choices=["transformers", "small"])
    p.add_argument("--torch-compile", action="store_true", help="--torch, also under torch.compile")
    p.add_argument("--torch-tuned", action="store_true", help="--torch, with MKL's vendor check patched")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="alternated own-process runs (--torch-tuned) or blocks (--paddle)",
    )
    p.add_argument("--paddle", action="store_true", help="also time the Paddle peer (paddle_llama.py)")
    p.add_argument("--paddle-python", help=f"a Python with paddle installed (default {PADDLE_PYTHON})")
    p.add_argument("--paddle-as-shipped", action="store_true", help="--paddle: MKL without the Intel shim")
    p.add_argument("--eager-reference", action="store_true", help="also eager on the reference kernels")
    p.add_argument("--profile", action="store_true", help="a breakdown of each mode's step, per part")
    p.add_argument(
        "--plain-gemms", action="store_true", help="static: also cinn with OpenBLAS's GEMMs as traced"
    )
    p.add_argument("--alone", choices=["torch", "static"], help=argparse.SUPPRESS)  # an own-process run
    a = p.parse_args()
    if a.alone:
        alone(a)
        return
    if a.paddle and (a.device != "cpu" or a.profile):
        p.error("--paddle times the CPU step (Paddle's CPU wheel): not with --device gpu or --profile")
    if a.torch_tuned:
        preload_mkl_shim()
        a.torch = True
    a.torch = a.torch or a.torch_compile
    torch_name = "torch_eager_tuned" if a.torch_tuned else "torch_eager"
    keep_freed_memory()  # every variant under the allocator settings the executor uses
    lf.set_device(a.device)
    cfg = load_config(a.config, a.set)
    llama = model_config(cfg)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    rng = np.random.default_rng(0)
    batches = [
        (rng.integers(0, llama.vocab_size, (b, s)), rng.integers(0, llama.vocab_size, (b, s)))
        for _ in range(a.warmup + a.steps)
    ]
    if a.profile:
        profile(a, llama, cfg, batches)
        return
    peak = matmul_peak_flops(a.device)
    fpt = llama.flops_per_token(s)
    emit(
        "train_throughput",
        "matmul_peak_gflops",
        peak / 1e9,
        "GFLOP/s",
        params=llama.num_parameters(),
        batch=b,
        seq_len=s,
        device=a.device,
        overrides=a.set,
        **machine(),
    )
    emit("train_throughput", "load_average_1min", os.getloadavg()[0], "")
    steps = {"eager": eager_step_fn(llama, cfg.optim.lr)}
    if a.eager_reference:
        steps["eager_reference_kernels"] = reference_kernels(eager_step_fn(llama, cfg.optim.lr))
    if a.mode == "static":
        # the plain static program (the to_static figure), then with the requested compiler
        for compiler in dict.fromkeys(["none", a.compiler]):
            t0 = time.perf_counter()
            step = steps[f"static_{compiler}"] = static_step_fn(llama, cfg.optim.lr, compiler)
            step(*batches[0])  # trace (and fuse, compile, tune: cached afterwards)
            emit("train_throughput", f"static_{compiler}_first_step_s", time.perf_counter() - t0, "s")
        if a.plain_gemms and a.compiler == "cinn":  # the baseline of merge-gemms and row products
            from llmkit.framework.compiler import merge_gemms
            from llmkit.framework.compiler.native import products

            kept = merge_gemms.enabled, products.enabled  # as the environment set them
            merge_gemms.enabled = products.enabled = False
            step = steps["static_cinn_plain_gemms"] = static_step_fn(llama, cfg.optim.lr, "cinn")
            step(*batches[0])
            merge_gemms.enabled, products.enabled = kept
    if a.torch:
        steps[torch_name] = torch_step_fn(llama, cfg.optim.lr, a.device, a.torch_model)
    if a.torch_compile:
        t0 = time.perf_counter()
        step = steps["torch_compiled"] = torch_step_fn(llama, cfg.optim.lr, a.device, a.torch_model, True)
        step(*batches[0])  # dynamo + inductor compile the forward and backward
        emit("train_throughput", "torch_compiled_first_step_s", time.perf_counter() - t0, "s")
    peer = paddle_peer(a, llama, cfg.optim.lr, batches) if a.paddle else None
    times = measure_interleaved(steps, batches, a.warmup, peer, a.rounds)
    if peer is not None:
        peer.close()
    medians = {name: float(np.median(np.concatenate(ts))) for name, ts in times.items()}
    tps = {name: b * s / sec for name, sec in medians.items()}
    for name, sec in medians.items():
        emit(
            "train_throughput",
            f"{name}_tokens_per_s",
            tps[name],
            "tokens/s",
            step_ms=round(sec * 1e3, 1),
            mfu=round(tps[name] * fpt / peak, 4),
            steps=a.steps,
        )
    if a.eager_reference:
        emit(
            "train_throughput",
            "eager_over_eager_reference_kernels",
            tps["eager"] / tps["eager_reference_kernels"],
            "x",
            note="the compiler's C kernels in eager ops, same run",
        )
    for name in steps:
        if name.startswith("static"):
            emit("train_throughput", f"{name}_over_eager", tps[name] / tps["eager"], "x", target=2.0)
    if "static_cinn_plain_gemms" in tps:
        ratio = tps["static_cinn"] / tps["static_cinn_plain_gemms"]
        emit(
            "train_throughput",
            "static_cinn_over_plain_gemms",
            ratio,
            "x",
            note="merged, row-block GEMMs / not",
        )
    for name, step in steps.items():
        if not name.startswith("torch") and a.device == "cpu":  # host memory (tracemalloc)
            emit("train_throughput", f"{name}_peak_memory_mib", peak_memory(step, batches[0]), "MiB")
    name = "eager" if a.mode == "eager" else f"static_{a.compiler}"
    best = tps[name]
    # figures from the issue, measured on its machine kind (PyTorch eager as shipped / tuned, torch.compile)
    ref = {
        "torch_2.13_eager_as_shipped": 5300.0,
        "torch_2.13_eager_tuned": 10800.0,
        "torch_compile_tuned": 11700.0,
    }
    if a.device == "cpu":  # the figures are for this machine kind's CPU
        for k, v in ref.items():
            emit("train_throughput", f"{name}_over_{k}", best / v, "x", reference_tokens_per_s=v)
    # the ceiling here: every training FLOP at this machine's measured matmul peak
    emit("train_throughput", "tokens_per_s_at_matmul_peak", peak / fpt, "tokens/s", note="100% MFU bound")
    if a.torch_tuned and a.mode == "static":
        ours, theirs = alternated_alone(a, a.rounds)
        for label, runs in (("static_" + a.compiler, ours), ("torch_eager_tuned", theirs)):
            emit(
                "train_throughput",
                f"{label}_own_process_tokens_per_s",
                float(np.median(runs)),
                "tokens/s",
                runs=[round(r, 1) for r in runs],
            )
        emit_paired_ratio(
            "train_throughput",
            f"{name}_over_torch_eager_tuned_own_process",
            ours,
            theirs,
            target=1.0,
            note="each alone in its own process, alternated",
        )
    if a.torch:
        emit(
            "train_throughput",
            f"{name}_over_{torch_name}_same_run",
            best / tps[torch_name],
            "x",
            **({"target": 1.0} if a.torch_tuned else {}),
            note=f"{a.torch_model} Llama on PyTorch, same process, steps interleaved",
        )
    if a.torch and name != "eager":
        emit("train_throughput", f"eager_over_{torch_name}_same_run", tps["eager"] / tps[torch_name], "x")
    if peer is not None:
        per_round = {k: [b * s / float(np.median(r)) for r in ts] for k, ts in times.items()}
        pairs = [("eager", "paddle_dygraph")] + [
            (k, "paddle_to_static") for k in steps if k.startswith("static")
        ]
        for ours, theirs in pairs:
            emit_paired_ratio(
                "train_throughput",
                f"{ours}_over_{theirs}_same_run",
                per_round[ours],
                per_round[theirs],
                **({"target": 1.0} if ours == "eager" else {}),
                note=f"Paddle in its own process, {len(times[ours])} alternated blocks of steps",
            )
    if a.torch_compile:
        emit(
            "train_throughput",
            f"{name}_over_torch_compiled_same_run",
            best / tps["torch_compiled"],
            "x",
            note=f"{a.torch_model} Llama under torch.compile, same process, steps interleaved",
        )


if __name__ == "__main__":
    main()
