"""pdserve router: the single entry point of a cluster (``python -m router --port P [--model PATH]``).

Modules, in the order a request meets them:
  __main__.py        ``python -m router``: every RouterConfig field is a flag (pdserve.cli_config).
  config.py          RouterConfig, every knob, validated at construction (``python -m router`` flags mirror it).
  openai_http.py     the OpenAI-compatible HTTP front (entry point; the code is in the ``openai/`` package), a client
                     of the router's own gRPC API.
  server.py          grpc.aio Router + Registry servicers on one port, grpc.health.v1, Prometheus, SIGTERM drain.
  validation.py      ValidateConfig and the registration check, both on pdserve.parallel_config (vLLM's rules).
  registry_checks.py field checks of RegisterWorker / Heartbeat: numbers a pod reports that cannot be true are refused.
  registry.py        pods, heartbeats, UNHEALTHY after missed heartbeats, eviction; the router's own load bookkeeping.
  core.py            shared state, request validation (prompt -> token ids, sampling params), pod clean-up calls.
  chat.py            a ChatPrompt as the chat template sees it (messages, tool calls, tool definitions).
  admission.py       decode KV booking, bounded FIFO queue, RESOURCE_EXHAUSTED beyond its bound.
  placement.py       pure policies: decode by free KV across ranks + running seqs; prefill by queued tokens + affinity.
  journey.py         ``generate``: the request's whole journey, top to bottom, with cancel / deadline / retry rules.
  flight.py          one in-flight request's cancellation and clean-up state, shared by its journey and the core.
  detok.py           incremental detokenizing and stop strings (applied by the router, per the proto contract).
  tool_parsers.py    the model's text -> OpenAI tool_calls, one parser per model family.
  metrics.py         Prometheus collectors.
"""
