"""The soak (load): bench/soak.py's run_soak against a real local cluster, and its checker on made-up runs.

The slow test is the soak itself (the same code `pdserve bench soak` runs, at a size that takes a few minutes on a
small shared machine): 1000 streamed greedy requests, 24 at a time, mixed prompt lengths, ~15% cancelled
mid-stream, against router + prefill pod + decode pod (TP 2 x DCP 2) whose decode KV holds far fewer requests than
are in flight.
"""

from __future__ import annotations

import pytest

from bench.soak import Outcome, Planned, SoakConfig, _evaluate, run_soak


@pytest.mark.slow
def test_soak_against_local_cluster(tmp_path):
    """Over capacity (the router queues / refuses and the decode pod preempts), every request completes with exactly
    the tokens it gets alone, or is refused with RESOURCE_EXHAUSTED and a message, or (the ones we cancel) ends
    cancelled with a prefix of those tokens; no stream hangs; afterwards every pod's KV is all free again and the
    router's queue is empty (no block leaked); no process's peak RSS grows from the first half to the second beyond
    10% + 16 MiB."""
    rep = run_soak(SoakConfig(), tmp_path)
    summary = (
        f"counts {rep['counts']}, queued {rep['queued_in_router']}, preemptions {rep['decode_preemptions']}, "
        f"leaked {rep['kv_blocks_leaked']}, timing {rep['timing_s']}, logs {rep['log_dir']}"
    )
    print(summary)
    assert rep["ok"], "soak found problems:\n" + "\n".join(rep["problems"][:30]) + "\n" + summary
    # The same verdicts, spelled out:
    assert set(rep["counts"]) <= {"completed", "CANCELLED", "cancelled", "RESOURCE_EXHAUSTED"}, summary
    # real work, not mostly refusals (~70% complete here; refusals grow on a slower machine, hence the margin)
    assert rep["counts"].get("completed", 0) > rep["requests"] // 4, summary
    assert rep["kv_blocks_leaked_total"] == 0, summary
    assert rep["queued_in_router"] + rep["resource_exhausted"] + rep["decode_preemptions"] > 0, summary
    assert rep["after"]["router_queue_depth"] == 0 and rep["after"]["router_inflight"] == 0, summary
    procs = {r["process"] for r in rep["rss"]}
    assert {"router", "prefill-0", "decode-0", "decode-0/rank1"} <= procs, procs


def _clean_run(cfg: SoakConfig):
    plan = [
        Planned(0, [5, 6, 7], 4),
        Planned(1, [8, 9], 3, cancel="close", cancel_after=1),
        Planned(2, [10, 11, 12, 13], 2),
    ]
    ref = {p.key: [20 + p.index, 30, 40, 50][: p.max_tokens] for p in plan}
    outcomes = [
        Outcome(0, "completed", tokens=list(ref[plan[0].key]), usage_tokens=4, finish_reason="length", queue_s=0.5),
        Outcome(1, "CANCELLED", "cancelled by the client", tokens=ref[plan[1].key][:1]),
        Outcome(2, "RESOURCE_EXHAUSTED", "router queue is full (16 requests waiting ...)"),
    ]
    idle = {
        "kv_free": {"decode-0": [20, 20]},
        "kv_total": {"decode-0": [20, 20]},
        "pod_inflight": {"decode-0": 0},
        "pod_waiting": {"decode-0": 0},
        "router_queue_depth": 0,
        "router_inflight": 0,
    }
    rss = {"router": {"peak_mib": 80.0, "first_half_peak_mib": 80.0, "second_half_peak_mib": 80.0}}
    return dict(
        cfg=cfg,
        plan=plan,
        outcomes=outcomes,
        ref_of=ref,
        alone={plan[0].key: ref[plan[0].key]},
        base=idle,
        after=dict(idle),
        preemptions=3.0,
        rss=rss,
        dead=[],
    )


def test_soak_checker_flags_every_kind_of_failure():
    """The checker behind the soak passes a clean run and names each failure it is meant to catch: a lost token, a
    repeated token, tokens of another request, a token count that disagrees with the router's usage, a cancelled
    stream that is not a prefix, an unacceptable status, a refusal without a message, a hung stream, a leaked KV
    block, a router queue left non-empty, RSS growth above the bound, a cluster-alone run that disagrees with the
    offline reference, a run that never exceeded capacity, and a service that died."""
    cfg = SoakConfig(num_requests=3, concurrency=2)
    ok = _evaluate(**_clean_run(cfg))
    assert ok["ok"] and ok["problems"] == [] and ok["kv_blocks_leaked_total"] == 0

    def problems(mutate) -> list[str]:
        run = _clean_run(cfg)
        mutate(run)
        rep = _evaluate(**run)
        assert not rep["ok"]
        return rep["problems"]

    def setattr_(i, **kw):
        def m(run):
            for k, v in kw.items():
                setattr(run["outcomes"][i], k, v)

        return m

    assert "tokens:" in problems(setattr_(0, tokens=[20, 30, 50], usage_tokens=3))[0]  # a lost token
    assert "tokens:" in problems(setattr_(0, tokens=[20, 30, 30, 40, 50], usage_tokens=5))[0]  # repeated
    assert "tokens:" in problems(setattr_(0, tokens=[22, 30, 40, 50]))[0]  # another request's first token
    assert "usage says 3" in problems(setattr_(0, usage_tokens=3))[0]
    assert "not a prefix" in problems(setattr_(1, tokens=[99]))[0]
    assert "ended with UNAVAILABLE" in problems(setattr_(2, status="UNAVAILABLE", message="no decode pod"))[0]
    assert "ended with error" in problems(setattr_(0, status="error", message="decode engine failed"))[0]
    assert "no message" in problems(setattr_(2, message=""))[0]
    assert "no_hang:" in problems(setattr_(0, status="hung", message="no end of stream"))[0]

    def leak(run):
        run["after"] = {**run["after"], "kv_free": {"decode-0": [19, 20]}}

    assert "baseline:" in problems(leak)[0]
    leaked = _evaluate(**{**_clean_run(cfg), "after": {**_clean_run(cfg)["after"], "kv_free": {"decode-0": [19, 20]}}})
    assert leaked["kv_blocks_leaked_total"] == 1

    def queue_left(run):
        run["after"] = {**run["after"], "router_queue_depth": 1}

    assert "baseline:" in problems(queue_left)[0]

    def rss_growth(run):
        run["rss"] = {"router": {"peak_mib": 110.0, "first_half_peak_mib": 80.0, "second_half_peak_mib": 110.0}}

    assert "rss: router" in problems(rss_growth)[0]

    def alone_differs(run):
        key = run["plan"][0].key
        run["alone"] = {key: [21, 30, 40, 50]}

    assert "reference:" in problems(alone_differs)[0]

    def no_overload(run):
        run["preemptions"] = 0.0
        run["outcomes"][0].queue_s = 0.0
        run["outcomes"][2] = Outcome(2, "completed", tokens=[22, 30], usage_tokens=2, finish_reason="length")

    assert "overload:" in problems(no_overload)[0]

    def died(run):
        run["dead"] = ["decode-0"]

    assert "services died" in problems(died)[0]


def test_soak_config_refuses_a_decode_pod_too_small_for_one_request():
    """SoakConfig is validated at construction: KV that cannot hold the longest request alone is refused with the
    fix, as is DCP above TP."""
    with pytest.raises(ValueError, match="cannot hold the longest request alone"):
        SoakConfig(decode_num_kv_blocks=2)
    with pytest.raises(ValueError, match="cannot exceed decode_tp"):
        SoakConfig(decode_tp=1, decode_dcp=2)
