"""Tensor-parallel all-reduce time: which collective a serving stack runs for a message, and what it costs.

A tensor-parallel step all-reduces its activations twice per layer. The stacks do not all run NCCL for it:
vLLM, SGLang and TensorRT-LLM run their own one-shot / two-shot kernels over peer-mapped buffers (CUDA IPC
over NVLink, HIP IPC over Infinity Fabric) below a size limit, replayed inside the decode CUDA graph, and
fall back to NCCL/RCCL above it (docs/hardware-model.md §1, *Tensor parallelism*). So the time of one
all-reduce of ``S`` bytes over a group of ``tp`` is, with ``B = link_gbs · η_link``:

    custom one-shot (S < stack's one-shot limit):  α_c(tp) + (tp − 1) · S / B
    custom two-shot (S < stack's custom limit):  2 α_c(tp) + 2 (tp − 1)/tp · S / B
    NCCL / RCCL (otherwise, or no custom path):     α(tp)   + 2 (tp − 1)/tp · S / B

``α(tp) = α_2 · (1 + g · log2(tp/2))`` is the device's graph-less NCCL latency (``allreduce_us``), and
``α_c(tp)`` the device's small-message latency of the custom one-shot kernel by group width
(``custom_allreduce_us``), interpolated linearly in log2(tp) between the published widths. A two-shot
all-reduce is a reduce-scatter and an all-gather, each behind its own cross-GPU barrier: two one-shot
rounds of latency (vLLM's graph-replayed tables on H100 put its intercept at 11-12 µs, twice the one-shot's
5-6 µs; docs §3, all-reduce pass). A device without
``custom_allreduce_us`` (PCIe-only GPUs, TPUs, Gaudi) has no custom path: every stack pays NCCL there, as
vLLM (no custom all-reduce on more than two PCIe-only GPUs) and TensorRT-LLM (AUTO picks NCCL without
NVLink) do. Pure functions of the catalog entries; nothing here is fitted.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

from voicepipe.hardware.catalog import Device, Stack
from voicepipe.hardware.num import arr, where
from voicepipe.hardware.system import DEFAULT_EFFICIENCY, Efficiency, FArray

Path = Literal["oneshot", "twoshot", "nccl"]


def allreduce_latency_s(device: Device, tp: int, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Small-message NCCL/RCCL all-reduce latency of a ``tp``-wide group: α_2 · (1 + g · log2(tp / 2));
    0 at tp 1."""
    if tp <= 1:
        return 0.0
    return float(device.allreduce_us or 0.0) * 1e-6 * (1.0 + eff.ar_growth * math.log2(tp / 2.0))


def custom_allreduce_latency_s(device: Device, tp: int) -> float | None:
    """Small-message latency of the stacks' custom all-reduce on ``device`` for a ``tp``-wide group, from
    ``Device.custom_allreduce_us`` (µs by group width): the published width itself, else linear in log2(tp)
    between the two nearest widths (beyond the table, the nearest segment extended; one width: flat).
    None where the device has no custom path; 0 at tp 1."""
    if tp <= 1:
        return 0.0
    table = device.custom_allreduce_us
    if not table:
        return None
    widths = sorted(table)
    if tp in table:
        return table[tp] * 1e-6
    if len(widths) == 1:
        return table[widths[0]] * 1e-6
    x = math.log2(tp)
    lo, hi = widths[0], widths[1]
    for a, b in pairwise(widths):
        lo, hi = a, b
        if tp < b:
            break
    xa, xb = math.log2(lo), math.log2(hi)
    return (table[lo] + (table[hi] - table[lo]) * (x - xa) / (xb - xa)) * 1e-6


def _limit(limits: dict[int, int], tp: int) -> int | None:
    """The stack's size limit for a ``tp``-wide group: the entry of the smallest listed width ≥ tp (the
    limits are stated for "up to N GPUs"); None beyond the widest (no custom kernel for that group)."""
    fit = [w for w in limits if w >= tp]
    return limits[min(fit)] if fit else None


def allreduce_path(stack: Stack, device: Device, tp: int, message_bytes: ArrayLike) -> np.ndarray | str:
    """Which collective ``stack`` runs for an all-reduce of ``message_bytes`` over ``tp`` ``device``s:
    "oneshot" / "twoshot" (its custom kernel) or "nccl" (vectorised over the message size; a str for one
    message given as a number)."""
    s = arr(message_bytes)
    nccl = "nccl" if isinstance(s, float) else np.full(s.shape, "nccl", dtype="<U7")
    if tp <= 1 or stack.allreduce != "custom" or not device.custom_allreduce_us:
        return nccl
    oneshot, most = _limit(stack.allreduce_oneshot_bytes, tp), _limit(stack.allreduce_max_bytes, tp)
    if oneshot is None or most is None:
        return nccl
    if isinstance(s, float):  # one message (the engine's hot path): the same choice as below
        return "oneshot" if s < min(oneshot, most) else "twoshot" if s < most else "nccl"
    return np.where(s < min(oneshot, most), "oneshot", np.where(s < most, "twoshot", "nccl"))


def allreduce_s(
    stack: Stack, device: Device, tp: int, message_bytes: ArrayLike, eff: Efficiency = DEFAULT_EFFICIENCY
) -> FArray:
    """Seconds for one all-reduce of ``message_bytes`` over ``tp`` chips of ``device`` as ``stack`` runs it
    (module docstring): latency plus the bytes each chip moves over its link at η_link; 0 at tp 1."""
    s = arr(message_bytes)
    if tp <= 1:
        return 0.0 * s
    link = float(device.link_gbs or 0) * 1e9 * eff.link_eff
    ring = 2.0 * (tp - 1) / tp * s / link
    nccl = allreduce_latency_s(device, tp, eff) + ring
    path = allreduce_path(stack, device, tp, s)
    alpha = custom_allreduce_latency_s(device, tp)
    custom = path != "nccl" if isinstance(path, str) else bool(np.any(path != "nccl"))
    if alpha is None or not custom:
        return nccl + 0.0 * s
    oneshot = alpha + (tp - 1) * s / link
    return where(path == "oneshot", oneshot, where(path == "twoshot", 2.0 * alpha + ring, nccl))
