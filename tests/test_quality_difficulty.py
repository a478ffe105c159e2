"""Modelled quality follows the turn's complexity: a base score times a published difficulty factor."""

from __future__ import annotations

import pytest

from tests.conftest import fast_config
from voicepipe.hardware import quality
from voicepipe.predict import predict
from voicepipe.scenario import Scenario, Turn

TURNS = [
    Turn(user="Is that right?", reply="Yes, that's right.", gap_ms=50, complexity="low"),
    Turn(user="And the bill?", reply="Your bill is forty two fifty.", gap_ms=50),
    Turn(user="Split it three ways with tax.", reply="That is fifteen each with tax.", gap_ms=50,
         complexity="high"),
]


def test_same_backend_scores_easy_turns_higher_than_hard_ones():
    q = quality.quality_of("llama-3.1-8b")
    low, med, high = (quality.at_complexity(q, c) for c in ("low", "medium", "high"))
    assert low is not None and high is not None
    assert low > med > high
    assert med == q and quality.at_complexity(q, None) == q  # no hint: the base score
    assert quality.at_complexity(None, "high") is None  # unknown stays unknown
    assert quality.at_complexity(0.99, "low") <= 1.0


def test_llama_3_1_8b_factors_are_the_model_cards_ratios():
    # Llama 3.1 8B Instruct: MMLU (0-shot CoT) 73.0, ARC-C 83.4, MMLU-Pro (5-shot CoT) 48.3
    assert quality.at_complexity(0.73, "low") == pytest.approx(0.834, abs=1e-9)
    assert quality.at_complexity(0.73, "high") == pytest.approx(0.483, abs=1e-9)


def test_a_stronger_model_loses_less_on_hard_turns():
    small = quality.at_complexity(0.73, "high") / 0.73
    large = quality.at_complexity(0.886, "high") / 0.886
    assert large > small


def test_every_difficulty_number_carries_a_source():
    refs = quality.difficulty_references()
    assert len(refs) >= 3
    for r in refs:
        assert r.source.startswith("http") or "(http" in r.source
        assert 0 < r.high < r.medium < r.low <= 100


def test_recorded_quality_of_a_run_follows_the_scripted_complexity():
    cfg = fast_config("agent.backend=groq-lpu/llama-3.1-8b")
    preds = sorted(predict(cfg, [Scenario(name="bill", turns=TURNS)]), key=lambda p: p.turn)
    assert [p.path for p in preds] == ["agent"] * 3
    low, med, high = (p.quality for p in preds)
    assert low > med > high


def test_council_vote_quality_follows_complexity():
    members = "council.members=[groq-lpu/llama-3.1-8b,cerebras-wse3/llama-3.1-8b,cerebras-wse3/qwen3-8b]"
    cfg = fast_config("router.policy=rules", "router.default=council", "council.aggregation=vote", members)
    preds = sorted(predict(cfg, [Scenario(name="bill", turns=TURNS)]), key=lambda p: p.turn)
    assert all(p.path == "council" for p in preds)
    assert preds[0].quality > preds[1].quality > preds[2].quality
