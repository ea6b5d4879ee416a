"""The server's figures for Prometheus (`GET /metrics`, its text format), kept by `prometheus_client`.

One registry per app (not the library's global one), so that several servers in one process keep
their own counts. Names and meanings are listed in docs/serving.md; every figure is per server since
it started.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
# seconds: from a few milliseconds (a cached block on an accelerator) to minutes (a long prompt on CPU)
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_TOKENS_PER_FORWARD = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0)


class Metrics:
    """The figures of one server. engine: the `Engine` (its queue and running requests are read
    when the metrics are scraped)."""

    def __init__(self, engine: Any):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("clover_requests", "HTTP requests answered, by endpoint and status code",
                                ("endpoint", "status"), registry=registry)
        self.time_to_first_block = Histogram(
            "clover_time_to_first_block_seconds", "From a request's submission to the engine to its first decided "
            "tokens (a block in diffusion mode, a token or a round in the causal modes)", buckets=_LATENCY,
            registry=registry)
        self.time_per_output_token = Histogram(
            "clover_time_per_output_token_seconds", "A finished request's time from submission to its end over its "
            "response tokens", buckets=_PER_TOKEN, registry=registry)
        self.tokens_per_forward = Histogram(
            "clover_tokens_per_forward", "A finished request's response tokens over its forward passes (NFE)",
            buckets=_TOKENS_PER_FORWARD, registry=registry)
        self.finished = Counter("clover_engine_requests", "Engine requests ended, by how they ended (eos, length, "
                                "cancelled, error, shutdown)", ("finish",), registry=registry)
        # Counted per engine request whose stats report cached prompt tokens (`RequestStats.cached_tokens`).
        self.prefix_cache_hits = Counter("clover_prefix_cache_hits", "Requests whose prompt was found, in part, in "
                                         "the prefix cache", registry=registry)
        self.prefix_cache_tokens = Counter("clover_prefix_cache_tokens", "Prompt tokens read from the prefix cache "
                                           "instead of prefilled", registry=registry)
        queued = Gauge("clover_queue_length", "Requests waiting for a slot", registry=registry)
        queued.set_function(engine.queued)
        running = Gauge("clover_running_requests", "Requests prefilling or decoding", registry=registry)
        running.set_function(engine.running)
        # The pool's pages follow the tokens held (requests take pages as their positions grow), so
        # these two show how full the K/V cache is and whether `--kv-cache-gb` is sized well.
        kv_in_use = Gauge("clover_kv_cache_bytes_in_use", "Bytes of the K/V page pool held by requests and the "
                          "prefix cache", registry=registry)
        kv_in_use.set_function(engine.kv_bytes_in_use)
        kv_capacity = Gauge("clover_kv_cache_bytes", "Bytes of the K/V page pool (its pages that can be held)",
                            registry=registry)
        kv_capacity.set_function(engine.kv_bytes_capacity)

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def engine_request_done(self, submission: Any, event: Any) -> None:
        """A finished engine request's figures (`Service.submit_all`'s on_finish)."""
        self.finished.labels(event.finish).inc()
        if submission.first is not None:
            self.time_to_first_block.observe(submission.first - submission.submitted)
        stats = event.stats
        if stats is None:
            return
        if stats.completion_tokens:
            self.time_per_output_token.observe((submission.ended - submission.submitted) / stats.completion_tokens)
            self.tokens_per_forward.observe(stats.tokens_per_forward)
        cached = getattr(stats, "cached_tokens", 0) or 0
        if cached:
            self.prefix_cache_hits.inc()
            self.prefix_cache_tokens.inc(cached)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
