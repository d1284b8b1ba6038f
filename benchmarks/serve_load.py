"""Load on the running server: output tokens/s, time to first token and inter-token latency.

Exports the bench model (random weights, the built-in 4096-piece tokenizer) unless ``--model-file``
is given, starts ``llmkit serve`` on a free loopback port, measures its cold start (process start to
the first answered request), then runs closed-loop clients at each concurrency: every client sends
streaming completions (token-id prompts, ``ignore_eos``, a fixed ``max_tokens``) back to back.
TTFT is send -> first token chunk; ITL is the gap between consecutive token chunks. Clients run in
this process on the same machine, so they share its cores with the server. Levels run in rounds
(``--rounds``, every level once per round) and the figures are medians over rounds: one level
alone lasts a few seconds, and this VM's speed drifts by 20-40% between minutes.

``--engine-only`` runs the same clients (same prompts, levels and rounds) against the engine the
server would load, stepped in this process without HTTP (``engine_`` figures): the ceiling the
server's own work is measured against.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/serve_load.py [--engine-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _common import emit, emit_paired_ratio, machine


def export_bench_model(out: Path) -> Path:
    import llmkit.framework as lf
    from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
    from llmkit.serve.export import export_model
    from llmkit.train.corpus import builtin_tokenizer

    tok = builtin_tokenizer(4096)
    lf.seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_preset("bench", vocab_size=tok.vocab_size))
    model.eval()
    return export_model(model, tok, out, model_name="bench")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    model_file: Path, port: int, max_batch: int, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, float]:
    """``llmkit serve`` (``extra``: more of its flags) and its cold start in seconds."""
    cmd = [sys.executable, "-m", "llmkit.cli", "serve", str(model_file), "--port", str(port)]
    return launch([*cmd, "--max-batch", str(max_batch), "--max-queue", "1024", *extra], port, "bench")


def launch(cmd: list[str], port: int, model: str, log: Path | None = None) -> tuple[subprocess.Popen, float]:
    """A server process (stderr into ``log``, else a pipe: a quiet server's) and its cold start:
    spawn -> first answered completion of ``model``, in seconds."""
    t0 = time.perf_counter()
    err = subprocess.PIPE if log is None else open(log, "wb")  # noqa: SIM115 (the process holds it)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 1}
    while True:
        if proc.poll() is not None:
            text = proc.stderr.read() if log is None else Path(log).read_bytes()[-4000:]
            raise RuntimeError(f"server exited: {text.decode(errors='replace')}")
        try:
            if httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=5).status_code == 200:
                return proc, time.perf_counter() - t0
        except httpx.HTTPError:
            time.sleep(0.02)


_EMPTY_TEXT = re.compile(rb'"text":\s*""')
_LAST_CHUNK = b"\r\n0\r\n\r\n"  # the end of a chunked body


class StreamClient(asyncio.Protocol):
    """One closed-loop client on one keep-alive HTTP/1.1 connection: it sends streaming completions
    back to back and times their token events as they arrive. A lean load generator, since it shares
    the machine's two cores with the server: the event loop hands it whatever arrived, and it finds
    the SSE events in that without decoding the chunked framing or the JSON, with no stream reader,
    async generator or task wake-up per event (at 32 streams 32-36 us of CPU per token against
    53-57 for reading the same bytes through asyncio's StreamReader)."""

    def __init__(self, host: str, port: int, stats: dict) -> None:
        self.host, self.port, self.stats = host, port, stats
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future | None = None  # the response in flight ends
        self.head: bytes | None = b""  # its status line and headers until they are complete
        self.pending = b""  # the end of what arrived that is not a whole event yet
        self.sent = 0.0
        self.last: float | None = None  # when its last token event arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(exc or RuntimeError("the server closed the connection"))

    async def run(self, path: str, bodies: list[dict]) -> None:
        loop = asyncio.get_running_loop()
        await loop.create_connection(lambda: self, self.host, self.port)
        try:
            for body in bodies:
                data = json.dumps(body).encode()
                head = (
                    f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                )
                self.done = loop.create_future()
                self.head, self.pending, self.last = b"", b"", None
                self.sent = time.perf_counter()
                self.transport.write(head.encode() + data)
                await self.done
                self.stats["tokens"] += body["max_tokens"]
        finally:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter()
        if self.done is None or self.done.done():
            return
        if self.head is not None:  # still reading the status line and headers
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            if not self.head.startswith(b"HTTP/1.1 200"):
                status = self.head.split(b"\r\n", 1)[0]
                self.done.set_exception(RuntimeError(f"server answered {status!r}"))
                return
            data, self.head = self.head[end + 4 :], None
        # Events end with a blank line; the chunk-size lines between them are skipped by looking
        # for "data: ", and the body ends with the last chunk.
        pending = self.pending + data
        *events, self.pending = pending.split(b"\n\n")
        stats = self.stats
        for event in events:
            i = event.find(b"data: ")
            # a token's chunk has text; skip [DONE] and chunks whose text is still held back
            if i < 0 or event[i + 6 : i + 7] != b"{" or _EMPTY_TEXT.search(event, i):
                continue
            if self.last is None:
                stats["ttft"].append(t - self.sent)
            else:
                stats["itl"].append(t - self.last)
            self.last = t
            stats["chunks"] += 1
        if pending.endswith(_LAST_CHUNK):
            self.done.set_result(None)


def client_prompts(concurrency: int, per_client: int, prompt_len: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(concurrency)
    return [
        [rng.integers(3, 4096, prompt_len).tolist() for _ in range(per_client)] for _ in range(concurrency)
    ]


async def level(port: int, concurrency: int, per_client: int, prompt_len: int, max_tokens: int) -> dict:
    stats: dict = {"ttft": [], "itl": [], "tokens": 0, "chunks": 0}
    body = dict(model="bench", max_tokens=max_tokens, ignore_eos=True, temperature=0, stream=True)
    clients = [
        StreamClient("127.0.0.1", port, stats).run("/v1/completions", [{**body, "prompt": q} for q in ps])
        for ps in client_prompts(concurrency, per_client, prompt_len)
    ]
    t0 = time.perf_counter()
    await asyncio.gather(*clients)
    stats["wall"] = time.perf_counter() - t0
    return stats


def _loop_factory() -> Any:
    """uvloop's event loop where it is installed (the serve extra brings it): the clients' CPU per
    token at 32 streams is about a sixth smaller than on asyncio's own loop (31-36 against 40 us)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def engine_level(engine: Any, concurrency: int, per_client: int, prompt_len: int, max_tokens: int) -> dict:
    """``level`` without HTTP: each client's next request goes in as its last one finishes, and
    this thread steps the engine; a token's time is the end of the step that made it."""
    from llmkit.infer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    stats: dict = {"ttft": [], "itl": [], "tokens": 0, "chunks": 0}
    todo = [iter(p) for p in client_prompts(concurrency, per_client, prompt_len)]
    live: dict[str, list] = {}  # request id -> [client, sent, last token time]

    def submit(k: int) -> None:
        prompt = next(todo[k], None)
        if prompt is not None:
            live[engine.add_request(prompt, params)] = [k, time.perf_counter(), None]

    t0 = time.perf_counter()
    for k in range(concurrency):
        submit(k)
    while live:
        outs = engine.step()
        t = time.perf_counter()
        for out in outs:
            st = live[out.request_id]
            if out.new_token_ids:
                stats["ttft" if st[2] is None else "itl"].append(t - (st[1] if st[2] is None else st[2]))
                st[2] = t
                stats["chunks"] += 1
            if out.finished:
                stats["tokens"] += out.num_output_tokens
                del live[out.request_id]
                submit(st[0])
    stats["wall"] = time.perf_counter() - t0
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model-file", type=Path, default=None, help="a model.llmkit (default: export the bench model)"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument(
        "--min-requests", type=int, default=16, help="per level at least (one client's run is short, noisy)"
    )
    p.add_argument("--rounds", type=int, default=5, help="every level once per round; medians over rounds")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--engine-only", action="store_true", help="the same load on the engine, without HTTP")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_file = a.model_file or export_bench_model(Path(tmp) / "bench.llmkit")
        info = dict(prompt_len=a.prompt_len, max_tokens=a.max_tokens, **machine())
        proc = None
        if a.engine_only:
            from llmkit.serve.server import load_engine, parse_args

            engine = load_engine(parse_args([str(model_file), "--max-batch", str(max(a.concurrency))]))
        else:
            port = free_port()
            proc, cold = start(model_file, port, max_batch=max(a.concurrency))
            note = "process start to the first answered request"
            emit("serve_load", "cold_start_s", cold, "s", note=note, **info)

        def run_level(c: int, per_client: int, prompt_len: int, max_tokens: int) -> dict:
            if proc is None:
                return engine_level(engine, c, per_client, prompt_len, max_tokens)
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                return runner.run(level(port, c, per_client, prompt_len, max_tokens))

        prefix = "engine_" if a.engine_only else ""
        emit("serve_load", "load_average_1min", os.getloadavg()[0], "load")
        tps: dict[int, list[float]] = {c: [] for c in a.concurrency}
        runs: dict[int, list[dict]] = {c: [] for c in a.concurrency}
        try:
            run_level(1, 1, a.prompt_len, 8)  # warm-up
            for _ in range(a.rounds):  # every level once per round: each sees the same stretches of the VM
                for c in a.concurrency:
                    per_client = max(a.requests_per_client, -(-a.min_requests // c))
                    s = run_level(c, per_client, a.prompt_len, a.max_tokens)
                    s["requests"] = c * per_client
                    tps[c].append(s["tokens"] / s["wall"])
                    runs[c].append(s)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
        ms = lambda xs, q: round(float(np.percentile(xs, q)) * 1e3, 2)
        for c in a.concurrency:
            every = {k: [x for s in runs[c] for x in s[k]] for k in ("ttft", "itl")}
            emit(
                "serve_load",
                f"{prefix}c{c}_output_tokens_per_s",
                float(np.median(tps[c])),
                "tokens/s",
                concurrency=c,
                rounds=[round(t) for t in tps[c]],
                requests=sum(s["requests"] for s in runs[c]),
                ttft_p50_ms=ms(every["ttft"], 50),
                ttft_p99_ms=ms(every["ttft"], 99),
                itl_p50_ms=ms(every["itl"], 50),
                itl_p99_ms=ms(every["itl"], 99),
                wall_s=round(sum(s["wall"] for s in runs[c]), 2),
                **info,
            )
        if 1 in tps:
            for c in tps:
                if c != 1:
                    emit_paired_ratio("serve_load", f"{prefix}c{c}_over_c1_throughput", tps[c], tps[1])


if __name__ == "__main__":
    main()
