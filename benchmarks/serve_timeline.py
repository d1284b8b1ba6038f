"""Where a streamed token's time goes between the engine and the client: ``llmkit serve`` with
timestamps on every engine step, decode replay, mailbox post and body write, driven by the openai
client (or ``--client raw``: a bare socket reader, the client's own cost taken out).

The server runs in a child process (this file with ``--child``) that wraps, without changing them,
``Engine.step``, ``ModelRunner.decode``, the native replay (``Replays.run``: the one C call of a
decode step), ``_Mailbox.post`` and the streaming response's body ``send``, and samples every
thread's CPU time each 0.2 s; all on CLOCK_MONOTONIC, as the client's receipt times. Per level
(``c`` closed-loop clients, ``--requests`` each, after a warm-up of the same shape), one JSON line
per figure:

- ``c<c>_tokens_per_s``; ``c<c>_engine_busy``: the fraction of the level's wall time inside steps
  (1.0: the engine never waited for the HTTP side);
- ``c<c>_decode_step_ms``, ``c<c>_replay_ms`` and ``c<c>_engine_python_ms``: a step that decodes,
  its decode replay, and the step outside C replays (a prefill chunk's replay in the same step
  left out too: the engine thread's Python, scheduling, binding, sampling, detokenization,
  callbacks), medians;
- ``c<c>_step_end_to_write_ms`` (the hand-off to the event loop and the SSE formatting) and
  ``c<c>_write_to_receipt_ms`` (the socket and the client's parsing), medians;
- ``c<c>_cpu_ms_per_token_<thread>``: CPU per output token of the event loop thread (``loop``),
  the engine thread (``engine``: its kernels' share included), the kernel helpers (``helpers``:
  spinning included) and the ``client`` process.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/serve_timeline.py MODEL.llmkit
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _common import emit, load_average, machine
from serve_load import _loop_factory, free_port, launch


def child(out: str, argv: list[str]) -> int:
    """``llmkit serve argv`` with the timestamps above, written to ``out`` at exit."""
    import starlette.responses as responses

    import llmkit.framework.compiler.native.run as native_run
    import llmkit.serve.serving as serving
    from llmkit.infer.engine import Engine
    from llmkit.infer.runner import ModelRunner
    from llmkit.serve import server

    mono = time.monotonic
    rec: dict = {k: [] for k in ("step", "decode", "replay", "post", "write", "cpu")}

    def timed(cls: type, name: str, key: str, count: bool = False) -> None:
        fn = getattr(cls, name)

        def wrapper(self, *a, **k):
            t0 = mono()
            result = fn(self, *a, **k)
            extra = (sum(len(o.new_token_ids) for o in result), threading.get_native_id()) if count else ()
            rec[key].append((t0, mono(), *extra))
            return result

        setattr(cls, name, wrapper)

    timed(Engine, "step", "step", count=True)
    timed(ModelRunner, "decode", "decode")
    timed(native_run.Replays, "run", "replay")
    post = serving._Mailbox.post
    serving._Mailbox.post = lambda self, q, item: (rec["post"].append(mono()), post(self, q, item))[1]
    stream = responses.StreamingResponse.stream_response

    async def stream_response(self, send):
        async def timed_send(message: dict) -> None:
            await send(message)
            if message["type"] == "http.response.body":
                rec["write"].append(mono())

        return await stream(self, timed_send)

    responses.StreamingResponse.stream_response = stream_response
    tick = os.sysconf("SC_CLK_TCK")

    def sample() -> None:
        while True:
            cpu = {}
            for tid in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{tid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    cpu[tid] = (int(fields[11]) + int(fields[12])) / tick
                except OSError:
                    pass
            rec["cpu"].append((mono(), cpu))
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    try:
        return server.main(argv)
    finally:
        rec["pid"] = os.getpid()
        with open(out, "w") as f:
            json.dump(rec, f)


async def clients(port: int, c: int, requests: int, raw: bool, prompts: list[list[int]]) -> list[tuple]:
    """(send time, [receipt time of each event]) of every request of ``c`` closed-loop clients."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900)
    body = dict(model="bench", max_tokens=64, temperature=0.0, stream=True)
    done = []

    async def one(k: int) -> None:
        for j in range(requests):
            p, t0, times = prompts[(k * requests + j) % len(prompts)], time.monotonic(), []
            if raw:
                data = json.dumps({**body, "prompt": p, "ignore_eos": True}).encode()
                r, w = await asyncio.open_connection("127.0.0.1", port)
                head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(data)}\r\n\r\n"
                w.write(head.encode() + data)
                tail = b""
                while b"[DONE]" not in tail:
                    got = await r.read(65536)
                    if not got:
                        break
                    times += [time.monotonic()] * got.count(b"data:")
                    tail = tail[-8:] + got
                w.close()
            else:
                s = await client.completions.create(
                    prompt=p, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **body
                )
                async for _ in s:
                    times.append(time.monotonic())
            done.append((t0, times))

    await asyncio.gather(*(one(k) for k in range(c)))
    await client.close()
    return done


