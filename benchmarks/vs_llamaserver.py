"""``llmkit serve`` against llama.cpp's own ``llama-server`` on the same weights, with the openai client.

The model and its files are ``vs_llamacpp.py``'s (the 134M Llama, random weights, each variant
exported by ``llmkit export`` as the static model file and as GGUF: F32 / Q8_0 / Q4_0 ...). Every
server of every asked variant runs at once, each on ``--threads`` threads (llmkit: its kernels'
``LLMKIT_CINN_THREADS``; llama-server: ``-t`` and ``-tb``), an idle one waiting without using the
cores (the CPU it took while another was measured is reported as ``idle_cpu_s``):

    llmkit serve FILE.llmkit --max-batch N --max-queue 1024 --served-model-name bench
    llama-server -m FILE.gguf -t T -tb T -np N -cb -c N*SLOT_CTX --no-webui

(N: the largest level; llama-server's ``-c`` is its whole KV cache, ``--slot-ctx`` tokens per
slot, allocated at start in its default float16; llmkit's pool is float32 and committed as blocks
are first used, up to ``--num-blocks``'s default.) Extra flags: ``--llmkit-args`` and
``--llama-server-args``.

At each level, ``c`` closed-loop clients (the openai client's ``AsyncOpenAI``, streaming,
token-id prompts of ``--prompt-len``, ``max_tokens`` ``--new-tokens``, ``ignore_eos``, temperature
0) send their requests back to back; output tokens/s is the completion tokens the usage chunks
report (checked: every request gets exactly ``--new-tokens``) over the level's wall time. Levels run
in rounds, every server once per level per round, the order rotated each round; figures are medians
over rounds and ratios the median of the per-round ratios (the two measured in the same minute).

Figures (one JSON line each, with the 1-minute load average of every round):

- ``<v>_cold_start_s_<side>``: spawn to the first answered completion;
- ``<v>_c<c>_<side>``: output tokens/s at ``c`` streams, the server's CPU seconds per output
  token beside it; ``<v>_c<c>_ratio``: llmkit / llama-server;
- ``<a>_over_<b>_c<c>_<side>``: one variant's tokens/s over another's on the same server (int4 g32
  over float32 is the issue's target);
- ``<v>_rss_MB_<side>`` / ``<v>_peak_MB_<side>``: the server's VmRSS after the rounds and its
  VmHWM; ``<v>_rss_MB_ratio``.

Run (llama-server built from llama-cpp-python 0.3.36's vendor/llama.cpp, docs/quantize.md):
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/vs_llamaserver.py \\
        --llama-server /path/to/llama-server [--variants float32 int4_g32 int8]
Without ``--llama-server`` llmkit's servers are measured alone.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shlex
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _common import emit, emit_paired_ratio, load_average, machine
from serve_load import _loop_factory, client_prompts, free_port, launch, start
from vs_llamacpp import VARIANTS, build_files, set_threads

MODEL = "bench"  # the name both servers answer to (llama-server serves whatever is asked)


class Server:
    """One running server: its process, port and CPU time so far."""

    def __init__(self, variant: str, side: str, proc: subprocess.Popen, port: int, cold: float) -> None:
        self.variant, self.side, self.proc, self.port, self.cold = variant, side, proc, port, cold

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def memory_MB(self) -> dict[str, float]:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kv = dict(line.split(":", 1) for line in f)
        return {k: int(kv[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_servers(files: dict[str, tuple[Path, Path]], a: argparse.Namespace, logs: Path) -> list[Server]:
    n = max(a.concurrency)
    servers = []
    for v, (static, gguf) in files.items():
        port = free_port()
        extra = ("--served-model-name", MODEL, *shlex.split(a.llmkit_args))
        proc, cold = start(static, port, n, extra)
        servers.append(Server(v, "llmkit", proc, port, cold))
        if a.llama_server:
            if gguf is None:
                raise SystemExit(
                    f"{v}: no GGUF (llama.cpp's Python bindings make it: use a Python with llama_cpp)"
                )
            port = free_port()
            cmd = [a.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                   "-t", str(a.threads), "-tb", str(a.threads), "-np", str(n), "-cb",
                   "-c", str(n * a.slot_ctx), "--no-webui", *shlex.split(a.llama_server_args)]  # fmt: skip
            proc, cold = launch(cmd, port, MODEL, log=logs / f"llama-server-{v}.log")
            servers.append(Server(v, "llama-server", proc, port, cold))
    return servers


async def openai_level(port: int, c: int, per_client: int, prompt_len: int, new_tokens: int) -> dict:
    """``c`` streaming clients, each sending its ``per_client`` requests back to back."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900)
    got: list[int] = []

    async def one(prompts: list[list[int]]) -> None:
        for p in prompts:
            stream = await client.completions.create(
                model=MODEL, prompt=p, max_tokens=new_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            if usage is None or usage.completion_tokens != new_tokens:
                raise RuntimeError(f"port {port}: asked {new_tokens} tokens, the usage says {usage}")
            got.append(usage.completion_tokens)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(ps) for ps in client_prompts(c, per_client, prompt_len)))
    finally:
        await client.close()
    return {"tokens": sum(got), "wall": time.perf_counter() - t0}


def run_level(s: Server, c: int, per_client: int, a: argparse.Namespace, new_tokens: int) -> dict:
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(openai_level(s.port, c, per_client, a.prompt_len, new_tokens))


