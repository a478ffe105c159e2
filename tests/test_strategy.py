import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from voicepipe.strategy import (
    LRU,
    best_match,
    council_quality,
    judge_accuracy,
    majority_accuracy,
    same_utterance,
    similarity,
)


def test_similarity_ignores_case_and_punctuation_and_ranks_paraphrases():
    assert similarity("What time do you close?", "what time do you close") == pytest.approx(1.0)
    close = similarity("when do you close", "what time do you close")
    far = similarity("do you have oat milk", "what time do you close")
    assert 0.4 < close < 0.95
    assert far < close
    assert similarity("", "x") == 0.0


def test_best_match_threshold_semantics():
    qs = [("what time do you close", "hours"), ("do you have wifi", "wifi")]
    s, key = best_match("What time do you close tonight?", qs)
    assert key == "hours" and s >= 0.8
    s, key = best_match("can I pay by card", qs)
    assert s < 0.8


def test_commit_rule_ignores_case_and_punctuation_only():
    assert same_utterance("Yes, Friday!", "yes friday")
    assert not same_utterance("Yes, Friday", "Yes, Friday at seven")


def test_lru_evicts_least_recent():
    c: LRU[str, int] = LRU(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1  # a is now most recent
    c.put("c", 3)
    assert c.get("b") is None and c.get("a") == 1 and c.get("c") == 3
    assert c.evictions == 1
    z: LRU[str, int] = LRU(0)
    z.put("a", 1)
    assert len(z) == 0


def test_majority_of_three_matches_closed_form():
    p = 0.7
    assert majority_accuracy([p, p, p]) == pytest.approx(p**3 + 3 * p**2 * (1 - p))
    assert majority_accuracy([0.9]) == pytest.approx(0.9)
    # two members: both right, or exactly one right and the coin picks it
    assert majority_accuracy([0.8, 0.6]) == pytest.approx(0.8 * 0.6 + 0.5 * (0.8 * 0.4 + 0.2 * 0.6))


@given(st.lists(st.floats(0, 1), min_size=1, max_size=7))
def test_majority_equals_brute_force(ps):
    total = 0.0
    for outcome in itertools.product([0, 1], repeat=len(ps)):
        pr = 1.0
        for o, p in zip(outcome, ps, strict=True):
            pr *= p if o else 1 - p
        right = sum(outcome)
        total += pr * (1.0 if 2 * right > len(ps) else 0.5 if 2 * right == len(ps) else 0.0)
    assert majority_accuracy(ps) == pytest.approx(total, abs=1e-9)


def test_judge_bounded_by_best_member_plus_gain():
    assert judge_accuracy([0.6, 0.7, 0.65], 0.05) == pytest.approx(0.75)
    assert judge_accuracy([0.99], 0.05) == 1.0


def test_council_quality_by_aggregation():
    assert council_quality("first", [0.6, 0.9]) == 0.6
    assert council_quality("vote", [0.7, 0.7, 0.7]) == pytest.approx(0.784)
    assert council_quality("judge", [0.6, 0.7], 0.02) == pytest.approx(0.72)
    assert council_quality("vote", [0.7, None]) is None
