"""Anchored predictions (``calibrate --anchor``, ``hardware predict --anchor``, a backend's ``anchor:``) and
the cross-device ratio validation they rest on (:mod:`voicepipe.hardware.validate.ratios`)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from tests.sse_server import SSEServer
from voicepipe.backends import UnknownBackend, build_backend
from voicepipe.backends.anchor import AnchoredServer, Factors, anchor_prediction, factors
from voicepipe.backends.base import LLMRequest
from voicepipe.backends.profile import Anchor
from voicepipe.cli import app
from voicepipe.hardware import catalog
from voicepipe.hardware.model import make_system
from voicepipe.hardware.validate import Point, Row, points, shipped_accuracy
from voicepipe.hardware.validate.ratios import (
    MIN_RATIOS,
    anchored_intervals,
    pairs,
    ratio_accuracy,
    ratio_band,
    ratio_pairs,
    ratio_report,
    residual_pairs,
)
from voicepipe.hardware.workload import steady, throughput
from voicepipe.turnrange import spread_of

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


def anchor(**kw) -> Anchor:
    base = {"hardware": "a100-80gb", "model": "llama-3.1-8b", "precision": "bf16", "kv_precision": "bf16",
            "stack": "vllm", "chips": 1, "concurrency": 1, "prompt_tokens": 256, "output_tokens": 64,
            "ttft_ms": 40.0, "tpot_ms": 9.0, "measured": "test"}  # fmt: skip
    return Anchor(**{**base, **kw})


def profile_file(tmp_path, a: Anchor | None, name: str = "p.yaml"):
    doc = {"ttft_ms": {"median": 40, "p90": 50}, "tokens_per_s": 100}
    if a is not None:
        doc["anchor"] = a.model_dump()
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


# -- calibrate --anchor, end to end against a real socket -----------------------------------------------
@pytest.fixture
def server():
    s = SSEServer(ttft_ms=30.0, token_ms=4.0).start()
    yield s
    s.stop()


def test_calibrate_anchor_records_the_measurement_and_predict_reproduces_it_on_the_anchor(server, tmp_path):
    out = tmp_path / "mine.yaml"
    r = cli("calibrate", server.url, "--model", "m", "--concurrency", "1", "--requests", "4", "--output-tokens", "8",
            "--out", str(out), "--against", "a100-80gb/llama-3.1-8b", "--anchor", "--stack", "vllm")  # fmt: skip
    assert r.exit_code == 0, r.output
    a = Anchor(**yaml.safe_load(out.read_text())["anchor"])
    assert (a.hardware, a.model, a.stack, a.chips, a.concurrency) == (
        "a100-80gb",
        "llama-3.1-8b",
        "vllm",
        1,
        1,
    )
    assert a.ttft_ms >= 25 and a.tpot_ms >= 3 and a.output_tokens == 8  # the server: 30 ms, then 4 ms a token
    assert "127.0.0.1" in a.measured
    # on the anchor itself, at the measured settings, the anchored figures are the measurement
    r = cli("hardware", "predict", "-H", "a100-80gb", "-m", "llama-3.1-8b", "--prompt-tokens", str(a.prompt_tokens),
            "--output-tokens", str(a.output_tokens), "--anchor", str(out), "--format", "json")  # fmt: skip
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["ttft_ms"] == pytest.approx(a.ttft_ms, rel=1e-9)
    assert 1e3 / got["tokens_per_second"] == pytest.approx(a.tpot_ms, rel=1e-9)
    assert got["anchored"]["file"] == str(out) and got["anchored"]["measured_ttft_ms"] == a.ttft_ms
    assert got["ratio_spans"] == []  # the very configuration measured


def test_calibrate_anchor_needs_against(server, tmp_path):
    r = cli("calibrate", server.url, "--model", "m", "--out", str(tmp_path / "x.yaml"), "--anchor")
    assert r.exit_code == 2 and "--anchor" in r.output and "Traceback" not in r.output


# -- hardware predict --anchor ----------------------------------------------------------------------------
def test_predict_anchor_scales_the_measurement_by_the_modelled_ratio(tmp_path):
    a = anchor()
    path = profile_file(tmp_path, a)
    r = cli("hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--prompt-tokens", "256",
            "--output-tokens", "64", "--anchor", str(path), "--format", "json")  # fmt: skip
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    on_anchor = anchor_prediction(a)
    target = got["modelled_unanchored"]
    # measured on the anchor x (model on the target / model on the anchor)
    assert got["ttft_ms"] == pytest.approx(a.ttft_ms * target["ttft_ms"] / on_anchor.ttft_ms, rel=1e-9)
    assert got["tokens_per_second"] == pytest.approx(
        1e3 / a.tpot_ms * target["tokens_per_second"] / on_anchor.tokens_per_second, rel=1e-9
    )
    assert got["stack"] == "vllm" and got["precision"] == "bf16"  # the anchor's
    assert got["ratio_spans"] == ["device h100-sxm x 1 here, a100-80gb x 1 measured"]
    lo, hi = got["intervals"]["ttft_ms"]
    assert lo <= got["ttft_ms"] <= hi and got["interval_level"] == 0.8
    assert "cross-device ratio residuals" in got["interval_basis"]["ttft_ms"]
    table = cli("hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--anchor", str(path))
    assert table.exit_code == 0 and "ANCHORED" in table.stdout and str(path) in table.stdout.replace("\n", "")


def test_predict_anchor_of_another_model_or_without_an_anchor_is_one_line_exit_2(tmp_path):
    path = profile_file(tmp_path, anchor())
    r = cli("hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-70b", "--anchor", str(path))
    assert r.exit_code == 2 and "anchor.model" in r.output and str(path) in r.output
    assert len(r.output.strip().splitlines()) == 1
    bare = profile_file(tmp_path, None, "bare.yaml")
    r = cli("hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--anchor", str(bare))
    assert r.exit_code == 2 and "anchor: missing" in r.output and str(bare) in r.output
    r = cli(
        "hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--anchor", str(tmp_path / "none.yaml")
    )
    assert r.exit_code == 2 and "no such profile file" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"ttft_ms": {"median": 1, "p90": 1}, "tokens_per_s": 1,
                                   "anchor": {**anchor().model_dump(), "chips": 0}}))  # fmt: skip
    r = cli("hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--anchor", str(bad))
    assert r.exit_code == 2 and "anchor.chips" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize(
    ("field", "value"),
    [("stack", "vlm"), ("hardware", "a100-90gb"), ("precision", "bf15"), ("kv_precision", "fp9"),
     ("model", "llama-3.1-9b")],
)
def test_an_anchor_field_the_catalog_does_not_know_is_one_line_naming_the_file_and_the_field(
    tmp_path, field, value
):
    path = profile_file(tmp_path, anchor(**{field: value}))
    r = cli("hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--anchor", str(path))
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    assert r.output.startswith(f"error: {path}: anchor.{field}: unknown"), r.output
    with pytest.raises(UnknownBackend, match=f"anchor.{field}: unknown"):  # the backend's anchor: too
        build_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "anchor": str(path)})


# -- the agent's hardware backend with anchor: (run / predict / capacity) ---------------------------------
def test_an_anchored_backend_is_the_same_engine_as_predict_anchor(tmp_path):
    a = anchor()
    path = profile_file(tmp_path, a)
    b = build_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "anchor": str(path)})
    assert b.name.endswith("+anchored") and b.describe()["anchored"]["file"] == str(path)
    req = LLMRequest("s", 0, 256, 64)
    t = b.predict(req, np.random.default_rng(0))
    r = cli("hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--prompt-tokens", "256",
            "--output-tokens", "64", "--anchor", str(path), "--format", "json")  # fmt: skip
    got = json.loads(r.stdout)
    assert t.ttft_s * 1e3 == pytest.approx(got["ttft_ms"], rel=1e-9)
    assert 1 / t.tpot_s == pytest.approx(got["tokens_per_second"], rel=1e-9)
    plain = build_backend("h100-sxm/llama-3.1-8b").predict(req, np.random.default_rng(0))
    f = factors(a)
    assert t.ttft_s == pytest.approx(plain.ttft_s * f.ttft, rel=1e-9)
    assert t.tpot_s == pytest.approx(plain.tpot_s * f.step, rel=1e-9)
    with pytest.raises(UnknownBackend, match=r"anchor\.model"):
        build_backend({"hardware": "h100-sxm", "model": "llama-3.1-70b", "anchor": str(path)})


def test_a_loaded_anchored_device_reads_the_same_from_predict_and_the_backend(tmp_path):
    path, n = profile_file(tmp_path, anchor()), 16
    r = cli("hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--batch", str(n), "--prompt-tokens",
            "256", "--output-tokens", "64", "--anchor", str(path), "--format", "json")  # fmt: skip
    got = json.loads(r.stdout)
    b = build_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "anchor": str(path), "max_batch": n})
    assert isinstance(b.server, AnchoredServer)
    run = steady(AnchoredServer(b.system, b.anchor[2], max_batch=n, prompt_cache=False), n, 256, 64)
    assert got["ttft_ms"] == pytest.approx(run.ttft_s * 1e3, rel=1e-9)
    assert got["tokens_per_second"] == pytest.approx(1 / run.tpot_s, rel=1e-9)
    assert got["aggregate_tokens_per_second"] == pytest.approx(throughput(run, static=False), rel=1e-9)
    assert got["tokens_per_second"] < json.loads(
        cli("hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--prompt-tokens", "256",
            "--output-tokens", "64", "--anchor", str(path), "--format", "json").stdout
    )["tokens_per_second"]  # fmt: skip  # load slows a user down, anchored too


@pytest.mark.parametrize("f", [Factors(1.4, 0.7), Factors(0.6, 1.5), Factors(1.0, 1.0)])
def test_an_anchored_step_never_shortens_when_work_is_added(f):
    dev, mdl = catalog.device("h100-sxm"), catalog.model("llama-3.1-8b")
    s = AnchoredServer(make_system(dev, mdl, "bf16", seqs=1, context=4096), f, max_batch=64)
    grid = [(d, p) for d in (0, 1, 2, 8, 32, 64) for p in (0, 1, 64, 512, 4096)]
    for d, p in grid:
        here = s.step_ns(d, d * 1000.0, p, 0)
        for d2, p2 in grid:
            if d2 >= d and p2 >= p and (d2, p2) != (d, p) and (d or p):
                assert s.step_ns(d2, d2 * 1000.0, p2, 0) >= here * (1 - 1e-12), (d, p, d2, p2)


# -- cross-device ratios ----------------------------------------------------------------------------------
def pt(id: str, device: str = "h100-sxm", value: float = 10.0, **kw) -> Point:
    base = {"id": id, "device": device, "chips": 1, "model": "llama-3.1-8b", "precision": "bf16", "batch": 1,
            "prompt_tokens": 128, "output_tokens": 128, "stack": "vllm", "metric": "tpot_ms", "value": value,
            "date": "2025-01-01", "source": "https://example.org/a", "tier": 1}  # fmt: skip
    return Point(**{**base, **kw})


def test_pairs_are_one_harness_on_two_devices_or_chip_counts():
    a, b = pt("a"), pt("b", "a100-80gb")
    c = pt("c", chips=2)  # same device, more chips: a pair
    other_source = pt("d", "l40s", source="https://example.org/b")
    other_batch = pt("e", "l40s", batch=8)
    same_place = pt("f")  # same device and chips as a: no pair
    spec = pt("g", "l40s", speculative="eagle alpha=0.7 gamma=3 draft_cost=0.05")
    got = {(x.id, y.id) for x, y in pairs([a, b, c, other_source, other_batch, same_place, spec])}
    assert got == {("a", "b"), ("a", "c"), ("b", "c"), ("b", "f"), ("c", "f")}


def test_a_point_without_a_timing_pairs_as_its_stacks_default_timing():
    """A point that leaves ``timing`` unset is run with its stack's default, and pairs as that: an unset
    field is not a different harness; a stated other timing is."""
    default = catalog.stack("vllm").timing
    other = "engine" if default == "client" else "client"
    a, b = pt("a", timing=default), pt("b", "a100-80gb")
    c = pt("c", "l40s", timing=other)
    assert {(x.id, y.id) for x, y in pairs([a, b, c])} == {("a", "b")}


def test_one_publishers_per_device_files_of_one_group_are_one_harness():
    """An author who ran one script on three devices and kept a result file per device: the files share a
    group (what the family hold-out holds out together), so their points pair; a file of another publisher
    in the same group (an MLPerf round's submitters) is another harness and pairs with none of them."""
    group = "https://example.org/author-repo"
    h200 = pt("h", "h200-sxm", source="https://example.org/author-repo/H200.json", group=group, publisher="A")
    b200 = pt("b", "b200", source="https://example.org/author-repo/B200.json", group=group, publisher="A")
    other = pt("o", "mi300x", source="https://example.org/author-repo/x.json", group=group, publisher="B")
    got = {(x.id, y.id) for x, y in pairs([h200, b200, other])}
    assert got == {("h", "b")}
    (p,) = ratio_pairs([Row(h200, 10.0), Row(b200, 10.0)])
    assert p.source == group  # the harness, not one of its files


def test_open_loop_points_pair_by_their_rate_and_count_not_by_the_concurrency_they_ended_up_with():
    h100 = pt("h", batch=11, request_rate=2.0, num_prompts=500)
    h200 = pt("g", "h200-sxm", batch=9, request_rate=2.0, num_prompts=500)  # fewer in flight: faster
    faster = pt("f", "h200-sxm", batch=11, request_rate=8.0, num_prompts=500)  # another rate, same mean
    assert {(x.id, y.id) for x, y in pairs([h100, h200, faster])} == {("h", "g")}


def test_a_ratio_is_right_when_both_predictions_are_off_by_the_same_factor():
    a, b = pt("a", value=10.0), pt("b", "a100-80gb", value=20.0)  # times: b is half as fast
    rows = [Row(a, 5.0), Row(b, 10.0)]  # each 2x fast, the ratio exact
    (p,) = ratio_pairs(rows)
    assert p.measured_speed_ratio == pytest.approx(0.5) and p.error == pytest.approx(0.0, abs=1e-9)
    (p,) = ratio_pairs([Row(a, 10.0), Row(b, 15.0)])  # b read 20/15 fast, a exact
    assert p.predicted_speed_ratio == pytest.approx(10 / 15) and p.error == pytest.approx(
        20 / 15 - 1, rel=1e-6
    )
    r1, r2 = (
        pt("r1", metric="tok_s_user", value=100.0),
        pt("r2", "a100-80gb", metric="tok_s_user", value=50.0),
    )
    (q,) = ratio_pairs([Row(r1, 100.0), Row(r2, 100.0)])  # a rate: b predicted 2x fast
    assert q.log_error == pytest.approx(math.log(2)) and q.error == pytest.approx(1.0)
    (q2,) = ratio_pairs([Row(r2, 100.0), Row(r1, 100.0)])  # the other direction: the same error
    assert q2.error == pytest.approx(q.error)
    rep = ratio_report([Row(a, 5.0), Row(b, 10.0), Row(r1, 100.0), Row(r2, 100.0)])
    assert (
        rep.summary is not None
        and rep.summary.pairs == 2
        and rep.summary.median_error_pct == pytest.approx(50.0)
    )
    assert (
        ratio_report([Row(a, 5.0), Row(b, None, "n/a")]).summary is None
    )  # an unanswered point pairs with none


def test_ratio_bands_use_their_phase_only_with_enough_pairs_from_enough_families():
    few = [("ttft", 0.1, "A"), ("ttft", -0.1, "A")]
    many = [("decode", x, "ABC"[i % 3]) for i, x in enumerate(np.linspace(-0.2, 0.2, MIN_RATIOS + 5))]
    band, basis = ratio_band(few + many, "ttft_ms")
    assert "every phase" in basis and band[0] < 0 < band[1]
    band, basis = ratio_band(few + many, "step_ms")
    assert "decode pairs" in basis and -0.2 <= band[0] < 0 < band[1] <= 0.2
    # as many pairs from one vendor's harness are one setup's: the phase borrows every pair's band
    one = [("decode", d, "A") for _, d, _ in many]
    wide = [("ttft", x, "B") for x in (-1.0, 1.0)] * 10
    band, basis = ratio_band(one + wide, "step_ms")
    assert "every phase" in basis and band[0] <= -1.0 and band[1] >= 1.0
    assert ratio_band(few, "ttft_ms") is None  # too few for an 80 % band
    iv, _ = anchored_intervals({"ttft_ms": 100.0, "tokens_per_second": 50.0}, many)
    assert (
        iv["ttft_ms"][0] < 100.0 < iv["ttft_ms"][1]
        and iv["tokens_per_second"][0] < 50.0 < iv["tokens_per_second"][1]
    )


def test_the_shipped_sources_give_cross_device_pairs():
    rp = residual_pairs(points(), shipped_accuracy().residuals)
    assert len(rp) >= 2 * 100  # over a hundred pairs, each in both directions
    assert {ph for ph, _, _ in rp} >= {"ttft", "decode", "throughput/e2e"}


def test_validate_reports_cross_device_ratios():
    r = cli("hardware", "validate", "--format", "json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["cross_device_ratios"]
    assert got["summary"]["pairs"] == len(got["pairs"]) >= 100
    assert 0 < got["summary"]["median_error_pct"] < 100
    # what an anchored prediction prints comes from the shipped residuals: the same pairs and error
    shipped = ratio_accuracy(residual_pairs(points(), shipped_accuracy().residuals))
    assert shipped["pairs"] == got["summary"]["pairs"]
    assert shipped["median_error_pct"] == pytest.approx(got["summary"]["median_error_pct"], abs=0.2)


def test_an_anchored_agents_turn_range_is_the_one_predict_anchor_prints(tmp_path):
    # a turn's range carries the agent's 80 % range: for an anchored agent that is the cross-device ratio
    # band hardware predict --anchor prints, not the unanchored model's held-out band
    path = profile_file(tmp_path, anchor())
    b = build_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "anchor": str(path)})
    got = json.loads(cli("hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--prompt-tokens", "256",
                         "--output-tokens", "64", "--anchor", str(path), "--format", "json").stdout)  # fmt: skip
    s = spread_of(b)
    for metric, (lo, hi) in (("ttft_ms", s.ttft), ("step_ms", s.step)):
        want = got["intervals"][metric]
        assert (lo * got[metric], hi * got[metric]) == pytest.approx(want, rel=1e-9)
    plain = spread_of(build_backend("h100-sxm/llama-3.1-8b"))
    assert (s.ttft, s.step) != (plain.ttft, plain.step)