def measure(servers: list[Server], a: argparse.Namespace, info: dict) -> None:
    for s in servers:  # warm: plan the programs of every batch size the levels reach
        run_level(s, 1, 1, a, 8)
        run_level(s, max(a.concurrency), 1, a, 4)
    tps: dict[tuple[int, int], list[float]] = {(c, i): [] for c in a.concurrency for i in range(len(servers))}
    cpu: dict[tuple[int, int], list[float]] = {k: [] for k in tps}
    idle: list[float] = []
    loads = []
    for r in range(a.rounds):
        order = list(range(len(servers)))
        order = order[r % len(order) :] + order[: r % len(order)]  # rotate who goes first
        for c in a.concurrency:
            per_client = max(a.requests_per_client, -(-a.min_requests // c))
            for i in order:
                before = [s.cpu_s() for s in servers]
                res = run_level(servers[i], c, per_client, a, a.new_tokens)
                used = [s.cpu_s() - b for s, b in zip(servers, before)]
                tps[(c, i)].append(res["tokens"] / res["wall"])
                cpu[(c, i)].append(used[i] / res["tokens"])
                idle.append(sum(used) - used[i])
        loads.append(load_average())
    for i, s in enumerate(servers):
        extra = dict(info, gguf=VARIANTS[s.variant].gguf, load_1min=loads)
        emit("vs_llamaserver", f"{s.variant}_cold_start_s_{s.side}", s.cold, "s", **extra)
        for c in a.concurrency:
            emit("vs_llamaserver", f"{s.variant}_c{c}_{s.side}", statistics.median(tps[(c, i)]), "tokens/s",
                 per_round=[round(t, 1) for t in tps[(c, i)]], concurrency=c,
                 cpu_ms_per_token=round(statistics.median(cpu[(c, i)]) * 1e3, 2), **extra)  # fmt: skip
        mem = s.memory_MB()
        emit("vs_llamaserver", f"{s.variant}_rss_MB_{s.side}", mem["VmRSS"], "MB", **extra)
        emit("vs_llamaserver", f"{s.variant}_peak_MB_{s.side}", mem["VmHWM"], "MB", **extra)
    emit("vs_llamaserver", "idle_cpu_s_max", max(idle), "s", load_1min=loads,
         note="CPU the servers not measured took during a level (0: they waited off the cores)")  # fmt: skip
    index = {(s.variant, s.side): i for i, s in enumerate(servers)}
    for v in dict.fromkeys(s.variant for s in servers):
        if (v, "llama-server") in index:
            mine, theirs = index[(v, "llmkit")], index[(v, "llama-server")]
            names = dict(gguf=VARIANTS[v].gguf, load_1min=loads)
            for c in a.concurrency:
                emit_paired_ratio("vs_llamaserver", f"{v}_c{c}_ratio", tps[(c, mine)], tps[(c, theirs)],
                                  note="llmkit / llama-server output tokens/s", **names)  # fmt: skip
            rss = [servers[k].memory_MB()["VmRSS"] for k in (mine, theirs)]
            note = "llmkit / llama-server VmRSS"
            emit("vs_llamaserver", f"{v}_rss_MB_ratio", rss[0] / rss[1], "x", note=note, **names)
    for v in ("int4_g32", "int8"):
        for side in ("llmkit", "llama-server"):
            if (v, side) in index and ("float32", side) in index:
                for c in a.concurrency:
                    emit_paired_ratio("vs_llamaserver", f"{v}_over_float32_c{c}_{side}",
                                      tps[(c, index[(v, side)])], tps[(c, index[("float32", side)])],
                                      load_1min=loads)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=None, help="the llama-server executable (default: llmkit alone)")
    p.add_argument("--variants", nargs="+", default=["float32", "int4_g32"], choices=list(VARIANTS))
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--min-requests", type=int, default=4, help="per level and server at least")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--slot-ctx", type=int, default=128, help="llama-server's KV tokens per slot")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--act-bits", type=int, default=0, choices=[0, 8], help="llmkit's activations (8: int8)")
    p.add_argument("--llmkit-args", default="", help="more flags for llmkit serve")
    p.add_argument("--llama-server-args", default="", help="more flags for llama-server")
    p.add_argument("--work", default="/tmp/llmkit_vs_llamacpp", help="where the model files are kept")
    a = p.parse_args()
    if a.slot_ctx < a.prompt_len + a.new_tokens:
        p.error(f"--slot-ctx {a.slot_ctx} holds no request of {a.prompt_len} + {a.new_tokens} tokens")
    if a.llama_server and not os.access(a.llama_server, os.X_OK):
        p.error(f"--llama-server {a.llama_server}: not an executable file")
    set_threads(a.threads)
    info = dict(threads=a.threads, act_bits=a.act_bits, prompt_len=a.prompt_len, new_tokens=a.new_tokens)
    info.update(machine())
    emit("vs_llamaserver", "load_average_1min", load_average(), "load", llama_server=a.llama_server, **info)
    peer = importlib.util.find_spec("llama_cpp") is not None  # it makes the Q4_K_M file
    files = build_files(Path(a.work), a.variants, a.act_bits, peer, a.threads)
    with tempfile.TemporaryDirectory() as logs:
        servers = start_servers(files, a, Path(logs))
        try:
            measure(servers, a, info)
        finally:
            for s in servers:
                s.stop()


if __name__ == "__main__":
    main()
