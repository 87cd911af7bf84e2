"""The server's Prometheus metrics (``GET /metrics``), in a registry of their own per app (so that two apps in one
process, as in the tests, never share or clash)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Histogram buckets of time-to-first-token and request latency (seconds).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """The counters, gauges and histograms of one server.

    Attributes:
        registry: the registry ``GET /metrics`` writes out.
        running: sequences in the running batch (decoding or being prefilled).
        peak_running: the most sequences that ran at once since the server started.
        waiting: requests in the queue, not yet admitted into a batch.
        kv_bytes: bytes the running batch's KV cache holds (``cache.nbytes()``; 0 between batches).
        evicted: tokens evicted, per layer and KV head, summed over the finished sequences (what each saw beyond
            its row's capacity).
        prefill_tokens: prompt tokens prefilled.
        decode_tokens: tokens generated.
        requests: requests finished, by ``outcome`` (``stop``, ``length``, ``error``, ``cancelled``).
        ttft: seconds from a request's arrival to its first piece of text.
        latency: seconds from a request's arrival to its end.
        prefix_bytes: bytes the prefix cache holds (kept chat turns, `PrefixCache`).
        prefix_entries: conversations the prefix cache holds.
        prefix_hits: prompt tokens taken from the prefix cache instead of being prefilled.
    """

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self._peak = 0
        self.running = Gauge("h2o_running_sequences", "Sequences in the running batch.", registry=registry)
        self.peak_running = Gauge("h2o_peak_running_sequences", "Most sequences running at once since the start.",
                                  registry=registry)
        self.waiting = Gauge("h2o_waiting_sequences", "Requests queued, not yet admitted.", registry=registry)
        self.kv_bytes = Gauge("h2o_kv_cache_bytes", "Bytes held by the running batch's KV cache.", registry=registry)
        self.evicted = Counter("h2o_evicted_tokens", "Tokens evicted per layer and KV head (finished sequences).",
                               registry=registry)
        self.prefill_tokens = Counter("h2o_prefill_tokens", "Prompt tokens prefilled.", registry=registry)
        self.decode_tokens = Counter("h2o_decode_tokens", "Tokens generated.", registry=registry)
        self.requests = Counter("h2o_requests", "Requests finished, by outcome.", ["outcome"], registry=registry)
        self.ttft = Histogram("h2o_time_to_first_token_seconds", "Seconds from arrival to the first text.",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.latency = Histogram("h2o_request_latency_seconds", "Seconds from arrival to the end of a request.",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.prefix_bytes = Gauge("h2o_prefix_cache_bytes", "Bytes held by the prefix cache of chat turns.",
                                  registry=registry)
        self.prefix_entries = Gauge("h2o_prefix_cache_entries", "Conversations held by the prefix cache.",
                                    registry=registry)
        self.prefix_hits = Counter("h2o_prefix_cache_tokens", "Prompt tokens taken from the prefix cache, not "
                                   "prefilled.", registry=registry)

    def set_prefix(self, prefix) -> None:
        """The prefix cache's bytes and entries now (``prefix``: a `PrefixCache`)."""
        self.prefix_bytes.set(prefix.held)
        self.prefix_entries.set(len(prefix.entries))

    def set_running(self, count: int) -> None:
        """``count`` sequences run now (``running``; ``peak_running`` if it is the most yet)."""
        self.running.set(count)
        if count > self._peak:
            self._peak = count
            self.peak_running.set(count)

    def text(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
