"""`pdserve bench serve`'s statistics on a synthetic trace whose answers are worked out by hand: TTFT, TPOT and ITL
percentiles, goodput and SLO attainment (failed and one-token requests included), the SLO capacity of a sweep and
vLLM's --goodput syntax."""

from __future__ import annotations

import pytest

from bench.serve_stats import SLO, RequestRecord, meets, parse_goodput, percentiles, slo_capacity, summarize, tpot

SLO_1S_100MS = SLO(ttft_s=1.0, tpot_s=0.1)


def trace() -> list[RequestRecord]:
    return [
        # TTFT 1.0 (meets, equal counts), TPOT (1.3 - 1.0) / 2 = 0.15 (misses); ITLs 0.1, 0.2
        RequestRecord(0.0, 10, [1.0, 1.1, 1.3], [1, 1, 1], ok=True),
        # TTFT 0.5, a two-token chunk: TPOT 0.1 / (3 - 1) = 0.05 -> meets both; ITL 0.1
        RequestRecord(1.0, 20, [1.5, 1.6], [1, 2], ok=True),
        # one token: no TPOT to miss, but TTFT 3.0 misses
        RequestRecord(2.0, 30, [5.0], [1], ok=True),
        # failed before any token: a miss that counts in attainment, not in latency percentiles
        RequestRecord(3.0, 40, ok=False, error="HTTP 503"),
    ]


def test_per_request_definitions():
    r = trace()
    assert tpot(r[0]) == pytest.approx(0.15)
    assert tpot(r[1]) == pytest.approx(0.05)
    assert tpot(r[2]) == 0.0 and tpot(r[3]) is None
    assert [meets(x, SLO_1S_100MS) for x in r] == [False, True, False, False]


def test_summary_of_the_trace():
    s = summarize(trace(), duration_s=5.0, slo=SLO_1S_100MS)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["errors"] == {"HTTP 503": 1}
    assert s["goodput_rps"] == pytest.approx(1 / 5.0)
    assert s["slo_attainment"] == pytest.approx(1 / 4)
    assert s["throughput_rps"] == pytest.approx(3 / 5.0)
    assert s["output_tok_s"] == pytest.approx(7 / 5.0)
    # TTFTs 0.5, 1.0, 3.0: p90 = 1.0 + 0.8 * 2.0 by linear interpolation
    assert s["ttft_s"] == pytest.approx({"p50": 1.0, "p90": 2.6, "p99": 2.96})
    # ITLs 0.1, 0.2, 0.1 pooled over requests
    assert s["itl_s"] == pytest.approx({"p50": 0.1, "p90": 0.18, "p99": 0.198})
    # TPOT only of requests with more than one token: 0.15 and 0.05
    assert s["tpot_s"]["p50"] == pytest.approx(0.1)
    assert s["mean_ttft_s"] == pytest.approx(1.5)


def test_looser_slo_counts_more_requests():
    s = summarize(trace(), duration_s=5.0, slo=SLO(ttft_s=3.0, tpot_s=0.16))
    assert s["goodput_rps"] == pytest.approx(3 / 5.0) and s["slo_attainment"] == pytest.approx(3 / 4)


def test_empty_percentiles_and_bad_duration():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    with pytest.raises(ValueError, match="duration_s"):
        summarize(trace(), 0.0, SLO_1S_100MS)


def test_slo_capacity_is_the_last_rate_before_the_first_miss():
    att = {1.0: 1.0, 2.0: 0.9, 4.0: 0.5, 8.0: 0.95}  # 8 rps "recovering" is noise past the knee
    sweep = [(rate, {"slo_attainment": a}) for rate, a in att.items()]
    assert slo_capacity(sweep) == 2.0
    assert slo_capacity([(1.0, {"slo_attainment": 0.5})]) == 0.0


def test_goodput_flag_like_vllm():
    assert parse_goodput(["ttft:2000", "tpot:150"], SLO_1S_100MS) == SLO(2.0, 0.15)
    assert parse_goodput(["tpot:50"], SLO_1S_100MS) == SLO(1.0, 0.05)
    for bad in (["e2el:100"], ["ttft=100"], ["ttft:abc"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad, SLO_1S_100MS)
    with pytest.raises(ValueError, match="positive"):
        SLO(0.0, 1.0)
