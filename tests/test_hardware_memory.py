"""What a serving engine keeps per GPU besides weights and KV (Stack.memory): the start-up profile's activation
peak, non-torch memory and the stack's memory share, subtracted wherever memory is sized (docs §1)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from voicepipe.cli.hardware import app
from voicepipe.hardware import catalog as cat
from voicepipe.hardware import model as hm
from voicepipe.hardware.serving import DeviceServer
from voicepipe.hardware.workload import steady

GIB = 2.0**30


def _system(dev: str, mdl: str, stack: cat.Stack, tp: int = 1, precision: str = "bf16") -> hm.System:
    return hm.System(cat.device(dev), cat.model(mdl), precision, tp, stack=stack)


def _with_memory(stack: cat.Stack, **update: object) -> cat.Stack:
    assert stack.memory is not None
    return stack.model_copy(update={"memory": stack.memory.model_copy(update=update)})


def test_a_larger_batched_token_budget_leaves_fewer_kv_tokens():
    # the profile's forward pass grows with its tokens; past the sampler term it takes KV room
    vllm = cat.stack("vllm")
    small = _system("a100-80gb", "llama-3.1-8b", vllm)
    big = _system("a100-80gb", "llama-3.1-8b", _with_memory(vllm, tokens=65536))
    assert hm.activation_peak_bytes(big) > hm.activation_peak_bytes(small)
    assert hm.kv_capacity_tokens(big) < hm.kv_capacity_tokens(small)
    # the forward term: tokens x 2 B x (2 hidden + 3 ffn / tp)
    m = cat.model("llama-3.1-8b")
    assert hm.activation_peak_bytes(big) == pytest.approx(65536 * 2 * (2 * m.hidden + 3 * hm.ffn_width(m)))


def test_a_larger_vocabulary_leaves_fewer_kv_tokens():
    vllm = cat.stack("vllm")
    m = cat.model("llama-3.1-8b")
    wide = m.model_copy(update={"vocab": 2 * m.vocab})
    a = hm.System(cat.device("h100-sxm"), m, "bf16", 1, stack=vllm)
    b = hm.System(cat.device("h100-sxm"), wide, "bf16", 1, stack=vllm)
    assert hm.weight_bytes(wide, "bf16") == hm.weight_bytes(m, "bf16")  # same weights, a wider sampler
    assert hm.engine_reserve_bytes(b) > hm.engine_reserve_bytes(a)
    assert hm.kv_capacity_tokens(b) < hm.kv_capacity_tokens(a)


def test_the_fitted_sampler_term_reproduces_held_out_startup_logs():
    # llm-d-planner, vLLM v0.11.0 on H100 (`vllm serve`: 1,024 slots): the constant was fitted to
    # Llama-3.1-8B (4.76 GiB); these logs were not used
    vllm = cat.stack("vllm")
    for mdl, tp, logged in (("qwen3-32b", 1, 5.64), ("qwen3-32b", 2, 5.64), ("gpt-oss-20b", 1, 7.38)):
        peak = hm.activation_peak_bytes(_system("h100-sxm", mdl, vllm, tp)) / GIB
        assert peak == pytest.approx(logged, rel=0.03), mdl


def test_vllm_profiles_more_slots_on_large_gpus_but_not_on_a100():
    vllm = cat.stack("vllm")
    h100, a100 = _system("h100-sxm", "qwen3-32b", vllm), _system("a100-80gb", "qwen3-32b", vllm)
    assert hm.profile_shape(h100) == (8192, 1024)
    assert hm.profile_shape(a100) == (2048, 256)
    assert hm.engine_reserve_bytes(h100) > 3 * hm.engine_reserve_bytes(a100)
    # the same weights on the same memory: the H100 pool is smaller by the reserve difference
    diff = hm.engine_reserve_bytes(h100) - hm.engine_reserve_bytes(a100)
    per_token = hm.kv_bytes_per_token(h100.model, h100.kv)
    assert (hm.kv_capacity_tokens(a100) - hm.kv_capacity_tokens(h100)) * per_token == pytest.approx(diff)


def test_sglang_budgets_its_share_by_tp_width_and_tp_adds_buffers():
    sgl = cat.stack("sglang")
    one, eight = _system("h200-sxm", "llama-3.1-70b", sgl, 1), _system("h200-sxm", "llama-3.1-70b", sgl, 8)
    assert hm.memory_share(one) == 0.88
    assert hm.memory_share(eight) == 0.81
    assert hm.engine_reserve_bytes(eight) > hm.engine_reserve_bytes(one)
    # a stack without a memory block keeps the old rule: usable_memory of the memory, less the weights
    bare = _system("h200-sxm", "llama-3.1-70b", cat.stack("lmdeploy"))
    assert hm.memory_share(bare) == hm.DEFAULT_EFFICIENCY.usable_memory
    assert hm.engine_reserve_bytes(bare) == 0.0


def test_the_reserve_decides_the_chip_count():
    # weights that fit one H100's budget only without the engine's reserve: vLLM needs two chips
    m = cat.model("llama-3.1-8b").model_copy(update={"params_total_b": 69.0 * GIB / 2 / 1e9})
    dev = cat.device("h100-sxm")
    assert hm.make_system(dev, m, "bf16", stack=cat.stack("none")).chips == 1
    assert hm.make_system(dev, m, "bf16", stack=cat.stack("vllm")).chips == 2
    with pytest.raises(hm.DoesNotFit):
        hm.make_system(dev, m, "bf16", tp=1, stack=cat.stack("vllm"))


def test_predict_and_the_server_slots_follow_the_reserve():
    vllm = cat.stack("vllm")
    none = vllm.model_copy(update={"memory": None})
    dev, m = cat.device("h100-sxm"), cat.model("qwen3-32b")
    with_reserve = hm.predict(dev, m, batch=500, prompt_tokens=2000, output_tokens=100, stack=vllm)
    without = hm.predict(dev, m, batch=500, prompt_tokens=2000, output_tokens=100, stack=none)
    assert with_reserve.engine_reserve_gb > 5.0 and without.engine_reserve_gb == 0.0
    assert with_reserve.effective_batch < without.effective_batch
    assert with_reserve.aggregate_tokens_per_second < without.aggregate_tokens_per_second
    # the serving engine's slots are the same running_sequences
    system = hm.System(dev, m, "bf16", 1, stack=vllm)
    slots = hm.running_sequences(system, 2000, 100)
    assert slots == with_reserve.effective_batch
    run = steady(DeviceServer(system, max_batch=slots, prompt_cache=False), 500, 2000, 100, rounds=1)
    assert run.tpot_s > 0


def test_hardware_predict_json_reports_the_reserve():
    wide = {"COLUMNS": "200"}
    r = CliRunner().invoke(
        app, ["predict", "-H", "h100-sxm", "-m", "qwen3-32b", "--format", "json"], env=wide
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["engine_reserve_gb"] == pytest.approx(5.77 * GIB / 1e9, rel=0.02)
    table = CliRunner().invoke(app, ["predict", "-H", "h100-sxm", "-m", "qwen3-32b"], env=wide)
    assert "engine reserve" in table.output


def test_a_memory_number_needs_its_source():
    raw = cat.stack("vllm").model_dump()
    with pytest.raises(ValueError, match="no source for share"):
        cat.Stack.model_validate({**raw, "memory": {**raw["memory"], "share": 0.95}})
    sourced = {**raw["memory"], "share": 0.95, "sources": {**raw["memory"]["sources"], "share": "my flag"}}
    assert cat.Stack.model_validate({**raw, "memory": sourced}).memory is not None


def test_tensorrt_llm_reserves_its_activations_over_the_engines_token_budget():
    trt = cat.stack("trtllm")
    s = _system("h100-sxm", "llama-3.1-70b", trt, precision="fp8")
    m = s.model
    per_token = 2.0 * (2 * m.hidden + 3 * hm.ffn_width(m))  # one layer's live tensors a token
    for name in ("trtllm", "trtllm-max-util", "nim"):  # the same TensorRT engines
        same = _system("h100-sxm", "llama-3.1-70b", cat.stack(name), precision="fp8")
        assert hm.engine_reserve_bytes(same) == pytest.approx(0.4 * GIB + 8192 * per_token), name
    # a run that builds with fewer tokens (trtllm-bench's 2,048) keeps more for KV
    small = hm.System(s.device, m, "fp8", 1, stack=trt, max_num_tokens=2048)
    assert hm.engine_reserve_bytes(small) == pytest.approx(0.4 * GIB + 2048 * per_token)
    assert hm.kv_capacity_tokens(small) > hm.kv_capacity_tokens(s)
