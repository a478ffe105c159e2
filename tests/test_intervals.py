"""80 % ranges on `hardware predict` and `sweep`, from the shipped held-out residuals."""

from __future__ import annotations

import json
import math

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


def test_a_configuration_without_evidence_gets_at_least_the_90_pct_band_of_its_cell_two_keys_coarser():
    """No device or stack evidence (two thin slices): the range holds the family-weighted 90 % band of its
    cell with two keys dropped, wherever its own cell falls. (A well-covered cell may be wider still.)"""
    acc = val.shipped_accuracy()
    mdl = catalog.model("llama-3.1-8b")
    covered = val.ranges(acc, VALUES, "h100-sxm", "hbm", "vllm", mdl, 8, "bf16")
    nowhere = val.ranges(acc, VALUES, "no-such-device", "hbm", "no-such-stack", mdl, 8, "bf16")
    assert covered.thin == ()
    assert nowhere.thin == ("device no-such-device (0 points)", "stack no-such-stack (0 points)")
    for m in METRICS:
        q = val.config_query(mdl, 8, "bf16", m, "no-such-device", "", "no-such-stack")  # no catalog maker
        keys = val.cell_keys(acc.residuals, q)
        coarse = val.cell_of_keys(acc.residuals, q, keys[: max(0, len(keys) - 2)])
        band = val.family_band(coarse, 0.9)
        assert band is not None
        lo, hi = band
        a, b = nowhere.intervals[m]
        value = VALUES[m]
        if m in ("tokens_per_second", "aggregate_tokens_per_second"):
            assert a <= value * math.exp(-hi) * (1 + 1e-9) and b >= value * math.exp(-lo) * (1 - 1e-9), m
        else:
            assert a <= value * math.exp(lo) * (1 + 1e-9) and b >= value * math.exp(hi) * (1 - 1e-9), m


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
    """Shifting the decode residuals, and nothing else, moves predict's step interval and not its TTFT's."""
    acc = val.shipped_accuracy()
    before = predict_json("--batch", "8")
    shifted = [r.model_copy(update={"log_speed": r.log_speed + 0.5}) if r.phase == "decode" else r
               for r in acc.residuals]  # fmt: skip
    monkeypatch.setattr(val, "shipped_accuracy", lambda: acc.model_copy(update={"residuals": shifted}))
    after = predict_json("--batch", "8")
    assert after["step_ms"] == before["step_ms"]
    assert after["intervals"]["step_ms"][0] > before["intervals"]["step_ms"][0]  # reads faster: the time rises
    assert after["intervals"]["ttft_ms"] == before["intervals"]["ttft_ms"]


def query(metric: str, stack: str | None = "vllm", device: str = "h100-sxm") -> val.Query:
    return val.config_query(catalog.model("llama-3.1-8b"), 8, "bf16", metric, device, "NVIDIA", stack)


def test_changing_one_residual_changes_its_cells_interval_and_no_other():
    acc = val.shipped_accuracy()
    mdl = catalog.model("llama-3.1-8b")
    base = val.ranges(acc, VALUES, "h100-sxm", "hbm", "vllm", mdl, 8, "bf16")
    members = val.cell_members(acc.residuals, query("ttft_ms"))
    band = val.family_band(members)
    assert band is not None
    hi = band[1]
    above = min(r.log_speed for r in members if r.log_speed > hi)  # moving the top end's one up to here moves it
    edge = next(r for r in members if r.log_speed == hi)
    moved = [r.model_copy(update={"log_speed": (hi + above) / 2}) if r.id == edge.id else r for r in acc.residuals]
    changed = val.ranges(acc.model_copy(update={"residuals": moved}), VALUES, "h100-sxm", "hbm", "vllm", mdl, 8,
                         "bf16")  # fmt: skip
    assert changed.intervals["ttft_ms"][1] > base.intervals["ttft_ms"][1]
    assert changed.intervals["step_ms"] == base.intervals["step_ms"]  # another phase's cell: untouched


def test_the_range_is_the_band_of_the_configurations_own_cell():
    """The finest cell around the configuration with enough residuals (from enough families) gives the
    band: shifting exactly that cell's residuals shifts the range by as much; a stack with no residuals
    reads a cell of several stacks."""
    acc = val.shipped_accuracy()
    mdl = catalog.model("llama-3.1-8b")
    members = {r.id for r in val.cell_members(acc.residuals, query("step_ms", "vllm"))}
    assert val.MIN_POINTS <= len(members) < len(acc.residuals)
    shifted = [r.model_copy(update={"log_speed": r.log_speed + 0.5}) if r.id in members else r
               for r in acc.residuals]  # fmt: skip
    a = val.ranges(acc, VALUES, "h100-sxm", "hbm", "vllm", mdl, 8, "bf16").intervals["step_ms"]
    b = val.ranges(acc.model_copy(update={"residuals": shifted}), VALUES, "h100-sxm", "hbm", "vllm", mdl, 8,
                   "bf16").intervals["step_ms"]  # fmt: skip
    assert b == pytest.approx((a[0] * math.exp(0.5), a[1] * math.exp(0.5)))  # reads faster: the time rises
    assert len({r.stack for r in val.cell_members(acc.residuals, query("step_ms", "no-such-stack"))}) > 1


