"""The routed experts' grouped GEMMs reach a smaller share of the sustained matmul rate than a dense
step's GEMMs where they are compute-bound (``Efficiency.moe_gemm_share``, from published fused-MoE kernel
benchmarks; docs §3, thirty-second pass): a ceiling on their math only, never on their bytes, and never
above the dense share (MFU)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from voicepipe.hardware import catalog as cat
from voicepipe.hardware.model import make_system
from voicepipe.hardware.step import step_parts, step_time
from voicepipe.hardware.system import DEFAULT_EFFICIENCY, System


def _system(model: str, **eff: float) -> System:
    s = make_system(cat.device("h100-sxm"), cat.model(model), "bf16", tp=2, seqs=1, context=2048)
    return replace(s, eff=replace(s.eff, **eff))


def _step_ms(s: System, decoders: int, prefill: int = 0) -> float:
    t = step_time(s, decoders, decoders * 1000, prefill_tokens=prefill, prefill_seqs=max(1, prefill // 1000))
    return float(t.total_s) * 1e3


def test_a_compute_bound_moe_step_runs_its_experts_math_at_the_grouped_gemms_share():
    # a prefill of 8,000 Mixtral tokens: the experts' math binds, so the ceiling adds what it says
    capped, free = _system("mixtral-8x7b"), _system("mixtral-8x7b", moe_gemm_share=1.0)
    p = step_parts(capped, 4, 4000, prefill_tokens=8000, prefill_seqs=8)
    e = capped.eff
    assert e.moe_gemm_share < e.mfu
    want = float(p.expert_flops_s) * (1 / e.moe_gemm_share - 1 / e.mfu) * 1e3
    assert want > 1.0  # milliseconds: not a rounding-sized effect
    assert _step_ms(capped, 4, 8000) - _step_ms(free, 4, 8000) == pytest.approx(want, rel=1e-6)


def test_a_bandwidth_bound_moe_step_and_a_dense_model_do_not_see_it():
    # four decoders stream the experts' bytes (the math is far below them): no change
    assert _step_ms(_system("mixtral-8x7b"), 4) == _step_ms(_system("mixtral-8x7b", moe_gemm_share=1.0), 4)
    # a dense model has no routed experts
    dense = _system("llama-3.1-8b")
    assert _step_ms(dense, 4, 8000) == _step_ms(_system("llama-3.1-8b", moe_gemm_share=0.1), 4, 8000)


def test_the_ceiling_never_lifts_the_experts_above_the_dense_share():
    # a dense share below the ceiling (a slow stack's MFU) is what the experts get too
    low = 0.5
    assert low < DEFAULT_EFFICIENCY.moe_gemm_share
    a = _system("mixtral-8x7b", mfu=low)
    b = _system("mixtral-8x7b", mfu=low, moe_gemm_share=1.0)
    assert _step_ms(a, 4, 8000) == _step_ms(b, 4, 8000)
