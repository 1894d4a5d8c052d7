"""What prefill and decode pods share: the serving config (config.py), registration with the router
(registrar.py), proto conversions (convert.py), the sampling check (sampling.py), the engine thread
(engine_thread.py), per-block KV checksums (kv_checksum.py), the vLLM-named metrics (vllm_metrics.py), and
health and lifecycle helpers (lifecycle.py); their error model is pdserve/errors.py. Neither service imports the
other; both import this."""
