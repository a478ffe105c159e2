"""The all-reduce a serving stack runs for tensor parallelism (voicepipe.hardware.collective)."""

from __future__ import annotations

import numpy as np
import pytest

import voicepipe.hardware.catalog as cat
import voicepipe.hardware.model as hm
from voicepipe.hardware.specs import Device, Stack

KIB, MIB = 1024, 1024 * 1024


def _link(dev: Device) -> float:
    return float(dev.link_gbs or 0) * 1e9 * hm.DEFAULT_EFFICIENCY.link_eff


def test_custom_kernel_below_its_limits_nccl_above():
    dev, vllm = cat.device("h100-sxm"), cat.stack("vllm")
    sizes = np.array([16 * KIB, 256 * KIB, 2 * MIB, 8 * MIB])
    assert list(hm.allreduce_path(vllm, dev, 8, sizes)) == ["oneshot", "twoshot", "twoshot", "nccl"]
    assert list(hm.allreduce_path(vllm, dev, 4, sizes)) == ["oneshot", "oneshot", "twoshot", "nccl"]
    assert list(hm.allreduce_path(vllm, dev, 2, sizes)) == ["oneshot", "oneshot", "oneshot", "nccl"]
    custom = hm.allreduce_s(vllm, dev, 8, sizes)
    nccl = hm.allreduce_s(cat.stack("trtllm-v0.6"), dev, 8, sizes)  # NCCL for every message
    assert np.all(custom[:3] < nccl[:3]) and custom[3] == pytest.approx(nccl[3])
    # the NCCL path is the device's graph-less latency plus the ring's bytes
    ring = 2 * 7 / 8 * sizes / _link(dev)
    assert np.allclose(nccl, hm.allreduce_latency_s(dev, 8) + ring)


def test_one_shot_reads_every_peer_two_shot_moves_the_ring_bytes():
    dev, vllm = cat.device("h100-sxm"), cat.stack("vllm")
    alpha = hm.custom_allreduce_latency_s(dev, 8)
    assert alpha == pytest.approx(5.9e-6)
    s1, s2 = 128 * KIB, 1 * MIB
    assert float(hm.allreduce_s(vllm, dev, 8, s1)) == pytest.approx(alpha + 7 * s1 / _link(dev))
    # two-shot: a reduce-scatter and an all-gather, each behind its own barrier
    assert float(hm.allreduce_s(vllm, dev, 8, s2)) == pytest.approx(2 * alpha + 2 * 7 / 8 * s2 / _link(dev))


def test_no_custom_path_without_peer_fabric_or_beyond_the_kernels_widths():
    vllm, trt = cat.stack("vllm"), cat.stack("trtllm")
    l40s = cat.device("l40s")  # PCIe only: vLLM refuses > 2 PCIe GPUs, TensorRT-LLM's AUTO picks NCCL
    assert hm.custom_allreduce_latency_s(l40s, 4) is None
    for stk in (vllm, trt):
        assert str(hm.allreduce_path(stk, l40s, 4, 16 * KIB)) == "nccl"
    assert str(hm.allreduce_path(vllm, cat.device("h100-sxm"), 16, 16 * KIB)) == "nccl"  # vLLM: 2-8 GPUs


def test_tensorrt_llm_auto_runs_one_shot_then_nccl():
    dev, trt = cat.device("h200-sxm"), cat.stack("trtllm")
    sizes = np.array([400_000, 600_000, 900_000, 1_200_000, 15_000_000])
    assert list(hm.allreduce_path(trt, dev, 8, sizes)) == ["oneshot", "nccl", "nccl", "nccl", "nccl"]
    assert list(hm.allreduce_path(trt, dev, 4, sizes)) == ["oneshot", "oneshot", "oneshot", "nccl", "nccl"]
    assert list(hm.allreduce_path(trt, dev, 2, sizes)) == ["oneshot"] * 5


def test_rocm_builds_follow_their_own_all_reduce():
    mi = cat.device("mi300x")
    assert cat.stack("vllm-v0").on(mi.maker).allreduce == "nccl"  # upstream ROCm build before 2025
    amd = cat.stack("vllm-rocm-amd")
    assert amd.on(mi.maker).allreduce == "custom"
    assert str(hm.allreduce_path(amd, mi, 8, 12 * MIB)) == "twoshot"  # the fork serves up to 16 MB
    assert str(hm.allreduce_path(cat.stack("vllm"), mi, 8, 12 * MIB)) == "nccl"  # upstream's 8 MiB


def test_latency_by_width_interpolates_in_log2():
    h100, mi = cat.device("h100-sxm"), cat.device("mi300x")
    a4, a6, a8 = (hm.custom_allreduce_latency_s(h100, tp) for tp in (4, 6, 8))
    assert a4 is not None and a6 is not None and a8 is not None
    assert a4 < a6 < a8 and a6 == pytest.approx(4.8e-6 + 1.1e-6 * (np.log2(6) - 2))
    m2, m4, m8 = (hm.custom_allreduce_latency_s(mi, tp) for tp in (2, 4, 8))
    assert (m2, m4) == (pytest.approx(7.07e-6), pytest.approx(7.18e-6))
    assert m8 == pytest.approx(7.29e-6)  # the TP 2-4 segment extended: no MI300X TP 8 figure
    assert hm.custom_allreduce_latency_s(h100, 1) == 0.0


def test_step_pays_the_stack_s_all_reduce():
    """A TP 8 decode step of Llama-3.1-70B at batch 1 on H100s: vLLM's custom all-reduce costs ~6.5 µs a
    call where TensorRT-LLM v0.5-v0.6 (NCCL) pays ~20 µs, 160 calls a step."""
    dev, m = cat.device("h100-sxm"), cat.model("llama-3.1-70b")
    comm = {}
    for key in ("vllm", "trtllm-v0.6"):
        s = hm.make_system(dev, m, "fp8", tp=8, stack=cat.stack(key))
        comm[key] = float(hm.step_parts(s, 1, 2048).comm_s)
    assert comm["trtllm-v0.6"] == pytest.approx(160 * float(hm.allreduce_s(cat.stack("trtllm-v0.6"), dev, 8, 16384)))
    assert comm["vllm"] == pytest.approx(160 * (5.9e-6 + 7 * 16384 / _link(dev)))
    assert comm["vllm"] < 0.4 * comm["trtllm-v0.6"]


def _stack(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "name": "s",
        "step_overhead_us": 1,
        "layer_overhead_us": 1,
        "prefill_layer_overhead_us": 1,
        "request_overhead_ms": 1,
        "sources": {"step_overhead_us": "x", "layer_overhead_us": "x", "request_overhead_ms": "x"},
    }
    return {**base, **over}


def test_custom_all_reduce_needs_limits_and_sources():
    with pytest.raises(ValueError, match="needs allreduce_oneshot_bytes"):
        Stack(**_stack(allreduce="custom"))
    with pytest.raises(ValueError, match="no source for allreduce"):
        Stack(**_stack(allreduce="custom", allreduce_oneshot_bytes={8: 1}, allreduce_max_bytes={8: 2}))
    dev = cat.device("h100-sxm").model_dump()
    dev["sources"] = {k: v for k, v in dev["sources"].items() if k != "custom_allreduce_us"}
    with pytest.raises(ValueError, match="no source for custom_allreduce_us"):
        Device(**dev)