def test_a_loaded_servers_aggregate_throughput_reads_the_throughput_points_not_the_decode_steps():
    """Aggregate tok/s is B clients' output over their whole requests, prefills included: the figure the
    throughput points publish, so their residuals speak for it; per-user tok/s and the step are decode's."""
    acc = val.shipped_accuracy()
    mdl = catalog.model("llama-3.1-8b")
    rng = val.ranges(acc, VALUES, "h100-sxm", "hbm", "vllm", mdl, 8, "bf16")
    for metric, phase in (("aggregate_tokens_per_second", "throughput/e2e"), ("tokens_per_second", "decode")):
        q = val.config_query(mdl, 8, "bf16", metric, "h100-sxm", "NVIDIA", "vllm")
        assert q.phase == phase
        (lo, hi), _ = val.band(acc.residuals, q)
        assert rng.intervals[metric] == pytest.approx((VALUES[metric] * math.exp(-hi), VALUES[metric] * math.exp(-lo)))


def synthetic(n: int, families: int, log_speed: float, tag: str = "fam", **slices: str) -> list[val.Residual]:
    base = {"publisher_family": "independent", "architecture": "dense", "batch": "batched", "phase": "decode",
            "precision": "16-bit", "device": "h100-sxm", "maker": "NVIDIA", "stack": "vllm", **slices}  # fmt: skip
    return [val.Residual(id=f"{log_speed}-{i}", family=f"{tag}{i % families}", log_speed=log_speed + i * 1e-3, **base)
            for i in range(n)]  # fmt: skip


def test_a_cell_from_too_few_families_gives_way_to_a_coarser_one():
    """Twenty residuals of one harness are one family's bias, not a cell: the rule widens past them."""
    q = query("step_ms")
    other = synthetic(40, 8, 0.0, stack="sglang")
    one_family = synthetic(20, 1, 1.0)
    assert all(r.stack == "sglang" or r.family == "fam0" for r in val.cell_members(other + one_family, q))
    assert {r.stack for r in val.cell_members(other + one_family, q)} == {"vllm", "sglang"}
    three = synthetic(20, val.MIN_FAMILIES, 1.0)
    assert {r.stack for r in val.cell_members(other + three, q)} == {"vllm"}


def test_coverage_builds_each_points_interval_without_its_own_family():
    """A family far off every other one is never covered, however many points it has: its own residuals
    are not in the band that scores it."""
    far = synthetic(30, 1, 2.0, "far", publisher_family="vendor")  # one family, all reading 7x fast
    rest = synthetic(60, 6, 0.0)
    cov = {(c.kind, c.slice): c for c in val.coverage(far + rest)}
    assert cov[("publisher_family", "vendor")].covered_pct == 0.0
    assert cov[("publisher_family", "independent")].covered_pct > 50.0
    q = val.query_of(far[0])
    assert val.band(far + rest, q, exclude_family="far0") == val.band(rest, q)


def test_coverage_scores_the_same_interval_ranges_prints():
    """One rule: the band coverage() scores a point with equals the range ranges() gives its configuration
    from an accuracy file without that point's family."""
    acc = val.shipped_accuracy()
    mdl = catalog.model("llama-3.1-8b")
    fam = next(r.family for r in acc.residuals if r.stack == "vllm" and r.device == "h100-sxm")
    without = acc.model_copy(update={"residuals": [r for r in acc.residuals if r.family != fam]})
    rng = val.ranges(without, {"step_ms": 1.0}, "h100-sxm", "hbm", "vllm", mdl, 8, "bf16", maker="NVIDIA")
    (lo, hi), _ = val.band(acc.residuals, query("step_ms"), exclude_family=fam)
    assert rng.intervals["step_ms"] == pytest.approx((math.exp(lo), math.exp(hi)))


def test_the_cli_level_is_the_slices_level():
    assert hw.LEVEL == val.LEVEL


def test_a_cell_just_large_enough_stands_at_the_level_not_at_its_extremes():
    """MIN_POINTS is the smallest cell whose conformal ranks are not its minimum and maximum (fewer
    residuals would give a band wider than the level says); one fewer falls back to the extremes."""
    n = val.MIN_POINTS
    assert val.speed_band([float(i) for i in range(n)]) == (1.0, float(n - 2))
    assert val.speed_band([float(i) for i in range(n - 1)]) == (0.0, float(n - 2))


def test_a_family_with_many_points_is_one_vote_in_a_band():
    """Nine families read 0 and one harness publishes 90 points reading 1.0 (7x fast), half the cell: by
    count its points would fill the band's top; as one family of ten it is past the 90th percentile."""
    q = query("step_ms")
    cell = synthetic(45, 9, 0.0) + synthetic(90, 1, 1.0, "big")
    band = val.family_band(cell)
    assert band is not None and 0.0 <= band[0] < band[1] <= 0.044 + 1e-9  # within the nine families' spread
    count_weighted = val.speed_band([r.log_speed for r in cell])
    assert count_weighted is not None and count_weighted[1] > 1.0  # the band the rule does not use
    (_, hi), thin = val.band(cell, q)
    assert thin == () and hi < 1.0


