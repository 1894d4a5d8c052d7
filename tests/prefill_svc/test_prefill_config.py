"""PrefillConfig refuses bad settings at construction, naming the setting; the CLI maps flags onto it."""

from __future__ import annotations

import pytest

from pdserve.cli_config import build
from prefill_svc.__main__ import build_parser, config_from_args
from prefill_svc.config import PrefillConfig


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"prefill_chunk_size": 8192, "max_num_batched_tokens": 4096}, "prefill_chunk_size"),
        ({"port": 70000}, "port"),
        ({"metrics_port": -1}, "metrics_port"),
        ({"lease_ttl_s": 0}, "lease_ttl_s"),
        ({"kv_transport": "carrier-pigeon"}, "kv_transport"),
        ({"router_address": "nohostport"}, "router_address"),
        ({"model": "/definitely/not/here"}, "not a directory"),
        ({"block_size": True}, "block_size"),
        ({"decode_context_parallel_size": 2}, "decode_context_parallel_size"),
    ],
)
def test_bad_settings_are_refused(kw, needle):
    with pytest.raises(ValueError, match=needle):  # PrefillConfigError, or its engine / serving part's error
        build(PrefillConfig, **kw)


def test_cli_flags_map_onto_the_config(tmp_path):
    a = build_parser().parse_args(
        [
            "--model",
            str(tmp_path),
            "--tensor-parallel-size",
            "2",
            "--port",
            "1234",
            "--router",
            "router:50051",
            "--prefill-chunk-size",
            "512",
            "--no-prefix-caching",
            "--kv-transport",
            "tcp",
            "--exact-prefill",
        ]
    )
    c = config_from_args(a)
    e = c.engine
    assert (
        e.tensor_parallel_size,
        c.serving.port,
        c.serving.router_address,
        e.prefill_chunk_size,
        e.enable_prefix_caching,
        c.kv_transport,
    ) == (2, 1234, "router:50051", 512, False, "tcp")
    assert e.decode_context_parallel_size == 1 and e.exact_prefill
    assert not PrefillConfig().engine.exact_prefill  # packed prefill unless asked
    assert c.serving.metrics_port is None  # no /metrics endpoint unless asked
