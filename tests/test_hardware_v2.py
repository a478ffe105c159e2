"""Hardware model v2: physics limits, catalog coverage, bring-your-own model/device, validation table."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import get_args

import numpy as np
import pytest
from typer.testing import CliRunner

from voicepipe.backends import build_backend
from voicepipe.cli.hardware import app
from voicepipe.hardware import catalog as cat
from voicepipe.hardware import model as hm
from voicepipe.hardware import validate as val
from voicepipe.hardware.validate.evidence import _reading
from voicepipe.hardware.validate.fit import _loss, engine_run, held_out, metric_of, subset

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "tests" / "data" / "hf"
runner = CliRunner()


def system(d: str, m: str, **kw) -> hm.System:
    return hm.make_system(cat.device(d), cat.model(m), **kw)


# ---------------------------------------------------------------- physics: monotonicity and limits


def test_quantised_never_faster_than_its_bandwidth_bound():
    for d in ("a100-80gb", "h100-sxm", "l40s", "rtx-4090", "mi300x"):
        for prec in ("int8", "int4", "fp8", "fp4"):
            s = system(d, "llama-3.1-8b", precision=prec, tp=1)
            bound = hm.weight_bytes(s.model, prec) * 0.9 / (s.device.mem_bw_tbs * 1e12)  # type: ignore[operator]
            assert float(hm.decode_step_s(s, 1, 1024)) > bound, (d, prec)


def test_weight_only_pays_its_efficiency_and_native_does_not():
    a100 = cat.device("a100-80gb")
    assert a100.weight_only("fp8") and a100.weight_only("int4") and not a100.weight_only("int8")
    assert not cat.device("h100-sxm").weight_only("fp8") and cat.device("b200").peak_tflops["fp4"] > 0
    s = system("a100-80gb", "llama-3.1-8b", precision="int4", tp=1)
    parts = hm.step_parts(s, 1, 1024)
    slow = hm.combine(parts, 0.8, 0.6, 0.5, 1.0)[2]
    fast = hm.combine(parts, 0.8, 0.6, 1.0, 1.0)[2]
    assert float(slow) > float(fast)


def test_kv_precision_halves_kv_bytes():
    m = cat.model("llama-3.1-8b")
    assert hm.kv_bytes_per_token(m, "fp8") == hm.kv_bytes_per_token(m, "bf16") / 2
    s16 = system("h100-sxm", "llama-3.1-8b", tp=1)
    s8 = system("h100-sxm", "llama-3.1-8b", tp=1, kv_precision="fp8")
    assert s16.kv == "bf16" and s8.kv == "fp8"
    assert hm.max_sequences(s8, 4096) > 1.9 * hm.max_sequences(s16, 4096)
    assert float(hm.step_parts(s8, 32, 32 * 2048).kv_s) == pytest.approx(
        float(hm.step_parts(s16, 32, 32 * 2048).kv_s) / 2, rel=0.01
    )


def test_more_tp_never_fewer_allreduces_and_latency_grows_with_group():
    m, dev = cat.model("llama-3.1-70b"), cat.device("h100-sxm")
    counts = [hm.allreduces_per_step(m, tp) for tp in (1, 2, 4, 8)]
    assert counts == sorted(counts) and counts[0] == 0 and counts[1] == 2 * m.layers
    lat = [hm.allreduce_latency_s(dev, tp) for tp in (2, 4, 8)]
    assert lat == sorted(lat) and 5e-6 < lat[0] < 1e-4
    # PCIe pays more than NVLink for the same group
    assert hm.allreduce_latency_s(cat.device("l40s"), 4) > hm.allreduce_latency_s(dev, 4)


def test_moe_expert_bytes_grow_with_batch_and_efficiency_slows_them():
    s = system("h100-sxm", "mixtral-8x7b", tp=2)
    e1, e64 = (float(hm.step_parts(s, b, b * 1024).expert_s) for b in (1, 64))
    assert e64 > 3 * e1
    parts = hm.step_parts(s, 1, 1024)
    assert float(hm.combine(parts, 0.8, 0.6, 1.0, 0.5)[2]) > float(hm.combine(parts, 0.8, 0.6, 1.0, 1.0)[2])


def test_short_prompt_ttft_streams_all_weights_and_pays_the_stack():
    s = system("h100-sxm", "llama-3.1-70b", tp=4, stack=cat.stack("vllm"))
    ttft = float(hm.prefill_s(s, 16))
    weights = hm.weight_bytes(s.model, "bf16") / 4 / (3.35e12)
    assert ttft > weights + cat.stack("vllm").request_overhead_ms * 1e-3
    bare = system("h100-sxm", "llama-3.1-70b", tp=4, stack=cat.stack("none"))
    assert float(hm.prefill_s(bare, 16)) < ttft


def test_over_memory_batch_runs_what_fits():
    p = hm.predict(cat.device("h100-sxm"), cat.model("llama-3.1-8b"), batch=5000, prompt_tokens=2048)
    assert not p.fits and 1 <= p.effective_batch == p.max_batch_fits < 5000
    # the engine's device rate: no more than every slot decoding at the users' rate (TTFT and the queue
    # take their share of each request's lifetime)
    assert 0.5 * p.tokens_per_second * p.effective_batch < p.aggregate_tokens_per_second
    assert p.aggregate_tokens_per_second <= p.tokens_per_second * p.effective_batch
    assert "queues" in p.note
    ok = hm.predict(cat.device("h100-sxm"), cat.model("llama-3.1-8b"), batch=8)
    assert ok.fits and ok.effective_batch == 8 and ok.chips == p.chips  # same chips whatever the batch
    with pytest.raises(hm.DoesNotFit, match="does not fit"):  # weights beyond any width stay an error
        hm.predict(cat.device("rtx-4090"), cat.model("llama-3.1-405b"))
    r = runner.invoke(
        app, ["predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--batch", "5000", "--format", "json"]
    )
    out = json.loads(r.output)
    assert r.exit_code == 0 and out["fits"] is False and out["effective_batch"] < 5000


def test_offload_tier_holds_weights_beyond_hbm():
    gh = cat.device("gh200")
    p = hm.predict(gh, cat.model("llama-3.1-70b"), prompt_tokens=128, output_tokens=128)
    assert p.chips == 1 and p.fits
    hbm_only = hm.weight_bytes(cat.model("llama-3.1-70b"), "bf16") / (4.0e12)
    assert p.step_ms / 1e3 > 3 * hbm_only  # most weights stream over C2C, far slower than HBM


# ---------------------------------------------------------------- catalog coverage


ISSUE_DEVICES = ["l40s", "rtx-4090", "rtx-6000-ada", "mi300x", "mi250x", "mi250x-gcd", "mi325x", "gaudi3",
                 "tpu-v5p", "sambanova-sn40l", "b200", "gb200"]  # fmt: skip
ISSUE_MODELS = ["llama-2-13b", "gpt-j-6b", "falcon-180b", "deepseek-v3", "deepseek-r1", "llama-4-scout",
                "llama-4-maverick", "qwen3-30b-a3b", "mistral-7b", "gemma-3-27b", "phi-4"]  # fmt: skip


def test_issue_catalog_entries_and_fp4():
    assert set(ISSUE_DEVICES) <= set(cat.devices())
    assert set(ISSUE_MODELS) <= set(cat.models())
    assert "fp4" in cat.PRECISIONS and cat.device("b200").peak_tflops["fp4"] == 2 * 4500
    m = cat.model("deepseek-v3")
    assert m.kv_dim == 576 and m.params_total_b == 671 and m.params_active_b == 37


def test_every_catalog_pair_answers_or_says_why():
    reasons = 0
    for d in cat.devices().values():
        for m in cat.models().values():
            try:
                p = hm.predict(d, m)
            except hm.DoesNotFit as exc:
                assert str(exc).startswith("does not fit:") and m.key in str(exc) and d.key in str(exc)
                reasons += 1
                continue
            assert p.tokens_per_second > 0 and p.ttft_ms > 0 and p.chips >= 1
    # every issue device answers a 8B model, every issue model answers on a big-memory node
    for d in ISSUE_DEVICES:
        assert hm.predict(cat.device(d), cat.model("llama-3.1-8b"), precision="fp8").tokens_per_second > 0
    for m in ISSUE_MODELS:
        assert hm.predict(cat.device("b200"), cat.model(m), precision="fp8").tokens_per_second > 0
    assert reasons < len(cat.devices()) * len(cat.models()) / 3


# ---------------------------------------------------------------- bring your own


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-3.1-8b", "mixtral-8x7b", "deepseek-v3"])
def test_hf_config_import_matches_the_catalog(name):
    ref = cat.models()[name]
    m = cat.model(str(HF / name / "config.json"))
    assert m.params_total_b == pytest.approx(ref.params_total_b, rel=0.01)
    assert m.active_params == pytest.approx(ref.active_params, rel=0.02)
    assert m.kv_elems_per_token == ref.kv_elems_per_token
    assert (m.experts, m.experts_active, m.kv_dim) == (ref.experts, ref.experts_active, ref.kv_dim)
    assert m.default_precision == ref.default_precision
    a = hm.predict(cat.device("h200-sxm"), m, tp=8)
    b = hm.predict(cat.device("h200-sxm"), ref, tp=8)
    assert a.step_ms == pytest.approx(b.step_ms, rel=0.02)


def test_hf_config_errors_name_file_and_field(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 4096, "num_attention_heads": 32, "vocab_size": 32000}))
    with pytest.raises(ValueError, match=r"config\.json: num_hidden_layers: missing"):
        cat.model(str(bad))
    bad.write_text(
        json.dumps({"num_hidden_layers": "x", "hidden_size": 1, "num_attention_heads": 1, "vocab_size": 1})
    )
    with pytest.raises(ValueError, match="num_hidden_layers: must be an integer"):
        cat.model(str(bad))
    r = runner.invoke(app, ["predict", "-H", "h100-sxm", "-m", str(tmp_path / "nope.json")])
    assert r.exit_code == 2 and "nope.json" in r.output and "Traceback" not in r.output


DEVICE_YAML = """
name: My accelerator
kind: hbm
memory_gb: 64
mem_bw_tbs: 2.0
peak_tflops: {bf16: 400}
link_gbs: 100
max_tp: 4
allreduce_us: 20
price_per_chip_hour: 1.0
sources:
  memory_gb: spec sheet
  mem_bw_tbs: spec sheet
  peak_tflops: spec sheet
  link_gbs: spec sheet
  max_tp: spec sheet
  allreduce_us: assumed
  price_per_chip_hour: assumed
