"""Block-scaled FP8 dense GEMMs at small M (docs/hardware-model.md §1, §3 twelfth pass, MLA 2)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from voicepipe.hardware import catalog as cat
from voicepipe.hardware import model as hm
from voicepipe.hardware import validate as val
from voicepipe.hardware.blockfp8 import Gemm, block_fp8_gemms, stream_share, system_kernel
from voicepipe.hardware.byo import load_hf_config
from voicepipe.hardware.specs import Stack
from voicepipe.hardware.step import step_parts

HF = Path(__file__).parent / "data" / "hf"


def _system(
    device: str = "h200-sxm", kernel: str | None = None, stack: str = "vllm-0.10", **kw: object
) -> hm.System:
    return hm.System(cat.device(device), cat.model("deepseek-r1"), "fp8", 8, stack=cat.stack(stack),
                     block_fp8_gemm=kernel, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_deepseek_rank_gemms_at_tp8_are_the_vllm_sglang_layout() -> None:
    # DeepSeek-V3/R1 config: hidden 7168, q_lora 1536, kv_lora 512 + rope 64, 128 heads of 128 (+64 rope),
    # 3 dense layers with an 18,432-wide MLP, 58 MoE layers with one 2,048-wide shared expert
    got = block_fp8_gemms(cat.model("deepseek-r1"), 8)
    assert got == (
        Gemm(1536, 7168, 61, True),  # q_a_proj (replicated)
        Gemm(3072, 1536, 61, True),  # q_b_proj: 16 heads x 192
        Gemm(576, 7168, 61, True),  # kv_a_proj_with_mqa (replicated)
        Gemm(7168, 2048, 61, True),  # o_proj: 16 heads x 128 deep
        Gemm(4608, 7168, 3, False),  # dense gate_up
        Gemm(7168, 2304, 3, False),  # dense down
        Gemm(512, 7168, 58, False),  # shared expert gate_up
        Gemm(7168, 256, 58, False),  # shared expert down
    )
    # attention DP: the attention projections are whole on every rank, the MLP still split
    dp = block_fp8_gemms(cat.model("deepseek-r1"), 8, attention_dp=True)
    assert Gemm(24576, 1536, 61, True) in dp and Gemm(7168, 16384, 61, True) in dp
    assert Gemm(512, 7168, 58, False) in dp


@pytest.mark.parametrize("n", [576, 1536, 2304])
def test_tile_law_matches_published_triton_block_fp8_times_on_h200(n: int) -> None:
    # SGLang PR #3893 (H200, benchmark_deepgemm_fp8_gemm.py, µs, M = 8-64, K = 7168): the Triton
    # w8a8_block_fp8_matmul takes 45.4 (N = 576), 50.5 (1,536) and 54.6 (2,304) against 19.9 for N = 2,048,
    # K = 512, i.e. ~28-37 µs over an ~18 µs harness floor, flat in N. One SM per 128-column tile at its
    # 1/132 share of the sustained bandwidth: every such GEMM takes 128 * K * SMs / BW, ~29 µs.
    dev = cat.device("h200-sxm")
    bw, sms, k = dev.stream_bytes_s, int(dev.sms or 0), 7168
    for m in (8, 16, 32, 64):
        law_us = n * k / bw / float(stream_share(n, m, "tile_bound", sms)) * 1e6
        assert law_us == pytest.approx(128 * k * sms / bw * 1e6, rel=0.15)
        assert 25.0 < law_us < 37.0  # the published ~28-37 µs over the harness floor
    # a GEMM wide enough to fill the SMs streams at the full rate; so does a prefill's M
    assert float(stream_share(24576, 8, "tile_bound", sms)) == 1.0
    assert float(stream_share(n, 8192, "tile_bound", sms)) == 1.0
    assert float(stream_share(n, 8, "none", sms)) == 1.0
    # DeepGEMM's 16-column tiles put 8x the SMs to work at small N
    assert float(stream_share(576, 8, "deepgemm", sms)) == pytest.approx(36 / 132)


def test_decode_pays_the_tile_bound_term_and_prefill_does_not() -> None:
    none, tile = _system(kernel="none"), _system(kernel="tile_bound")
    for batch in (1, 4, 48):
        term = float(step_parts(tile, batch, batch * 2000).fixed_s - step_parts(none, batch, batch * 2000).fixed_s)
        assert 4e-3 < term < 9e-3, batch  # ~6 ms of GPU time a decode step at TP 8 on an H200
        extra = float(
            hm.step_time(tile, batch, batch * 2000).total_s - hm.step_time(none, batch, batch * 2000).total_s
        )
        # the step pays it whole once the GPU outlasts the host's launch floor (batch 1 hides part of it)
        assert 0 < extra <= term + 1e-9 and (batch == 1 or extra == pytest.approx(term)), batch
    p_none = hm.mixed_step_s(none, 0, 0, prefill_tokens=4096)
    p_tile = hm.mixed_step_s(tile, 0, 0, prefill_tokens=4096)
    assert float(p_tile) == pytest.approx(float(p_none), rel=1e-3)  # thousands of rows fill the SMs
    # DeepGEMM's 16-column tiles fill far more SMs: a small fraction of the tile-bound term
    deep = _system(kernel="deepgemm")
    d = float(hm.step_time(deep, 4, 8000).total_s - hm.step_time(none, 4, 8000).total_s)
    t = float(hm.step_time(tile, 4, 8000).total_s - hm.step_time(none, 4, 8000).total_s)
    assert 0 < d < 0.2 * t
    # more compute units at the same bandwidth: a larger share left idle (MI300X, 304 CUs)
    amd = _system("mi300x", kernel="tile_bound", stack="vllm-rocm-amd")
    amd_none = _system("mi300x", kernel="none", stack="vllm-rocm-amd")
    assert float(hm.step_time(amd, 4, 8000).total_s - hm.step_time(amd_none, 4, 8000).total_s) > 2 * t


def test_which_kernel_a_system_runs() -> None:
    s = _system()
    assert system_kernel(s) == "tile_bound"  # the profile's (vLLM v0.8-v0.10)
    assert system_kernel(_system(stack="sglang")) == "deepgemm"
    assert system_kernel(_system(stack="sglang", kernel="tile_bound")) == "tile_bound"  # the run's own
    assert system_kernel(_system("mi325x", stack="sglang")) == "none"  # SGLang's ROCm build: AITER
    assert system_kernel(_system(stack="trtllm")) == "none"
    assert system_kernel(replace(s, precision="fp4")) == "none"  # not the FP8 checkpoint
    llama = hm.System(
        cat.device("h200-sxm"), cat.model("llama-3.1-70b"), "fp8", 8, stack=cat.stack("vllm-0.10")
    )
    assert system_kernel(llama) == "none"  # per-tensor/per-channel FP8 checkpoints
    assert system_kernel(replace(s, device=cat.device("b200"))) == "none"  # no SM count recorded
    assert system_kernel(replace(s, device=cat.device("a100-80gb"))) == "none"  # fp8 weight-only there


def test_a_build_that_names_a_kernel_must_source_it() -> None:
    base = cat.stack("none").model_dump(exclude={"key"})
    with pytest.raises(ValueError, match="block_fp8_gemm"):
        Stack(**{**base, "block_fp8_gemm": "tile_bound"})
    ok = Stack(
        **{**base, "block_fp8_gemm": "tile_bound", "sources": {**base["sources"], "block_fp8_gemm": "x"}}
    )
    assert ok.block_fp8_gemm == "tile_bound"


def test_hf_config_reads_block_scales_and_mlp_widths() -> None:
    m = load_hf_config(str(HF / "deepseek-v3" / "config.json"))
    assert (m.fp8_weight_block, m.dense_ffn, m.shared_ffn) == (128, 18432, 2048)
    dense = load_hf_config(str(HF / "llama-3.1-8b" / "config.json"))
    assert dense.fp8_weight_block is None and dense.dense_ffn == 14336 and dense.shared_ffn is None


@pytest.mark.parametrize("chips", [8, None])
def test_a_point_states_the_kernel_its_build_ran(chips: int | None) -> None:
    # SkyPilot's SGLang 0.4.5.post3 rows: the release defaults to Triton, the harness turned DeepGEMM on;
    # the stated kernel reaches the system whether the point gives its chips or the sizing picks them
    base = dict(id="t", device="h200-sxm", chips=chips, model="deepseek-r1", precision="fp8", batch=4,
                prompt_tokens=1000, output_tokens=100, stack="vllm-0.10", metric="tok_s_total", date="2025",
                source="test", tier=2, value=1e3)  # fmt: skip
    own = val.prepare(val.Point(**{**base, "block_fp8_gemm": "deepgemm"}))  # type: ignore[arg-type]
    profile = val.prepare(val.Point(**base))  # type: ignore[arg-type]
    assert own.system is not None and profile.system is not None
    assert (system_kernel(own.system), system_kernel(profile.system)) == ("deepgemm", "tile_bound")
