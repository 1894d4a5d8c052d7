"""pdserve router: the single entry point of a cluster (``python -m router --port P [--model PATH]``).

Modules, in the order a request meets them:
  config.py      RouterConfig, every knob, validated at construction (``python -m router`` flags mirror it).
  server.py      grpc.aio Router + Registry servicers on one port, grpc.health.v1, Prometheus, SIGTERM drain.
  validation.py  ValidateConfig and the registration check, both on pdserve.parallel_config (vLLM's rules).
  registry.py    pods, heartbeats, UNHEALTHY after missed heartbeats, eviction; the router's own load bookkeeping.
  core.py        shared state, request validation (prompt -> token ids, sampling params), pod clean-up calls.
  admission.py   decode KV booking, bounded FIFO queue, RESOURCE_EXHAUSTED beyond its bound.
  placement.py   pure policies: decode by free KV across ranks + running seqs; prefill by queued tokens + affinity.
  journey.py     ``generate``: the request's whole journey, top to bottom, with cancel / deadline / retry rules.
  detok.py       incremental detokenizing and stop strings (applied by the router, per the proto contract).
  metrics.py     Prometheus collectors.
"""
