"""A checkpoint that stores only its routed experts in 4 bits (gpt-oss: MXFP4 experts, bf16 attention,
router, embedding and head; ``ModelSpec.dense_precision``): what it holds and streams, which part of a
step is weight-only, and a run that states another layout (llama.cpp's MXFP4_MOE GGUF: Q8_0 rest)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from voicepipe.cli import app
from voicepipe.hardware import catalog as cat
from voicepipe.hardware import model as hm
from voicepipe.hardware import validate as val
from voicepipe.hardware.byo import load_hf_config
from voicepipe.hardware.step import combine, step_parts

GIB = 2.0**30


def _system(dev: str, mdl: str, prec: str, tp: int = 1, **kw: object) -> hm.System:
    return hm.System(cat.device(dev), cat.model(mdl), prec, tp, stack=cat.stack("vllm"), **kw)  # type: ignore[arg-type]


def test_the_published_gpt_oss_checkpoints_weigh_what_the_model_card_says():
    # model card (arXiv 2508.10925) Table 1: checkpoint 12.8 GiB (20b) and 60.8 GiB (120b); the 20b's
    # model.safetensors.index.json: total_size 13,761,264,768 bytes. Every weight at 4.25 bits: 11.1 GB.
    assert hm.weight_bytes(cat.model("gpt-oss-20b"), "int4") == pytest.approx(13.761e9, rel=0.01)
    assert hm.weight_bytes(cat.model("gpt-oss-120b"), "int4") / GIB == pytest.approx(60.8, rel=0.01)
    # the card's parameter split: 19.12 B routed-expert weights (MLP), 3.61 B active without the embedding
    m = cat.model("gpt-oss-20b")
    assert float(hm.weight_read_params(m, 10_000)) - float(hm.weight_read_params(m, 1)) == pytest.approx(
        19.12e9 * (1 - 4 / 32), rel=0.01
    )
    assert float(hm.weight_read_params(m, 1)) == pytest.approx(3.61e9, rel=0.01)
    # the bf16 release of the same model (lmsys/gpt-oss-120b-bf16) is bf16 throughout
    assert hm.weight_bytes(cat.model("gpt-oss-120b"), "bf16") == pytest.approx(116.8e9 * 2, rel=1e-9)


def test_the_rule_keeps_the_rest_in_bf16_only_for_the_published_checkpoint():
    m = cat.model("gpt-oss-20b")
    assert hm.dense_weight_precision(m, "int4") == "bf16"  # the published MXFP4 checkpoint
    assert hm.dense_weight_precision(m, "fp8") == "fp8"  # a checkpoint quantised otherwise
    assert hm.dense_weight_precision(m, "int4", "int8") == "int8"  # a run that states its own layout
    assert hm.dense_weight_precision(cat.model("mixtral-8x7b"), "int4") == "int4"  # no such field: all int4
    with pytest.raises(ValueError, match="precision"):
        _system("h100-sxm", "gpt-oss-20b", "int4", dense_precision="int3")
    raw = cat.model("gpt-oss-20b").model_dump()
    raw["sources"] = {k: v for k, v in raw["sources"].items() if k != "dense_precision"}
    with pytest.raises(ValidationError, match="dense_precision"):
        cat.ModelSpec(**raw)


def test_a_decode_step_streams_the_rest_at_16_bit_and_only_the_experts_are_weight_only():
    s = _system("h100-sxm", "gpt-oss-20b", "int4")
    bw, e = s.device.stream_bytes_s, s.eff
    parts = step_parts(s, 1, 1024)
    # the dense stream at batch 1: attention 0.64 B + head 0.58 B (+ router) params, 2 bytes each
    assert float(parts.dense_s) * bw == pytest.approx((0.64e9 + 0.58e9) * 2.0, rel=0.02)
    # the 4 experts a token touches: 4/32 of 19.1 B params at 4.25 bits
    assert float(parts.expert_s) * bw == pytest.approx(19.1e9 * 4 / 32 * 4.25 / 8, rel=0.02)
    # H100 has no int4 math: the MXFP4 experts dequantise in-kernel, the bf16 rest is native
    assert (bool(parts.weight_only), bool(parts.expert_weight_only)) == (False, True)
    # so eta_wq slows the expert stream only: at 0.5 the GPU time grows by one more expert stream
    gpu = replace(parts, serial_s=0.0, launch_s=0.0)
    full = float(combine(gpu, e.eta_mem, e.mfu, 1.0, e.eta_moe)[2])
    half = float(combine(gpu, e.eta_mem, e.mfu, 0.5, e.eta_moe)[2])
    assert half - full == pytest.approx(float(parts.expert_s) / (e.eta_moe * e.eta_mem), rel=0.02)


def test_a_model_without_the_field_times_exactly_as_one_precision_did():
    # the expert/rest split of FLOPs and flags changes nothing where both share the run's precision
    for dev, mdl, prec, tp in (("h100-sxm", "mixtral-8x7b", "int4", 2), ("a100-80gb", "llama-3.1-8b", "int8", 1)):
        s = _system(dev, mdl, prec, tp)
        parts = step_parts(s, np.array([1.0, 8.0, 64.0]), np.array([1024.0, 8192.0, 65536.0]), prefill_tokens=512)
        assert np.all(parts.weight_only == parts.expert_weight_only)
        # (the grouped GEMMs' own ceiling, Efficiency.moe_gemm_share, lifted: it is not the precision's)
        parts = replace(parts, expert_share=1.0)
        merged = replace(parts, flops_s=parts.flops_s + parts.expert_flops_s, expert_flops_s=0.0 * parts.flops_s)
        for wq in (1.0, 0.6):
            a = combine(parts, 0.78, 0.79, wq, 0.65, 1e-5)[2]
            b = combine(merged, 0.78, 0.79, wq, 0.65, 1e-5)[2]
            assert np.allclose(a, b, rtol=1e-12)
    assert float(step_parts(_system("h100-sxm", "llama-3.1-8b", "bf16"), 4, 4096).expert_flops_s) == 0.0


def test_llama_cpps_mxfp4_moe_gguf_keeps_the_rest_in_q8_0():
    # llama-bench prints 'gpt-oss 20B MXFP4 MoE | 11.27 GiB' (llama.cpp PR #16991) and 'gpt-oss 120B MXFP4
    # MoE | 59.02 GiB' (PR #19922): MXFP4 experts, the rest ~8.5 bits (Q8_0; the catalog's int8 is 8 bits)
    for mdl, gib in (("gpt-oss-20b", 11.27), ("gpt-oss-120b", 59.02)):
        assert hm.weight_bytes(cat.model(mdl), "int4", "int8") / GIB == pytest.approx(gib, rel=0.02)
    gguf = _system("rtx-6000-ada", "gpt-oss-20b", "int4", dense_precision="int8")
    hf = _system("rtx-6000-ada", "gpt-oss-20b", "int4")
    assert gguf.dense_format == "int8" and hf.dense_format == "bf16"
    assert float(hm.step_time(gguf, 1, 128).total_s) < float(hm.step_time(hf, 1, 128).total_s)
    assert hm.kv_capacity_tokens(gguf) > hm.kv_capacity_tokens(hf)  # less weight, more room for the cache


def test_the_points_that_ran_llama_cpps_gguf_state_its_layout_and_no_other_point_does():
    stated = {p.id: p.dense_precision for p in val.points() if p.dense_precision is not None}
    assert stated == {
        "llamacpp-pr19053-rtx6000ada-gptoss20b-mxfp4-tg128": "int8",
        "llamacpp-pr19053-rtx6000ada-gptoss20b-mxfp4-pp8096": "int8",
    }
    for p in val.points():
        if p.model.startswith("gpt-oss") and p.stack == "llama.cpp":
            assert "MXFP4 MoE" in p.notes and p.dense_precision == "int8"


def test_a_users_mxfp4_config_that_skips_attention_keeps_it_in_its_dtype(tmp_path):
    cfg = {
        "model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880, "intermediate_size": 2880,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
        "num_local_experts": 32, "num_experts_per_tok": 4, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = load_hf_config(str(path))
    assert (m.default_precision, m.dense_precision) == ("int4", "bf16")
    assert hm.weight_bytes(m, "int4") == pytest.approx(hm.weight_bytes(cat.model("gpt-oss-20b"), "int4"), rel=0.02)
    cfg["quantization_config"] = {"quant_method": "mxfp4"}  # nothing left unconverted: all 4-bit
    path.write_text(json.dumps(cfg))
    load_hf_config.cache_clear()
    assert load_hf_config(str(path)).dense_precision is None


def test_predict_says_which_weights_are_4_bit_and_which_are_not():
    p = hm.predict(cat.device("h100-sxm"), cat.model("gpt-oss-120b"))
    assert (p.precision, p.dense_precision) == ("int4", "bf16")
    assert p.weights_label() == "int4 experts, bf16 rest"
    plain = hm.predict(cat.device("h100-sxm"), cat.model("llama-3.1-8b"))
    assert plain.weights_label() == plain.precision == plain.dense_precision == "bf16"
    out = CliRunner().invoke(app, ["hardware", "predict", "-H", "h100-sxm", "-m", "gpt-oss-120b"], env={"COLUMNS": "200"})
    assert out.exit_code == 0 and "int4 experts, bf16 rest / bf16" in out.stdout
    js = CliRunner().invoke(app, ["hardware", "predict", "-H", "h100-sxm", "-m", "gpt-oss-120b", "--format", "json"])
    assert json.loads(js.stdout)["dense_precision"] == "bf16"
