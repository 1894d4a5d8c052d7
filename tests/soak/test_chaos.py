"""The chaos soak (bench/chaos.py): load above decode KV capacity on a local cluster (2 routers, 2 prefill pods, a
TP 2 x DCP 2 decode pod, restart policy on-failure) while a seeded nemesis SIGKILLs and SIGSTOPs/SIGCONTs prefill
pods, a decode rank, a router, and kills a prefill pod holding KV that the decode pod has not read yet; and the
checker's pieces on made-up data."""

from __future__ import annotations

import pytest

from bench.chaos import FAULT_KINDS, FULL, ChaosConfig, Nemesis, _replayed, recovery_time, run_chaos
from bench.soak import Outcome


@pytest.mark.slow
def test_chaos_soak_heals_and_every_request_ends_once_with_right_tokens(tmp_path):
    """Every request ends exactly once: completed with the tokens of its fault-free greedy run, or failed with an
    accepted status and a message before its deadline, after a prefix of those tokens; none hangs; every pod is
    READY again afterwards with all its KV free within the lease TTL; the token rate is back within 20% of the
    fault-free rate within 30 s of the last fault."""
    rep = run_chaos(FULL, tmp_path)
    summary = (
        f"requests {rep['requests']}, completed {rep['completed']}, failed {rep['failed']}, faults "
        f"{rep['faults']}, restarts {rep['restarts']}, recovery {rep['recovery_s']}, logs {rep['log_dir']}"
    )
    print(summary)
    assert rep["ok"], "chaos soak found problems:\n" + "\n".join(rep["problems"][:30]) + "\n" + summary
    assert rep["lost"] == 0 and rep["ended_twice"] == 0 and rep["hung"] == 0, summary
    assert rep["wrong_tokens"] == 0 and rep["duplicated_tokens"] == 0, summary
    assert rep["kv_blocks_leaked"] == 0, summary
    assert rep["recovery_s"] is not None and rep["recovery_s"] <= 30, summary
    assert {f["kind"] for f in rep["faults"]} == set(FAULT_KINDS), summary
    assert rep["restarts"], "no fault needed the restart policy: " + summary
    assert rep["completed"] > 0, summary


def test_nemesis_schedule_is_seeded_and_fires_every_kind():
    a = Nemesis(None, ChaosConfig(seed=3, num_faults=10), 0.0).kinds
    assert a == Nemesis(None, ChaosConfig(seed=3, num_faults=10), 0.0).kinds
    assert set(a) == set(FAULT_KINDS) and len(a) == 10
    assert a != Nemesis(None, ChaosConfig(seed=4, num_faults=10), 0.0).kinds


def test_replayed_tokens_are_counted_as_duplicates():
    ref = [1, 2, 3, 4, 5, 6]
    assert _replayed([1, 2, 3, 2, 3, 4], ref) == 2  # resumed two tokens back
    assert _replayed([1, 2, 3], ref) == 0
    assert _replayed([1, 2, 9], ref) == 0  # wrong, not repeated


def test_recovery_is_the_first_window_back_within_the_ratio():
    cfg = ChaosConfig(recovery_window_s=2.0, recovery_ratio=0.8)
    o = Outcome(0, "completed")
    # 10 tokens/s until t=10, nothing until t=14, then 9 tokens/s
    o.token_times = [i / 10 for i in range(100)] + [14 + i / 9 for i in range(90)]
    assert recovery_time([o], 10.0, 10.0, cfg, 24.0) == pytest.approx(4.0, abs=0.3)
    assert recovery_time([o], 10.0, 20.0, cfg, 24.0) is None