def figures(rec: dict, reqs: list[tuple], cpu_client: float, tokens: int, c: int, info: dict) -> None:
    lo, hi = min(t0 for t0, _ in reqs), max(ts[-1] for _, ts in reqs)
    med = statistics.median
    steps = [s for s in rec["step"] if lo <= s[0] <= hi]
    engine_tid = str(steps[0][3])
    decodes = [d for d in rec["decode"] if lo <= d[0] <= hi]
    replays = [r for r in rec["replay"] if lo <= r[0] <= hi]
    starts = [r[0] for r in replays]
    python, decode_steps, replay = [], [], []
    for d in decodes:  # the step around each decode, less the replays inside it (prefill's too)
        step = steps[bisect.bisect_right([s[0] for s in steps], d[0]) - 1]
        i = bisect.bisect_left(starts, d[0])
        replay.append(sum(b - a for a, b in replays[i : bisect.bisect_right(starts, d[1])]) * 1e3)
        i = bisect.bisect_left(starts, step[0])
        inside = sum(b - a for a, b in replays[i : bisect.bisect_right(starts, step[1])])
        python.append((step[1] - step[0] - inside) * 1e3)
        decode_steps.append((step[1] - step[0]) * 1e3)
    writes = [w for w in rec["write"] if lo <= w <= hi + 1]
    receipts = sorted(t for _, ts in reqs for t in ts)
    after = [(writes[i] - s[1]) * 1e3 for s in steps if (i := bisect.bisect_left(writes, s[1])) < len(writes)]
    receipt = [
        (receipts[i] - w) * 1e3 for w in writes if (i := bisect.bisect_left(receipts, w)) < len(receipts)
    ]
    wall = hi - lo
    put = dict(info, concurrency=c, load_1min=load_average())
    emit("serve_timeline", f"c{c}_tokens_per_s", tokens / wall, "tokens/s", **put)
    emit("serve_timeline", f"c{c}_engine_busy", sum(b - a for a, b, *_ in steps) / wall, "fraction", **put)
    for name, xs in (("decode_step", decode_steps), ("replay", replay), ("engine_python", python),
                     ("step_end_to_write", after), ("write_to_receipt", receipt)):  # fmt: skip
        emit("serve_timeline", f"c{c}_{name}_ms", med(xs), "ms", mean=round(statistics.mean(xs), 3), **put)
    inner = [s for s in rec["cpu"] if lo <= s[0] <= hi]  # the samples inside the level, scaled to it
    (t0, first), (t1, last) = inner[0], inner[-1]
    scaled = tokens * (t1 - t0) / wall
    used = {tid: last[tid] - first.get(tid, 0.0) for tid in last}
    loop = used.pop(str(rec["pid"]), 0.0)
    engine = used.pop(engine_tid, 0.0)
    for name, s in (
        ("loop", loop),
        ("engine", engine),
        ("helpers", sum(used.values())),
        ("client", cpu_client * scaled / tokens),
    ):
        emit("serve_timeline", f"c{c}_cpu_ms_per_token_{name}", s / scaled * 1e3, "ms", **put)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], sys.argv[3:]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a static model file (llmkit export); its model is served as 'bench'")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=3, help="per client and level")
    p.add_argument("--client", choices=["openai", "raw"], default="openai")
    p.add_argument("--threads", type=int, default=2, help="kernel threads (LLMKIT_CINN_THREADS)")
    a = p.parse_args()
    os.environ.setdefault("LLMKIT_CINN_THREADS", str(a.threads))
    out = Path(tempfile.mkdtemp(prefix="serve_timeline_")) / "timeline.json"
    port, n = free_port(), max(a.concurrency)
    cmd = [sys.executable, __file__, "--child", str(out), a.model, "--port", str(port), "--max-batch", str(n),
           "--max-queue", "1024", "--served-model-name", "bench"]  # fmt: skip
    proc, _ = launch(cmd, port, "bench")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 4096, 32).tolist() for _ in range(n * a.requests)]
    levels = []
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            for c in a.concurrency:
                runner.run(clients(port, c, 1, a.client == "raw", prompts))  # warm: this level's shapes
                c0 = time.process_time()
                reqs = runner.run(clients(port, c, a.requests, a.client == "raw", prompts))
                levels.append((c, reqs, time.process_time() - c0))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    rec = json.loads(out.read_text())
    info = dict(machine(), client=a.client, threads=a.threads, model=a.model)
    for c, reqs, cpu_client in levels:
        figures(rec, reqs, cpu_client, 64 * c * a.requests, c, info)


if __name__ == "__main__":
    main()
