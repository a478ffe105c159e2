"""Under attention DP a stack keeps its MLPs on the rank (TensorRT-LLM: weights replicated, each rank over
its own tokens) or splits them over the group on every rank's gathered tokens (SGLang): Stack.attention_dp_mlp.
The attention itself is every rank's own either way."""

from __future__ import annotations

import json

import pytest

import voicepipe.hardware.model as hm
from voicepipe.hardware import catalog as cat
from voicepipe.hardware.blockfp8 import Gemm, block_fp8_gemms
from voicepipe.hardware.sizing import weight_split
from voicepipe.hardware.system import attention_params, body_params, dp_own_params, table_bytes


def system(mlp: str, attention_dp: bool = True) -> hm.System:
    stack = cat.stack("sglang").model_copy(update={"attention_dp_mlp": mlp})
    return hm.System(cat.device("h200-sxm"), cat.model("deepseek-r1"), "fp8", 8, stack=stack,
                     attention_dp=attention_dp)  # fmt: skip


def test_the_shipped_stacks_state_where_their_mlps_run():
    assert cat.stack("sglang").attention_dp_mlp == "split"
    assert cat.stack("trtllm").attention_dp_mlp == cat.stack("vllm").attention_dp_mlp == "own"
    for s in cat.stacks().values():  # every stack with a switch for attention DP says where its MLPs run
        assert not s.attention_dp_flag or "attention_dp_mlp" in s.sources, s.key


def test_a_rank_keeps_the_attention_alone_or_every_weight_outside_the_routed_experts():
    m = cat.model("deepseek-r1")
    assert dp_own_params(system("split")) == attention_params(m)
    assert dp_own_params(system("own")) == body_params(m) > attention_params(m)
    assert dp_own_params(system("own", attention_dp=False)) == 0.0
    # never less than the attention, whatever a model's rounded published active count says (Qwen3 MoE's
    # put its "body" below its attention)
    stack = cat.stack("trtllm")
    for mdl in cat.models().values():
        s = hm.System(cat.device("h200-sxm"), mdl, mdl.default_precision, 8, stack=stack, attention_dp=True)
        assert dp_own_params(s) >= attention_params(mdl), mdl.key


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


def test_a_stack_that_keeps_the_mlps_on_each_rank_streams_and_stores_them_and_the_head_whole():
    split, own = (hm.step_parts(system(k), 64, 64 * 2000.0) for k in ("split", "own"))
    m, s = cat.model("deepseek-r1"), system("own")
    head = m.embed_params * table_bytes(s.head_format)  # TensorRT-LLM's LM head is replicated under ADP
    extra = ((body_params(m) - attention_params(m)) * 1.0 + head) * (1.0 - 1.0 / 8)  # fp8: a byte a param
    bw = s.device.stream_bytes_s
    assert float(own.dense_s) - float(split.dense_s) == pytest.approx(extra / bw, rel=1e-9)
    assert weight_split(system("own"))[0] - weight_split(system("split"))[0] == pytest.approx(extra, rel=1e-9)


def test_block_fp8_gemms_a_rank_keeps_run_over_its_own_tokens():
    # SGLang's build runs DeepSeek's block-FP8 GEMMs tile-bound: a rank that keeps its MLPs whole runs them
    # over its own tokens, wider GEMMs (more tiles) over fewer rows than the split ones
    split, own = (hm.step_parts(system(k), 0, 0, prefill_tokens=256, prefill_seqs=8) for k in ("split", "own"))
    assert float(own.fixed_s) != pytest.approx(float(split.fixed_s), rel=1e-6)


def test_block_fp8_mlp_gemms_are_whole_on_the_rank_where_it_keeps_them():
    m = cat.model("deepseek-r1")
    split = block_fp8_gemms(m, 8, attention_dp=True)
    own = block_fp8_gemms(m, 8, attention_dp=True, mlp_own=True)
    assert Gemm(512, 7168, 58, False) in split and Gemm(4096, 7168, 58, True) in own  # shared expert gate_up
    assert Gemm(7168, 18432, 3, True) in own  # the dense layers' down projection, whole
    assert [g for g in own if g.n == 24576] == [g for g in split if g.n == 24576]  # attention: the same


# ---------------------------------------------------------------- attention DP as a run setting of predict,
# sweep and the agent's backend (it was a validation-point field only: one engine behind every entry point)

ADP = ["-H", "h200-sxm", "-m", "deepseek-r1", "--tp", "8", "--stack", "sglang", "--prompt-tokens", "2000",
       "--output-tokens", "200", "--format", "json"]  # fmt: skip


