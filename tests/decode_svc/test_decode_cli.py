"""python -m decode_svc's flags reach the pod's config and its engine's config."""
from __future__ import annotations

from decode_svc.__main__ import build_parser, config_from_args


def test_cli_flags_map_onto_the_config_and_engine(tiny_models):
    path = str(tiny_models["mqa"])
    a = build_parser().parse_args(["--model", path, "--tensor-parallel-size", "2",
                                   "--decode-context-parallel-size", "2", "--num-kv-blocks", "77", "--exact-prefill"])
    c = config_from_args(a)
    e = c.engine_config()
    assert (c.tensor_parallel_size, c.decode_context_parallel_size, c.num_kv_blocks) == (2, 2, 77)
    assert (e.tensor_parallel_size, e.decode_context_parallel_size, e.num_kv_blocks) == (2, 2, 77)
    assert c.exact_prefill and e.exact_prefill
    assert not config_from_args(build_parser().parse_args(["--model", path])).engine_config().exact_prefill
