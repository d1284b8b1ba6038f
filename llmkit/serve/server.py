"""``llmkit serve model.llmkit``: the OpenAI-compatible server on uvicorn.

It runs only the static model file: programs, weights, tokenizer and chat template all come from
it, and this process never imports ``llmkit.models`` (``GET /health`` reports it). It binds to
loopback unless ``--host`` says otherwise. SIGTERM (or Ctrl-C) shuts down gracefully: no new
connections, in-flight requests get ``--drain-timeout`` seconds to finish, the rest are cancelled.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

from llmkit.framework.blas import set_blas_threads
from llmkit.framework.compiler.build import spin_between_kernels
from llmkit.infer import Engine, EngineConfig, EngineThread, SamplingParams

from . import MAX_REQUEST_BYTES

log = logging.getLogger("llmkit.serve")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="llmkit serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", help="static model file written by `llmkit export` (a model.llmkit directory)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* and /metrics, and for /health's details "
        "(default: $LLMKIT_API_KEY, else none)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=MAX_REQUEST_BYTES,
        help=f"larger request bodies get a 413 (default: {MAX_REQUEST_BYTES})",
    )
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before answering 429")
    p.add_argument("--max-tokens-per-step", type=int, default=256, help="decode + prompt tokens per step")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV cache blocks (default: max-batch sequences of the full context); the pool's memory "
        "is committed as blocks are first used",
    )
    p.add_argument(
        "--kv-memory",
        type=str,
        default=None,
        help="or: as many KV cache blocks as fit in this memory, in bytes or with a unit: 512MiB, 2GiB",
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        help="the KV cache's dtype: int8 stores a float32 model's keys and values as int8 with a "
        "float32 scale per token and kv head (68 bytes a row instead of 256 at head dim 64; logits "
        "move slightly, see docs/serve.md); default: the model's dtype",
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: the file's)")
    p.add_argument("--blas-threads", type=int, default=1, help="OpenBLAS threads of this process")
    p.add_argument(
        "--compiler",
        default=None,
        choices=["none", "cinn"],
        help="kernels for the programs: fused compiled ones (default where a C compiler works), or the "
        "op table's reference kernels",
    )
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get at shutdown"
    )
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    a = p.parse_args(argv)
    if a.api_key is None:
        a.api_key = os.environ.get("LLMKIT_API_KEY")
        source = "$LLMKIT_API_KEY"
    else:
        source = "--api-key"
    if a.api_key is not None and not a.api_key.strip():
        p.error(
            f"{source} is empty: an empty key would let anyone in; set a key, or unset it to serve "
            "without authentication"
        )
    if a.max_request_bytes < 1:
        p.error(f"--max-request-bytes must be positive, got {a.max_request_bytes}")
    if a.kv_memory is not None:
        if a.num_blocks is not None:
            p.error("give --num-blocks or --kv-memory, not both")
        size = memory_bytes(a.kv_memory)
        if size is None:
            p.error(f"--kv-memory must be a positive size such as 512MiB or 2GiB, got {a.kv_memory!r}")
        a.kv_memory = size
    return a


_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}


def memory_bytes(text: str) -> int | None:
    """Bytes of a size written as a number and an optional binary unit (B, KiB, MiB, GiB, or K, M,
    G); None when it is not one, or not positive."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        return None
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    return n if n > 0 else None


def load_engine(a: argparse.Namespace, warm: bool = True) -> Engine:
    """The engine ``llmkit serve`` runs for these arguments, warmed up unless not ``warm``
    (``benchmarks/serve_load.py --engine-only`` drives the same one without HTTP)."""
    set_blas_threads(a.blas_threads)
    spin_between_kernels()  # inference only: kernel threads wait for the next kernel spinning
    config = EngineConfig(
        max_batch=a.max_batch,
        max_tokens_per_step=max(a.max_tokens_per_step, a.max_batch + 64),
        num_blocks=a.num_blocks,
        kv_memory_bytes=a.kv_memory,
        enable_prefix_caching=not a.no_prefix_caching,
        compiler=a.compiler,
        kv_dtype=a.kv_dtype,
    )
    engine = Engine.from_static(a.model, config)
    if a.served_model_name:
        engine.model_name = a.served_model_name
    if warm:
        warm_up(engine)
    return engine


def warm_up(engine: Engine) -> None:
    """Plan the prefill and decode programs and touch the pool before the first client waits for it
    (the score program is parsed and planned by the first echo request: most servers never run it)."""
    engine.generate(
        [[engine.tokenizer.bos_id]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    )
    engine.reset_prefix_cache()


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = load_engine(a, warm=False)
    # The warm-up's kernels run (without the GIL) while this thread imports the HTTP stack.
    with ThreadPoolExecutor(1, thread_name_prefix="llmkit-warm-up") as pool:
        warming = pool.submit(warm_up, engine)
        import uvicorn

        from .app import build_app
        from .serving import Serving

        warming.result()
    runner = EngineThread(engine).start()
    app = build_app(
        Serving(runner, max_queue=a.max_queue),
        api_key=a.api_key,
        drain_timeout=a.drain_timeout,
        max_request_bytes=a.max_request_bytes,
    )
    serving = app.state.serving

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            # Stop taking requests and start the engine's drain now: in-flight requests finish
            # within --drain-timeout or end as cancelled, so their connections close and uvicorn's
            # graceful shutdown (which waits for them) completes.
            super().handle_exit(sig, frame)  # type: ignore[arg-type]
            serving.closing = True
            runner.stop(drain_timeout=a.drain_timeout, join_timeout=0)

    server = Server(
        uvicorn.Config(
            app,
            host=a.host,
            port=a.port,
            log_level=a.log_level,
            timeout_graceful_shutdown=a.drain_timeout + 5,
            access_log=a.log_level in ("debug", "info"),
        )
    )
    print(
        f"llmkit serve: {engine.model_name} on http://{a.host}:{a.port} "
        f"(loaded in {time.perf_counter() - t0:.1f} s; "
        f"max_batch {a.max_batch}, {engine.blocks.num_blocks} KV blocks of {engine.spec.block_size} "
        f"tokens, at most {engine.blocks.num_blocks * engine.spec.block_bytes / 2**20:.0f} MiB)",
        flush=True,
    )
    # uvicorn handles SIGTERM/SIGINT while it runs (graceful shutdown, then the app's lifespan drains
    # the engine) and re-raises the signal afterwards; this handler makes that a clean exit 0.
    signal.signal(signal.SIGTERM, lambda sig, frame: setattr(server, "should_exit", True))
    server.run()
    runner.stop(drain_timeout=0.0)
    return 0
