"""The prefill pod: ``python -m prefill_svc --model PATH --tensor-parallel-size N --port P [--router ADDR]``.

- ``config.py``   PrefillConfig (validated at construction; ``engine`` is the LLMEngine's config).
- ``sampling.py`` a request's sampling params as the prefill pod reads them: the first token's engine params, the
                  client's stop rules.
- ``worker.py``   the engine loop on its own thread: prompts in (batched, chunked, prefix-cached), first token out,
                  KV held under a lease until decode has it (or ReleaseKV / CancelPrefill / TTL).
- ``kv.py``       one kv_transfer publisher per TP rank process, fed layer by layer from the forward pass.
- ``server.py``   grpc.aio PrefillWorker + grpc.health.v1 + Prometheus + registration/heartbeats + SIGTERM drain.
- ``metrics.py``  the pod's Prometheus metrics (its own, kv_transfer's lease metrics, the vLLM-named families).
- ``__main__.py`` ``python -m prefill_svc``: every PrefillConfig field is a flag.

Protos <-> engine / kv_transfer objects live in ``pdserve/pod/convert.py`` (shared with the decode pod). A
KVHandle's ``kv_transfer_address`` is the kv_transfer control endpoint of each prefill rank, comma-separated in rank
order when TP > 1 (one address when TP == 1); ``kv_handle_to_handoff`` turns a KVHandle back into the KVHandoff a
puller takes.
"""
