"""Prometheus metrics of the HTTP server: token and request counters, engine gauges, latency
histograms measured in the server from result and stream timings.

Each app owns its `CollectorRegistry` (not prometheus-client's global one), so a process can
create several apps (tests do) without "duplicated timeseries" errors.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "plait_"
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The server's metrics, registered in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", registry=reg)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens of finished requests", registry=reg
        )
        self.requests = Counter(
            PREFIX + "requests",
            "Generate requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=reg,
        )
        self.running = Gauge(PREFIX + "num_running_reqs", "Requests the engine is running", registry=reg)
        self.queued = Gauge(PREFIX + "num_queued_reqs", "Requests waiting in the engine's queue", registry=reg)
        self.in_flight = Gauge(PREFIX + "num_http_in_flight", "Generate requests the HTTP server holds", registry=reg)
        self.cache_hit_rate = Gauge(
            PREFIX + "cache_hit_rate",
            "Prompt tokens served by the prefix cache, over all prompt tokens since start",
            registry=reg,
        )
        self.kv_usage = Gauge(
            PREFIX + "kv_usage", "Fraction of KV slots not free (requests and prefix cache)", registry=reg
        )
        self.spec_accept_rate = Gauge(
            PREFIX + "spec_accept_rate",
            "Speculative (n-gram or draft-model) draft tokens kept over those proposed, since start",
            registry=reg,
        )
        self.rank_alive = Gauge(
            PREFIX + "tp_rank_alive", "1 while the tensor-parallel rank's process runs", ["rank"], registry=reg
        )
        self.spec_accepted = Gauge(
            PREFIX + "spec_accepted_tokens", "Speculative draft tokens kept, since start", registry=reg
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token (streams)", buckets=_TTFT_BUCKETS, registry=reg
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between tokens (streams)", buckets=_ITL_BUCKETS, registry=reg
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Request latency, arrival to last token",
            buckets=_E2E_BUCKETS,
            registry=reg,
        )

    def count_request(self, endpoint: str, status: int) -> None:
        """One answered generate request."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_result(self, result: dict[str, Any], start: float) -> None:
        """A finished sequence: its token counts and end-to-end latency."""
        meta = result.get("meta_info") or {}
        self.prompt_tokens.inc(meta.get("prompt_tokens") or 0)
        self.generation_tokens.inc(meta.get("completion_tokens") or 0)
        self.e2e.observe(time.perf_counter() - start)

    def render(self, info: dict[str, Any] | None, in_flight: int) -> bytes:
        """The text exposition, with gauges refreshed from `engine.get_server_info()`."""
        self.in_flight.set(in_flight)
        if info:
            self.running.set(info.get("num_running", 0))
            self.queued.set(info.get("num_waiting", 0))
            self.cache_hit_rate.set(cache_hit_rate(info))
            self.kv_usage.set(kv_usage(info))
            self.spec_accept_rate.set(info.get("spec_accept_rate") or 0.0)
            self.spec_accepted.set(info.get("num_spec_accepted_tokens") or 0)
            for r in info.get("tp_ranks") or ():
                self.rank_alive.labels(rank=str(r["rank"])).set(1 if r["alive"] else 0)
        return generate_latest(self.registry)


class StreamTimer:
    """Turns the arrival times of cumulative stream results into TTFT and inter-token samples."""

    def __init__(self, metrics: ServerMetrics, start: float):
        self.metrics = metrics
        self.start = start
        self.tokens = 0
        self.last = start

    def update(self, result: dict[str, Any]) -> None:
        """Record the tokens that arrived with this cumulative result."""
        n = (result.get("meta_info") or {}).get("completion_tokens") or 0
        new = n - self.tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self.tokens == 0:
            self.metrics.ttft.observe(now - self.start)
            new -= 1  # the first token's time is TTFT, not an inter-token gap
        for _ in range(new):  # tokens that arrive together share the gap
            self.metrics.itl.observe((now - self.last) / max(new, 1))
        self.tokens, self.last = n, now


def cache_hit_rate(info: dict[str, Any]) -> float:
    """Cached over all prompt tokens since start (0 before any request)."""
    prompt = info.get("num_prompt_tokens") or 0
    return (info.get("num_cached_tokens") or 0) / prompt if prompt else 0.0


def kv_usage(info: dict[str, Any]) -> float:
    """Fraction of the KV pool that is not free."""
    total = info.get("max_total_num_tokens") or 0
    if not total or "free_slots" not in info:
        return 0.0
    return max(0.0, min(1.0, (total - (info.get("free_slots") or 0)) / total))
