"""The host side of a step (issue 24, item 4): the host launches the forward while the GPU runs it, so a
step whose GPU work is shorter than its launch takes the launch time, and a small model at batch 1 under
vLLM V1's piecewise CUDA graphs runs at the host's speed, not the memory's."""

from __future__ import annotations

import re

import numpy as np
import pytest
from pydantic import ValidationError

from voicepipe.hardware import catalog as cat
from voicepipe.hardware import model as hm
from voicepipe.hardware import validate as val
from voicepipe.hardware.catalog import Stack
from voicepipe.hardware.step import host_bound, launch_host_s
from voicepipe.hardware.validate.fit import engine_run, metric_of


def _system(dev: str, mdl: str, prec: str, stack: str | Stack) -> hm.System:
    stk = cat.stack(stack) if isinstance(stack, str) else stack
    return hm.System(cat.device(dev), cat.model(mdl), prec, 1, stack=stk)


def test_a_step_whose_gpu_time_is_below_its_host_time_takes_the_host_time():
    ms = 1e-3
    # synchronous: the host's work between forwards adds; the forward is the longer of GPU and launch
    assert float(host_bound(1 * ms, 3 * ms, 0.5 * ms, False)) == pytest.approx(3.5 * ms)
    assert float(host_bound(4 * ms, 3 * ms, 0.5 * ms, False)) == pytest.approx(4.5 * ms)
    # async scheduling: the step is the longer of the GPU and all the host work, plus what overlaps nothing
    assert float(host_bound(4 * ms, 3 * ms, 0.5 * ms, True, 0.2 * ms)) == pytest.approx(4.2 * ms)
    assert float(host_bound(1 * ms, 3 * ms, 0.5 * ms, True, 0.2 * ms)) == pytest.approx(3.7 * ms)


def test_a_piecewise_decode_step_of_a_small_model_is_host_bound_so_a_b200_runs_it_as_an_h200():
    stk = cat.stack("vllm-0.10")
    mdl = cat.model("gpt-oss-20b")
    steps = {}
    for dev in ("h200-sxm", "b200"):
        s = _system(dev, "gpt-oss-20b", "int4", stk)
        st = hm.step_time(s, 1, 1500)
        steps[dev] = float(st.total_s)
        # the host launching 24 layers piecewise outruns nothing: the step is its launch and its serial work
        host = (stk.step_overhead_us + stk.seq_overhead_us + mdl.layers * stk.host_layer_us) * 1e-6
        assert steps[dev] == pytest.approx(host, rel=1e-9)
        assert st.bound()[()] == "latency"
    assert steps["b200"] == steps["h200-sxm"]
    # with a full graph for decode (v0.11+) the same step follows the bandwidth again
    full = {d: float(hm.step_time(_system(d, "gpt-oss-20b", "int4", "vllm"), 1, 1500).total_s) for d in steps}
    assert full["h200-sxm"] / full["b200"] > 1.1
    assert full["h200-sxm"] < steps["h200-sxm"]


def test_the_launch_overlaps_the_gpu_so_a_large_model_does_not_pay_it():
    # Qwen3-32B at 16-bit: 64 layers x 135 us = 8.6 ms of launches under ~20 ms of weight streaming
    piecewise = hm.step_time(_system("h200-sxm", "qwen3-32b", "bf16", "vllm-0.10"), 1, 1024)
    full = hm.step_time(_system("h200-sxm", "qwen3-32b", "bf16", "vllm"), 1, 1024)
    assert float(piecewise.total_s) == pytest.approx(float(full.total_s), rel=1e-12)


def test_full_and_piecewise_launches_piecewise_only_the_steps_that_prefill():
    layers = cat.model("gpt-oss-20b").layers
    pw, fp = cat.stack("vllm-0.10"), cat.stack("vllm")
    assert (pw.cudagraph_mode, fp.cudagraph_mode) == ("piecewise", "full_and_piecewise")
    n = np.array([0.0, 512.0])  # a decode-only step, a step that prefills
    assert np.allclose(launch_host_s(pw, layers, n), layers * pw.host_layer_us * 1e-6)
    assert np.allclose(launch_host_s(fp, layers, n), [0.0, layers * fp.host_layer_us * 1e-6])
    # stacks without the mechanism (full graphs, C++ runtimes) launch nothing per layer on the host
    for key in ("sglang", "trtllm", "llama.cpp", "none"):
        assert not np.any(launch_host_s(cat.stack(key), layers, n))


