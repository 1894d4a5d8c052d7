"""RouterConfig: validated at construction, with messages that name the field."""

from __future__ import annotations

import pytest

from router.__main__ import _parser
from router.config import RouterConfig


def test_defaults_are_valid():
    c = RouterConfig()
    assert c.unhealthy_after_s == pytest.approx(3.0)


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"port": -1}, "port"),
        ({"port": 70000}, "port"),
        ({"port": True}, "port"),
        ({"host": ""}, "host"),
        ({"heartbeat_interval_s": 0}, "heartbeat_interval_s"),
        ({"heartbeat_interval_s": float("nan")}, "heartbeat_interval_s"),
        ({"max_queue_len": -1}, "max_queue_len"),
        ({"prefix_block_size": 0}, "prefix_block_size"),
        ({"eviction_timeout_s": 2.0}, "eviction_timeout_s"),
        ({"lease_ttl_s": -1}, "lease_ttl_s"),
        ({"model": "/nonexistent/model"}, "tokenizer.json"),
        ({"served_model_name": ""}, "served_model_name"),
        ({"helper_threads": "fifo"}, "helper_threads"),
    ],
)
def test_bad_values_are_refused_with_the_field_name(kw, needle):
    with pytest.raises(ValueError, match=needle):
        RouterConfig(**kw)


def test_model_name_defaults_to_directory_name(tmp_path):
    assert RouterConfig().model_name_for("/models/SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    assert RouterConfig(served_model_name="x").model_name_for("/models/y") == "x"


def test_cli_flags_cover_every_field():
    args = _parser().parse_args(["--port", "0", "--max-queue-len", "3", "--heartbeat-interval-s", "0.5"])
    assert args.port == 0 and args.max_queue_len == 3 and args.heartbeat_interval_s == 0.5
    assert args.model is None


def test_event_loop_choice_is_validated():
    """event_loop takes auto / uvloop / asyncio only, and auto means uvloop exactly when it is installed."""
    import importlib.util

    with pytest.raises(ValueError, match="event_loop"):
        RouterConfig(event_loop="trio")
    assert RouterConfig(event_loop="asyncio").uses_uvloop is False
    assert RouterConfig().uses_uvloop is (importlib.util.find_spec("uvloop") is not None)
