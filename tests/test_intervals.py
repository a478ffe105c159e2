"""80 % ranges on `hardware predict` and `sweep`, from the shipped held-out residuals."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import voicepipe.hardware.validate as val
from voicepipe.cli import hardware as hw
from voicepipe.cli.hardware import app
from voicepipe.hardware import catalog

runner = CliRunner()
METRICS = ("ttft_ms", "step_ms", "tokens_per_second", "aggregate_tokens_per_second")
SWEEP_KEYS = {"ttft_ms": "ttft_ms", "step_ms": "step_ms", "tokens_per_second": "per_user_tps",
              "aggregate_tokens_per_second": "aggregate_tps"}  # fmt: skip
VALUES = {"ttft_ms": 40.0, "step_ms": 8.0, "tokens_per_second": 125.0, "aggregate_tokens_per_second": 500.0}


def run(*args: str):
    r = runner.invoke(app, list(args))
    assert r.exit_code == 0, r.output
    return r


def predict_json(*args: str) -> dict:
    return json.loads(run("predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", *args, "--format", "json").stdout)


def width(rng: val.Ranges, metric: str) -> float:
    lo, hi = rng.intervals[metric]
    return hi / lo


@pytest.mark.parametrize("batch", ["1", "16"])
def test_predict_json_gives_each_metric_an_80_pct_interval_bracketing_its_value(batch):
    out = predict_json("--batch", batch)
    assert out["interval_level"] == 0.8
    assert set(out["intervals"]) == set(METRICS)
    for m in METRICS:
        lo, hi = out["intervals"][m]
        assert lo < out[m] < hi, (m, lo, out[m], hi)


def test_sweep_json_gives_every_row_an_interval_bracketing_its_values():
    out = json.loads(run("sweep", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--batches", "1,8,64",
                         "--format", "json").stdout)  # fmt: skip
    assert out["interval_level"] == 0.8
    assert out["rows"]
    for row in out["rows"]:
        for m, key in SWEEP_KEYS.items():
            lo, hi = row["intervals"][m]
            assert lo < row[key] < hi, (row["batch"], m)


def test_predict_table_shows_the_range_beside_the_value():
    out = predict_json()
    text = run("predict", "-H", "h100-sxm", "-m", "llama-3.1-8b").stdout
    for m in METRICS:
        assert val.fmt_range(*out["intervals"][m]) in text, m
    assert "80% range from the held-out residuals" in text


def test_sweep_table_shows_the_range_beside_the_value():
    out = json.loads(run("sweep", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--batches", "8", "--format", "json").stdout)
    text = run("sweep", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--batches", "8", "--wide").stdout
    row = next(r for r in out["rows"] if r["batch"] == 8)
    assert f"{row['per_user_tps']:.1f} {val.fmt_range(*row['intervals']['tokens_per_second'])}" in text
    assert f"{row['aggregate_tps']:.0f} {val.fmt_range(*row['intervals']['aggregate_tokens_per_second'])}" in text
    assert f"{row['ttft_ms']:.0f} {val.fmt_range(*row['intervals']['ttft_ms'])}" in text


def test_a_configuration_without_evidence_gets_a_wider_interval_than_a_well_covered_one():
    acc = val.shipped_accuracy()
    mdl = catalog.model("llama-3.1-8b")
    covered = val.ranges(acc, VALUES, "h100-sxm", "hbm", "vllm", mdl, 8, "bf16")
    nowhere = val.ranges(acc, VALUES, "no-such-device", "hbm", "no-such-stack", mdl, 8, "bf16")
    assert covered.thin == ()
    assert nowhere.thin == ("device no-such-device (0 points)", "stack no-such-stack (0 points)")
    for m in METRICS:
        assert width(nowhere, m) > width(covered, m), m


def test_each_missing_kind_of_evidence_widens_the_interval_further():
    acc = val.shipped_accuracy()
    mdl = catalog.model("llama-3.1-8b")
    one = val.ranges(acc, VALUES, "no-such-device", "hbm", "vllm", mdl, 8, "bf16")
    two = val.ranges(acc, VALUES, "no-such-device", "hbm", "no-such-stack", mdl, 8, "bf16")
    assert len(one.thin) == 1 and len(two.thin) == 2
    assert all(width(two, m) >= width(one, m) for m in METRICS)
    assert any(width(two, m) > width(one, m) for m in METRICS)


def test_a_catalog_device_with_no_published_point_is_marked_and_widened_in_predict():
    assert "tpu-v6e" not in val.shipped_accuracy().by_device
    far = json.loads(run("predict", "-H", "tpu-v6e", "-m", "llama-3.1-8b", "--format", "json").stdout)
    near = predict_json()
    assert "device tpu-v6e (0 points)" in far["interval_far_from_evidence"]
    assert near["interval_far_from_evidence"] == []
    lo, hi = far["intervals"]["ttft_ms"]
    nlo, nhi = near["intervals"]["ttft_ms"]
    assert hi / lo > nhi / nlo


def test_predict_intervals_come_from_the_shipped_residuals(monkeypatch):
    """Shifting one cell's residuals, and nothing else, moves predict's interval for that metric."""
    acc = val.shipped_accuracy()
    before = predict_json("--batch", "8")
    want = val.config_slices(catalog.model("llama-3.1-8b"), 8, "bf16", "step_ms")
    shifted = [
        r.model_copy(update={"log_speed": r.log_speed + 0.5})
        if all(r.slice(k) == v for k, v in want.items()) and r.device_kind == "hbm" else r
        for r in acc.residuals
    ]  # fmt: skip
    assert shifted != acc.residuals
    monkeypatch.setattr(val, "shipped_accuracy", lambda: acc.model_copy(update={"residuals": shifted}))
    after = predict_json("--batch", "8")
    assert after["step_ms"] == before["step_ms"]
    assert after["intervals"]["step_ms"] != before["intervals"]["step_ms"]
    assert after["intervals"]["step_ms"][0] > before["intervals"]["step_ms"][0]  # reads faster: the time rises


def test_changing_one_residual_changes_its_cells_interval_and_no_other():
    acc = val.shipped_accuracy()
    mdl = catalog.model("llama-3.1-8b")
    base = val.ranges(acc, VALUES, "h100-sxm", "hbm", "vllm", mdl, 8, "bf16")
    pool = [r for r in acc.residuals if r.device_kind == "hbm"]
    cell = sorted(val.cell(pool, val.config_slices(mdl, 8, "bf16", "ttft_ms")))
    band = val.speed_band(cell)
    assert band is not None
    hi = band[1]
    above = min(x for x in cell if x > hi)  # the next larger residual: moving the top rank's one there moves it
    edge = next(r for r in pool if r.phase == "ttft" and r.log_speed == hi)
    moved = [r.model_copy(update={"log_speed": (hi + above) / 2}) if r.id == edge.id else r for r in acc.residuals]
    changed = val.ranges(acc.model_copy(update={"residuals": moved}), VALUES, "h100-sxm", "hbm", "vllm", mdl, 8,
                         "bf16")  # fmt: skip
    assert changed.intervals["ttft_ms"][1] > base.intervals["ttft_ms"][1]
    assert changed.intervals["step_ms"] == base.intervals["step_ms"]  # another phase's cell: untouched


def test_the_cli_level_is_the_slices_level():
    assert hw.LEVEL == val.LEVEL
