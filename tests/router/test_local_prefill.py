"""--local-prefill-max-tokens N | auto: the flag's parsing and errors, auto's rule over a decode pod's step profile
(router/local_prefill.py), the per-pod threshold the registry keeps and logs, and which decode pods may then
prefill a request themselves (RouterCore.local_prefill_pods)."""

from __future__ import annotations

import logging

import pytest
from router_helpers import register_request

from pdserve import cli_config
from pdserve_api.v1 import common_pb2, registry_pb2
from router.__main__ import _parser
from router.config import RouterConfig
from router.core import Prepared, RouterCore
from router.local_prefill import STEP_BUDGET, auto_threshold, parse_max_tokens, prefill_seconds, profile_problem
from router.registry import Registry

MODEL = "SmolLM2-135M-Instruct"


def profile(tokens, seconds, step):
    return registry_pb2.StepProfile(prefill_tokens=tokens, prefill_s=seconds, decode_step_s=step)


# --- the flag ---


@pytest.mark.parametrize("raw,want", [("auto", "auto"), ("AUTO", "auto"), ("0", 0), ("64", 64), (" 8 ", 8)])
def test_flag_takes_a_count_or_auto(raw, want):
    assert parse_max_tokens(raw) == want
    args = _parser().parse_args(["--local-prefill-max-tokens", raw])
    assert cli_config.from_args(RouterConfig, args).local_prefill_max_tokens == want


@pytest.mark.parametrize("raw", ["-1", "1.5", "many", ""])
def test_a_bad_flag_value_names_the_flag_and_what_to_pass(raw, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--local-prefill-max-tokens", raw])
    err = capsys.readouterr().err
    assert "--local-prefill-max-tokens" in err and "auto" in err and "integer >= 0" in err


@pytest.mark.parametrize("value", [-1, 1.5, "64", "Auto", True, None])
def test_config_refuses_anything_but_a_count_or_auto(value):
    with pytest.raises(ValueError, match=r"local_prefill_max_tokens must be an integer >= 0 .* 'auto'"):
        RouterConfig(local_prefill_max_tokens=value)


def test_auto_goes_back_onto_a_command_line():
    """A supervisor passes the value through: the argv it builds parses back to auto."""
    argv = cli_config.argv_for(RouterConfig, local_prefill_max_tokens="auto")
    assert argv == ["--local-prefill-max-tokens", "auto"]
    assert cli_config.to_argv(RouterConfig(local_prefill_max_tokens="auto")) == argv
    assert RouterConfig(local_prefill_max_tokens="auto").local_prefill
    assert not RouterConfig().local_prefill


# --- the rule ---


def test_prefill_time_is_linear_between_points_and_never_falls():
    pts = [(1, 0.010), (32, 0.020), (64, 0.040), (128, 0.030), (256, 0.100)]
    assert prefill_seconds(32, pts) == pytest.approx(0.020)
    assert prefill_seconds(48, pts) == pytest.approx(0.030)  # halfway between 32 and 64
    assert prefill_seconds(96, pts) == pytest.approx(0.040)  # the dip at 128 is lifted to 64's time
    assert prefill_seconds(192, pts) == pytest.approx(0.070)
    assert prefill_seconds(16, [(32, 0.064)]) == pytest.approx(0.032)  # one point: through the origin


def test_auto_is_the_longest_prompt_within_the_step_budget():
    # 1 token = one 10 ms step; 2 steps = 20 ms is reached halfway between 32 (15 ms) and 64 (25 ms): 48 tokens
    t = auto_threshold(profile([32, 64, 128, 256], [0.015, 0.025, 0.045, 0.085], 0.010))
    assert STEP_BUDGET == 2.0
    assert t.tokens == 48
    assert "48 tokens" in t.why and "10.0 ms" in t.why


def test_auto_interpolates_below_the_first_measured_length():
    # from (1 token, 10 ms) to (32, 41 ms): 1 ms a token, so 20 ms is 11 tokens
    assert auto_threshold(profile([32, 64], [0.041, 0.073], 0.010)).tokens == 11


def test_auto_stops_at_the_longest_length_measured():
    t = auto_threshold(profile([32, 64, 128, 256], [0.010, 0.011, 0.012, 0.013], 0.010))
    assert t.tokens == 256 and "longest length measured" in t.why


def test_a_pod_whose_prefill_is_slow_still_takes_one_token():
    """A one-token prompt is the work of one decode step, within any budget of at least one step."""
    assert auto_threshold(profile([32], [5.0], 0.010)).tokens == 1


@pytest.mark.parametrize(
    "p,why",
    [
        (None, "no step profile"),
        (profile([], [], 0.01), "no step profile"),
        (profile([32], [0.02], 0.0), "no decode step time"),
    ],
)
def test_without_a_usable_profile_auto_never_prefills_locally(p, why):
    t = auto_threshold(p)
    assert t.tokens == 0 and why in t.why and "never local" in t.why


@pytest.mark.parametrize(
    "p,needle",
    [
        (profile([32, 64], [0.1], 0.01), "2 prompt lengths but 1 prefill times"),
        (profile([64, 32], [0.1, 0.2], 0.01), "ascending"),
        (profile([0, 32], [0.1, 0.2], 0.01), "ascending positive"),
        (profile([32], [float("nan")], 0.01), "finite"),
        (profile([32], [0.1], -1.0), "finite and >= 0"),
    ],
)
def test_malformed_profiles_are_named(p, needle):
    assert needle in profile_problem(p)


# --- the registry and placement ---


def registry(value) -> Registry:
    return Registry(RouterConfig(local_prefill_max_tokens=value), MODEL)


def test_auto_threshold_is_per_decode_pod_logged_once_and_shown(caplog):
    reg = registry("auto")
    fast = profile([32, 64], [0.001, 0.002], 0.010)
    slow = profile([32, 64], [0.041, 0.073], 0.010)
    with caplog.at_level(logging.INFO, logger="router.registry"):
        reg.register(register_request("d-fast", step_profile=fast))
        reg.register(register_request("d-slow", step_profile=slow))
        reg.register(register_request("d-none"))
        reg.register(register_request("d-fast", step_profile=fast))  # again (e.g. the router restarted)
        reg.register(register_request("p0", role=common_pb2.ROLE_PREFILL, step_profile=slow))
    assert {p: e.local_prefill_max_tokens for p, e in reg.pods.items()} == {
        "d-fast": 64,
        "d-slow": 11,
        "d-none": 0,
        "p0": 0,
    }
    lines = [r.getMessage() for r in caplog.records if "local prefill threshold" in r.getMessage()]
    assert len(lines) == 3  # once per decode pod, not for its re-registration nor for the prefill pod
    assert "local prefill threshold for pod d-slow: 11 tokens (auto: " in lines[1]
    assert "no step profile" in lines[2]
    assert reg.pod_status(reg.pods["d-slow"]).local_prefill_max_tokens == 11


def test_a_fixed_threshold_holds_for_every_decode_pod_whatever_it_measured():
    reg = registry(40)
    reg.register(register_request("d0", step_profile=profile([32], [5.0], 0.01)))
    reg.register(register_request("d1"))
    assert reg.pods["d0"].local_prefill_max_tokens == reg.pods["d1"].local_prefill_max_tokens == 40


def test_a_malformed_profile_is_refused_at_registration():
    from pdserve.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="ascending"):
        registry("auto").register(register_request("d0", step_profile=profile([64, 32], [0.1, 0.2], 0.01)))


