"""PrefillConfig refuses bad settings at construction, naming the setting; the CLI maps flags onto it."""
from __future__ import annotations

import pytest

from prefill_svc.__main__ import build_parser
from prefill_svc.config import PrefillConfig, PrefillConfigError


@pytest.mark.parametrize("kw, needle", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"prefill_chunk_size": 8192, "max_num_batched_tokens": 4096}, "prefill_chunk_size"),
    ({"port": 70000}, "port"),
    ({"metrics_port": -1}, "metrics_port"),
    ({"lease_ttl_s": 0}, "lease_ttl_s"),
    ({"kv_transport": "carrier-pigeon"}, "kv_transport"),
    ({"router_address": "nohostport"}, "router_address"),
    ({"model": "/definitely/not/here"}, "not a directory"),
    ({"block_size": True}, "block_size"),
])
def test_bad_settings_are_refused(kw, needle):
    with pytest.raises(PrefillConfigError, match=needle):
        PrefillConfig(**kw)


def test_cli_flags_map_onto_the_config(tmp_path):
    a = build_parser().parse_args(["--model", str(tmp_path), "--tensor-parallel-size", "2", "--port", "1234",
                                   "--router", "router:50051", "--prefill-chunk-size", "512",
                                   "--no-prefix-caching", "--kv-transport", "tcp", "--exact-prefill"])
    kw = {k: v for k, v in vars(a).items() if k not in ("ready_file", "log_level")}
    c = PrefillConfig(**kw)
    assert (c.tensor_parallel_size, c.port, c.router_address, c.prefill_chunk_size, c.enable_prefix_caching) == \
        (2, 1234, "router:50051", 512, False)
    e = c.engine_config()
    assert e.tensor_parallel_size == 2 and e.prefill_chunk_size == 512 and e.decode_context_parallel_size == 1
    assert c.exact_prefill and e.exact_prefill
    assert not PrefillConfig().engine_config().exact_prefill  # packed prefill unless asked
