"""pdserve/pod/vllm_metrics.py without a pod: the re-exported older histogram name, the generation counter following
the engine's running total, KV usage as vLLM's 0..1 fraction."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.pod.vllm_metrics import DecodeVllmMetrics, kv_usage


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    return {
        s.name + ("" if "le" not in s.labels else f"@{s.labels['le']}"): s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }


def test_older_itl_name_carries_the_same_samples_and_counter_follows_the_total():
    r = CollectorRegistry()
    m = DecodeVllmMetrics(r, "tiny")
    for gap in (0.004, 0.03, 0.2):
        m.token_gap(gap)
    m.set_generated(5)
    m.set_generated(3)  # a stale snapshot never moves a counter back
    m.set_generated(7)
    s = _samples(r)
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert s[f"{name}_count"] == 3 and abs(s[f"{name}_sum"] - 0.234) < 1e-9
        assert (s[f"{name}_bucket@0.01"], s[f"{name}_bucket@0.2"], s[f"{name}_bucket@+Inf"]) == (1, 3, 3)
    assert s["vllm:generation_tokens_total"] == 7


def test_kv_usage_is_a_fraction():
    assert (kv_usage(0, 64), kv_usage(16, 64), kv_usage(64, 64), kv_usage(3, 0)) == (0.0, 0.25, 1.0, 0.0)
