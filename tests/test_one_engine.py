"""One engine: `hardware predict`, `sweep`, `validate` and the agent's hardware backend compute through the
same serving simulation (DeviceServer), so one configuration gives one set of numbers, idle and loaded."""

from __future__ import annotations

import numpy as np
import pytest

from voicepipe.backends.hardware import make_hardware_backend
from voicepipe.hardware import catalog as cat
from voicepipe.hardware import model as hm
from voicepipe.hardware import validate as val
from voicepipe.hardware.serving import DeviceServer, closed_loop
from voicepipe.hardware.sweep import SweepJob
from voicepipe.hardware.validate.fit import engine_run, metric_of
from voicepipe.hardware.workload import steady, throughput
from voicepipe.llm import LLMRequest

DEV, MDL, P, OUT = "h100-sxm", "llama-3.1-8b", 1024, 256


def _point(**kw: object) -> val.Point:
    base = dict(id="t", device=DEV, chips=1, model=MDL, precision="bf16", prompt_tokens=P, output_tokens=OUT,
                stack="vllm", date="2025", source="test", tier=1, value=1e3)  # fmt: skip (a value the engine never reads)
    return val.Point(**{**base, **kw})


def _validate(**kw: object) -> float:
    x = val.prepare(_point(**kw))
    assert not x.reason
    return metric_of(x, engine_run(x))


def test_a_request_alone_reads_the_same_from_every_entry_point():
    p = hm.predict(cat.device(DEV), cat.model(MDL), batch=1, prompt_tokens=P, output_tokens=OUT, tp=1)
    b = make_hardware_backend({"hardware": DEV, "model": MDL, "tp": 1})
    t = b.predict(LLMRequest("s", 0, P, OUT), np.random.default_rng(0))
    # the live stream on the backend's shared device, alone
    stream = b.server.open(LLMRequest("s", 0, P, OUT), 0)
    live_ttft = stream.at_ns(0) / 1e9
    live_tpot = (stream.at_ns(OUT - 1) - stream.at_ns(0)) / (OUT - 1) / 1e9
    row = SweepJob(cat.device(DEV), cat.model(MDL), P, OUT, 1, None, None, None, 4, 64).row(1)
    ttft = [p.ttft_ms, t.ttft_s * 1e3, live_ttft * 1e3, row["ttft_ms"], _validate(batch=1, metric="ttft_ms")]
    tpot = [1e3 / p.tokens_per_second, t.tpot_s * 1e3, live_tpot * 1e3, 1e3 / row["per_user_tps"],
            _validate(batch=1, metric="tpot_ms")]  # fmt: skip
    assert max(ttft) == pytest.approx(min(ttft), abs=2e-6)  # the live stream rounds to whole ns
    assert max(tpot) == pytest.approx(min(tpot), abs=2e-6)


def test_a_loaded_device_reads_the_same_from_predict_sweep_validate_and_the_shared_server():
    n = 32
    p = hm.predict(cat.device(DEV), cat.model(MDL), batch=n, prompt_tokens=P, output_tokens=OUT, tp=1)
    row = SweepJob(cat.device(DEV), cat.model(MDL), P, OUT, 1, None, None, None, 4, 64).row(n)
    assert row["per_user_tps"] == p.tokens_per_second and row["ttft_ms"] == p.ttft_ms
    v_tpot = _validate(batch=n, metric="tpot_ms")
    v_thr = _validate(batch=n, metric="tok_s_total", closed_loop=True)
    assert 1e3 / p.tokens_per_second == pytest.approx(v_tpot, rel=1e-9)
    assert p.aggregate_tokens_per_second == pytest.approx(v_thr, rel=1e-9)
    # the backend's shared DeviceServer, driven by clients through submit/finish (the path `run` and
    # `capacity` take), gives the same steady run: a 2-round closed loop's second round
    b = make_hardware_backend({"hardware": DEV, "model": MDL, "tp": 1, "max_batch": n})
    r = steady(DeviceServer(b.system, max_batch=n, prompt_cache=False), n, P, OUT)
    assert 1.0 / r.tpot_s == pytest.approx(p.tokens_per_second, rel=1e-9)
    assert throughput(r, static=False) == pytest.approx(p.aggregate_tokens_per_second, rel=1e-9)
    live = closed_loop(DeviceServer(b.system, max_batch=n, prompt_cache=False), n, 2, P, OUT)
    # closed_loop averages both rounds (the burst included): same engine, within the burst's share
    assert live.mean_user_tokens_per_s == pytest.approx(p.tokens_per_second, rel=0.25)
    # and load slows a user down against the request alone
    alone = hm.predict(cat.device(DEV), cat.model(MDL), batch=1, prompt_tokens=P, output_tokens=OUT, tp=1)
    assert p.tokens_per_second < alone.tokens_per_second and p.ttft_ms > alone.ttft_ms
