"""Prometheus metrics of one router (own CollectorRegistry, so several routers can live in one test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_OVERHEAD = (0.0001, 0.0002, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "pdserve_router_requests",
            "Generate calls by outcome (finish reason, or the gRPC code of a failure)",
            ["outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve_router_ttft_seconds", "Arrival at the router -> first token sent", buckets=_LAT, registry=r
        )
        self.e2e = Histogram("pdserve_router_e2e_seconds", "Arrival -> final message", buckets=_LAT, registry=r)
        self.queue = Histogram(
            "pdserve_router_queue_seconds", "Time waiting for decode KV in the router queue", buckets=_LAT, registry=r
        )
        self.overhead = Histogram(
            "pdserve_router_overhead_seconds",
            "Router time to first token minus the pods' calls on that path (AllocateKV + Prefill) and the queue wait",
            buckets=_OVERHEAD,
            registry=r,
        )
        self.prefill_retries = Counter("pdserve_router_prefill_retries", "Prefills retried on another pod", registry=r)
        self.kv_recomputes = Counter(
            "pdserve_router_kv_recomputes",
            "Prompts computed again because their decode pod could not load the KV (--kv-load-failure-policy "
            "recompute)",
            registry=r,
        )
        choice = Counter(
            "pdserve_router_prefill_choice",
            "Where requests' prompts were computed: on a prefill pod (remote, KV transferred) or on their decode "
            "pod (local, conditional disaggregation)",
            ["where"],
            registry=r,
        )
        self.prefill_remote, self.prefill_local = choice.labels("remote"), choice.labels("local")
        self.local_prefill_max_tokens = Gauge(
            "pdserve_router_local_prefill_max_tokens",
            "Longest prompt (tokens) the router prefills on this decode pod itself (--local-prefill-max-tokens, or "
            "what auto derived from the pod's step profile); 0: never",
            ["pod"],
            registry=r,
        )
        self.tokens = Counter("pdserve_router_generated_tokens", "Tokens streamed to clients", registry=r)
        self.queue_depth = Gauge("pdserve_router_queue_depth", "Requests waiting for decode KV", registry=r)
        self.inflight = Gauge("pdserve_router_inflight_requests", "Generate calls in progress", registry=r)
        self.pods = Gauge("pdserve_router_pods", "Registered pods", ["role", "state"], registry=r)
        self.cleanup_failures = Counter(
            "pdserve_router_cleanup_failures", "Cancel / release calls to pods that failed", ["rpc"], registry=r
        )

        self._outcomes: dict[str, Counter] = {}  # outcome -> bound child: labels() takes a lock and builds a key

    def count_request(self, outcome: str) -> None:
        child = self._outcomes.get(outcome)
        if child is None:
            child = self._outcomes[outcome] = self.requests.labels(outcome)
        child.inc()

    def forget_pod(self, pod_id: str) -> None:
        """A pod left: its per-pod series go (a gauge of a gone pod would read as a live one)."""
        try:
            self.local_prefill_max_tokens.remove(pod_id)
        except KeyError:  # never set: not a decode pod, or conditional disaggregation off
            pass

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