@pytest.mark.parametrize(("kv", "stack"), [("fp8", None), ("bf16", None), ("bf16", "trtllm"), ("fp8", "trtllm")])
def test_an_anchored_backend_caches_in_the_anchors_kv_format_whatever_its_stacks_default(tmp_path, kv, stack):
    # vLLM caches fp8 weights in bf16 unless asked (kv_default activations), TensorRT-LLM in fp8: a vLLM
    # anchor measured with an fp8 cache re-anchors a target that caches in fp8 too, as predict --anchor does
    a = anchor(hardware="h100-sxm", precision="fp8", kv_precision=kv)
    spec = {"hardware": "h200-sxm", "model": "llama-3.1-8b", "anchor": str(profile_file(tmp_path, a))}
    b = build_backend({**spec, **({"stack": stack} if stack else {})})
    assert (b.system.precision, b.system.kv, b.system.serving.key) == ("fp8", kv, stack or "vllm")


def test_an_anchor_on_an_engine_timed_stack_is_compared_with_a_client_side_model():
    # calibrate --anchor times the server over HTTP: the TTFT factor is measured over the model's
    # client-side TTFT even where the stack's published numbers are engine-side (TensorRT-LLM)
    a = anchor(stack="trtllm")
    client = make_system(catalog.device(a.hardware), catalog.model(a.model), a.precision, tp=1,
                         kv_precision=a.kv_precision, stack=catalog.stack("trtllm"), timing="client")  # fmt: skip
    assert anchor_prediction(a).ttft_timing == "client"
    run = steady(AnchoredServer(client, Factors(1.0, 1.0), max_batch=1, prompt_cache=False), 1, 256, 64, rounds=1)
    assert factors(a).ttft == pytest.approx(a.ttft_ms / (run.ttft_s * 1e3), rel=1e-9)


def test_the_hand_written_anchor_profile_in_the_docs_predicts(tmp_path):
    """docs/hardware-model.md §3 shows an anchor profile to write by hand: it must load and anchor."""
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "hardware-model.md").read_text()
    block = next(b for b in doc.split("```yaml\n")[1:] if "anchor:" in b).split("```", 1)[0]
    path = tmp_path / "mine.yaml"
    path.write_text(block)
    r = cli("hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--anchor", str(path), "--format", "json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["anchored"]
    assert got["hardware"] == "a100-80gb" and got["measured_ttft_ms"] == 40 and got["measured_tpot_ms"] == 12
