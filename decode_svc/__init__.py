"""Decode pods: the DecodeWorker gRPC service over one TP group of ranks with Decode Context Parallelism.

- config.py      DecodeConfig, validated at construction (parallel rules from pdserve.parallel_config)
- kv_source.py   how prompt KV reaches every rank's blocks (kv_transfer pullers; dense/file sources for tests)
- pod.py         DecodePod: reserve / submit / step / cancel, queueing and preemption (synchronous)
- kv_loads.py    requests whose prompt KV is still arriving, tracked while the running batch keeps stepping
- engine_loop.py the engine thread that owns the pod and streams outputs to subscribers
- server.py      grpc.aio DecodeWorker + grpc.health.v1 + router registration + SIGTERM drain
- metrics.py     Prometheus gauges (running / waiting sequences, KV blocks per rank, generated tokens)
- __main__.py    python -m decode_svc ...
"""