def test_async_scheduling_hides_the_per_step_host_work_under_the_gpu():
    base = cat.stack("vllm")
    sources = {**base.sources, "async_scheduling": "test", "async_gap_us": "test"}
    overlap = base.model_copy(update={"async_scheduling": True, "async_gap_us": 160.0, "sources": sources})
    sync = hm.step_time(_system("h100-sxm", "llama-3.1-8b", "bf16", base), 1, 1024)
    over = hm.step_time(_system("h100-sxm", "llama-3.1-8b", "bf16", overlap), 1, 1024)
    serial = (base.step_overhead_us + base.seq_overhead_us) * 1e-6
    # an 8B model's step (~7 ms of GPU work) is longer than the host's: the serial part disappears
    assert float(sync.total_s) - float(over.total_s) == pytest.approx(serial - 160e-6, rel=1e-9)
    # and under load the per-sequence host work no longer grows the step while the GPU is longer
    s = _system("h100-sxm", "llama-3.1-8b", "bf16", overlap)
    grown = float(hm.step_time(s, 65, 65 * 1024).overhead_s) - float(hm.step_time(s, 1, 1024).overhead_s)
    assert grown < 64 * base.seq_overhead_us * 1e-6


def test_a_stack_with_host_launch_costs_cites_its_graph_mode_and_its_scheduling():
    base = dict(name="x", step_overhead_us=1, layer_overhead_us=1, prefill_layer_overhead_us=0, request_overhead_ms=1,
                sources={"step_overhead_us": "s", "layer_overhead_us": "s", "request_overhead_ms": "s"})  # fmt: skip
    with pytest.raises(ValidationError, match="host_layer_us"):
        Stack(**base, host_layer_us=100)  # type: ignore[arg-type]
    sourced = {**base, "sources": {**base["sources"], "host_layer_us": "s"}}  # type: ignore[dict-item]
    with pytest.raises(ValidationError, match="cudagraph_mode"):
        Stack(**sourced, host_layer_us=100)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="async_scheduling"):
        Stack(**base, async_scheduling=True)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="async_gap_us"):
        Stack(**base, async_gap_us=100)  # type: ignore[arg-type]


def _release(p: val.Point) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", p.engine_version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def test_vllm_v1_points_run_the_profile_of_their_release():
    # vLLM V1 captured piecewise graphs on every step until v0.11.0 made FULL_AND_PIECEWISE the default:
    # a V1 point runs vllm-0.10 by its stated release, or, unstated, by the release of its date
    for p in val.points():
        if p.stack not in ("vllm", "vllm-0.10"):
            continue
        rel, date = _release(p), str(p.date)
        if rel is not None and rel >= (0, 8):
            want = "vllm-0.10" if rel <= (0, 10) else "vllm"
        elif rel is None and "2025-04" <= date[:7] <= "2025-09":
            want = "vllm-0.10"
        elif rel is None and date[:7] > "2025-09":
            want = "vllm"
        else:  # V0 releases (2024): not this rule's
            continue
        assert p.stack == want, (p.id, p.engine_version, date)


def test_the_fit_retimes_a_host_bound_point_as_the_engine_runs_it():
    pts = [p for p in val.points() if p.id == "gpuconc-h200-gptoss20b-c1-1000-1000-thr"]
    assert pts and pts[0].stack == "vllm-0.10"
    x = val.prepare(pts[0])
    theta = np.array([[getattr(hm.DEFAULT_EFFICIENCY, k) for k in hm.FITTED]])
    retimed = float(val.predicted(val.batch_of([x]), theta)[0, 0])
    assert retimed == pytest.approx(metric_of(x, engine_run(x)), rel=1e-6)
