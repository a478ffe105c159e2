"""The engine's cap on running sequences (vLLM max_num_seqs, SGLang max_running_requests, TensorRT-LLM
max_batch_size): each stack's documented default, the run's own setting over it (System.max_seqs from the
CLI, the agent's backend or a validation point), one place that holds the engine to it, and what a
saturated server runs (trtllm-bench's tuning heuristic where a run left the batch to it)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from voicepipe.backends.hardware import make_hardware_backend
from voicepipe.cli import app
from voicepipe.hardware import catalog as cat
from voicepipe.hardware import model as hm
from voicepipe.hardware import validate as val
from voicepipe.hardware.serving import DeviceServer
from voicepipe.hardware.sweep import SweepJob
from voicepipe.hardware.validate.harness import trtllm_bench_max_batch

runner = CliRunner()
MDL, P, OUT = "llama-3.1-8b", 128, 128  # short sequences of a small model: thousands fit on an 80 GB GPU


def _system(dev: str = "h100-sxm", stack: str = "vllm", **kw: object) -> hm.System:
    return hm.System(cat.device(dev), cat.model(MDL), "bf16", 1, stack=cat.stack(stack), **kw)  # type: ignore[arg-type]


def _point(**kw: object) -> val.Point:
    base = dict(id="t", device="h100-sxm", chips=1, model=MDL, precision="bf16", prompt_tokens=P, output_tokens=OUT,
                stack="vllm", metric="tok_s_total", date="2025", source="test", tier=2, value=1e3)  # fmt: skip
    return val.Point(**{**base, **kw})


def test_a_stack_cap_limits_the_running_batch_below_what_fits():
    v1 = _system()
    fit = hm.kv_sequences(v1, P, OUT)
    assert fit > 1500  # far more fit than any vLLM default lets run
    # vLLM V1 (v0.9+): 1,024 on a GPU of >= 70 GiB that is not an A100, else 256; V0: 256 everywhere
    assert hm.seq_cap(v1) == 1024 and hm.running_sequences(v1, P, OUT) == 1024
    assert hm.running_sequences(_system("a100-80gb"), P, OUT) == 256
    assert hm.running_sequences(_system(stack="vllm-v0"), P, OUT) == 256
    assert hm.seq_cap(_system(stack="sglang")) == hm.seq_cap(_system(stack="trtllm")) == 2048
    assert hm.seq_cap(_system(stack="llama.cpp")) is None  # no documented cap: what fits
    assert hm.running_sequences(_system(stack="llama.cpp"), P, OUT) == hm.kv_sequences(_system(stack="llama.cpp"), P, OUT)
    # the serving engine holds any server to it, whatever slots it is given
    assert DeviceServer(v1, max_batch=5000).max_batch == 1024
    p = hm.predict(v1.device, v1.model, batch=1500, prompt_tokens=P, output_tokens=OUT, tp=1)
    assert p.effective_batch == 1024 and not p.fits and p.max_seqs == 1024 and p.max_batch_fits > 1500
    assert "at most 1024 sequences" in p.note
    # more clients than slots wait their turn: the same per-user speed as a batch of 1,024, a longer TTFT
    full = hm.predict(v1.device, v1.model, batch=1024, prompt_tokens=P, output_tokens=OUT, tp=1)
    assert p.ttft_ms > full.ttft_ms


def test_the_vllm_caps_are_the_slots_its_start_up_profile_samples():
    for key in ("vllm", "vllm-0.10", "vllm-v0", "vllm-rocm-amd"):
        stk = cat.stack(key)
        assert stk.memory is not None and stk.max_seqs == stk.memory.seqs
        assert stk.max_seqs_large == stk.memory.large_seqs
        for dev in ("h100-sxm", "a100-80gb", "mi300x", "l40s"):
            s = hm.System(cat.device(dev), cat.model(MDL), "bf16", 1, stack=stk)
            assert hm.profile_shape(s)[1] == hm.seq_cap(s)


def test_the_runs_own_cap_beats_the_stack_default_everywhere():
    # System: the run's --max-num-seqs, above or below the default
    assert hm.running_sequences(_system(max_seqs=1500), P, OUT) == 1500
    assert hm.running_sequences(_system(max_seqs=8), P, OUT) == 8
    with pytest.raises(ValueError, match="max_seqs"):
        _system(max_seqs=0)
    # vLLM profiles its sampler over max_num_seqs sequences: fewer slots leave more room for KV
    assert hm.engine_reserve_bytes(_system(max_seqs=64)) < hm.engine_reserve_bytes(_system())
    assert hm.kv_capacity_tokens(_system(max_seqs=64)) > hm.kv_capacity_tokens(_system())
    # predict, a sweep row and a validation point (the source's stated cap) take it
    dev, mdl = cat.device("h100-sxm"), cat.model(MDL)
    p = hm.predict(dev, mdl, batch=1500, prompt_tokens=P, output_tokens=OUT, tp=1, max_seqs=1500)
    assert p.effective_batch == 1500 and p.fits and p.max_seqs == 1500
    row = SweepJob(dev, mdl, P, OUT, 1, None, None, None, 4, 64, max_seqs=16).row(32)
    assert row["effective_batch"] == 16 and not row["fits"]
    assert val.prepare(_point(batch=3000)).batch == 1024
    assert val.prepare(_point(batch=3000, max_seqs=2000)).batch == 2000
    assert val.prepare(_point(batch=3000, max_seqs=2000)).requests == 3000  # the rest queue
    # the agent's backend: max_batch is the same setting, on its system and its shared server
    b = make_hardware_backend({"hardware": "h100-sxm", "model": MDL, "tp": 1, "max_batch": 12})
    assert b.system.max_seqs == 12 and b.server.max_batch == 12 and hm.seq_cap(b.system) == 12
    assert make_hardware_backend({"hardware": "h100-sxm", "model": MDL, "tp": 1}).system.max_seqs == 64


def test_predict_on_an_sram_machine_reports_the_cap_its_server_holds():
    # an SRAM machine is sized for the whole batch, but a run's own cap still holds (DeviceServer): what
    # predict reports running is what its engine ran, not the batch with a queue's TTFT behind it
    dev, mdl = cat.device("cerebras-wse3"), cat.model(MDL)
    free = hm.predict(dev, mdl, batch=16, prompt_tokens=P, output_tokens=OUT)
    assert free.fits and free.effective_batch == 16 and free.max_seqs is None
    capped = hm.predict(dev, mdl, batch=16, prompt_tokens=P, output_tokens=OUT, max_seqs=4)
    assert capped.effective_batch == 4 and not capped.fits and capped.max_seqs == 4
    assert "at most 4 sequences" in capped.note
    assert capped.ttft_ms > free.ttft_ms  # the other 12 wait for slots
    row = SweepJob(dev, mdl, P, OUT, None, None, None, None, 4, 64, max_seqs=4).row(16)
    assert (row["effective_batch"], row["fits"]) == (4, False)


def test_a_backend_short_of_memory_runs_as_many_as_fit_under_that_many_slots():
    # 64 sequences of Qwen3-32B do not fit one H100: the backend runs what fits, and since max_batch is the
    # engine's cap, vLLM profiles only that many sampler slots -- the count is one its own system holds, and
    # one more would not fit (not what fits beside the 1,024-slot reserve of the stack's default cap)
    b = make_hardware_backend({"hardware": "h100-sxm", "model": "qwen3-32b", "tp": 1})
    n, ctx = b.deployment.max_batch, b.deployment.context
    assert 1 <= n < 64 and b.system.max_seqs == n and f"max_batch {n}:" in b.deployment.notes[0]
    assert hm.max_sequences(b.system, ctx) >= n
    assert hm.max_sequences(replace(b.system, max_seqs=n + 1), ctx) < n + 1
    assert n > hm.max_sequences(replace(b.system, max_seqs=None), ctx)  # the default cap's reserve holds fewer


def test_hardware_predict_and_sweep_take_max_seqs():
    args = ["hardware", "predict", "-H", "h100-sxm", "-m", MDL, "--tp", "1", "--prompt-tokens", str(P),
            "--output-tokens", str(OUT), "--batch", "32", "--format", "json"]  # fmt: skip
    r = runner.invoke(app, [*args, "--max-seqs", "8"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["effective_batch"] == 8 and got["max_seqs"] == 8 and not got["fits"]
    assert json.loads(runner.invoke(app, args).stdout)["max_seqs"] == 1024  # the stack's default
    r = runner.invoke(app, ["hardware", "sweep", "-H", "h100-sxm", "-m", MDL, "--tp", "1", "--batches", "4,32",
                            "--max-seqs", "16", "--format", "json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    sw = json.loads(r.stdout)
    assert sw["default_max_batch"] == 16
    assert {x["batch"]: x["effective_batch"] for x in sw["rows"]} == {4: 4, 16: 16, 32: 16}


def test_a_sweep_takes_a_cap_above_what_fits_as_predict_does():
    # a cap is not a batch that must fit: 2,048 sequences of 4,096 tokens fit on no width of L40S, yet the
    # engine with that cap runs what fits (predict); the sweep answers the same instead of "does not fit"
    args = ["-H", "l40s", "-m", MDL, "--max-seqs", "2048", "--format", "json"]
    r = runner.invoke(app, ["hardware", "sweep", *args, "--batches", "1"])
    assert r.exit_code == 0, r.output
    sw = json.loads(r.stdout)
    assert sw["default_max_batch"] == 2048
    row = next(x for x in sw["rows"] if x["batch"] == 2048)
    p = json.loads(runner.invoke(app, ["hardware", "predict", *args, "--batch", "2048"]).stdout)
    assert row["mode"] == "default" and not row["fits"] and row["effective_batch"] == p["effective_batch"] < 2048
    assert row["chips"] == p["chips"] and row["step_ms"] == p["step_ms"]


def test_a_saturated_server_runs_what_fits_under_its_cap():
    # no published batch: as many as fit, at most the stack's cap (no arbitrary ceiling)
    x = val.prepare(_point(stack="sglang"))
    assert x.batch == x.requests == 2048 < hm.kv_sequences(x.system, P, OUT)
    big = val.prepare(_point(model="llama-3.1-70b", precision="fp8", kv_precision="fp8", stack="trtllm"))
    assert big.batch == hm.kv_sequences(big.system, P, OUT) < 2048  # the KV binds first
    # a run that left max_batch_size to trtllm-bench: its tuning heuristic, then the runtime's KV admission
    tb = val.prepare(_point(stack="trtllm", max_seqs="trtllm-bench"))
    assert tb.system is not None and tb.system.max_seqs == trtllm_bench_max_batch(tb.system, P, OUT)
    assert tb.batch == min(tb.system.max_seqs, hm.kv_sequences(tb.system, P, OUT))


def test_trtllm_bench_sizes_max_batch_as_its_tuning_heuristic_does():
    h100, mdl = cat.device("h100-sxm"), cat.model(MDL)
    s = hm.System(h100, mdl, "fp8", 1, kv_precision="fp8", stack=cat.stack("trtllm"))
    # by hand: (80 GiB - 8.03e9 B of fp8 weights) x 0.95 over 2 x 32 layers x 8 KV heads x 128 x 1 B per token
    gib = 2.0**30
    per_request = 2 * 32 * 8 * 128 * 1 * (1000 + 1000)
    requests = (80 * gib - mdl.total_params) * 0.95 / per_request
    assert 512 < requests < 640
    assert trtllm_bench_max_batch(s, 1000, 1000) == 640  # rounded up to a multiple of 128
    assert trtllm_bench_max_batch(s, 10, 10) == 4096  # at most 4,096 requests
    assert trtllm_bench_max_batch(s, 100_000, 100_000) == 64  # at least 64
    # GQA heads count at least once per TP rank; attention DP makes the cap per rank
    eight = replace(s, chips=8)
    assert trtllm_bench_max_batch(eight, 1000, 1000) == trtllm_bench_max_batch(replace(eight, attention_dp=True), 1000, 1000) // 8
