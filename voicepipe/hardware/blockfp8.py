"""Block-scaled FP8 dense GEMMs at small M: a tile-bound kernel streams a narrow weight on a few SMs.

A checkpoint whose FP8 weights carry one scale per 128 × 128 block (DeepSeek-V3/R1, Kimi K2:
``ModelSpec.fp8_weight_block``) runs its dense GEMMs through a block-scaled kernel. The kernels that
2025 vLLM and SGLang builds ran by default (Triton ``w8a8_block_fp8_matmul``, CUTLASS's sm90 blockwise
GEMM: ``Stack.block_fp8_gemm`` "tile_bound") give each output tile to one SM and loop over the whole K
dimension in it, without splitting K. A GEMM of ``M`` tokens whose output has fewer tiles than the device
has SMs then streams its weight on ``tiles`` SMs only, each at its share of the sustained bandwidth:

    tiles = ceil(M / tile_m) · ceil(N / tile_n)       share = min(1, tiles / SMs)
    extra = N · K · bytes · (1 / share − 1) / BW_s    (per rank, per layer that has the GEMM)

a fixed GPU cost on top of the weight's modelled stream (outside η_mem: the published kernel times are
those of 128-column tiles at the full per-SM share, ~29 µs for K = 7168 on an H200 whatever N) (:data:`TILE`: 128 × 128 for "tile_bound"; DeepGEMM, "deepgemm",
narrows its tile to 64 × 16 to fill the SMs). At TP 8 DeepSeek's per-rank projections are narrow
(the latent's down-projection: 576 columns, 5 tiles of 132 SMs), so a decode step pays several ms; a
prefill's thousands of tokens fill the SMs and pay nothing. Which GEMMs a rank runs:
:func:`block_fp8_gemms`; the routed experts are the fused-MoE kernel's (``t_route``), not these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from numpy.typing import ArrayLike

from voicepipe.hardware.num import arr, ceil, maximum, minimum
from voicepipe.hardware.specs import BlockFp8Gemm, Device, ModelSpec
from voicepipe.hardware.system import MLA_ROPE_DIM, FArray, System

# (rows, columns) of an output tile: the 128 x 128 scale block for "tile_bound" (CUTLASS's tile; Triton's
# tuned tiles are narrower but its published times are those of 128-column tiles, docs §1); DeepGEMM's
# narrowest, which its heuristic picks while the tiles do not fill the SMs (block_m 64, block_n 16)
TILE: dict[str, tuple[int, int]] = {"tile_bound": (128, 128), "deepgemm": (64, 16)}


@dataclass(frozen=True)
class Gemm:
    """One block-scaled FP8 GEMM of a rank: ``n`` output columns, ``k`` inner width, in ``layers`` layers;
    ``own``: a rank's own (under attention DP it runs it whole, over its own tokens only)."""

    n: int
    k: int
    layers: int
    own: bool


