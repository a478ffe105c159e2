"""predict = the live stages on virtual time: a live run's predicted_ms and cost equal it on every path."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import fast_config, tiny_scenario
from voicepipe.config import load_config
from voicepipe.predict import predict
from voicepipe.runner import run_pipeline
from voicepipe.scenario import CacheEntry, Scenario, Turn, load_scenario

FAST_MEMBERS = "council.members=[groq-lpu/llama-3.1-8b,cerebras-wse3/llama-3.1-8b,cerebras-wse3/qwen3-8b]"


def assert_live_equals_predicted(res, preds, *, hop_tolerant: bool = False) -> None:
    """Same turns, paths, modelled time (and its breakdown) and cost. ``hop_tolerant``: the timing
    depends on when messages arrive (overlap, queueing), so live may differ by the hops it paid."""
    assert res.stage_errors == 0 and len(res.records) == len(preds)
    live = sorted(res.records, key=lambda r: (r.session, r.turn))
    for rec, p in zip(live, sorted(preds, key=lambda p: (p.session, p.turn)), strict=True):
        assert (rec.session, rec.turn, rec.path, rec.route) == (p.session, p.turn, p.path, p.route)
        if hop_tolerant:
            # bounded by the turn's bus time (hops + scheduling) plus hops hidden under overlapping spans
            assert abs(rec.predicted_ms - p.predicted_ms) <= 2 * rec.tax_ms + 5.0, (rec, p)
            continue
        assert p.exact
        assert rec.predicted_ms == pytest.approx(p.predicted_ms, abs=0.001)
        live_parts = {(b.stage, b.what): b.ms for b in rec.breakdown if b.modelled}
        pred_parts = {(b.stage, b.what): b.ms for b in p.breakdown if b.modelled}
        assert live_parts == pytest.approx(pred_parts, abs=0.001)
        assert rec.cost_usd == pytest.approx(p.cost_usd, rel=1e-12, abs=1e-15)
        assert rec.quality == p.quality and rec.backend == p.backend


async def test_agent_path_on_a_hardware_backend():
    # its TTFT depends on the prompt, so history must grow exactly as live
    cfg = fast_config("agent.backend=h100-sxm/llama-3.1-70b", "seed=7")
    sc = tiny_scenario(turns=3)
    assert_live_equals_predicted(await run_pipeline(cfg, [sc], 1), predict(cfg, [sc]))


async def test_premature_endpoints_and_a_prerendered_cache_hit():
    sc = Scenario(
        name="mix",
        turns=[
            Turn(user="I'd like, um, [600] a latte please.", reply="Sure, one latte.", gap_ms=50),
            Turn(user="What time do you close?", reply="We close at six tonight.", gap_ms=50),
        ],
        cache=[CacheEntry(questions=["what time do you close"], answer="We close at six tonight.")],
    )
    cfg = fast_config("cache.enabled=true", "router.cache_first=true", "agent.backend=a100-80gb/llama-3.1-8b")
    preds = predict(cfg, [sc])
    assert preds[0].premature_endpoint and preds[1].path == "cache"
    res = await run_pipeline(cfg, [sc], 1)
    # the withdrawn segment's work is cancelled when the next word arrives: its waste is hop-timed
    assert_live_equals_predicted(res, preds, hop_tolerant=True)
    rec, p = res.records[1], preds[1]
    assert rec.predicted_ms == pytest.approx(p.predicted_ms, abs=0.001) and rec.cost_usd == p.cost_usd == 0


@pytest.mark.parametrize("aggregation", ["first", "vote", "judge", "draft-refine"])
async def test_council(aggregation):
    cfg = fast_config(
        "router.policy=rules", "router.default=council", FAST_MEMBERS, f"council.aggregation={aggregation}",
        "council.judge=cerebras-wse3/llama-3.1-8b", "council.k=2",
    )  # fmt: skip
    sc = tiny_scenario(turns=2)
    preds = predict(cfg, [sc])
    assert all(p.path == "council" and p.backend == f"council:{aggregation}" for p in preds)
    assert_live_equals_predicted(await run_pipeline(cfg, [sc], 1), preds)


@pytest.mark.parametrize("config", ["classifier.yaml", "router-rules.yaml"])
async def test_router_policies(config):
    cfg = load_config(
        f"scenarios/configs/{config}", ["client.playout=first_audio", "client.turn_timeout_s=10"]
    )
    sc = tiny_scenario(turns=3)
    preds = predict(cfg, [sc])
    assert_live_equals_predicted(await run_pipeline(cfg, [sc], 1), preds)
    if config == "classifier.yaml":
        assert all(p.route.startswith("classifier:") for p in preds)
        assert all(any(b.what == "classifier" for b in p.breakdown) for p in preds)


async def test_preemptive_commit_and_cancel():
    sc = Scenario(
        name="pre",
        turns=[
            # eager end of turn at the hesitation (cancelled: the words go on), then on the full utterance
            Turn(
                user="Yes, Friday. [500] Oh, and one of us uses a wheelchair.", reply="No problem.", gap_ms=50
            ),
            Turn(user="Thanks a lot.", reply="You're welcome.", gap_ms=50),
        ],
    )
    cfg = fast_config(
        "router.preemptive.enabled=true", "router.preemptive.stable_ms=120", "asr.silence_ms=450"
    )
    preds = predict(cfg, [sc])
    assert [p.path for p in preds] == ["preemptive", "preemptive"] and not any(p.exact for p in preds)
    assert preds[0].wasted_tokens > 0 and preds[1].wasted_tokens == 0  # the cancelled first attempt
    res = await run_pipeline(cfg, [sc], 1)
    assert_live_equals_predicted(res, preds, hop_tolerant=True)
    assert res.records[0].wasted_tokens > 0


async def test_barge_in():
    sc = Scenario(
        name="barge",
        turns=[
            Turn(
                user="Tell me about the menu.",
                reply="We have coffee, tea, and pastries. " * 3,
                barge_in_after_ms=300,
                gap_ms=50,
            ),
            Turn(user="Just a tea then.", reply="One tea, coming up.", gap_ms=50),
        ],
    )
    cfg = fast_config("agent.backend=h100-sxm/llama-3.1-8b")
    preds = predict(cfg, [sc])
    res = await run_pipeline(cfg, [sc], 1)
    assert res.records[0].barge_in_stop_ms is not None
    assert_live_equals_predicted(res, preds)


async def test_speculative_render_of_a_learned_answer():
    q = "What time do you close tonight?"
    sc = Scenario(
        name="spec",
        turns=[
            Turn(user=q, reply="We close at six tonight.", gap_ms=50),
            Turn(user=q, reply="We close at six tonight.", gap_ms=50, words_per_minute=100),
        ],
    )
    cfg = fast_config("cache.enabled=true", "cache.learn=true", "router.cache_first=true", "tts.ttfb_ms=300")
    preds = predict(cfg, [sc])
    assert [p.path for p in preds] == ["agent", "cache"]
    assert any(b.what == "render (speculative)" for b in preds[1].breakdown) or preds[1].predicted_ms < 700
    assert_live_equals_predicted(await run_pipeline(cfg, [sc], 1), preds, hop_tolerant=True)


async def test_two_concurrent_sessions_sharing_a_device():
    cfg = fast_config("agent.backend=a100-40gb/llama-3.1-8b", "agent.prompt_tokens=4000")
    sc = tiny_scenario(turns=2)
    preds = predict(cfg, [sc], 2)
    alone = predict(cfg, [sc], 1)
    assert {p.session for p in preds} == {"tiny-0", "tiny-1"} and not any(p.exact for p in preds)

    def agent_ms(p) -> float:
        return sum(b.ms for b in p.breakdown if b.stage == "agent")

    together = [p for p in preds if p.session == "tiny-0"]
    assert all(agent_ms(t) > agent_ms(a) for t, a in zip(together, alone, strict=True))  # they batch
    assert_live_equals_predicted(await run_pipeline(cfg, [sc], 2), preds, hop_tolerant=True)


def test_breakdown_sums_and_order_of_backends():
    sc = load_scenario("cafe-order")
    slow = predict(load_config(None, ["agent.backend=sonnet-gpu"]), [sc])
    fast = predict(load_config(None, ["agent.backend=cerebras-wse3/llama-3.1-8b"]), [sc])
    for p in slow + fast:
        assert sum(b.ms for b in p.breakdown) == pytest.approx(p.predicted_ms, abs=1e-6)
    assert all(s.predicted_ms > f.predicted_ms for s, f in zip(slow, fast, strict=True))


def test_council_and_judge_predictions():
    sc = load_scenario("cafe-order")
    first = predict(load_config("scenarios/configs/council-first.yaml"), [sc])
    judge = predict(load_config("scenarios/configs/council-judge-slow-gpu.yaml"), [sc])
    assert all(p.path == "council" for p in first + judge)
    assert np.median([p.predicted_ms for p in judge]) > 2 * np.median([p.predicted_ms for p in first])


def test_a_config_the_stages_reject_is_an_error_not_a_timeout():
    cfg = load_config(
        None, ["router.policy=rules", "router.default=council", FAST_MEMBERS, "council.deadline_ms=1"]
    )
    with pytest.raises(ValueError, match="council"):
        predict(cfg, [tiny_scenario(turns=1)])


def vp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_predict_json_and_errors(tmp_path):
    out = tmp_path / "p.jsonl"
    r = vp("predict", "rapid-fire", "--set", "agent.backend=groq-llama-3.1-8b", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "PREDICTED" in r.stdout
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 8 and all(rec["modelled"] and rec["predicted_ms"] > 0 for rec in recs)
    bad = vp("predict", "rapid-fire", "--set", "agent.backend=nope")
    assert bad.returncode == 2 and "agent.backend" in bad.stderr and "Traceback" not in bad.stderr


def test_compare_predict_rows_in_expected_direction(tmp_path):
    out = tmp_path / "c.jsonl"
    r = vp("compare", "cafe-order", "--predict", "--vary", "agent.backend=sonnet-gpu,cerebras-llama-3.1-8b",
           "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    by = {}
    for rec in recs:
        by.setdefault(rec["label"], []).append(rec["predicted_ms"])
    slow, fast = by["agent.backend=sonnet-gpu"], by["agent.backend=cerebras-llama-3.1-8b"]
    assert np.median(slow) > np.median(fast) + 300


def test_importing_voicepipe_and_predicting_leaves_the_programs_collector_settings_alone():
    """A program using voicepipe as a library keeps its own GC settings (only the CLI opts in to tuning):
    checked in a fresh interpreter with unusual settings, before, during and after a virtual prediction."""
    code = """
import gc, json
gc.set_threshold(1234, 5, 6)
before = (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count())
import voicepipe
from voicepipe.clock import run_virtual
from tests.conftest import fast_config, tiny_scenario
from voicepipe.predict import predict
preds = predict(fast_config(), [tiny_scenario()], 2)

async def during():
    return (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count())

print(json.dumps([before, run_virtual(during()), (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()), len(preds)]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, during, after, n = json.loads(out.stdout.strip().splitlines()[-1])
    assert n == 4
    assert before == [True, [1234, 5, 6], 0]
    assert during == before and after == before