def test_the_family_band_puts_at_most_the_tail_weight_outside_each_end():
    """Ten families of one residual each: the 80 % band runs from the second lowest to the second highest
    (the lowest is 10 % of the weight, the highest 10 %). Splitting the lowest family's vote over two
    points moves nothing: together they are still 10 %."""
    one_each = [val.Residual(id=str(i), family=f"f{i}", log_speed=float(i), publisher_family="independent",
                             architecture="dense", batch="batched", phase="decode", precision="16-bit",
                             device="h100-sxm", maker="NVIDIA", stack="vllm") for i in range(10)]  # fmt: skip
    assert val.family_band(one_each) == (1.0, 8.0)
    split = [*one_each, one_each[0].model_copy(update={"id": "0b", "log_speed": -1.0})]
    assert val.family_band(split) == (1.0, 8.0)
    assert val.family_band(one_each, 0.6) == (2.0, 7.0)
    assert val.family_band([]) is None
    with pytest.raises(ValueError, match="level"):
        val.family_band(one_each, 0.0)


def test_a_thin_slice_widens_with_the_cell_one_key_coarser_not_with_other_phases():
    """One thin slice: the union with the 80 % band of the cell one key coarser. A TTFT range never takes
    the spread of decode residuals through it (the old rule took every residual of the kind)."""
    ttft_far = synthetic(40, 8, 3.0, phase="ttft")  # other phase, far away
    decode = synthetic(40, 8, 0.0) + synthetic(40, 8, 0.5, "sg", stack="sglang")
    q = query("step_ms", "rare-stack")
    (_, hi), thin = val.band(ttft_far + decode, q)
    assert thin == ("stack rare-stack (0 points)",)
    assert hi < 3.0  # the TTFT residuals are not in a decode range
    assert hi >= 0.5  # both stacks of its phase speak for a stack with no evidence


def test_a_kind_with_too_few_residuals_for_the_level_gives_its_extremes():
    """Twelve SRAM residuals (fewer than MIN_POINTS): percentiles of so few families do not stand at 80 %,
    so the range is the widest seen, as the SRAM machines' is today."""
    sram = synthetic(12, 3, 0.0, device="wafer", device_kind="sram")
    hbm = synthetic(60, 6, 5.0)
    q = val.Query(phase="decode", architecture="dense", batch="batched", precision="16-bit", device="wafer",
                  maker="NVIDIA", stack=None, device_kind="sram")  # fmt: skip
    (lo, hi), _ = val.band(sram + hbm, q)
    assert (lo, hi) == (0.0, pytest.approx(0.011))
    assert val.family_band(sram) != (lo, hi)  # the percentiles would have been narrower


def test_two_thin_slices_union_the_cell_with_the_90_pct_band_of_the_cell_two_keys_coarser():
    """A new device with a new stack: the cell (phase, maker, architecture, batch) unioned with the
    family-weighted 90 % band of (phase, maker): two keys coarser, not one, and at 90 %, not 80 or 95."""
    cell = synthetic(40, 8, 0.0)
    other_batch = synthetic(40, 8, -1.0, "b1", batch="batch 1")  # one key coarser
    other_arch = synthetic(40, 8, 2.0, "moe", architecture="moe")  # two keys coarser
    other_maker = synthetic(40, 8, 5.0, "amd", maker="AMD")  # past the phase and maker: never
    res = cell + other_batch + other_arch + other_maker
    q = query("step_ms", "rare-stack", device="rare-device")
    (lo, hi), thin = val.band(res, q)
    assert len(thin) == 2
    assert val.cell_keys(res, q) == ["phase", "maker", "architecture", "batch"]
    wide = val.family_band(cell + other_batch + other_arch, 0.9)
    own = val.family_band(cell)
    assert wide is not None and own is not None
    assert (lo, hi) == (min(own[0], wide[0]), max(own[1], wide[1]))
    assert (lo, hi) != val.family_band(cell + other_arch + other_batch, 0.95)
    assert 1.0 < hi < 5.0  # the MoE residuals two keys away speak (one key away they would not); AMD's not


def test_a_familys_weights_that_sum_to_the_tail_in_binary_leave_the_band_whole():
    """Nine residuals of one family among ten families are exactly 10 % of the weight, though nine ninths
    do not sum to 1 in binary: the band's low end is the first residual above them."""
    def r(i: int, family: str, v: float) -> val.Residual:
        return val.Residual(id=str(i), family=family, log_speed=v, publisher_family="independent",
                            architecture="dense", batch="batched", phase="decode", precision="16-bit",
                            device="h100-sxm", maker="NVIDIA", stack="vllm")  # fmt: skip

    big = [r(i, "big", -9.0 + i) for i in range(9)]  # -9 … -1
    singles = [r(10 + i, f"s{i}", float(i)) for i in range(9)]  # 0 … 8
    band = val.family_band(big + singles)
    assert band is not None and band[0] == 0.0