def _prepared(n: int, **params) -> Prepared:
    return Prepared("r", list(range(3, 3 + n)), common_pb2.SamplingParams(**params), None, False, n + 16)


def test_only_decode_pods_whose_threshold_takes_the_prompt_prefill_it():
    core = RouterCore(RouterConfig(local_prefill_max_tokens="auto"))
    core.registry.register(register_request("p0", role=common_pb2.ROLE_PREFILL))
    core.registry.register(register_request("d-fast", step_profile=profile([32, 64], [0.001, 0.002], 0.010)))
    core.registry.register(register_request("d-slow", step_profile=profile([32, 64], [0.041, 0.073], 0.010)))
    core.registry.register(register_request("d-none"))
    assert core.local_prefill_pods(_prepared(8)) == {"d-fast", "d-slow"}
    assert core.local_prefill_pods(_prepared(11)) == {"d-fast", "d-slow"}
    assert core.local_prefill_pods(_prepared(12)) == {"d-fast"}
    assert core.local_prefill_pods(_prepared(65)) == frozenset()
    assert core.local_prefill_pods(_prepared(8, prompt_logprobs=0)) == frozenset()  # a prefill pod's job
    only_first = _prepared(8)
    only_first.prefill_only = True  # max_tokens == 1: no decode pod at all
    assert core.local_prefill_pods(only_first) == frozenset()
    text = core.metrics.exposition().decode()
    assert 'pdserve_router_local_prefill_max_tokens{pod="d-slow"} 11.0' in text
    assert 'pod="p0"' not in text
    core.registry.deregister(registry_pb2.DeregisterWorkerRequest(pod_id="d-slow"))
    assert 'pod="d-slow"' not in core.metrics.exposition().decode()


def test_zero_never_prefills_locally():
    core = RouterCore(RouterConfig())
    core.registry.register(register_request("d0", step_profile=profile([32], [0.001], 0.01)))
    assert core.local_prefill_pods(_prepared(1)) == frozenset()
    assert "pdserve_router_local_prefill_max_tokens{" not in core.metrics.exposition().decode()
