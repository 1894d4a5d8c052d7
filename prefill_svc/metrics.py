"""Prometheus metrics of a prefill pod (one registry per server, plus kv_transfer's process-wide lease metrics, plus
the vLLM-named families of pdserve/pod/vllm_metrics.py that a prefill pod measures)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pdserve.pod.vllm_metrics import PrefillVllmMetrics, kv_usage
from prefill_svc.worker import PrefillResult, Stats


class _Chain:
    """Re-export another registry's metrics (kv_transfer registers its lease metrics on the default one)."""

    def __init__(self, other: CollectorRegistry) -> None:
        self.other = other

    def collect(self):
        yield from self.other.collect()

    def describe(self):
        return []  # unchecked: the names live in another registry


class _Refresh:
    """Registered first, so every scrape sees the worker's current stats (not the last periodic update)."""

    def __init__(self, metrics: "PrefillMetrics") -> None:
        self.metrics = metrics

    def collect(self):
        if self.metrics.stats_fn is not None:
            self.metrics.update(self.metrics.stats_fn())
        return []

    def describe(self):
        return []


class PrefillMetrics:
    def __init__(self, include_process_metrics: bool = True, stats_fn: Callable[[], Stats] | None = None) -> None:
        self.stats_fn = stats_fn
        self._lock = threading.Lock()
        self.registry = r = CollectorRegistry(auto_describe=True)
        r.register(_Refresh(self))
        if include_process_metrics:
            r.register(_Chain(REGISTRY))
        self.queued_prompt_tokens = Gauge(
            "pdserve_prefill_queued_prompt_tokens", "Prompt tokens admitted but not yet computed", registry=r
        )
        self.tokens_per_s = Gauge(
            "pdserve_prefill_tokens_per_second",
            "Prompt tokens computed per second over the last update interval",
            registry=r,
        )
        self.tokens_computed = Counter(
            "pdserve_prefill_prompt_tokens_computed", "Prompt tokens computed (prefix-cache hits excluded)", registry=r
        )
        self.prefix_hit_tokens = Counter(
            "pdserve_prefill_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.prefix_query_tokens = Counter(
            "pdserve_prefill_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hit_rate = Gauge(
            "pdserve_prefill_prefix_cache_hit_rate", "Prefix-cache hit tokens / query tokens since start", registry=r
        )
        self.kv_held_blocks = Gauge(
            "pdserve_prefill_kv_held_blocks", "KV blocks held for transfer to decode (per rank)", registry=r
        )
        self.kv_leases = Gauge("pdserve_prefill_kv_leases", "KV leases held for decode pods", registry=r)
        self.kv_free_blocks = Gauge("pdserve_prefill_kv_free_blocks", "Free KV blocks (per rank)", registry=r)
        self.running = Gauge("pdserve_prefill_running_seqs", "Prompts being computed", registry=r)
        self.waiting = Gauge("pdserve_prefill_waiting_seqs", "Prompts waiting for a batch slot or KV", registry=r)
        self.draining = Gauge("pdserve_prefill_draining", "1 while the pod drains (refuses new work)", registry=r)
        self.requests = Counter("pdserve_prefill_requests", "Prefill RPCs by outcome (gRPC code)", ["code"], registry=r)
        self.queue_seconds = Histogram(
            "pdserve_prefill_queue_seconds", "Time a prompt waited before computing", registry=r
        )
        self.compute_seconds = Histogram(
            "pdserve_prefill_compute_seconds",
            "First chunk to first token of a prompt",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.leases_freed = Counter(
            "pdserve_prefill_kv_leases_freed", "KV leases whose blocks went back, by reason", ["reason"], registry=r
        )
        self.vllm: PrefillVllmMetrics | None = None
        self._last: Stats | None = None
        self._rate_t, self._rate_tokens = time.monotonic(), 0
        self.last_tokens_per_s = 0.0
        self.http_port: int | None = None
        self._http: WSGIServer | None = None

    def enable_vllm(self, model_name: str) -> None:
        """Add the vLLM-named families, labelled with the model name the pod serves (known once it loaded)."""
        with self._lock:
            if self.vllm is None:
                self.vllm = PrefillVllmMetrics(self.registry, model_name)

    def observe(self, res: PrefillResult) -> None:
        """A Prefill answered with its first token."""
        self.queue_seconds.observe(res.queue_s)
        self.compute_seconds.observe(res.compute_s)
        if self.vllm is not None:  # TTFT as this pod sees it: the prompt's arrival here to its first token
            self.vllm.first_token(
                res.queue_s + res.compute_s, res.num_prompt_tokens, res.finish_reason if res.finished else None
            )

    def update(self, s: Stats) -> None:
        with self._lock:
            self._update(s)

    def _update(self, s: Stats) -> None:
        now = time.monotonic()
        prev = self._last or Stats()
        if now - self._rate_t >= 0.2:  # the rate over windows of >= 0.2 s, however often this is called
            self.last_tokens_per_s = (s.prompt_tokens_computed - self._rate_tokens) / (now - self._rate_t)
            self._rate_t, self._rate_tokens = now, s.prompt_tokens_computed
        self.tokens_per_s.set(self.last_tokens_per_s)
        self.tokens_computed.inc(max(s.prompt_tokens_computed - prev.prompt_tokens_computed, 0))
        self.prefix_hit_tokens.inc(max(s.prefix_hit_tokens - prev.prefix_hit_tokens, 0))
        self.prefix_query_tokens.inc(max(s.prefix_query_tokens - prev.prefix_query_tokens, 0))
        self.prefix_hit_rate.set(s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else 0.0)
        for reason, n in s.leases_freed.items():
            self.leases_freed.labels(reason=reason).inc(max(n - prev.leases_freed.get(reason, 0), 0))
        self.queued_prompt_tokens.set(s.queued_prompt_tokens)
        self.kv_held_blocks.set(s.kv_held_blocks)
        self.kv_leases.set(s.num_leases)
        self.kv_free_blocks.set(s.free_blocks)
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        if self.vllm is not None:
            self.vllm.set_state(s.num_running, s.num_waiting, kv_usage(s.total_blocks - s.free_blocks, s.total_blocks))
        self._last = s

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        self.http_port = self._http.server_port
        return self.http_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
