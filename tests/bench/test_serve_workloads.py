"""bench serve's workloads and goodput ratios: the long workload's prompts stay in 2-4K tokens, and the conditional
side is compared with the better of the two fixed placements on every workload, zero goodput giving a named lower
bound, never infinity."""

from __future__ import annotations

from bench.serve import _goodput_ratios, workload, workloads


def _side(goodputs: list[float], duration_s: float = 10.0) -> dict:
    return {
        "max_goodput_rps": max(goodputs),
        "sweep": [{"rate_rps": i, "goodput_rps": g, "duration_s": duration_s} for i, g in enumerate(goodputs)],
    }


def test_long_prompts_stay_in_their_range_and_chat_keeps_its_clip():
    for quick in (True, False):
        chat, long = workloads(quick)
        assert (chat.name, long.name) == ("chat", "long")
        lens = [len(ids) for ids, _ in workload(200, long.prompt, long.output, 49152, prompt_range=long.prompt_range)]
        assert min(lens) >= 2048 and max(lens) <= 4096 and min(lens) < long.prompt < max(lens)
        assert long.tpot_x < chat.tpot_x  # the long workload's TPOT SLO is the tight one
    lens = [len(ids) for ids, _ in workload(400, 64, 12, 49152)]
    assert min(lens) >= 16 and max(lens) <= 256


def test_conditional_is_measured_against_the_better_placement_per_workload():
    per = {
        "chat": {"unified": _side([0.5, 0.7]), "disaggregated": _side([0.4, 0.5]), "conditional": _side([0.7])},
        "long": {"unified": _side([0.1, 0.0]), "disaggregated": _side([0.2, 0.3]), "conditional": _side([0.27])},
    }
    ratios, lower = _goodput_ratios(per)
    assert ratios["goodput_disaggregated_vs_unified"] == 0.5 / 0.7
    assert abs(ratios["goodput_long_disaggregated_vs_unified"] - 3.0) < 1e-12
    assert ratios["goodput_conditional_vs_best_of_both"] == 1.0  # vs unified on chat
    assert abs(ratios["goodput_long_conditional_vs_best_of_both"] - 0.9) < 1e-12  # vs disaggregated on long
    assert (
        ratios["goodput_conditional_vs_best_of_both_worst_workload"]
        == ratios["goodput_long_conditional_vs_best_of_both"]
    )
    assert lower == []


def test_a_side_without_goodput_gives_a_named_lower_bound():
    per = {"long": {"unified": _side([0.0, 0.0], duration_s=20.0), "disaggregated": _side([0.25])}}
    ratios, lower = _goodput_ratios(per)
    assert ratios["goodput_long_disaggregated_vs_unified"] == 0.25 / (1 / 20.0)
    assert lower == ["goodput_long_disaggregated_vs_unified"]