"""


def test_device_yaml_works_in_predict_sweep_and_backends(tmp_path):
    dev = tmp_path / "dev.yaml"
    dev.write_text(DEVICE_YAML)
    cfg = str(HF / "llama-3.1-8b" / "config.json")
    p = hm.predict(cat.device(str(dev)), cat.model(cfg))
    assert p.chips == 1 and p.tokens_per_second < 2.0e12 / 16e9  # below its bandwidth roofline
    for cmd in (["predict"], ["sweep", "--batches", "1,8"]):
        r = runner.invoke(app, [*cmd, "-H", str(dev), "-m", cfg, "--format", "json"])
        assert r.exit_code == 0, r.output
    b = build_backend({"hardware": str(dev), "model": cfg, "kv_precision": "fp8", "stack": "sglang"})
    d = b.describe()
    assert d["kv_precision"] == "fp8" and d["stack"] == "sglang" and d["modelled"] is True


def test_device_yaml_errors_name_file_and_field(tmp_path):
    dev = tmp_path / "dev.yaml"
    dev.write_text(DEVICE_YAML.replace("mem_bw_tbs: 2.0\n", ""))
    with pytest.raises(ValueError, match=r"dev\.yaml: .*mem_bw_tbs"):
        cat.device(str(dev))
    dev.write_text(DEVICE_YAML.replace("  allreduce_us: assumed\n", ""))
    with pytest.raises(ValueError, match=r"dev\.yaml: .*no source for allreduce_us"):
        cat.device(str(dev))
    dev.write_text(DEVICE_YAML + "warp: 9\n")
    r = runner.invoke(app, ["predict", "-H", str(dev), "-m", "llama-3.1-8b"])
    assert r.exit_code == 2 and "warp" in r.output and "Traceback" not in r.output


# ---------------------------------------------------------------- validation


def test_validate_reproduces_the_documented_table():
    doc = (ROOT / "docs" / "hardware-model.md").read_text()
    m = re.search(r"<!-- validation:begin -->\n(.*?)\n<!-- validation:end -->", doc, re.S)
    assert m, "docs/hardware-model.md lacks the validation table markers"
    assert m.group(1).strip() == val.markdown(val.run()).strip(), (
        "regenerate: python -c 'import voicepipe.hardware.validate as v; v.update_doc()'"
    )


def test_validation_points_are_sourced_and_loso_holds_out_the_source():
    pts = val.points()
    assert len(pts) >= 60 and all(p.source.startswith("http") for p in pts)
    rep = val.run()
    assert rep.sources >= 5
    held = [r for r in rep.rows if r.predicted is not None]
    assert len(held) >= 60 and np.isfinite([r.predicted for r in held]).all()


def test_hold_out_leaves_out_the_points_whole_publisher_family():
    # one vendor's docs and blogs (and MLPerf results it submitted) are one family; each independent
    # author its own
    pts = val.points()
    nvidia = [p for p in pts if p.family == "NVIDIA"]
    assert len({p.source for p in nvidia}) >= 5 and any(p.group == "mlperf-inference" for p in nvidia)
    assert {p.family for p in pts if p.publisher.startswith("Argonne")} == {"Argonne National Laboratory"}
    alone = next((p for p in pts if not p.publisher), None)
    assert alone is None or alone.family == alone.held_out_with
    assert val.run().families == len({p.family for p in pts if not val.prepare(p).reason})


def test_the_fit_that_predicts_a_point_has_seen_no_point_of_its_family():
    # the hold-out's mechanism on a few families (seconds; the whole run's rows are the shipped accuracy's,
    # checked below): every family's rows are engine runs under constants fitted on the other families only,
    # and differ from what the fit on all of them predicts
    families = {"PyTorch", "vLLM", "Tenstorrent", "InternLM", "SemiAnalysis InferenceX"}
    few = [p for p in val.points() if p.family in families]
    rep = held_out(few)
    ok = [val.prepare(p) for p in few]
    trainable = [x for x in ok if not x.reason and x.spec is None]
    full = val.batch_of(trainable)
    got = {r.point.id: r.predicted for r in rep.rows}
    theta_all = val.fit(full)
    for fam in families:
        train = [i for i, x in enumerate(trainable) if x.point.family != fam]
        test = [x for x in ok if not x.reason and x.point.family == fam]
        assert test and len(train) < len(trainable)
        theta = val.fit(subset(full, train))
        want = [metric_of(x, engine_run(x, theta)) for x in test]
        assert [got[x.point.id] for x in test] == pytest.approx(want, rel=1e-9), fam
        assert [metric_of(x, engine_run(x, theta_all)) for x in test] != pytest.approx(want, rel=1e-6), fam


def test_a_speculative_point_is_never_predicted_without_the_speculative_model():
    spec = [p for p in val.points() if p.is_speculative]
    assert spec and all(p.speculative_settings() is None for p in spec)  # MTP rows state γ, not α
    for p in spec:
        assert val.prepare(p).reason == "speculative, no α"
    # stated settings: the engine runs it with them
    full = spec[0].model_copy(update={"speculative": "mtp alpha=0.7 gamma=3 draft_cost=0.1"})
    x = val.prepare(full)
    assert not x.reason and x.spec == hm.Speculative(0.7, 3, 0.1)
    plain = val.prepare(full.model_copy(update={"speculative": "none"}))
    assert metric_of(x, engine_run(x)) > 1.2 * metric_of(plain, engine_run(plain))  # tok/s per user


def test_evidence_never_cites_a_speculative_point():
    # even a speculative point that was answered is no evidence for any (non-speculative) prediction
    rep = val.run()
    spec_id = next(p.id for p in val.points() if p.is_speculative)
    rows = tuple(val.Row(r.point, r.point.value * 1.5) if r.point.id == spec_id else r for r in rep.rows)
    acc = val.accuracy(val.Report(rows, rep.theta_all, rep.sources, rep.families))
    assert acc == val.accuracy(rep)
    assert spec_id not in {r.id for r in acc.residuals}
    near = val.near_report("h200-sxm", cat.model("deepseek-r1"), "trtllm", acc)
    spec_pts = {p.id for p in val.points() if p.is_speculative}
    n = len([p for p in val.points() if p.model == "deepseek-r1" and p.device == "h200-sxm"
             and p.id not in spec_pts and not val.prepare(p).reason])  # fmt: skip
    group = next(g for g in near.groups if g.kind == "model_device")
    assert group.evidence.points == n


def test_validate_prints_the_per_slice_table_held_out_by_family():
    r = runner.invoke(app, ["validate"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "held out by publisher family, per slice" in r.output
    for line in ("publisher_family: vendor", "publisher_family: framework", "publisher_family: independent",
                 "architecture: dense", "architecture: moe", "architecture: mla", "batch: batch 1",
                 "batch: batched", "phase: ttft", "phase: decode", "precision: quantised", "precision: 16-bit"):
        assert line in r.output, line
    r = runner.invoke(app, ["validate", "--format", "json"])
    data = json.loads(r.output)
    assert data["held_out_by"] == "publisher family"
    kinds = {(s["kind"], s["slice"]): s for s in data["slices"]}
    res = val.residuals(val.run().rows)
    assert kinds[("phase", "ttft")]["points"] == sum(1 for x in res if x.phase == "ttft")
    assert {"median_abs_error_pct", "bias_pct", "points"} <= kinds[("architecture", "moe")].keys()
    assert any(c["kind"] == "all" for c in data["coverage"])


def test_trtllm_sizes_its_pool_from_free_memory_and_reserves_full_length():
    dev, mdl = cat.device("h200-sxm"), cat.model("llama-3.1-70b")
    vllm = hm.System(dev, mdl, "fp8", 1, hm.DEFAULT_EFFICIENCY, "fp8", cat.stack("vllm"))
    trt = hm.System(dev, mdl, "fp8", 1, hm.DEFAULT_EFFICIENCY, "fp8", cat.stack("trtllm"))
    weights = trt.stored_weight_bytes
    assert weights == vllm.stored_weight_bytes > hm.weight_bytes(mdl, "fp8")  # the head stays 16-bit
    per_token = hm.kv_bytes_per_token(mdl, "fp8")
    u = hm.DEFAULT_EFFICIENCY.usable_memory
    r_vllm, r_trt = hm.engine_reserve_bytes(vllm), hm.engine_reserve_bytes(trt)
    assert r_vllm > 0 and r_trt > 0
    assert hm.kv_capacity_tokens(vllm) == pytest.approx((dev.capacity_bytes * u - weights - r_vllm) / per_token)
    assert hm.kv_capacity_tokens(trt) == pytest.approx((dev.capacity_bytes - weights - r_trt) * u / per_token)
    # vLLM grows blocks: what fits at the mean context; TensorRT-LLM reserves prompt + output up front
    assert hm.running_sequences(vllm, 1000, 1000) == hm.max_sequences(vllm, 1500)
    assert hm.running_sequences(trt, 1000, 1000) == hm.max_sequences(trt, 2000)
    # the MLPerf harness runs MAX_UTILIZATION: grows, from the free-memory pool
    mlperf = hm.System(dev, mdl, "fp8", 1, hm.DEFAULT_EFFICIENCY, "fp8", cat.stack("trtllm-max-util"))
    assert hm.running_sequences(mlperf, 1000, 1000) == hm.max_sequences(trt, 1500)
    # an SRAM machine has no serving stack's scheduler: the admission rule does not apply
    wafer = hm.System(
        cat.device("cerebras-wse3"), cat.model("llama-3.1-8b"), "bf16", 1, stack=cat.stack("trtllm")
    )
    same = hm.System(
        cat.device("cerebras-wse3"), cat.model("llama-3.1-8b"), "bf16", 1, stack=cat.stack("vllm")
    )
    assert hm.running_sequences(wafer, 1024, 2048) == hm.running_sequences(same, 1024, 2048)


def test_fit_loss_is_capped_so_a_gross_miss_stops_pulling():
    pts = [p for p in val.points() if p.tier == 1][:6]
    theta = np.array([[getattr(hm.DEFAULT_EFFICIENCY, k) for k in hm.FITTED]])
    # the first point's published value moved away from what the model predicts for it, by a factor
    model = float(val.predicted(val.batch_of([val.prepare(pts[0])]), theta)[0, 0])

    def loss(scale):
        moved = [pts[0].model_copy(update={"value": model * scale}), *pts[1:]]
        return float(_loss(val.batch_of([val.prepare(p) for p in moved]), theta)[0])

    assert loss(1.1) < loss(1.3)  # within the cap a worse point costs more
    assert loss(10.0) == pytest.approx(loss(100.0))  # past it, no more


def _close(a: object, b: object, unit: float = 0.1) -> bool:
    """Equal, numbers within one unit of their last rounded digit (another BLAS may move a median across a
    rounding boundary)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], unit) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= unit + 1e-9  # type: ignore[arg-type]
    return a == b


