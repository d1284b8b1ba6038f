"""Prometheus metrics of the server (``GET /metrics``, text format), in a registry of its own.

Request-level figures are observed by the serving layer as clients see them (time to first token,
inter-token latency, requests by endpoint and status); engine state (running and waiting requests,
KV blocks, prefix-cache hits, token counts and the generation rate) is read from the engine at
scrape time, so it is never stale.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.0,
    10.0,
    30.0,
)


class _EngineCollector:
    """Engine gauges and counters, read at scrape time; tokens/s over the last ``window`` seconds."""

    def __init__(self, stats: Callable[[], dict[str, int]], window: float = 10.0) -> None:
        self.stats = stats
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()

    def _rate(self, total: int) -> float:
        t = time.monotonic()
        self._samples.append((t, total))
        while len(self._samples) > 2 and self._samples[1][0] < t - self.window:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        return (total - n0) / (t - t0) if t > t0 else 0.0

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        gauges = {
            "llmkit_requests_running": ("Requests in the running batch", s["running"]),
            "llmkit_requests_waiting": ("Requests queued for admission", s["waiting"]),
            "llmkit_kv_blocks_used": ("KV cache blocks held by requests", s["kv_blocks_used"]),
            "llmkit_kv_blocks_total": ("KV cache blocks in the pool", s["kv_blocks_total"]),
            "llmkit_kv_blocks_cached": ("KV cache blocks holding a reusable prefix", s["kv_blocks_cached"]),
            "llmkit_generation_tokens_per_second": (
                f"Generated tokens per second over the last {self.window:g} s",
                self._rate(s["generated_tokens"]),
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "llmkit_prefix_cache_queries": (
                "Full prompt blocks looked up in the prefix cache",
                "prefix_cache_queries",
            ),
            "llmkit_prefix_cache_hits": ("Full prompt blocks found in the prefix cache", "prefix_cache_hits"),
            "llmkit_prompt_tokens": ("Prompt tokens computed (cache hits excluded)", "prompt_tokens"),
            "llmkit_generation_tokens": ("Tokens generated", "generated_tokens"),
            "llmkit_engine_steps": ("Engine steps run", "steps"),
        }
        for name, (doc, key) in counters.items():
            yield CounterMetricFamily(name, doc, value=s[key])


class Metrics:
    """The server's metrics; ``render()`` is the /metrics body."""

    def __init__(self, engine_stats: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "llmkit_requests",
            "HTTP API requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "llmkit_time_to_first_token_seconds",
            "Arrival to first generated token, per choice",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "llmkit_inter_token_latency_seconds",
            "Time between consecutive token deliveries, per token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "llmkit_request_latency_seconds",
            "Arrival to the last token of a request",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