def cli(*args: str):
    from typer.testing import CliRunner

    from voicepipe.cli.hardware import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})  # a table's cells unfolded


def test_predict_with_attention_dp_is_the_engines_run_of_that_system():
    got = cli("predict", "--batch", "64", "--attention-dp", *ADP)
    assert got.exit_code == 0, got.output
    out = json.loads(got.output)
    want = hm.predict(cat.device("h200-sxm"), cat.model("deepseek-r1"), batch=64, prompt_tokens=2000,
                      output_tokens=200, tp=8, stack=cat.stack("sglang"), attention_dp=True)  # fmt: skip
    plain = json.loads(cli("predict", "--batch", "64", *ADP).output)
    assert out["attention_dp"] is True and plain["attention_dp"] is False
    for key in ("ttft_ms", "step_ms", "aggregate_tokens_per_second"):
        assert out[key] == pytest.approx(getattr(want, key), rel=1e-12)
        assert out[key] != pytest.approx(plain[key], rel=1e-6)  # the setting reaches the engine


def test_a_sweep_row_with_attention_dp_is_the_predict_with_it():
    sw = cli("sweep", "--batches", "32", "--attention-dp", *ADP)
    assert sw.exit_code == 0, sw.output
    sweep = json.loads(sw.output)
    row = next(r for r in sweep["rows"] if r["batch"] == 32)
    one = json.loads(cli("predict", "--batch", "32", "--attention-dp", *ADP).output)
    assert sweep["attention_dp"] is True
    assert row["aggregate_tps"] == pytest.approx(one["aggregate_tokens_per_second"], rel=1e-12)


@pytest.mark.parametrize(("args", "why"), [
    (["-H", "h200-sxm", "-m", "llama-3.1-8b", "--tp", "1"], "needs --tp 2 or more"),
    (["-H", "h200-sxm", "-m", "deepseek-r1", "--stack", "vllm-v0"], "has no attention data parallelism"),
    (["-H", "cerebras-wse3", "-m", "llama-3.1-8b"], "SRAM machine"),
])  # fmt: skip
def test_attention_dp_where_no_run_has_it_is_one_line_exit_2(args, why):
    r = cli("predict", "--attention-dp", *args)
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --attention-dp: ") and why in lines[0]


def test_without_a_width_attention_dp_takes_the_smallest_group_of_two_or_more():
    out = json.loads(cli("predict", "--attention-dp", "-H", "h200-sxm", "-m", "llama-3.1-8b", "--format", "json").output)
    assert out["chips"] == 2 and out["attention_dp"] is True


def test_the_agents_backend_takes_attention_dp_as_a_key():
    from voicepipe.backends.hardware import make_hardware_backend

    spec = {"hardware": "h200-sxm", "model": "deepseek-r1", "tp": 8, "stack": "sglang"}
    b = make_hardware_backend({**spec, "attention_dp": True})
    assert b.system.attention_dp and b.name.endswith("+adp") and b.describe()["attention_dp"] is True
    assert not make_hardware_backend(spec).system.attention_dp
    with pytest.raises(ValueError, match="attention_dp must be true or false"):
        make_hardware_backend({**spec, "attention_dp": "yes"})


def test_an_anchored_prediction_keeps_the_anchors_run_settings_so_refuses_attention_dp(tmp_path):
    r = cli("predict", "--attention-dp", "--anchor", str(tmp_path / "anchor.json"), "-H", "h200-sxm", "-m",
            "deepseek-r1", "--tp", "8")  # fmt: skip
    assert r.exit_code == 2 and r.output.strip().startswith("error: --attention-dp: an anchored prediction keeps")
    from voicepipe.backends.hardware import make_hardware_backend

    with pytest.raises(ValueError, match="attention_dp: an anchored backend keeps the run settings"):
        make_hardware_backend({"hardware": "h200-sxm", "model": "deepseek-r1", "anchor": str(tmp_path / "a.json"),
                               "attention_dp": True})  # fmt: skip


def test_the_predict_table_says_the_chips_run_attention_dp():
    r = cli("predict", "--attention-dp", "-H", "h200-sxm", "-m", "deepseek-r1", "--tp", "8", "--stack", "sglang")
    assert r.exit_code == 0 and "8 (attention DP: each runs the attention of its own sequences)" in r.output
    plain = cli("predict", "-H", "h200-sxm", "-m", "deepseek-r1", "--tp", "8", "--stack", "sglang")
    assert "attention DP" not in plain.output
