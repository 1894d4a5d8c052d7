"""python -m decode_svc's flags reach the pod's config and its engine's config."""

from __future__ import annotations

from decode_svc.__main__ import build_parser, config_from_args


def test_cli_flags_map_onto_the_config_and_engine(tiny_models):
    path = str(tiny_models["mqa"])
    a = build_parser().parse_args(
        [
            "--model",
            path,
            "-tp",
            "2",
            "-dcp",
            "2",
            "--num-kv-blocks",
            "77",
            "--exact-prefill",
            "--drain-timeout-s",
            "7",
            "--metrics-port",
            "0",
        ]
    )
    c = config_from_args(a)
    e = c.engine
    assert (e.tensor_parallel_size, e.decode_context_parallel_size, e.num_kv_blocks) == (2, 2, 77)
    assert e.exact_prefill and (c.serving.drain_timeout_s, c.serving.metrics_port) == (7.0, 0)
    d = config_from_args(build_parser().parse_args(["--model", path]))
    assert not d.engine.exact_prefill
    # the decode pod's own defaults, not the engine's or the prefill pod's
    assert (d.engine.max_num_seqs, d.engine.enable_prefix_caching) == (256, False)
    assert (d.serving.port, d.serving.pod_id, d.serving.drain_timeout_s, d.serving.metrics_port) == (
        50061,
        "decode-0",
        120.0,
        None,
    )
