"""Under attention DP a stack keeps its MLPs on the rank (TensorRT-LLM: weights replicated, each rank over
its own tokens) or splits them over the group on every rank's gathered tokens (SGLang): Stack.attention_dp_mlp.
The attention itself is every rank's own either way."""

from __future__ import annotations

import pytest

import voicepipe.hardware.model as hm
from voicepipe.hardware import catalog as cat
from voicepipe.hardware.blockfp8 import Gemm, block_fp8_gemms
from voicepipe.hardware.sizing import weight_split
from voicepipe.hardware.system import attention_params, body_params, dp_own_params


def system(mlp: str, attention_dp: bool = True) -> hm.System:
    stack = cat.stack("sglang").model_copy(update={"attention_dp_mlp": mlp})
    return hm.System(cat.device("h200-sxm"), cat.model("deepseek-r1"), "fp8", 8, stack=stack,
                     attention_dp=attention_dp)  # fmt: skip


def test_the_shipped_stacks_state_where_their_mlps_run():
    assert cat.stack("sglang").attention_dp_mlp == "split"
    assert cat.stack("trtllm").attention_dp_mlp == "own"
    assert "attention_dp_mlp" in cat.stack("sglang").sources and "attention_dp_mlp" in cat.stack("trtllm").sources


def test_a_rank_keeps_the_attention_alone_or_every_weight_outside_the_routed_experts():
    m = cat.model("deepseek-r1")
    assert dp_own_params(system("split")) == attention_params(m)
    assert dp_own_params(system("own")) == body_params(m) > attention_params(m)
    assert dp_own_params(system("own", attention_dp=False)) == 0.0


def test_one_long_prompt_runs_its_mlps_over_the_group_where_the_stack_splits_them():
    split, own = (hm.step_parts(system(k), 0, 0, prefill_tokens=8192) for k in ("split", "own"))
    # the prompt's attention-side work sits on one rank either way; its MLP FLOPs on one rank (own) or
    # spread over eight (split)
    m = cat.model("deepseek-r1")
    mlp = body_params(m) - attention_params(m)
    want = 2.0 * 8192 * mlp * (1.0 - 1.0 / 8) / system("own").device.matmul_flops("fp8")
    assert float(own.flops_s) - float(split.flops_s) == pytest.approx(want, rel=1e-9)
    # without attention DP the setting changes nothing
    plain = [hm.step_parts(system(k, attention_dp=False), 0, 0, prefill_tokens=8192) for k in ("split", "own")]
    assert float(plain[0].flops_s) == float(plain[1].flops_s)


def test_a_stack_that_keeps_the_mlps_on_each_rank_streams_and_stores_them_whole():
    split, own = (hm.step_parts(system(k), 64, 64 * 2000.0) for k in ("split", "own"))
    m = cat.model("deepseek-r1")
    extra = (body_params(m) - attention_params(m)) * (1.0 - 1.0 / 8) * 1.0  # fp8: a byte a param
    bw = system("own").device.stream_bytes_s
    assert float(own.dense_s) - float(split.dense_s) == pytest.approx(extra / bw, rel=1e-9)
    assert weight_split(system("own"))[0] - weight_split(system("split"))[0] == pytest.approx(extra, rel=1e-9)


def test_block_fp8_mlp_gemms_are_whole_on_the_rank_where_it_keeps_them():
    m = cat.model("deepseek-r1")
    split = block_fp8_gemms(m, 8, attention_dp=True)
    own = block_fp8_gemms(m, 8, attention_dp=True, mlp_own=True)
    assert Gemm(512, 7168, 58, False) in split and Gemm(4096, 7168, 58, True) in own  # shared expert gate_up
    assert Gemm(7168, 18432, 3, True) in own  # the dense layers' down projection, whole
    assert [g for g in own if g.n == 24576] == [g for g in split if g.n == 24576]  # attention: the same