def test_modelled_numbers_carry_the_shipped_cross_validated_error():
    # the figures printed beside every modelled number are the current set's, not a stale copy
    assert _close(val.shipped_accuracy().model_dump(), val.accuracy(val.run()).model_dump()), (
        "regenerate: python -c 'import voicepipe.hardware.validate as v; v.update_doc()'"
    )
    summary = val.shipped_accuracy().summary
    r = runner.invoke(app, ["predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["validation"] == summary.model_dump()
    r = runner.invoke(app, ["sweep", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--format", "json"])
    assert r.exit_code == 0 and json.loads(r.output)["validation"] == summary.model_dump()
    r = runner.invoke(app, ["predict", "-H", "h100-sxm", "-m", "llama-3.1-8b"])
    assert r.exit_code == 0 and "cross-validated" in r.output and f"{summary.median_error_pct} %" in r.output


def test_close_is_strict_beyond_one_rounding_unit():
    assert _close({"a": 12.2, "b": {"c": 3}}, {"a": 12.3, "b": {"c": 3}})
    assert not _close({"a": 12.2}, {"a": 12.4}) and not _close({"c": 3}, {"c": 4})
    assert not _close({"a": 1.0}, {"a": 1.0, "b": 2.0})


def test_speed_ratio_reads_optimism_the_same_way_for_every_metric():
    for metric in get_args(val.Metric):
        p = next((q for q in val.points() if q.metric == metric), None)
        if p is None:
            continue
        # a model reading 2x as fast: half the published time, or twice the published rate
        fast = p.value * 2 if metric.startswith("tok_s") else p.value / 2
        assert val.speed_ratio(val.Row(p, fast)) == pytest.approx(2.0), metric
        assert val.speed_ratio(val.Row(p, None)) is None
    # rates are named tok_s_*; every other metric is a time
    assert {m for m in get_args(val.Metric) if m.startswith("tok_s")} == val.SPEED_METRICS


def test_evidence_figures_over_a_known_set_of_rows():
    pts = val.points()
    a = next(p for p in pts if p.metric == "tok_s_total")
    b = next(p for p in pts if p.metric == "tpot_ms" and p.held_out_with != a.held_out_with)
    c = next(p for p in pts if p.metric == "tok_s_total" and p.held_out_with == a.held_out_with and p != a)
    rows = [
        val.Row(a, a.value * 1.1),  # +10 %, speed 1.1
        val.Row(b, b.value * 0.8),  # -20 %, speed 1.25
        val.Row(c, c.value * 1.5),  # +50 %, speed 1.5
        val.Row(b, None, reason="not answerable"),  # not counted
    ]
    e = val.evidence(rows)
    assert (e.points, e.sources, e.within_30_pct) == (3, 2, 67)
    assert e.median_error_pct == pytest.approx(20.0) and e.speed_ratio == pytest.approx(1.25)


def test_accuracy_groups_every_answered_row_once_per_kind():
    acc = val.shipped_accuracy()
    kinds = (acc.by_model_device_stack, acc.by_model_device, acc.by_model_stack, acc.by_model,
             acc.by_architecture, acc.by_device, acc.by_stack)  # fmt: skip
    for groups in kinds:
        assert sum(g.points for g in groups.values()) == acc.summary.points
    # the MLA group is the points of the catalog's MLA models (DeepSeek-R1, -V3), no more, no fewer
    mla = [m for m in acc.by_model if cat.model(m).kv_dim is not None]
    assert sorted(mla) == ["deepseek-r1", "deepseek-v3"]
    assert acc.by_architecture["mla"].points == sum(acc.by_model[m].points for m in mla)


def _near(*args: str) -> dict:
    r = runner.invoke(app, [*args, "--format", "json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)["validation_near"]


def _text(*args: str) -> str:
    r = runner.invoke(app, list(args), env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    return r.output


def test_predict_and_sweep_say_how_the_model_fared_near_this_configuration():
    acc = val.shipped_accuracy()
    near = _near("predict", "-H", "h100-sxm", "-m", "llama-3.1-8b")
    groups = {g["kind"]: g for g in near["groups"]}
    assert groups["model_device"]["evidence"] == acc.by_model_device["llama-3.1-8b on h100-sxm"].model_dump()
    assert groups["device"]["evidence"] == acc.by_device["h100-sxm"].model_dump()
    assert groups["stack"]["evidence"] == acc.by_stack["vllm"].model_dump()
    # most specific first; the nearest is the first with enough points to read
    order = ["model_device_stack", "model_device", "model_stack", "model", "device", "stack", "architecture"]
    assert [g["kind"] for g in near["groups"]] == [k for k in order if k in groups]
    first = next(g for g in near["groups"] if g["evidence"]["points"] >= val.FEW)
    assert near["nearest"] == first and near["held_out"] is True
    assert _near("sweep", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--batches", "1") == near
    # the text is the same object: every group's label and the reading are printed
    out = " ".join(_text("predict", "-H", "h100-sxm", "-m", "llama-3.1-8b").split())
    assert all(g["label"] in out for g in near["groups"]) and near["reading"] in out
    # an SRAM machine runs its vendor's software and its per-layer time is fitted to its vendor's speeds:
    # only its own points are shown, flagged as not held out, with no reading drawn from them
    near = _near("predict", "-H", "cerebras-wse3", "-m", "llama-3.1-8b")
    assert {g["kind"] for g in near["groups"]} <= {"model_device", "device"}
    assert near["held_out"] is False and near["nearest"] is None and "not held out" in near["reading"]
    assert _near("sweep", "-H", "cerebras-wse3", "-m", "llama-3.1-8b", "--batches", "1") == near


def _group(points: int, speed: float, faster: int, sources: int = 2) -> val.Group:
    e = val.Evidence(points=points, sources=sources, median_error_pct=20.0, within_30_pct=70,
                     speed_ratio=speed, faster_pct=faster)  # fmt: skip
    return val.Group(kind="device", label="x", evidence=e, command="voicepipe hardware validate")


def test_a_direction_needs_a_large_one_sided_median_from_two_sources():
    assert "best case" in _reading(_group(10, 1.5, 90), True)
    assert "worst case" in _reading(_group(10, 0.7, 10), True)
    # a large median with points on both sides, or from one source, gives the spread instead
    assert "no consistent direction" in _reading(_group(10, 1.5, 60), True)
    assert "no consistent direction" in _reading(_group(10, 1.5, 100, sources=1), True)
    assert "no consistent direction" in _reading(_group(10, 1.05, 100), True)
    assert "unknown" in _reading(None, True)


def _one_sided(e: val.Evidence) -> str | None:
    if e.points < val.FEW or e.sources < 2:
        return None
    if e.speed_ratio > val.ODD and e.faster_pct >= val.ONE_SIDED:
        return "a best case"
    if e.speed_ratio < 1 / val.ODD and e.faster_pct <= 100 - val.ONE_SIDED:
        return "a worst case"
    return None


def test_the_nearest_evidence_reads_a_one_sided_group_as_a_best_or_worst_case():
    # every model-device-stack group whose points lean one way reads the prediction that way (which groups
    # lean follows the data; at least one does)
    acc = val.shipped_accuracy()
    leaning = {k: w for k, e in acc.by_model_device_stack.items() if (w := _one_sided(e))}
    assert leaning
    for key, want in sorted(leaning.items())[:2]:
        model, rest = key.split(" on ")
        device, stack = rest.split(" with ")
        out = _text("predict", "-H", device, "-m", model, "--stack", stack)
        assert f"nearest ({key})" in out and want in out, out
        assert f"rows: voicepipe hardware validate --model {model} --device {device} --stack {stack}\n" in out
    # a device no point measures says so
    bare = next(k for k, d in cat.devices().items() if d.kind == "hbm" and k not in acc.by_device)
    assert f"{bare}: no published point" in _text("predict", "-H", bare, "-m", "llama-3.1-8b")


def test_a_model_of_the_users_own_gets_its_twins_or_its_architectures_evidence(tmp_path):
    acc = val.shipped_accuracy()
    # a config.json of a catalogued model is that model
    near = _near("predict", "-H", "h100-sxm", "-m", str(HF / "mixtral-8x7b" / "config.json"), "--tp", "2")
    assert near["catalogued_as"] == "mixtral-8x7b"
    # DeepSeek-V3's config states its projections' head layout; its MLA latent matches the catalog's
    # DeepSeek models, and the one with published points speaks for it
    cfg = str(HF / "deepseek-v3" / "config.json")
    near = _near("predict", "-H", "h200-sxm", "-m", cfg, "--tp", "8")
    assert near["catalogued_as"] == "deepseek-r1" and set(near["twins"]) == {"deepseek-r1", "deepseek-v3"}
    model = next(g for g in near["groups"] if g["kind"] == "model")
    assert model["evidence"] == acc.by_model["deepseek-r1"].model_dump()
    # a model of an architecture the catalog lacks: no model groups; its architecture's come last
    data = json.loads((HF / "llama-3.1-8b" / "config.json").read_text())
    data["num_hidden_layers"] = 20
    own = tmp_path / "config.json"
    own.write_text(json.dumps(data))
    near = _near("predict", "-H", "h100-sxm", "-m", str(own))
    assert near["catalogued_as"] is None
    assert [g["kind"] for g in near["groups"]] == ["device", "stack", "architecture"]
    out = " ".join(_text("predict", "-H", "h100-sxm", "-m", str(own)).split())
    assert "not the architecture of a catalogued model" in out


def test_hardware_validate_filters_by_exact_device_model_and_stack():
    def ids(*args: str) -> set[str]:
        r = runner.invoke(app, ["validate", *args, "--format", "json"])
        assert r.exit_code == 0, r.output
        return {row["id"] for row in json.loads(r.output)["rows"]}

    # "gaudi-pytorch" appears in no point's id or source, only as its stack
    assert ids("--match", "gaudi-pytorch") == {p.id for p in val.points() if p.stack == "gaudi-pytorch"}
    # exact keys: vllm is not vllm-v0
    want = {p.id for p in val.points() if val.stack_key(p.stack) == "vllm"}
    answered = {r.point.id for r in val.run().rows if r.predicted is not None}
    assert ids("--stack", "vllm") == want
    assert len(want & answered) == val.shipped_accuracy().by_stack["vllm"].points
    assert ids("--model", "llama-3.1-8b", "--device", "h100-sxm") == {
        p.id for p in val.points() if p.model == "llama-3.1-8b" and p.device == "h100-sxm"
    }
    assert ids("--architecture", "mla") == {p.id for p in val.points() if p.model in ("deepseek-r1", "deepseek-v3")}
    assert ids("--stack", "tensorrt-llm") == ids("--stack", "trtllm")  # the data's own alias
    # the rows shown get their own figures under the table
    r = runner.invoke(app, ["validate", "--model", "deepseek-r1"], env={"COLUMNS": "200"})
    e = val.evidence([row for row in val.run().rows if row.point.model == "deepseek-r1"])
    assert f"these {e.points} held-out rows: median error {e.median_error_pct:g} %" in r.output
    # a key no point has is a one-line error, not an empty table
    r = runner.invoke(app, ["validate", "--device", "H100-SXM"])
    assert r.exit_code == 2 and "--device: no published point has 'H100-SXM'" in r.output


def test_validate_marks_the_sram_fit_points_and_keeps_them_out_of_the_shown_rows_figures():
    """The points an SRAM machine's constants were fitted to are not held out: the table says so on their
    rows, and the figures under a filtered table are over the held-out rows only."""
    rows = [row for row in val.run().rows if "groq" in row.point.id]
    fit = [row for row in rows if row.point.sram_fit]
    assert fit and len(fit) < len(rows)
    r = runner.invoke(app, ["validate", "--match", "groq", "--all"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    for row in fit:
        line = next(x for x in r.output.splitlines() if x.startswith(row.point.id + " "))
        assert line.rstrip().endswith("% fit"), line
    assert "fit: one of the " in r.output
    held = [row for row in rows if row.error is not None and not row.point.sram_fit]
    e = val.evidence(held)
    assert f"these {e.points} held-out rows: median error {e.median_error_pct:g} %" in r.output


def test_the_validate_title_counts_the_filtered_rows_and_then_the_worst_kept():
    tier1 = sum(1 for row in val.run().rows if row.point.tier == 1)
    r = runner.invoke(app, ["validate", "--tier", "1", "--worst", "3"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    assert f"{tier1} of {len(val.run().rows)} rows, the 3 largest errors" in r.output


def test_hardware_validate_cli_prints_the_summary():
    r = runner.invoke(app, ["validate"])
    assert r.exit_code == 0, r.output
    assert "tier 1: median" in r.output and "worst" in r.output


def test_hardware_validate_filters_rows_but_not_the_summary():
    rep = val.run()
    r = runner.invoke(app, ["validate", "--tier", "1", "--worst", "3", "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    errs = [abs(x["error"]) for x in out["rows"]]
    assert len(errs) == 3 and all(x["tier"] == 1 for x in out["rows"]) and errs == sorted(errs, reverse=True)
    tier1 = [x for x in rep.rows if x.point.tier == 1 and x.error is not None]
    assert errs[0] == pytest.approx(max(abs(x.error or 0.0) for x in tier1))
    assert out["summary"] == val.summary_lines(rep)  # over every point, whatever is shown
    m = json.loads(runner.invoke(app, ["validate", "--match", "MI300X", "--format", "json"]).output)
    assert 0 < len(m["rows"]) < len(rep.rows)
    for x in m["rows"]:
        assert "mi300x" in " ".join((x["id"], x["device"], x["model"], x["source"])).lower()
    g = json.loads(runner.invoke(app, ["validate", "--match", "mlperf-inference", "--format", "json"]).output)
    assert g["rows"] and all(x["group"] == "mlperf-inference" for x in g["rows"])
    assert {x["held_out_with"] for x in g["rows"]} >= {"NVIDIA", "AMD"}  # held out with their submitter


def test_predict_and_sweep_agree_on_chips_at_batch_one():
    for m in ("llama-3.1-70b", "llama-3.1-8b", "mixtral-8x7b"):
        p = json.loads(runner.invoke(app, ["predict", "-H", "h100-sxm", "-m", m, "--format", "json"]).output)
        s = json.loads(runner.invoke(app, ["sweep", "-H", "h100-sxm", "-m", m, "--format", "json"]).output)
        row = next(r for r in s["rows"] if r["batch"] == 1)
        assert row["chips"] == p["chips"] and row["step_ms"] == pytest.approx(p["step_ms"])


def test_json_file_output(tmp_path):
    out = tmp_path / "p.json"
    r = runner.invoke(app, ["predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--json", str(out)])
    assert r.exit_code == 0 and "MODELLED" in r.output
    assert json.loads(out.read_text())["modelled"] is True


def test_shipped_defaults_are_the_full_data_fit():
    rep = val.run()
    for name, value in rep.theta_all.items():
        assert getattr(hm.DEFAULT_EFFICIENCY, name) == pytest.approx(value, rel=0.03, abs=0.005), name


def test_pipeline_config_takes_own_device_and_model_for_agent_and_council(tmp_path):
    from voicepipe.config import load_config
    from voicepipe.errors import UserError

    dev = tmp_path / "dev.yaml"
    dev.write_text(DEVICE_YAML)
    model_cfg = HF / "mixtral-8x7b" / "config.json"
    cfg_file = tmp_path / "pipe.yaml"
    spec = f"{{hardware: {dev}, model: {model_cfg}, precision: int4}}"
    cfg_file.write_text(f"agent:\n  backend: {spec}\ncouncil:\n  members: [{spec}, h100-sxm/llama-3.1-8b]\n")
    cfg = load_config(cfg_file)
    assert isinstance(cfg.agent.backend, dict) and cfg.agent.backend["hardware"] == str(dev)
    assert build_backend(cfg.agent.backend).describe()["chips"] >= 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"agent:\n  backend: {{hardware: {dev}, model: {tmp_path / 'missing.json'}}}\n")
    with pytest.raises(UserError, match=r"missing\.json"):
        load_config(bad)


def test_pipeline_stack_runs_chips_in_turn():
    one = system("rtx-4090", "llama-3.1-8b", tp=1, stack=cat.stack("llama.cpp"), precision="int4")
    two = system("rtx-4090", "llama-3.1-8b", tp=2, stack=cat.stack("llama.cpp"), precision="int4")
    tensor = system("rtx-4090", "llama-3.1-8b", tp=2, stack=cat.stack("vllm"), precision="int4")
    alone = system("rtx-4090", "llama-3.1-8b", tp=1, stack=cat.stack("vllm"), precision="int4")
    t1, t2 = (float(hm.decode_step_s(s, 1, 512)) for s in (one, two))
    assert t1 < t2 < 1.1 * t1  # no speed-up from a layer split, only a hop more
    assert float(hm.step_parts(tensor, 1, 512).dense_s) == pytest.approx(
        float(hm.step_parts(alone, 1, 512).dense_s) / 2
    )
    assert hm.max_sequences(two, 4096) > 2 * hm.max_sequences(one, 4096)  # but twice the memory


def test_offload_tier_only_when_no_width_holds_the_weights_in_hbm():
    sn = cat.device("sambanova-sn40l")
    s70 = hm.make_system(sn, cat.model("llama-3.1-70b"))
    assert s70.chips == 4 and hm.weight_split(s70)[1] == 0
    gh = hm.make_system(cat.device("gh200"), cat.model("llama-3.1-70b"))
    assert gh.chips == 1 and hm.weight_split(gh)[1] > 0


def test_stack_without_gqa_sharing_rereads_kv_per_query_head():
    old, new = cat.stack("trtllm-v0.6"), cat.stack("trtllm")
    assert not old.gqa_kv_shared and new.gqa_kv_shared
    gqa = [system("h100-sxm", "llama-2-70b", tp=4, precision="fp8", stack=s) for s in (old, new)]
    kv_old, kv_new = (float(hm.step_parts(s, 64, 64 * 2048).kv_s) for s in gqa)
    # decode reads grow by the group size (64 query heads / 8 KV heads), the newly written tokens do not
    assert 7.5 * kv_new < kv_old < 8.0 * kv_new
    mha = [system("h100-sxm", "llama-2-7b", tp=1, precision="fp8", stack=s) for s in (old, new)]
    assert float(hm.step_parts(mha[0], 64, 64 * 2048).kv_s) == float(
        hm.step_parts(mha[1], 64, 64 * 2048).kv_s
    )
    # prefill attention (context FMHA) is not affected
    pre = [float(hm.step_parts(s, 0, 0, prefill_tokens=2048).kv_s) for s in gqa]
    assert pre[0] == pre[1]


def test_attention_dp_splits_the_mla_cache_by_sequence_and_replicates_attention_weights():
    import dataclasses

    tp = system("h200-sxm", "deepseek-r1", tp=8, precision="fp8")
    dp = dataclasses.replace(tp, attention_dp=True)
    assert hm.kv_shards(tp.model, 8) == 1 and hm.kv_shards(tp.model, 8, attention_dp=True) == 8
    assert hm.max_sequences(dp, 3072) > 4 * hm.max_sequences(tp, 3072)  # less the attention copies
    a, b = hm.step_parts(tp, 256, 256 * 2048), hm.step_parts(dp, 256, 256 * 2048)
    assert float(b.kv_s) == pytest.approx(float(a.kv_s) / 8)
    assert float(b.dense_s) > float(a.dense_s)  # every chip streams the whole attention weights
    assert hm.weight_split(dp)[0] > hm.weight_split(tp)[0]


def test_per_sequence_host_cost_grows_with_the_batch():
    v0, v1 = cat.stack("vllm-v0"), cat.stack("vllm")
    assert v0.seq_overhead_us > v1.seq_overhead_us > 0  # V1 still does some per-sequence host work
    old, new = (system("h100-sxm", "llama-3.1-8b", tp=1, stack=s) for s in (v0, v1))
    gap = [float(hm.decode_step_s(old, b, 1024) - hm.decode_step_s(new, b, 1024)) for b in (1, 64, 256)]
    per_seq = (v0.seq_overhead_us - v1.seq_overhead_us) * 1e-6
    assert gap[0] == pytest.approx(per_seq)
    assert gap[2] == pytest.approx(256 * per_seq)
    assert gap[0] < gap[1] < gap[2]






def test_sustained_bandwidth_and_matmul_rates_come_from_measurements_or_the_default_share():
    h200, h100, b200 = cat.device("h200-sxm"), cat.device("h100-sxm"), cat.device("b200")
    # a recorded microbenchmark is used as is; an unrecorded device gets the default share of its datasheet
    assert h200.stream_bytes_s == pytest.approx(h200.stream_bw_tbs * 1e12)  # type: ignore[operator]
    assert b200.stream_bw_tbs is None
    assert b200.stream_bytes_s == pytest.approx(8.0e12 * cat.STREAM_SHARE_DEFAULT)
    assert h100.matmul_flops("fp8") == pytest.approx(h100.matmul_tflops["fp8"] * 1e12)
    # weight-only formats run at the bf16 rate; an unmeasured precision at the bf16 share of its peak
    assert h100.matmul_flops("int4") == h100.matmul_flops("bf16")
    mi = cat.device("mi300x")
    share = mi.matmul_tflops["bf16"] / mi.peak_tflops["bf16"]
    assert "int8" not in mi.matmul_tflops
    assert mi.matmul_flops("int8") == pytest.approx(mi.peak_flops("int8") * share)
    rtx = cat.device("rtx-4090")
    assert rtx.matmul_flops("bf16") == pytest.approx(rtx.peak_flops("bf16") * cat.MAMF_SHARE_DEFAULT)
    # the step's memory term scales with the sustained bandwidth, not the datasheet figure
    s = hm.make_system(h200, cat.model("llama-3.1-8b"), "bf16", tp=1)
    parts = hm.step_parts(s, 1, 1024)
    dense_bytes = float(hm.weight_read_params(s.model, 1)) * 2.0
    assert float(parts.dense_s) == pytest.approx(dense_bytes / h200.stream_bytes_s)


def test_default_shares_are_the_median_of_the_recorded_measurements():
    devs = [d for d in cat.devices().values() if d.kind == "hbm"]
    bw = [d.stream_bw_tbs / d.mem_bw_tbs for d in devs if d.stream_bw_tbs is not None]  # type: ignore[operator]
    mm = [d.matmul_tflops["bf16"] / d.peak_tflops["bf16"] for d in devs if "bf16" in d.matmul_tflops]
    assert len(bw) >= 5 and len(mm) >= 5
    assert abs(cat.STREAM_SHARE_DEFAULT - float(np.median(bw))) <= 0.02
    assert abs(cat.MAMF_SHARE_DEFAULT - float(np.median(mm))) <= 0.02
    # no share above the datasheet: a measurement is at most the peak it is measured against
    assert max(bw) <= 1.0 and max(mm) <= 1.0


def test_measured_rates_need_a_source(tmp_path):
    dev = tmp_path / "dev.yaml"
    dev.write_text(
        DEVICE_YAML.replace(
            "peak_tflops: {bf16: 400}\n", "peak_tflops: {bf16: 400}\nmatmul_tflops: {bf16: 300}\n"
        )
    )
    with pytest.raises(ValueError, match=r"dev\.yaml: .*no source for matmul_tflops"):
        cat.device(str(dev))
    dev.write_text(DEVICE_YAML.replace("mem_bw_tbs: 2.0\n", "mem_bw_tbs: 2.0\nstream_bw_tbs: 1.7\n"))
    with pytest.raises(ValueError, match=r"dev\.yaml: .*no source for stream_bw_tbs"):
        cat.device(str(dev))


# ---------------------------------------------------------------- third accuracy pass: kernels, MLA, paged KV


def test_weight_gemms_and_attention_each_have_their_own_roofline():
    # 13B with 1,024 short sequences: the weight GEMMs are compute-bound, attention is KV-bound; the
    # kernels run one after the other, so the step pays both, not the larger of the two sums
    s = system("h200-sxm", "llama-2-13b", precision="fp8", tp=1)
    parts = hm.step_parts(s, 1024, 1024 * 192)
    eta, mfu = 0.8, 0.7
    memory, compute, total = (float(x) for x in hm.combine(parts, eta, mfu, 1.0, 1.0, 0.0))
    weights, cache = float(parts.dense_s) / eta, float(parts.kv_s) / eta
    matmul, attention = float(parts.flops_s) / mfu, float(parts.attn_s) / mfu
    assert matmul > weights and cache > attention  # the two classes sit on opposite sides of the ridge
    # what is not kernels: collectives, the GPU-side fixed costs and the host's work between forwards
    busy = total - float(parts.comm_s) - float(parts.fixed_s) - float(parts.serial_s)
    assert busy == pytest.approx(matmul + cache)
    assert busy > 1.3 * max(memory, compute)
    # a batch-1 step is memory-bound in both classes: the roofline adds the two streams
    one = hm.step_parts(s, 1, 1024)
    m1, _, t1 = (float(x) for x in hm.combine(one, eta, mfu, 1.0, 1.0, 0.0))
    assert t1 - float(one.comm_s) - float(one.fixed_s) - float(one.serial_s) == pytest.approx(m1)


def test_mla_decode_attention_uses_the_absorbed_latent_width():
    r1, llama = cat.model("deepseek-r1"), cat.model("llama-3.1-70b")
    assert hm.decode_attention_width(llama) == 2 * llama.head_dim
    assert r1.kv_dim is not None
    assert hm.decode_attention_width(r1) == 2 * r1.kv_dim - hm.MLA_ROPE_DIM  # scores 576 + values 512
    s = system("h200-sxm", "deepseek-r1", tp=8)
    kv = 64 * 4096
    parts = hm.step_parts(s, 64, kv)
    flops = 2.0 * r1.layers * r1.heads * hm.decode_attention_width(r1) * kv
    assert float(parts.attn_s) == pytest.approx(flops / s.device.matmul_flops("bf16") / 8)
    # prefill attention keeps the per-head form (prompts are not decoded through the latent), with
    # 192-wide scores (128 + the 64-wide rotary key) and 128-wide values
    pre = hm.step_parts(s, 0, 0, prefill_tokens=1000)
    width = 2 * r1.head_dim + hm.MLA_ROPE_DIM
    assert float(pre.attn_s) == pytest.approx(
        2.0 * r1.layers * r1.heads * width * 1000 * 500 / s.device.matmul_flops("bf16") / 8
    )


def test_paged_kv_runs_the_sequences_that_fit_at_their_mean_context():
    s = system("a100-80gb", "llama-2-7b", precision="fp16", tp=1)
    full, mean = hm.max_sequences(s, 128 + 2048), hm.max_sequences(s, 128 + 1024)
    assert hm.running_sequences(s, 128, 2048) == mean > full  # blocks allocated as sequences grow
    p = hm.predict(s.device, s.model, precision="fp16", batch=5000, prompt_tokens=128, output_tokens=2048)
    assert not p.fits and p.effective_batch == p.max_batch_fits == mean
    assert "mean context of 1152 tokens" in p.note
    # nothing runs when not even one whole sequence fits beside the weights
    big = system("h200-sxm", "llama-3.1-70b", precision="fp8", tp=1)
    assert hm.max_sequences(big, 1_000_000) == 0
    assert hm.running_sequences(big, 1_000_000, 2) == 0


def test_device_memory_is_read_as_binary_gigabytes():
    # a vendor's "80 GB" of HBM is 80 GiB (nvidia-smi: 81,559 MiB on an H100 80GB); SRAM stays decimal
    h100 = cat.device("h100-sxm")
    assert h100.capacity_bytes > 85e9
    assert cat.device("groq-lpu").capacity_bytes == pytest.approx(0.23e9)
    # so 70B fp8 weights (72.7 GB with the 16-bit embedding and head) on one H100 leave room for more than
    # a dozen 2,000-token sequences (fp8 cache), not a handful, on a bare loop that keeps nothing besides
    # weights and KV (stack "none"); vLLM's start-up profile reserves ~4.9 GiB more (sampler over 1,024 slots
    # of a 128K vocabulary), which leaves none within its default 0.9 share
    bare = hm.System(h100, cat.model("llama-3.1-70b"), "fp8", 1, kv_precision="fp8", stack=cat.stack("none"))
    assert hm.running_sequences(bare, 1000, 1000) >= 15
    vllm = hm.System(h100, cat.model("llama-3.1-70b"), "fp8", 1, kv_precision="fp8", stack=cat.stack("vllm"))
    assert hm.running_sequences(vllm, 1000, 1000) == 0


def test_kv_rereads_follow_the_heads_one_read_serves():
    shared, old_trt, tm = cat.stack("lmdeploy"), cat.stack("trtllm-v0.6"), cat.stack("lmdeploy-v0.1")
    assert tm.gqa_heads_per_read == 4
    assert [cat.kv_rereads(shared, g) for g in (1, 8)] == [1.0, 1.0]
    assert [cat.kv_rereads(old_trt, g) for g in (1, 8)] == [1.0, 8.0]
    # 4 heads a block when the group is a multiple of 4, else 2, else 1
    assert [cat.kv_rereads(tm, g) for g in (1, 2, 4, 6, 8, 7)] == [1.0, 1.0, 1.0, 3.0, 2.0, 7.0]
    a, b = (system("a100-80gb", "llama-2-70b", tp=4, stack=s) for s in (tm, cat.stack("lmdeploy")))
    assert float(hm.step_parts(a, 64, 64 * 1152).kv_s) == pytest.approx(
        2 * float(hm.step_parts(b, 64, 64 * 1152).kv_s), rel=0.01
    )


def test_predict_says_when_a_precision_has_no_math_of_its_own_on_the_device():
    def run(dev: str) -> tuple[bool, str]:
        j = json.loads(
            _text("predict", "-H", dev, "-m", "llama-3.1-8b", "--precision", "fp4", "--format", "json")
        )
        return j["weight_only"], _text("predict", "-H", dev, "-m", "llama-3.1-8b", "--precision", "fp4")

    only, text = run("h100-sxm")  # Hopper has no fp4 tensor cores
    assert only and "no fp4 math here" in text
    only, text = run("b200")  # Blackwell has
    assert not only and "no fp4 math" not in text


def test_show_of_a_backend_prints_its_evidence_as_predict_does():
    out = " ".join(_text("show", "h100-sxm/llama-3.1-70b").split())
    near = _near("predict", "-H", "h100-sxm", "-m", "llama-3.1-70b")
    assert near["reading"] in out and all(g["label"] in out for g in near["groups"])
    assert "not held out" in _text("show", "cerebras-wse3/llama-3.1-8b")


def test_loaded_itl_carries_newcomers_prefill_and_the_median_gap_does_not():
    """Both are figures of one steady engine run (25 clients): the mean time per token includes the steps
    that also prefill a newcomer; the median gap is the mean decode-only step, between it and a lone one."""
    base = dict(id="x", device="h100-sxm", chips=1, model="llama-3.1-8b", precision="bf16", prompt_tokens=1000,
                output_tokens=100, stack="vllm", date="2025", source="s", tier=1, value=1.0)  # fmt: skip

    def value(**kw: object) -> float:
        x = val.prepare(val.Point(**{**base, **kw}))
        return metric_of(x, engine_run(x))

    mean, median = value(batch=25, metric="itl_ms"), value(batch=25, metric="itl_median_ms")
    alone = value(batch=1, metric="itl_ms")
    assert mean > 1.2 * median and median > alone
