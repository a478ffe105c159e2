"""Requests of varied lengths in the engine's workloads: a benchmark client's random dataset (uniform at range
ratio 0) or a dataset sampled per request (exponential at the stated means) keeps the stated means, is the
same on every run, and changes what a cache-bound server holds at once; a point states how its client drew
them, and a burst of varied lengths runs the requests it sent, not one wave of what fits."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

from voicepipe.backends.hardware import make_hardware_backend
from voicepipe.hardware.workload import request_lengths, static_batch, throughput

points = importlib.import_module("voicepipe.hardware.validate.points")


@pytest.mark.parametrize("kind", ["uniform", "exponential"])
def test_varied_lengths_keep_the_stated_means_and_are_the_same_every_run(kind):
    got = request_lengths(kind, 1000, 500, 200)
    prompts, outputs = np.array(got).T
    assert abs(prompts.mean() / 500 - 1) < 0.01 and abs(outputs.mean() / 200 - 1) < 0.01
    assert got == request_lengths(kind, 1000, 500, 200)
    assert prompts.min() >= 1 and outputs.min() >= 2  # every request emits past its first token
    assert np.corrcoef(prompts, outputs)[0, 1] < 0.1  # a long prompt does not come with a long output


def test_a_random_dataset_at_range_ratio_zero_spans_one_to_twice_the_mean():
    prompts, _ = np.array(request_lengths("uniform", 1000, 500, 200)).T
    assert prompts.min() <= 5 and 990 <= prompts.max() <= 1000
    assert abs(np.median(prompts) / 500 - 1) < 0.02  # flat: median at the mean


def test_an_unpublished_dataset_is_spread_like_a_maximum_entropy_one():
    _, outputs = np.array(request_lengths("exponential", 1000, 500, 200)).T
    assert 0.9 < outputs.std() / outputs.mean() < 1.1  # an exponential's spread equals its mean
    assert np.median(outputs) < 0.8 * outputs.mean()  # most requests are short, a few long


def test_fixed_lengths_are_every_request_the_means():
    assert request_lengths("fixed", 3, 500, 200) == [(500, 200)] * 3


def test_a_cache_bound_burst_of_varied_lengths_serves_fewer_tokens_a_second_than_equal_ones():
    # a pool for ~24 requests at their mean context: the long ones hold more of it for longer
    server = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 64}).server
    server.kv_pool = 24 * (300 + 100)
    equal = throughput(static_batch(server, 200, 300, 200), static=True)
    varied = throughput(static_batch(server, 200, 300, 200, lengths="exponential"), static=True)
    assert varied < 0.9 * equal


def test_a_point_with_a_prompt_count_but_no_rate_runs_the_burst_it_states():
    base = dict(id="x", device="h100-sxm", chips=1, model="llama-3.1-8b", precision="bf16", batch=8,
                prompt_tokens=300, output_tokens=200, stack="vllm", metric="tok_s_total", value=100.0,
                date="2025-01", source="https://example.org", tier=2)  # fmt: skip
    varied = points.prepare(points.Point(**base, num_prompts=100, lengths="uniform"))
    assert (varied.workload, varied.requests, varied.lengths) == ("static", 100, "uniform")  # the requests it sent
    equal = points.prepare(points.Point(**base, num_prompts=100))
    assert (equal.workload, equal.requests, equal.batch) == ("static", 100, 8)  # 100 sent, 8 slots
    unstated = points.prepare(points.Point(**base))
    assert (unstated.requests, unstated.lengths) == (8, "fixed")  # one batch of what fits
    # a count without a rate is a burst: a steady per-token mean or a closed loop has no such count
    for bad in ({"metric": "tpot_ms"}, {"closed_loop": True}):
        with pytest.raises(ValueError, match="num_prompts without request_rate is a burst"):
            points.Point(**{**base, **bad}, num_prompts=100)


def test_a_burst_of_several_batches_pays_the_ramp_and_the_drain_once():
    # in-flight batching starts a queued request as a slot frees, so three batches' worth of equal requests
    # serve more tokens a second than one batch (its fill and its drain amortised), and fewer than 1.5x
    server = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 32}).server
    one = throughput(static_batch(server, 32, 1000, 100), static=True)
    three = throughput(static_batch(server, 96, 1000, 100), static=True)
    assert one * 1.02 < three < one * 1.5


def test_hardware_predict_runs_the_lengths_it_is_given_and_refuses_others():
    from typer.testing import CliRunner

    from voicepipe.cli.hardware import app

    def agg(lengths: str) -> float:
        res = CliRunner().invoke(app, ["predict", "-H", "h100-sxm", "-m", "qwen3-32b", "--batch", "200",
                                       "--prompt-tokens", "217", "--output-tokens", "201", "--lengths", lengths,
                                       "--format", "json"])  # fmt: skip
        assert res.exit_code == 0, res.output
        out = json.loads(res.output)
        assert out["lengths"] == lengths
        return float(out["aggregate_tokens_per_second"])

    assert agg("exponential") < 0.9 * agg("fixed")  # the cache holds fewer of a mixed set at once
    bad = CliRunner().invoke(app, ["predict", "-H", "h100-sxm", "-m", "qwen3-32b", "--lengths", "weird"])
    assert bad.exit_code == 2 and "--lengths" in bad.output and "Traceback" not in bad.output


def test_a_sweep_row_with_varied_lengths_is_the_predict_of_the_same_lengths():
    from typer.testing import CliRunner

    from voicepipe.cli.hardware import app

    args = ["-H", "h100-sxm", "-m", "qwen3-32b", "--prompt-tokens", "217", "--output-tokens", "201",
            "--lengths", "exponential", "--format", "json"]  # fmt: skip
    sw = CliRunner().invoke(app, ["sweep", "--batches", "64", *args])
    assert sw.exit_code == 0, sw.output
    sweep = json.loads(sw.output)
    row = next(r for r in sweep["rows"] if r["batch"] == 64)
    pr = CliRunner().invoke(app, ["predict", "--batch", "64", *args])
    one = json.loads(pr.output)
    assert sweep["lengths"] == "exponential"
    assert row["aggregate_tps"] == pytest.approx(one["aggregate_tokens_per_second"], rel=1e-9)
    fixed = CliRunner().invoke(app, ["sweep", "--batches", "64", *args[:-4], "--format", "json"])
    fixed_row = next(r for r in json.loads(fixed.output)["rows"] if r["batch"] == 64)
    assert abs(fixed_row["aggregate_tps"] / row["aggregate_tps"] - 1) > 0.01  # the option reaches the engine


def test_a_closed_loop_of_varied_lengths_is_measured_at_full_load_not_in_its_drain():
    from voicepipe.hardware.workload import _Driver, steady

    def server():  # a fresh engine each run
        return make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 32}).server

    got = throughput(steady(server(), 16, 500, 300, lengths="exponential"), static=False)
    # the reference: many rounds, a long warm-up left out, so neither the burst nor the drain weighs
    ref = throughput(_Driver(server(), 256).run(16, 500, 300, measure_from=64, lengths="exponential"), static=False)
    assert abs(got / ref - 1) < 0.1
