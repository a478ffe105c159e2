"""The analytic predictor: equals the live run's predicted_ms, and its grid agrees with its scalar path."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import fast_config, tiny_scenario
from voicepipe.config import load_config
from voicepipe.predict import Predictor, predict, predict_grid, utterance
from voicepipe.runner import run_pipeline
from voicepipe.scenario import CacheEntry, Scenario, Turn, load_scenario


def assert_live_equals_predicted(res, preds) -> None:
    assert len(res.records) == len(preds)
    for rec, p in zip(res.records, preds, strict=True):
        assert (rec.session, rec.turn, rec.path) == (p.session, p.turn, p.path)
        assert rec.predicted_ms == pytest.approx(p.predicted_ms, abs=0.01)
        live = {(b.stage, b.what): b.ms for b in rec.breakdown if b.modelled}
        pred = {(b.stage, b.what): b.ms for b in p.breakdown if b.modelled}
        assert live == pytest.approx(pred, abs=0.01)
        if rec.path in ("agent", "cache"):  # history grows the same way: same prompts, same cost
            assert rec.cost_usd == pytest.approx(p.cost_usd, rel=1e-9, abs=1e-12)


async def test_live_predicted_equals_predict_on_the_agent_path():
    # a hardware backend: its TTFT depends on the prompt, so history must grow exactly as predicted
    cfg = fast_config("agent.backend=h100-sxm/llama-3.1-70b", "seed=7")
    sc = tiny_scenario(turns=3)
    assert_live_equals_predicted(await run_pipeline(cfg, [sc], 1), predict(cfg, [sc]))


async def test_live_predicted_equals_predict_with_premature_endpoints_and_cache():
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
    assert_live_equals_predicted(await run_pipeline(cfg, [sc], 1), preds)


def test_utterance_replays_endpointing():
    turn = load_scenario("hesitant-speaker").turns[0]  # two long pauses, annotated incomplete
    assert utterance(load_config(None, ["asr.silence_ms=200"]), turn).segment == 2
    assert utterance(load_config(None, ["asr.silence_ms=1000"]), turn).segment == 0
    assert utterance(load_config(None, ["asr.endpointing=smart"]), turn).segment == 0


def test_breakdown_sums_and_order_of_backends():
    sc = load_scenario("cafe-order")
    slow = predict(load_config(None, ["agent.backend=sonnet-gpu"]), [sc])
    fast = predict(load_config(None, ["agent.backend=cerebras-wse3/llama-3.1-8b"]), [sc])
    for p in slow + fast:
        assert sum(b.ms for b in p.breakdown) == pytest.approx(p.predicted_ms, abs=1e-6)
    assert all(s.predicted_ms > f.predicted_ms for s, f in zip(slow, fast, strict=True))


def test_grid_equals_scalar_predictor():
    sc = load_scenario("support-call")
    cfgs = [
        load_config(None, [f"agent.backend={b}", f"asr.silence_ms={s}"])
        for b in ("sonnet-gpu", "groq-lpu/llama-3.1-8b")
        for s in (200, 450)
    ] + [load_config("scenarios/configs/fast-lane.yaml")]
    grid = predict_grid(cfgs, sc)
    assert grid.shape == (5, len(sc.turns))
    for i, cfg in enumerate(cfgs):
        scalar = np.array([p.predicted_ms for p in Predictor(cfg).scenario(sc)])
        np.testing.assert_allclose(grid[i], scalar, atol=1e-6)


def test_council_and_judge_predictions():
    sc = load_scenario("cafe-order")
    first = predict(load_config("scenarios/configs/council-first.yaml"), [sc])
    judge = predict(load_config("scenarios/configs/council-judge-slow-gpu.yaml"), [sc])
    assert all(p.path == "council" for p in first + judge)
    assert np.median([p.predicted_ms for p in judge]) > 2 * np.median([p.predicted_ms for p in first])


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


async def test_live_predicted_equals_predict_with_preemption_through_a_hesitation():
    sc = Scenario(
        name="pre",
        turns=[
            Turn(
                user="Yes, Friday. [500] Oh, and one of us uses a wheelchair.", reply="No problem.", gap_ms=50
            )
        ],
    )
    cfg = fast_config(
        "router.preemptive.enabled=true", "router.preemptive.stable_ms=120", "asr.silence_ms=450"
    )
    preds = predict(cfg, [sc])
    res = await run_pipeline(cfg, [sc], 1)
    assert preds[0].path == res.records[0].path == "preemptive"
    assert res.records[0].predicted_ms == pytest.approx(preds[0].predicted_ms, abs=1.0)  # within the hops
