"""An open-loop client (requests sent at a rate whatever the server does) runs as one, and a median
inter-token gap is the median of the gaps the measured requests see."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from voicepipe.hardware import catalog
from voicepipe.hardware.model import DEFAULT_EFFICIENCY, System
from voicepipe.hardware.serving import DeviceServer
from voicepipe.hardware.step import request_overhead_s
from voicepipe.hardware.workload import Run, open_loop, static_batch, steady

points = importlib.import_module("voicepipe.hardware.validate.points")


def server(max_batch: int = 64) -> DeviceServer:
    s = System(catalog.device("h100-sxm"), catalog.model("llama-3.1-8b"), "bf16", 1, DEFAULT_EFFICIENCY,
               None, catalog.stack("vllm"))  # fmt: skip
    return DeviceServer(s, max_batch=max_batch, prompt_cache=False)


def test_requests_arrive_at_the_clients_rate_and_a_slow_rate_leaves_the_device_idle_between_them():
    r = open_loop(server(), 5, 0.5, 256, 64, poisson=False)  # one every 2 s; each well under a second alone
    assert [j.arrive_ns / 1e9 for j in r.jobs] == pytest.approx([0.0, 2.0, 4.0, 6.0, 8.0])
    alone_e2e = r.jobs[0].finish_ns / 1e9
    assert alone_e2e < 1.0
    # the run lasts from the first arrival to the last finish, idle gaps included
    assert r.figure("duration") == pytest.approx(8.0 + alone_e2e, rel=0.02)
    assert r.idle_s == pytest.approx(8.0 + alone_e2e - 5 * alone_e2e, rel=0.05)
    # nobody queued: every request sees the device to itself
    waits = [j.first_ns - j.arrive_ns for j in r.jobs]
    assert max(waits) == pytest.approx(min(waits), rel=0.01)


def test_a_rate_far_above_the_device_is_a_burst():
    fast = open_loop(server(), 40, 1e6, 256, 64, poisson=False)
    burst = static_batch(server(), 40, 256, 64)
    assert fast.idle_s == 0.0
    assert fast.figure("duration") == pytest.approx(burst.figure("duration"), rel=0.01)


def test_a_queue_grows_where_the_rate_outruns_the_slots_and_the_figures_count_the_wait():
    r = open_loop(server(max_batch=4), 16, 50.0, 512, 128, poisson=False)  # 4 slots, one every 20 ms
    assert all(j.finish_ns is not None and j.finish_ns > j.arrive_ns for j in r.jobs)
    waits = [(j.first_ns - j.arrive_ns) / 1e9 for j in r.jobs]
    assert waits[-1] > 5 * waits[0]  # the later ones wait for a slot
    # the run's figures are the jobs' own means, queueing from each arrival instant included
    assert r.ttft_s == pytest.approx(float(np.mean(waits)) + r.request_s, rel=1e-3)
    e2e = [(j.finish_ns - j.arrive_ns) / 1e9 for j in r.jobs]
    assert r.e2e_s == pytest.approx(float(np.mean(e2e)) + r.request_s, rel=1e-3)


def test_poisson_arrivals_queue_where_even_ones_do_not_and_the_rate_is_kept():
    # 8B on an H100 at 12 requests a second of 2,048-token prompts: evenly spaced, a prompt hardly waits
    # behind another (TTFT ~ a prompt alone); Poisson arrivals clump, so prefills queue and the mean TTFT
    # rises (by ~1.7x here)
    even = open_loop(server(), 400, 12.0, 2048, 64, poisson=False)
    clumped = open_loop(server(), 400, 12.0, 2048, 64)
    assert clumped.ttft_s > 1.3 * even.ttft_s
    assert len(clumped.jobs) == 400 * 5  # 2,000 requests' worth of draws, read as one run
    rate = clumped.clients / clumped.figure("duration")
    assert rate == pytest.approx(12.0, rel=0.1)
    # fixed seeds: the same figures every time
    assert open_loop(server(), 400, 12.0, 2048, 64).ttft_s == clumped.ttft_s


def run_of(step_ms: list[float], steps: list[float], decoding: list[float], decoders: list[float]) -> Run:
    n = len(step_ms)
    z = np.zeros(n)
    return Run(jobs=(), request_s=0.0, clients=1, output_tokens=10, start=z, length=np.array(step_ms) * 1e6 * steps,
               steps=np.array(steps, dtype=float), decoders=np.array(decoders, dtype=float), kv=z, prefill=z,
               cached=z, prompts=z, span=z, waiting=z, decoding=np.array(decoding, dtype=float))  # fmt: skip


def test_the_median_gap_is_the_mixed_step_when_most_gaps_carry_a_prefill_chunk():
    # 70 steps of 500 ms (a chunk beside the decoders) and 30 decode-only steps of 40 ms, 10 decoders each
    r = run_of([500.0, 40.0], [70, 30], [10, 10], [10, 10])
    assert r.figure("decode_step") == pytest.approx(0.5)
    r = run_of([500.0, 40.0], [30, 70], [10, 10], [10, 10])
    assert r.figure("decode_step") == pytest.approx(0.04)


def run_with_pauses(pause_steps: float, decode_steps: float) -> Run:
    """Prefill steps of 300 ms run apart (10 measured decoders wait, no token) and decode steps of 40 ms."""
    r = run_of([300.0, 40.0], [pause_steps, decode_steps], [10, 10], [0, 10])
    return Run(**{**r.__dict__, "prefill": np.array([4096.0, 0.0])})


def test_a_prefill_step_run_apart_lengthens_the_gap_its_decoders_wait_in():
    # 30 paused steps among 100 decode steps: 30 of the 100 gaps are 340 ms, the median gap 40 ms
    assert run_with_pauses(30, 100).figure("decode_step") == pytest.approx(0.04)
    # 60 among 100: most gaps span a pause, the median gap is the pause plus a decode step
    assert run_with_pauses(60, 100).figure("decode_step") == pytest.approx(0.34)


def pt(**kw: object) -> object:
    base = {"id": "x", "device": "h100-sxm", "chips": 1, "model": "llama-3.1-8b", "precision": "bf16",
            "batch": 12, "prompt_tokens": 512, "output_tokens": 128, "stack": "vllm", "metric": "itl_median_ms",
            "value": 10.0, "date": "2025-01", "source": "https://example.org", "tier": 1}  # fmt: skip
    return points.Point(**{**base, **kw})


def test_a_point_with_a_request_rate_runs_as_an_open_loop_of_its_prompts():
    x = points.prepare(pt(request_rate=4.0, num_prompts=200))
    assert (x.workload, x.rate, x.requests) == ("open", 4.0, 200)
    assert x.batch > 12  # the server's slots, not the published mean concurrency
    assert points.prepare(pt()).workload == "steady"


@pytest.mark.parametrize("kw", [{"request_rate": 2.0}, {"num_prompts": 100},
                                {"request_rate": 2.0, "num_prompts": 100, "closed_loop": True,
                                 "metric": "tok_s_total"}])  # fmt: skip
def test_a_rate_needs_its_count_and_is_not_a_closed_loop(kw: dict[str, object]):
    with pytest.raises(ValueError, match="request_rate"):
        pt(**kw)


def test_the_fit_retimes_every_figure_of_an_open_loop_point_as_the_engine_runs_it():
    # the fit re-times a run's stretches under other constants: at the run's own constants it must give
    # what the run gives, for a throughput (a realisation's mean duration) as for the per-request figures
    fit = importlib.import_module("voicepipe.hardware.validate.fit")
    hm = importlib.import_module("voicepipe.hardware.model")
    ids = ("skyie-h200x8-dsr1-sglang-5000-1000-n50-thr", "skyie-h200x8-dsr1-sglang-5000-1000-n50-itlmed",
           "trtllm014-online-h100-llama31-8b-bf16-tp1-202-214-qps8-ttft",
           "trtllm014-online-h100-llama31-8b-bf16-tp1-202-214-qps8-itl")  # fmt: skip
    xs = [points.prepare(p) for p in points.points() if p.id in ids]
    assert len(xs) == 4 and all(x.workload == "open" for x in xs)
    theta = np.array([[getattr(hm.DEFAULT_EFFICIENCY, k) for k in hm.FITTED]])
    retimed = fit.predicted(fit.batch_of(xs), theta)[0]
    engine = [fit.metric_of(x, fit.engine_run(x)) for x in xs]
    # (the fit merges a long run's stretches into at most MAX_ROWS step shapes: a few per mille)
    assert retimed == pytest.approx(engine, rel=5e-3)


def test_an_arrival_while_the_decoders_step_runs_starts_when_that_step_ends():
    srv = server()
    r = open_loop(srv, 2, 1 / 0.3003, 256, 400, poisson=False)  # the second comes while the first decodes
    first, second = r.jobs
    step = r.step_s()[1] * 1e9  # the first decoding alone (after its prefill): steps of one length
    assert second.arrive_ns > first.first_ns
    waited = second.start_ns - second.arrive_ns
    assert 0 < waited < step
    steps_in = (second.start_ns - first.first_ns) / step
    assert steps_in == pytest.approx(round(steps_in), abs=1e-6)  # on the first's step grid


def test_a_closed_loop_request_reaches_the_engine_its_per_request_cost_after_the_last_finished():
    srv = server()
    lead = request_overhead_s(srv.system) * 1e9
    assert lead > 0
    r = steady(srv, 3, 256, 32, rounds=3)
    done = {(j.req.session, j.req.turn): j for j in r.jobs}
    later = [j for j in r.jobs if j.req.turn == 2]
    assert later
    for j in later:
        before = done[(j.req.session, 1)]
        assert j.arrive_ns == pytest.approx(before.finish_ns + lead, abs=1e-3)


def test_an_overlap_scheduler_starts_an_arrival_one_step_after_the_running_step_ends():
    s = System(catalog.device("h100-sxm"), catalog.model("llama-3.1-8b"), "bf16", 1, DEFAULT_EFFICIENCY,
               None, catalog.stack("sglang"))  # fmt: skip
    srv = DeviceServer(s, max_batch=64, prompt_cache=False)
    assert srv.schedule_ahead == 1
    r = open_loop(srv, 2, 1 / 0.3003, 256, 400, poisson=False)  # the second comes while the first decodes
    first, second = r.jobs
    step = r.step_s()[1] * 1e9
    assert second.arrive_ns > first.first_ns
    waited = second.start_ns - second.arrive_ns
    assert step < waited < 2 * step  # the rest of the running step, and the one formed ahead of it
    steps_in = (second.start_ns - first.first_ns) / step
    assert steps_in == pytest.approx(round(steps_in), abs=1e-6)  # on the first's step grid
