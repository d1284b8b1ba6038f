"""EngineThread: a background thread that steps an engine while it has work.

The server (or any other caller that wants requests served while it does something else) submits
with ``engine.add_request(..., callback=...)`` and cancels with ``engine.abort`` from its own
thread; this thread wakes up, steps until the engine is idle, and sleeps again. Callbacks run on
this thread: hand results to another thread or event loop from there (``call_soon_threadsafe``).

``stop(drain_timeout)`` ends it cleanly: in-flight requests get ``drain_timeout`` seconds to
finish, the rest are cancelled (finish reason "abort"), then the thread exits.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .engine import Engine
from .request import FinishReason

log = logging.getLogger("llmkit.infer")


class EngineThread:
    """Runs ``engine.step()`` on a daemon thread; ``wake()`` after submitting."""

    def __init__(self, engine: Engine, name: str = "llmkit-engine") -> None:
        self.engine = engine
        self._wake = threading.Event()
        self._stop = False
        self._deadline: float | None = None
        self.error: BaseException | None = None  # the last step failure (requests were failed)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> EngineThread:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, *args: Any, **kwargs: Any) -> str:
        """``engine.add_request(...)`` and wake the thread."""
        rid = self.engine.add_request(*args, **kwargs)
        self._wake.set()
        return rid

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, drain_timeout: float = 0.0, join_timeout: float | None = 30.0) -> None:
        """Let in-flight requests run for up to ``drain_timeout`` s, cancel the rest, end the thread.

        ``join_timeout=0`` returns at once (from a signal handler); a second call may shorten the
        drain, never extend it.
        """
        deadline = time.monotonic() + max(0.0, drain_timeout)
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline
        self._stop = True
        self._wake.set()
        if join_timeout != 0 and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(join_timeout)

    def _run(self) -> None:
        eng = self.engine
        while True:
            if self._stop and (not eng.has_work() or time.monotonic() >= (self._deadline or 0.0)):
                eng.fail_all(FinishReason.ABORT)
                return
            if not eng.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                eng.step()
            except Exception as e:  # a failed step must not hang every client: fail them, keep serving
                log.exception("engine step failed; failing in-flight requests")
                self.error = e
                try:
                    eng.fail_all(FinishReason.ERROR)
                except Exception:
                    log.exception("could not fail in-flight requests")
