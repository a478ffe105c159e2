"""The hardware agent's 80 % interval carried into predict's turns: a range, and a verdict that never
counts a turn inside the budget only at the range's fast end as a pass."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

import voicepipe.turnrange as tr
from tests.conftest import tiny_scenario
from voicepipe.cli import app
from voicepipe.config import load_config
from voicepipe.predict import predict
from voicepipe.records import summarise, verdict
from voicepipe.report.export import read_csv, write_csv

HW = "agent.backend=a100-40gb/llama-3.1-70b"  # a slow agent: its parts are a large share of the turn
runner = CliRunner()


def test_verdict_passes_only_at_the_slow_end_and_is_uncertain_between_the_ends():
    assert verdict(700, (650, 790), 800) == "pass"
    assert verdict(700, (650, 850), 800) == "uncertain"  # point inside, slow end over
    assert verdict(820, (780, 900), 800) == "uncertain"  # point over, fast end inside
    assert verdict(820, (810, 900), 800) == "miss"
    assert verdict(700, None, 800) == "pass" and verdict(820, None, 800) == "miss"  # no range: the point
    assert verdict(700, (650, 790), 800, talked_over=True) == "miss"
    assert verdict(None, None, 800) == "miss"
    assert verdict(810, (700, 790), 800) == "uncertain"  # a range beside the point is hulled with it


@pytest.fixture(scope="module")
def hw_preds():
    cfg = load_config(None, [HW, "client.playout=first_audio"])
    return cfg, predict(cfg, [tiny_scenario(turns=3)])


def test_a_hardware_agents_interval_is_carried_into_every_turn(hw_preds):
    cfg, preds = hw_preds
    spread = tr.spreads(cfg)[preds[0].backend]
    for p in preds:
        lo, hi = p.predicted_range_ms
        assert lo < p.predicted_ms < hi
        agent = {b.what: b.ms for b in p.breakdown if b.stage == "agent"}
        want_hi = p.predicted_ms + agent.get("ttft", 0) * (spread.ttft[1] - 1) + sum(
            agent.get(w, 0) * (spread.step[1] - 1) for w in ("decode", "queue"))  # fmt: skip
        assert hi == pytest.approx(max(want_hi, p.predicted_ms))
        assert p.interval_level == 0.8


def test_a_turn_inside_only_at_the_fast_end_is_uncertain_and_not_within_budget(hw_preds):
    cfg, preds = hw_preds
    p = preds[0]
    lo, hi = p.predicted_range_ms
    for budget, want in (((lo + p.predicted_ms) / 2, "uncertain"), ((p.predicted_ms + hi) / 2, "uncertain"),
                         (hi + 1, "pass"), (lo - 1, "miss")):  # fmt: skip
        q = predict(cfg.model_copy(update={"budget_ms": budget}), [tiny_scenario(turns=3)])[0]
        assert q.verdict == want, budget
        assert q.within_budget == (want == "pass")
        rec = q.as_record()
        assert rec.within_budget == (want == "pass") and rec.uncertain == (want == "uncertain")
        assert q.to_json()["verdict"] == want


def test_a_profile_agent_has_no_range_and_is_judged_at_its_latency():
    cfg = load_config(None, ["client.playout=first_audio"])  # the default empirical agent
    for p in predict(cfg, [tiny_scenario(turns=2)]):
        assert p.predicted_range_ms is None and p.interval_level is None
        assert p.verdict == ("pass" if p.predicted_ms <= p.budget_ms else "miss")


def test_the_turn_range_comes_from_the_shipped_residuals(monkeypatch, hw_preds):
    """Residuals read faster move the turn's slow end up and leave its latency alone."""
    cfg, preds = hw_preds
    acc = tr.shipped_accuracy()
    faster = [r.model_copy(update={"log_speed": r.log_speed + 0.5}) for r in acc.residuals]
    monkeypatch.setattr(tr, "shipped_accuracy", lambda: acc.model_copy(update={"residuals": faster}))
    again = predict(cfg, [tiny_scenario(turns=3)])
    for a, b in zip(preds, again, strict=True):
        assert b.predicted_ms == a.predicted_ms
        assert b.predicted_range_ms[1] > a.predicted_range_ms[1]


def test_summary_counts_uncertain_turns_apart_from_the_ones_within(hw_preds):
    cfg, preds = hw_preds
    lo, hi = preds[0].predicted_range_ms
    mid = predict(cfg.model_copy(update={"budget_ms": (lo + hi) / 2}), [tiny_scenario(turns=3)])
    s = summarise([p.as_record() for p in mid])
    assert s.uncertain == sum(p.verdict == "uncertain" for p in mid) >= 1
    assert s.within_budget == sum(p.verdict == "pass" for p in mid) / len(mid)


def cli_predict(scenario_file, budget: float, *extra: str):
    return runner.invoke(app, ["predict", str(scenario_file), "--set", HW, "--set", "client.playout=first_audio",
                               "--set", f"budget_ms={budget}", *extra])  # fmt: skip


@pytest.fixture
def scenario_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    sc = tiny_scenario(turns=3)
    path.write_text(json.dumps(sc.model_dump(mode="json")))
    return path


def test_require_within_does_not_count_an_uncertain_turn_as_a_pass(scenario_file, hw_preds):
    _, preds = hw_preds
    budget = (
        math.floor(max(p.predicted_range_ms[1] for p in preds)) - 0.5
    )  # every point inside, a slow end over
    assert all(p.predicted_ms <= budget for p in preds)
    r = cli_predict(scenario_file, budget, "--format", "json")
    got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    passes = sum(g["verdict"] == "pass" for g in got)
    assert any(g["verdict"] == "uncertain" for g in got) and all(g["verdict"] != "miss" for g in got)
    assert (
        cli_predict(scenario_file, budget, "--require", "within>=1").exit_code == 1
    )  # points alone would pass
    assert (
        cli_predict(scenario_file, budget, "--require", f"within>={passes / len(got) - 1e-9}").exit_code == 0
    )
    assert cli_predict(scenario_file, budget, "--require", "uncertain<=0").exit_code == 1


def test_the_table_marks_an_uncertain_turn_and_shows_its_range(scenario_file, hw_preds):
    _, preds = hw_preds
    lo, hi = preds[0].predicted_range_ms
    r = cli_predict(scenario_file, (preds[0].predicted_ms + hi) / 2, "--wide")
    assert r.exit_code == 0, r.output
    assert f"{lo:,.0f}–{hi:,.0f}" in r.stdout
    assert "uncertain" in r.stdout and "?" in r.stdout


def test_a_turns_range_survives_the_csv_export(tmp_path, hw_preds):
    _, preds = hw_preds
    recs = [p.export_record() for p in preds]
    write_csv(recs, tmp_path / "t.csv")
    back = read_csv(tmp_path / "t.csv")
    assert [r.predicted_range_ms for r in back] == [r.predicted_range_ms for r in recs]
    assert [r.uncertain for r in back] == [r.uncertain for r in recs]
