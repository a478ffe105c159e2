"""Streaming each token through the server (issue 24, twelfth pass): the API process that detokenises,
wraps and sends every chunk runs beside the engine, so its serial per-chunk cost (``stream_chunk_us``)
bounds a client-timed step from below and caps the server's streamed tokens a second; below that ceiling
it adds nothing to an inter-token gap, and an engine-timed run never pays it."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from voicepipe.backends.hardware import make_hardware_backend
from voicepipe.hardware import catalog as cat
from voicepipe.hardware import model as hm
from voicepipe.hardware.serving import DeviceServer
from voicepipe.hardware.step import combine, mixed_step_s, step_parts, stream_s
from voicepipe.hardware.workload import steady, throughput

DEV, MDL = "h100-sxm", "qwen3-0.6b"
CHUNK_US = 100.0  # a slow API process, so the ceiling binds on a small model (the shipped vLLM figure is 29)


def _stack(chunk_us: float = CHUNK_US) -> cat.Stack:
    base = cat.stack("vllm")
    return base.model_copy(update={"stream_chunk_us": chunk_us})


def _system(timing: str, chunk_us: float = CHUNK_US) -> hm.System:
    return hm.System(cat.device(DEV), cat.model(MDL), "bf16", 1, stack=_stack(chunk_us), timing=timing)  # type: ignore[arg-type]


def test_the_shipped_vllm_profile_streams_a_chunk_in_29_us_with_its_source():
    stk = cat.stack("vllm")
    assert stk.stream_chunk_us == 29
    assert "27869" in stk.sources["stream_chunk_us"]
    # no other profile has a published ceiling
    assert all(cat.stack(k).stream_chunk_us == 0 for k in ("sglang", "trtllm", "nim", "vllm-0.10", "vllm-v0"))


def test_a_stack_with_a_stream_cost_needs_its_source():
    base = cat.stack("vllm").model_dump()
    base["sources"] = {k: v for k, v in base["sources"].items() if k != "stream_chunk_us"}
    with pytest.raises(ValidationError, match="stream_chunk_us"):
        cat.Stack(**base)


def test_a_client_timed_step_lasts_at_least_the_api_process_streaming_its_chunks():
    d, kv = 512, 512 * 256
    engine = float(mixed_step_s(_system("engine"), d, kv))
    client = float(mixed_step_s(_system("client"), d, kv))
    floor = d * CHUNK_US * 1e-6
    assert engine < floor  # the GPU and the engine loop would be faster than the API process
    assert client == pytest.approx(floor, rel=1e-12)
    # an engine-timed run (the engine's own benchmark, no API server) never pays it
    assert float(stream_s(_system("engine"), d)) == 0.0


def test_below_the_ceiling_streaming_adds_nothing_to_a_step():
    # a constant delivery delay per token cancels in a mean inter-token gap: only a saturated API process
    # shows, so a few decoders read the same client- or engine-timed
    for d in (1, 8, 32):
        assert float(mixed_step_s(_system("client"), d, d * 2048)) == float(mixed_step_s(_system("engine"), d, d * 2048))


def test_a_speculative_step_is_floored_once_not_per_draft_step():
    spec = hm.Speculative(alpha=0.8, gamma=4, draft_cost=0.05)
    d, kv = 512, 512 * 256
    engine = float(mixed_step_s(_system("engine"), d, kv, spec=spec))
    client = float(mixed_step_s(_system("client"), d, kv, spec=spec))
    assert client == pytest.approx(max(engine, d * CHUNK_US * 1e-6), rel=1e-12)


def test_the_fit_retimes_a_floored_step_as_the_engine_runs_it():
    s = _system("client")
    d = np.array([1.0, 64.0, 512.0, 1024.0])
    kv = d * 300.0
    e = s.eff
    retimed = combine(step_parts(s, d, kv), e.eta_mem, e.mfu, e.eta_wq, e.eta_moe, e.layer_s)[2]
    assert np.allclose(retimed, mixed_step_s(s, d, kv), rtol=1e-12)


def test_many_streaming_clients_are_capped_at_one_over_the_chunk_cost():
    n, prompt, out = 512, 128, 256
    rate, lit = {}, {}
    for timing in ("client", "engine"):
        r = steady(DeviceServer(_system(timing), max_batch=n, prompt_cache=False), n, prompt, out)
        # tokens the decoders emitted over the time they took, stretch by stretch
        rate[timing] = float((r.steps * r.decoders).sum() / (r.length.sum() / 1e9))
        lit[timing] = throughput(r, static=False)
    ceiling = 1e6 / CHUNK_US
    assert rate["engine"] > ceiling  # the engine alone would stream faster than the API process can
    assert rate["client"] <= ceiling * (1 + 1e-9)
    assert rate["client"] > 0.9 * ceiling
    assert lit["client"] < lit["engine"]


def test_the_agent_is_a_client_so_its_backend_streams_through_the_api_process():
    # run/predict/capacity call the server over HTTP (backends.hardware.as_client), whatever the stack's
    # default timing: its shared device pays the same floor as a client-timed validation point
    b = make_hardware_backend({"hardware": DEV, "model": MDL, "tp": 1, "stack": "trtllm"})
    assert b.system.ttft_timing == "client"
    b = make_hardware_backend({"hardware": DEV, "model": MDL, "tp": 1})
    assert float(stream_s(b.system, 100)) == pytest.approx(100 * 29e-6, rel=1e-12)
