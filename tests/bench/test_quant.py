"""bench/quant.py's pieces that decide its figures: distinct prompts and the matching greedy prefix."""

from __future__ import annotations

import pytest

from bench import quant


def test_prompts_are_distinct_and_enough_for_the_issue_check():
    ps = quant.prompts(64)
    assert len(set(ps)) == 64
    with pytest.raises(ValueError, match="at most"):
        quant.prompts(1000)


def test_matching_prefix_counts_tokens_before_the_first_difference():
    assert quant.matching_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert quant.matching_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert quant.matching_prefix([], [1]) == 0
