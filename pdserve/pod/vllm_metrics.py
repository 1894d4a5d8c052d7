"""Metric families under vLLM's names, beside each pod's own pdserve_* metrics, so dashboards and scorers written for
vLLM read a pdserve pod unchanged. Names, label names and bucket boundaries follow vLLM's PrometheusStatLogger
(vllm/v1/metrics/loggers.py). A pod creates only the families it measures (docs/metrics.md says which and what they
mean there): the prefill pod computes prompts and samples the first token, the decode pod samples every later one."""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

LABELS = ("model_name", "engine")
ENGINE = "0"  # a pod runs one engine, vLLM's engine index 0
# vLLM's FinishReason strings, all pre-created as vLLM does so a dashboard sees zeros rather than no series
FINISHED_REASONS = ("stop", "length", "abort", "error")

# vLLM PrometheusStatLogger's buckets for vllm:time_to_first_token_seconds
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
# vLLM PrometheusStatLogger's buckets for vllm:inter_token_latency_seconds (and its older time_per_output_token name)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# vLLM PrometheusStatLogger's request_latency_buckets (vllm:e2e_request_latency_seconds)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def kv_usage(used: int, total: int) -> float:
    """vLLM's kv_cache_usage_perc: the fraction of KV blocks in use, 0..1 (cached but evictable blocks are free)."""
    return min(max(used / total, 0.0), 1.0) if total > 0 else 0.0


# vLLM's NixlPromMetrics buckets: vllm:nixl_xfer_time_seconds (the first one dropped, as there) and
# vllm:nixl_bytes_transferred
NIXL_XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))


class OnScrape:
    """Exports nothing; registered before the families fn refreshes, so every scrape sees current values."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def collect(self):
        self.fn()
        return []

    def describe(self):
        return []


class Alias:
    """Re-exports another collector's families under a second name at scrape time (nothing observed twice)."""

    def __init__(self, source: Histogram, name: str, documentation: str) -> None:
        self.source, self.name, self.documentation = source, name, documentation

    def collect(self):
        for fam in self.source.collect():
            out = Metric(self.name, self.documentation, fam.type)
            for smp in fam.samples:
                out.samples.append(smp._replace(name=self.name + smp.name[len(fam.name) :]))
            yield out

    def describe(self):
        return [Metric(self.name, self.documentation, "histogram")]


class _PodVllmMetrics:
    """The families both pods measure: scheduler state, KV usage, generated tokens, finished requests."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        lv = (model_name, ENGINE)
        r = registry
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", LABELS, registry=r
        ).labels(*lv)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", LABELS, registry=r
        ).labels(*lv)
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", LABELS, registry=r
        ).labels(*lv)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=r
        ).labels(*lv)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=r,
        )
        self.request_success = {reason: success.labels(*lv, reason) for reason in FINISHED_REASONS}

    def set_state(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_cache_usage.set(kv_cache_usage)


class PrefillVllmMetrics(_PodVllmMetrics):
    """Prefill pod: prompts computed and their first token (decode pods sample the rest)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        super().__init__(registry, model_name)
        lv = (model_name, ENGINE)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=registry
        ).labels(*lv)
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            registry=registry,
            buckets=TTFT_BUCKETS,
        ).labels(*lv)

    def first_token(self, ttft_s: float, num_prompt_tokens: int, finished_reason: str | None) -> None:
        """A prompt got its first token; finished_reason when the request ended there (no decode follows)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc()
        self.time_to_first_token.observe(ttft_s)
        if finished_reason is not None:
            self.request_success[finished_reason].inc()


class DecodeVllmMetrics(_PodVllmMetrics):
    """Decode pod: the tokens after the first, their spacing, and the requests' end on this pod."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        super().__init__(registry, model_name)
        lv = (model_name, ENGINE)
        itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            LABELS,
            registry=registry,
            buckets=ITL_BUCKETS,
        )
        self.inter_token_latency = itl.labels(*lv)
        # the name vLLM exported before renaming it, still read by older dashboards
        registry.register(
            Alias(
                itl,
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in "
                "seconds. DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            )
        )
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            registry=registry,
            buckets=REQUEST_LATENCY_BUCKETS,
        ).labels(*lv)
        # A request's whole KV transfer into this pod (every rank's share, over NIXL or the TCP fallback), under
        # the names of vLLM's NixlConnector families.
        self.kv_xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            LABELS,
            registry=registry,
            buckets=NIXL_XFER_TIME_BUCKETS,
        ).labels(*lv)
        self.kv_bytes = Histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            LABELS,
            registry=registry,
            buckets=NIXL_BYTES_BUCKETS,
        ).labels(*lv)
        self.kv_failed = Counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers.",
            LABELS,
            registry=registry,
        ).labels(*lv)
        self._lock = threading.Lock()
        self._generated = 0

    def kv_transfer(self, seconds: float, nbytes: int, failed: bool) -> None:
        if failed:
            self.kv_failed.inc()
            return
        self.kv_xfer_time.observe(seconds)
        self.kv_bytes.observe(nbytes)

    def set_generated(self, total: int) -> None:
        """Advance the generation counter to the engine's running total (scrapes may run concurrently)."""
        with self._lock:
            if total > self._generated:
                self.generation_tokens.inc(total - self._generated)
                self._generated = total

    def token_gap(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def finished(self, e2e_s: float, finished_reason: str) -> None:
        self.request_success[finished_reason].inc()
        self.e2e_request_latency.observe(e2e_s)