def block_fp8_gemms(
    model: ModelSpec, tp: int, attention_dp: bool = False, mlp_own: bool = False
) -> tuple[Gemm, ...]:
    """The dense GEMMs one rank of a ``tp``-wide group runs per step (vLLM/SGLang tensor-parallel layouts).

    MLA (``kv_dim``): the query's and the latent's down-projections (replicated on every rank), the query's
    up-projection (``heads/tp · (head_dim + rope)`` columns) and the output projection (``heads/tp ·
    head_dim`` deep); under attention DP the attention projections are whole on every rank (the MLPs too
    with ``mlp_own``: Stack.attention_dp_mlp "own"). The latent's
    up-projection is absorbed at decode (not a GEMM over the tokens) and is left out. Other attention:
    the fused QKV (KV heads replicated below one per rank) and the output projection. MLP: the dense layers'
    gate/up (``2 · dense_ffn / tp`` columns) and down projection, and an MoE layer's shared experts
    (``shared_ffn``); an MoE layer without ``shared_ffn`` has none here (its routed experts are the
    fused-MoE kernel's)."""
    m = model
    t = 1 if attention_dp else tp
    hd = m.head_dim
    gemms: list[Gemm] = []
    if m.kv_dim is not None:
        qk = m.heads * (hd + MLA_ROPE_DIM) // t
        if m.q_lora_rank:
            gemms.append(Gemm(m.q_lora_rank, m.hidden, m.layers, True))
            gemms.append(Gemm(qk, m.q_lora_rank, m.layers, True))
        else:
            gemms.append(Gemm(qk, m.hidden, m.layers, True))
        gemms.append(Gemm(m.kv_dim, m.hidden, m.layers, True))
    else:
        kv = max(1, m.kv_heads // t)
        gemms.append(Gemm((m.heads // t + 2 * kv) * hd, m.hidden, m.layers, True))
    gemms.append(Gemm(m.hidden, m.heads * hd // t, m.layers, True))
    moe = m.routed_layers
    dense_layers = m.layers - moe
    own = attention_dp and mlp_own
    tm = 1 if own else tp
    if dense_layers and m.dense_ffn:
        gemms.append(Gemm(2 * m.dense_ffn // tm, m.hidden, dense_layers, own))
        gemms.append(Gemm(m.hidden, m.dense_ffn // tm, dense_layers, own))
    if moe and m.shared_ffn:
        gemms.append(Gemm(2 * m.shared_ffn // tm, m.hidden, moe, own))
        gemms.append(Gemm(m.hidden, m.shared_ffn // tm, moe, own))
    return tuple(g for g in gemms if g.n > 0 and g.k > 0)


def stream_share(n: int, tokens: ArrayLike, kernel: BlockFp8Gemm, sms: int) -> FArray:
    """Share of the bandwidth a GEMM with ``n`` output columns over ``tokens`` rows streams its weight at
    under ``kernel``: its output tiles over the device's SMs, at most 1 (1 for kernel "none")."""
    m = maximum(arr(tokens), 1.0)
    if kernel == "none":
        return 0.0 * m + 1.0
    tile_m, tile_n = TILE[kernel]
    return minimum(1.0, ceil(m / tile_m) * math.ceil(n / tile_n) / sms)


def tile_bound_extra_params(
    model: ModelSpec, kernel: BlockFp8Gemm, tp: int, sms: int, tokens: ArrayLike, attention_dp: bool = False,
    mlp_own: bool = False,
) -> FArray:  # fmt: skip
    """Weight params per rank whose streaming time (at the sustained bandwidth) a step of ``tokens`` tokens
    (M) pays on top of its modelled stream because its block-scaled GEMMs have fewer output tiles than the
    device has SMs (module doc); 0 for kernel "none". Under attention DP a rank's own GEMMs (:class:`Gemm`) run
    over its own ``tokens / tp``."""
    tokens_arr = maximum(arr(tokens), 1.0)
    out = 0.0 * tokens_arr
    if kernel == "none":
        return out
    for g in block_fp8_gemms(model, tp, attention_dp, mlp_own):
        m = ceil(tokens_arr / tp) if attention_dp and g.own else tokens_arr
        out = out + g.layers * g.n * g.k * (1.0 / stream_share(g.n, m, kernel, sms) - 1.0)
    return out


def kernel_for(
    model: ModelSpec, device: Device, dense_format: str, stated: BlockFp8Gemm | None, build: BlockFp8Gemm
) -> BlockFp8Gemm:
    """The kernel a system's dense GEMMs run: "none" unless the model is a block-scaled checkpoint
    (``ModelSpec.fp8_weight_block``) whose dense weights run at fp8 (``dense_format``) on a device with FP8
    math whose SM count is recorded; else the run's own setting (``stated``), else the stack build's."""
    if dense_format != "fp8" or model.fp8_weight_block is None or device.sms is None:
        return "none"
    return "none" if device.weight_only("fp8") else stated or build


def block_fp8_experts(system: System) -> bool:
    """Whether the routed experts are a block-scaled FP8 checkpoint's (``ModelSpec.fp8_weight_block``) run
    with FP8 math: a fused-MoE chain that quantises its activations per token group and scales per block,
    whose fixed cost per layer is ``Efficiency.moe_route_block_s`` (docs/hardware-model.md §3, nineteenth
    pass) instead of ``moe_route_s``. Unlike the dense GEMMs' tile term it needs no SM count: the figure is
    a whole chain's, measured on NVIDIA GPUs and taken for every device with FP8 math (no AMD or Gaudi
    table was found)."""
    m, d = system.model, system.device
    return (
        m.is_moe and m.fp8_weight_block is not None and system.precision == "fp8" and not d.weight_only("fp8")
    )


def system_kernel(system: System) -> BlockFp8Gemm:
    """The block-scaled FP8 GEMM kernel a system's dense GEMMs run (:func:`kernel_for`: the run's own
    ``System.block_fp8_gemm``, else its stack build's ``Stack.block_fp8_gemm``)."""
    stated, build = system.block_fp8_gemm, system.serving.block_fp8_gemm
    return kernel_for(system.model, system.device, system.dense_format, stated, build)
