"""bench/serve_model.py, the discrete-event model behind `pdserve bench serve`'s core-count answer: on cases worked
out by hand (one request alone: TTFT is its prefill, TPOT one decode step; a unified pod's prefill stalls the decode
of a running request; the split keeps it out) and the SLO capacity search."""

from __future__ import annotations

import pytest

from bench.serve_model import StepTimes, attainment, capacity, fit_line, simulate
from bench.serve_stats import SLO

ST = StepTimes(prefill_a=0.0, prefill_b=0.01, decode_c=0.05, decode_d=0.0)  # 10 ms / prompt token, 50 ms / step


def test_one_request_alone():
    for kind, pods in (("unified", 0), ("disaggregated", 1)):
        (r,) = simulate(kind, 2, pods, 0.001, [(100, 5)], ST, chunk=1024, budget=4096, transfer_s=0.0)
        assert r.first - r.arrival == pytest.approx(1.0)  # 100 tokens x 10 ms
        assert (r.last - r.first) / (r.made - 1) == pytest.approx(0.05) and r.made == 5


def test_a_unified_pods_prefill_stalls_running_decodes_and_the_split_does_not():
    # Two requests on one unified pod: the second's 1 s prefill runs in a step of the first's decoding (mixed).
    reqs = [(10, 40), (100, 2)]
    uni = simulate("unified", 1, 0, 1e9, reqs, ST, 1024, 4096, 0.0)  # both arrive at ~0 with a huge rate
    split = simulate("disaggregated", 2, 1, 1e9, reqs, ST, 1024, 4096, 0.0)
    tpot = [(r.last - r.first) / (r.made - 1) for r in (uni[0], split[0])]
    assert tpot[1] == pytest.approx(0.05)  # the decode pod never prefills
    assert tpot[0] > 0.05 + 1.0 / 39 * 0.9  # one gap of the 1 s prefill among 39
    slo = SLO(ttft_s=2.5, tpot_s=0.06)
    assert attainment(split, slo) == 1.0 and attainment(uni, slo) == 0.5


def test_capacity_grows_with_pods_and_lines_fit():
    reqs = [(50, 10)] * 100
    slo = SLO(ttft_s=2.0, tpot_s=0.2)
    one = capacity("unified", 1, 0, reqs, ST, slo, 1024, 4096, 0.0)
    two = capacity("unified", 2, 0, reqs, ST, slo, 1024, 4096, 0.0)
    assert 0 < one < two
    assert fit_line([1, 2, 3], [3, 5, 7]) == pytest.approx((1.0, 2.0))


def test_a_unified_step_decodes_and_prefills_at_once():
    """Mixed steps: a prompt arriving while another request decodes costs the decoder that prefill plus one decode
    row, in one gap, not a prefill step and then a decode step."""
    st = StepTimes(prefill_a=0.0, prefill_b=0.01, decode_c=0.05, decode_d=0.002)
    first, second = simulate("unified", 1, 0, 1e9, [(10, 3), (100, 2)], st, 1024, 4096, 0.0)
    assert first.first == pytest.approx(0.1, abs=1e-6)  # the first prompt alone: 10 tokens
    # step 2: the second prompt (1.0 s) with the first's decode row (0.002 s); both get a token at its end
    assert second.first == pytest.approx(1.102, abs=1e-6)
    # step 3: a decode step of both (0.05 + 2 x 0.002 s), the last token of each
    assert first.last == second.last == pytest.approx(1.156, abs=1e-6) and first.made == 3
