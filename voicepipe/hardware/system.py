"""The system a step runs on: efficiencies, speculative decoding, bytes, KV capacity and sizing.

Pure functions over the catalog (:mod:`voicepipe.hardware.catalog`): how many bytes the weights and the
KV cache take, what the serving engine keeps per chip besides them (:func:`engine_reserve_bytes`: its
start-up profile's activation peak and non-torch memory, against the stack's memory share), how many
sequences fit beside the weights (paged or reserved KV, :func:`kv_sequences`) and how many the engine
runs at once (at most its cap, :func:`seq_cap`; :func:`running_sequences`),
and the smallest tensor-parallel width that holds a configuration (:func:`make_system`). The step
formulas that use them are in :mod:`voicepipe.hardware.step`; :mod:`voicepipe.hardware.model` states them
all and re-exports both modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from voicepipe.hardware.catalog import (
    PRECISIONS,
    BlockFp8Gemm,
    Device,
    ModelSpec,
    Stack,
    check_kv_precision,
    check_precision,
)
from voicepipe.hardware.catalog import stack as catalog_stack

FArray = NDArray[np.float64]


class DoesNotFit(ValueError):
    """The configuration cannot hold the weights it was asked to (at any tensor-parallel width)."""


@dataclass(frozen=True)
class Efficiency:
    """Efficiency factors, one set for every HBM device (η_mem, MFU, η_wq, η_moe fitted; see docs §2)."""

    # fitted on every answerable point of data/validation*.yaml (`voicepipe hardware validate`; docs §2, §3)
    eta_mem: float = 0.845  # share of the sustained (STREAM-like) bandwidth a native decode step streams
    mfu: float = 0.807  # share of the sustained (measured maximum) matmul FLOP/s a serving step reaches
    eta_wq: float = 1.0  # weight-only kernels' efficiency relative to native ones (dequant in the loop)
    eta_moe: float = 0.634  # expert (grouped-GEMM) streaming efficiency relative to dense GEMV + routing
    layer_s: float = 4.11e-05  # per layer per step on HBM devices beyond the stack's own gaps (launch, sync)
    ar_growth: float = 0.5  # all-reduce latency growth per doubling of the TP group beyond 2
    # per MoE layer per step: router, top-k, alignment, grouped-GEMM launches; the intercept of published
    # fused-MoE kernel times against the expert bytes they touch, 24.5-26.6 µs (docs §2, tenth pass)
    moe_route_s: float = 25e-6
    link_eff: float = 0.45  # share of link bandwidth NCCL reaches at 0.1-10 MB messages
    usable_memory: float = 0.90  # share of HBM for weights + KV, or of what weights leave (Stack.kv_pool)
    usable_sram: float = 1.0  # SRAM machines map weights and KV directly


DEFAULT_EFFICIENCY = Efficiency()
FITTED = ("eta_mem", "mfu", "eta_wq", "eta_moe", "layer_s")  # the constants validate fits; the rest are set


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding (Leviathan et al. 2023): acceptance α, γ drafts per step, draft cost c."""

    alpha: float
    gamma: int
    draft_cost: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"speculative.alpha must be in [0, 1], got {self.alpha}")
        if self.gamma < 1:
            raise ValueError(f"speculative.gamma must be >= 1, got {self.gamma}")
        if self.draft_cost < 0:
            raise ValueError(f"speculative.draft_cost must be >= 0, got {self.draft_cost}")


def expected_tokens_per_step(alpha: ArrayLike, gamma: ArrayLike) -> FArray:
    """E[tokens per target step] = (1 − α^(γ+1)) / (1 − α); γ + 1 when α = 1."""
    a = np.asarray(alpha, dtype=float)
    g = np.asarray(gamma, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = (1.0 - a ** (g + 1.0)) / (1.0 - a)
    return np.where(a >= 1.0, g + 1.0, e)


def speculative_speedup(alpha: ArrayLike, gamma: ArrayLike, draft_cost: ArrayLike) -> FArray:
    """Closed-form speed-up when the target step is memory-bound: E / (γ·c + 1)."""
    g = np.asarray(gamma, dtype=float)
    return expected_tokens_per_step(alpha, g) / (g * np.asarray(draft_cost, dtype=float) + 1.0)


def default_kv_precision(precision: str, kv_default: str = "weights") -> str:
    """KV-cache format when none is given. ``kv_default`` "weights" (the stack's default, Stack.kv_default):
    the precision the model runs at if that is a KV format (bf16, fp16, fp8), else bf16 (int8/int4/fp4
    weight formats keep a 16-bit cache). "activations" (vLLM, SGLang: kv_cache_dtype "auto" uses the model
    data type): the 16-bit activation format, so fp8 weights keep a bf16 cache unless fp8 KV is asked for."""
    if kv_default == "activations":
        return precision if precision in ("bf16", "fp16") else "bf16"
    return precision if precision in ("bf16", "fp16", "fp8") else "bf16"


@dataclass(frozen=True)
class System:
    """One serving instance: a model on ``chips`` chips of a device at a precision, under a stack."""

    device: Device
    model: ModelSpec
    precision: str
    chips: int
    eff: Efficiency = field(default=DEFAULT_EFFICIENCY)
    kv_precision: str | None = None  # None: default_kv_precision(precision, the stack's kv_default)
    stack: Stack | None = None  # None: the catalog's default stack
    # attention data parallelism (TensorRT-LLM/SGLang "attention DP" for MLA models): each chip runs the
    # attention of its own 1/chips of the sequences with a full copy of the attention weights
    attention_dp: bool = False
    # which TTFT the system answers: "client" (the stack's HTTP path on top of the engine's) or "engine";
    # None: the stack's default (Stack.timing)
    timing: Literal["client", "engine"] | None = None
    # eager execution (vLLM --enforce-eager, SGLang --disable-cuda-graph): no CUDA/HIP graphs, so every
    # step launches its kernels from the host, decode steps too (HBM devices; docs §1 "Eager execution")
    eager: bool = False
    # multi-step scheduling (vLLM V0 --num-scheduler-steps N, v0.5.5-v0.6.x): the host schedules, prepares
    # inputs and processes outputs once per N decode steps (HBM devices; docs §1 "Multi-step scheduling")
    scheduler_steps: int = 1
    # the engine's cap on sequences running at once as the run set it (vLLM --max-num-seqs, SGLang
    # --max-running-requests, TensorRT-LLM --max_batch_size); None: the stack's default (seq_cap)
    max_seqs: int | None = None
    # the precision of the weights outside the routed experts where the run's checkpoint states its own (a
    # GGUF that stores them in Q8_0: int8); None: the model's published checkpoint (dense_weight_precision)
    dense_precision: str | None = None
    block_fp8_gemm: BlockFp8Gemm | None = None  # the run's block-FP8 GEMM kernel; None: Stack.block_fp8_gemm

    def __post_init__(self) -> None:
        if self.scheduler_steps < 1:
            raise ValueError(f"scheduler_steps must be >= 1, got {self.scheduler_steps}")
        if self.max_seqs is not None and self.max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {self.max_seqs}")
        if self.dense_precision is not None:
            check_precision(self.dense_precision)

    @property
    def dense_format(self) -> str:
        """The precision the weights outside the routed experts stream at (:func:`dense_weight_precision`)."""
        return dense_weight_precision(self.model, self.precision, self.dense_precision)

    @property
    def ttft_timing(self) -> Literal["client", "engine"]:
        """The TTFT this system models: its own ``timing``, else its stack's default."""
        return self.timing or self.serving.timing

    @property
    def name(self) -> str:
        return f"{self.device.key}/{self.model.key}"

    @property
    def kv(self) -> str:
        return self.kv_precision or default_kv_precision(self.precision, self.serving.kv_default)

    @cached_property
    def serving(self) -> Stack:
        """The stack profile as built for this device's maker (:meth:`Stack.on`: e.g. vLLM V0's ROCm build on
        an AMD device); its ``key`` is the profile's, its ``name`` says which build. Worked out once per
        system (it is read on every engine step)."""
        return (self.stack or catalog_stack()).on(self.device.maker)

    @cached_property
    def split(self) -> tuple[float, float]:
        """(weight bytes per chip in HBM, per chip spilled to the offload tier): :func:`weight_split`, worked
        out once per system (every engine step reads it)."""
        return _weight_split(self)


# ---------------------------------------------------------------- bytes


def bytes_per_param(precision: str) -> float:
    return PRECISIONS[check_precision(precision)]


def kv_bytes_per_token(model: ModelSpec, precision: str) -> float:
    """KV-cache bytes per token (all layers) with KV elements stored at ``precision``."""
    return model.kv_elems_per_token * PRECISIONS[check_kv_precision(precision)]


def dense_weight_precision(model: ModelSpec, precision: str, stated: str | None = None) -> str:
    """The precision of the weights outside the routed experts (attention, dense and shared MLPs, router,
    embedding and head) of a run at ``precision``: ``stated`` where the run's checkpoint says (a GGUF's
    own layout), else the model's published checkpoint's (``ModelSpec.dense_precision``: gpt-oss keeps them
    in bf16 beside MXFP4 experts) when the run is at that checkpoint's precision, else ``precision``."""
    if stated is not None:
        return check_precision(stated)
    if model.dense_precision is not None and precision == model.default_precision:
        return model.dense_precision
    return precision


def weight_bytes(model: ModelSpec, precision: str, dense: str | None = None) -> float:
    """Bytes to hold every weight: the routed experts at ``precision``, the rest at
    :func:`dense_weight_precision` (``dense``: the run's own statement of it)."""
    rest, experts = _expert_split(model)
    return rest * bytes_per_param(dense_weight_precision(model, precision, dense)) + experts * bytes_per_param(
        precision
    )


def _expert_split(model: ModelSpec) -> tuple[float, float]:
    """(dense params, routed-expert params) from total/active and top-k of E."""
    if not model.is_moe:
        return model.total_params, 0.0
    share = model.experts_active / model.experts
    experts = (model.total_params - model.active_params) / (1.0 - share)
    return model.total_params - experts, experts


def _read_split(model: ModelSpec, tokens: ArrayLike) -> tuple[FArray, FArray]:
    """(dense params streamed, routed-expert params streamed) by one step over ``tokens`` tokens."""
    t = np.maximum(np.asarray(tokens, dtype=float), 1.0)
    dense, experts = _expert_split(model)
    touched = 1.0 - (1.0 - model.experts_active / model.experts) ** t if model.is_moe else 0.0 * t
    not_streamed = 0.0 if model.tied_embeddings else model.embed_params
    return dense - not_streamed + 0.0 * t, experts * touched


def weight_read_params(model: ModelSpec, tokens: ArrayLike) -> FArray:
    """Params one forward step over ``tokens`` tokens streams: dense + touched experts − embedding."""
    dense, experts = _read_split(model, tokens)
    return dense + experts


MLA_ROPE_DIM = 64  # decoupled rotary key width of MLA (DeepSeek-V2/V3/R1, Kimi K2: qk_rope_head_dim)


def decode_attention_width(model: ModelSpec) -> float:
    """Multiply-adds per head per (query, cached token) pair in decode attention: scores plus values.

    Standard attention: ``2 · head_dim``. MLA decodes in the absorbed form (DeepSeek-V2, arXiv
    2405.04434 §2.1.2; FlashMLA): every head scores the whole cached latent plus its rotary key
    (``kv_dim``) and reads the latent back as its value (``kv_dim − rope``), ~4× a 128-wide head."""
    if model.kv_dim is None:
        return 2.0 * model.head_dim
    return 2.0 * model.kv_dim - MLA_ROPE_DIM


def prefill_attention_width(model: ModelSpec) -> float:
    """Multiply-adds per head per (prompt token, attended token) pair in prefill attention.

    Standard attention: ``2 · head_dim`` (scores over ``head_dim``, values over ``head_dim``). MLA
    prefills in the non-absorbed form (DeepSeek-V2, arXiv 2405.04434 §2.1.2-2.1.3; DeepSeek-V3
    config.json: qk_nope_head_dim 128 + qk_rope_head_dim 64 = 192-wide scores, v_head_dim 128): the
    scores also span the decoupled rotary key, ``2 · head_dim + rope`` = 320, 1.25× a 128-wide head."""
    if model.kv_dim is None:
        return 2.0 * model.head_dim
    return 2.0 * model.head_dim + MLA_ROPE_DIM


def matmul_params(model: ModelSpec) -> float:
    """Params each token multiplies through (active, minus the untied input embedding lookup)."""
    return model.active_params - (0.0 if model.tied_embeddings else model.embed_params)


# ---------------------------------------------------------------- capacity


def kv_shards(model: ModelSpec, chips: int, attention_dp: bool = False) -> int:
    """How many ways the KV cache splits across a group: by sequence under attention DP (every chip
    holds its own sequences' cache), else by KV head (heads can't split further; an MLA latent: none)."""
    if attention_dp:
        return chips
    return 1 if model.kv_dim is not None else max(1, min(chips, model.kv_heads))


def attention_params(model: ModelSpec) -> float:
    """Attention projection params, all layers: Q and O (heads × head_dim each) and K, V (GQA heads).

    MLA (DeepSeek-V2 arXiv 2405.04434 §2.1; V3 config.json) counts its low-rank factors: the query's
    down- and up-projection (``hidden × q_lora_rank``, ``q_lora_rank × heads·(head_dim + rope)``; a
    full-rank query without ``q_lora_rank``), the latent's down-projection (``hidden × kv_dim``) and
    up-projection to keys and values (``(kv_dim − rope) × heads·2·head_dim``), and O. DeepSeek-V3: 187 M
    a layer."""
    m, hd = model, model.head_dim
    if m.kv_dim is None:
        return float(m.layers * m.hidden * (2 * m.heads * hd + 2 * m.kv_heads * hd))
    qk = m.heads * (hd + MLA_ROPE_DIM)
    q = m.hidden * m.q_lora_rank + m.q_lora_rank * qk if m.q_lora_rank else m.hidden * qk
    kv = m.hidden * m.kv_dim + (m.kv_dim - MLA_ROPE_DIM) * m.heads * 2 * hd
    return float(m.layers * (q + kv + m.heads * hd * m.hidden))


def tp_replicated_params(model: ModelSpec) -> float:
    """Params every rank of a tensor-parallel group holds and multiplies whole: MLA's down-projections of
    the query and the latent, whose RMSNorms need the whole low-rank vector on every rank and whose
    latent is the cache every rank keeps (vLLM and SGLang DeepSeek-V2/V3: ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` are ``ReplicatedLinear``, vllm/model_executor/models/deepseek_v2.py),
    ``hidden × (q_lora_rank + kv_dim)`` a layer (DeepSeek-V3: 15 M, 0.92 B in all); 0 for other attention."""
    if model.kv_dim is None:
        return 0.0
    return float(model.layers * model.hidden * (model.kv_dim + (model.q_lora_rank or 0)))


# ---------------------------------------------------------------- engine memory (docs §1, Engine memory)

GIB = float(2**30)
ACTIVATION_BYTES = 2.0  # bf16/fp16 activations of the start-up profile's forward pass


def ffn_width(model: ModelSpec) -> float:
    """Width of the gated MLP one token passes through in a layer (all its active experts and shared
    experts together), from the parameter count: (active − attention − embedding and head) / (3 · layers ·
    hidden). Llama-3.1-8B: 14,343 (config: 14,336)."""
    head = model.embed_params * (1.0 if model.tied_embeddings else 2.0)
    rest = model.active_params - attention_params(model) - head
    return max(0.0, rest / (3.0 * model.layers * model.hidden))


def memory_share(system: System) -> float:
    """The share of each chip's memory the stack budgets for weights, KV and its reserve: the stack's
    ``memory.share_by_tp`` at the largest width ≤ the system's (SGLang's mem_fraction_static), its
    ``memory.share``, else ``Efficiency.usable_memory`` (vLLM's gpu_memory_utilization default)."""
    mem = system.serving.memory if system.device.kind == "hbm" else None
    if mem is not None and mem.share_by_tp:
        widths = [w for w in mem.share_by_tp if w <= system.chips] or [min(mem.share_by_tp)]
        return mem.share_by_tp[max(widths)]
    if mem is not None and mem.share is not None:
        return mem.share
    return system.eff.usable_memory


def large_device(system: System) -> bool:
    """Whether the stack's large-device defaults apply: the device's memory reaches ``memory.large_gpu_gib``
    and its key starts with none of ``memory.large_gpu_except`` (vLLM V1: H100/H200/MI300X, not A100)."""
    mem, dev = system.serving.memory, system.device
    return (
        mem is not None
        and mem.large_gpu_gib is not None
        and dev.capacity_bytes >= mem.large_gpu_gib * GIB
        and not any(dev.key.startswith(prefix) for prefix in mem.large_gpu_except)
    )


def seq_cap(system: System) -> int | None:
    """The engine's cap on sequences running at once: the run's own ``System.max_seqs``, else on an HBM
    device the stack's documented default (``Stack.max_seqs_large`` on a large device, :func:`large_device`,
    else ``Stack.max_seqs``); None: no cap beyond what fits (SRAM machines, stacks without one)."""
    if system.max_seqs is not None:
        return system.max_seqs
    if system.device.kind != "hbm":
        return None
    stk = system.serving
    if stk.max_seqs_large is not None and large_device(system):
        return stk.max_seqs_large
    return stk.max_seqs


def profile_shape(system: System) -> tuple[int, int]:
    """(tokens, sequence slots) of the stack's start-up profile on this device: the large-device defaults
    where :func:`large_device`, else the ordinary ones; the slots are the run's own cap where it sets one
    (``System.max_seqs``: vLLM profiles its sampler over ``max_num_seqs`` sequences)."""
    mem = system.serving.memory
    if mem is None:
        return 0, 0
    tokens, seqs = mem.tokens, mem.seqs
    if large_device(system):
        tokens = mem.large_tokens if mem.large_tokens is not None else mem.tokens
        seqs = mem.large_seqs if mem.large_seqs is not None else mem.seqs
    if seqs and system.max_seqs is not None:
        seqs = system.max_seqs
    return tokens, seqs


def activation_peak_bytes(system: System) -> float:
    """The start-up profile's activation peak per chip: the larger of one forward pass over the profile's
    tokens, ``tokens · 2 B · (2·hidden + 3·ffn/tp)`` (residual and normed input, the gated MLP's
    up-projection output and activation), and the sampler over its sequence slots' logits, ``seqs · vocab
    · logit_bytes``. 0 for a stack without a memory block."""
    mem = system.serving.memory
    if mem is None or system.device.kind != "hbm":
        return 0.0
    tokens, seqs = profile_shape(system)
    m = system.model
    forward = tokens * ACTIVATION_BYTES * (2.0 * m.hidden + 3.0 * ffn_width(m) / system.chips)
    sampler = seqs * m.vocab * mem.logit_bytes
    return float(max(forward, sampler))


def engine_reserve_bytes(system: System) -> float:
    """What the engine keeps on each chip besides the weights and the KV cache, counted against its
    memory budget before the KV pool is sized: its non-torch memory (``memory.context_gib``, or
    ``context_tp_gib`` at TP > 1: NCCL and all-reduce buffers) plus the activation peak of its start-up
    profile (:func:`activation_peak_bytes`). 0 on SRAM machines and for a stack without a memory block."""
    mem = system.serving.memory
    if mem is None or system.device.kind != "hbm":
        return 0.0
    context = mem.context_tp_gib if system.chips > 1 and mem.context_tp_gib is not None else mem.context_gib
    return context * GIB + activation_peak_bytes(system)


def weight_room(system: System) -> float:
    """Bytes per chip the weights may take: the stack's memory budget less the engine's reserve."""
    return system.device.capacity_bytes * memory_share(system) - engine_reserve_bytes(system)


def weight_split(system: System) -> tuple[float, float]:
    """(weight bytes per chip in HBM, per chip spilled to the offload tier): see :func:`_weight_split`;
    kept on the system once worked out (:attr:`System.split`)."""
    return system.split


def _weight_split(system: System) -> tuple[float, float]:
    """(weight bytes per chip in HBM, per chip spilled to the offload tier).

    Weights stay in HBM when they fit; a device with an offload tier (SambaNova's DDR) keeps half its
    usable HBM for KV and streams the rest of the weights from that tier.
    """
    dev = system.device
    per_chip = weight_bytes(system.model, system.precision, system.dense_precision) / system.chips
    dense = bytes_per_param(system.dense_format)  # attention and MLA projections are outside the experts
    if system.attention_dp:  # a full copy of the attention weights on every chip
        per_chip += attention_params(system.model) * dense * (1 - 1 / system.chips)
    else:  # under TP, a full copy of the replicated projections (MLA's down-projections)
        per_chip += tp_replicated_params(system.model) * dense * (1 - 1 / system.chips)
    usable = weight_room(system)
    if per_chip <= usable or dev.offload_gb is None:
        return per_chip, 0.0
    keep = usable / 2.0
    return keep, per_chip - keep


def weights_fit(system: System) -> bool:
    """Whether the weights alone (plus one token of KV room) fit this system at all."""
    dev = system.device
    if dev.kind == "sram":
        return True
    in_hbm, spilled = weight_split(system)
    offload = float(dev.offload_gb or 0.0) * 1e9
    return in_hbm < weight_room(system) and spilled <= offload


def kv_capacity_tokens(system: System) -> float:
    """KV-cache tokens (summed over sequences) that fit beside the weights and the engine's reserve (≥ 0).

    Per chip, the pool is the stack's memory share (:func:`memory_share`) of the whole memory less the
    weights and what the engine keeps besides them (:func:`engine_reserve_bytes`), or, for a stack that
    sizes it from what the loaded weights and its buffers leave free (``kv_pool: free``, TensorRT-LLM), the
    share of that."""
    dev, m = system.device, system.model
    if dev.kind == "hbm":
        if not weights_fit(system):
            return 0.0
        weights = weight_split(system)[0]
        reserve = engine_reserve_bytes(system)
        if system.serving.kv_pool == "free":  # a share of what the weights and buffers leave free
            free = (dev.capacity_bytes - weights - reserve) * memory_share(system)
        else:  # a share of the whole memory, less the weights and the reserve
            free = dev.capacity_bytes * memory_share(system) - weights - reserve
        per_token = kv_bytes_per_token(m, system.kv) / kv_shards(m, system.chips, system.attention_dp)
    else:
        free = (
            system.chips * dev.capacity_bytes * system.eff.usable_sram
            - weight_bytes(m, system.precision, system.dense_precision)
        )
        per_token = kv_bytes_per_token(m, system.kv)
    return max(0.0, free / per_token)


def kept_tokens(system: System, context: float) -> float:
    """KV tokens (full-token equivalents) one sequence of ``context`` keeps in memory: the window on local
    layers where the stack frees what falls out of it (:attr:`Stack.window_kv`), else every token. The
    kernels read only the window either way (:func:`step_parts`)."""
    if system.device.kind == "hbm" and system.serving.window_kv:
        return float(system.model.held(context))
    return float(context)


def max_sequences(system: System, context: int) -> int:
    """How many sequences of ``context`` tokens fit beside the weights (≥ 0) (:func:`kept_tokens`)."""
    return max(0, math.floor(kv_capacity_tokens(system) / kept_tokens(system, context)))


def running_sequences(system: System, prompt_tokens: int, output_tokens: int) -> int:
    """How many sequences of ``prompt + output`` tokens a server keeps running at once: what fits
    (:func:`kv_sequences`), at most the engine's cap (:func:`seq_cap`). The serving engine's slots
    everywhere (``predict``, ``sweep``, ``validate``; :class:`~voicepipe.hardware.serving.DeviceServer`
    holds any server to the cap as well)."""
    fit = kv_sequences(system, prompt_tokens, output_tokens)
    cap = seq_cap(system)
    return fit if cap is None else min(fit, cap)


def kv_sequences(system: System, prompt_tokens: int, output_tokens: int) -> int:
    """How many sequences of ``prompt + output`` tokens fit in a paged-KV server's cache at once.

    Serving stacks allocate KV-cache blocks as a sequence grows (PagedAttention, Kwon et al. 2023,
    arXiv 2309.06180; LMDeploy's blocked cache alike), so what bounds the running batch is the cache at
    the sequences' current context — over a decode, on average ``prompt + output/2`` — not the cache each
    would reach at its end. A stack that reserves a request's whole ``prompt + output`` at admission
    (``kv_admission: reserve``, TensorRT-LLM's default GUARANTEED_NO_EVICT) runs what fits at that full
    length. 0 when not even one whole sequence fits beside the weights."""
    full = max_sequences(system, prompt_tokens + output_tokens)
    if full < 1 or (system.device.kind == "hbm" and system.serving.kv_admission == "reserve"):
        return full
    return max_sequences(system, max(1, math.floor(mean_context(prompt_tokens, output_tokens))))


def sram_units(
    device: Device, model: ModelSpec, precision: str, seqs: int, context: int, eff: Efficiency, kv: str,
    dense: str | None = None,
) -> int:  # fmt: skip
    """Chips/wafers an SRAM machine needs to hold the weights plus ``seqs`` KV caches of ``context``."""
    need = weight_bytes(model, precision, dense) + seqs * context * kv_bytes_per_token(model, kv)  # every token kept
    return math.ceil(need / (device.capacity_bytes * eff.usable_sram))


def tp_options(device: Device) -> list[int]:
    return [2**i for i in range(int(math.log2(device.max_tp)) + 1)]


def make_system(
    device: Device,
    model: ModelSpec,
    precision: str | None = None,
    *,
    tp: int | None = None,
    seqs: int = 1,
    context: int = 4096,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    kv_precision: str | None = None,
    stack: Stack | None = None,
    strict: bool = True,
    timing: Literal["client", "engine"] | None = None,
    eager: bool = False,
    scheduler_steps: int = 1,
    max_seqs: int | None = None,
    dense_precision: str | None = None,
) -> System:
    """Size a system that holds the weights and ``seqs`` sequences of ``context`` tokens.

    HBM: the smallest power-of-two TP width (≤ ``max_tp``) that holds them, or the given ``tp``. When no
    width holds ``seqs`` sequences, ``strict`` raises :class:`DoesNotFit`; otherwise the widest width
    whose weights fit is returned (the server will run as many sequences as fit). Weights that fit at no
    width always raise. SRAM: the chips/wafers follow from capacity (``tp`` is not accepted). ``eager``,
    ``scheduler_steps`` and ``max_seqs`` are run settings (:class:`System`); the last changes what vLLM's
    start-up profile reserves (:func:`profile_shape`), the others do not change the sizing.
    ``dense_precision`` is the checkpoint's own format outside the routed experts (:class:`System`).
    """
    prec = check_precision(precision or model.default_precision)
    kv = check_kv_precision(kv_precision) if kv_precision else None

    def build(width: int) -> System:
        return System(
            device, model, prec, width, eff, kv, stack, timing=timing, eager=eager,
            scheduler_steps=scheduler_steps, max_seqs=max_seqs, dense_precision=dense_precision,
        )  # fmt: skip

    if device.kind == "sram":
        if tp is not None:
            raise ValueError(f"tp does not apply to {device.key}: its chip count follows from SRAM capacity")
        probe = build(1)
        return build(sram_units(device, model, prec, seqs, context, eff, probe.kv, dense_precision))
    if tp is not None:
        if tp < 1 or tp > device.max_tp:
            raise ValueError(f"tp {tp} out of range for {device.key} (1..{device.max_tp})")
        # a pipeline split takes any chip count
        tensor = (stack or catalog_stack()).on(device.maker).multi_chip == "tensor"
        if tensor and model.heads % tp:
            raise ValueError(f"tp {tp}: {model.heads} attention heads do not split {tp} ways (tensor "
                             "parallelism shards whole heads, as vLLM and TensorRT-LLM require)")  # fmt: skip
        widths = [tp]
    else:
        widths = tp_options(device)
    for spill_ok in (False, True):  # prefer a width that holds the weights in HBM to one that spills
        for width in widths:
            system = build(width)
            if max_sequences(system, context) >= seqs and (spill_ok or weight_split(system)[1] == 0):
                return system
    widest = build(widths[-1])
    if strict or max_sequences(widest, context) < 1:
        raise DoesNotFit(_no_fit(widest, seqs if strict else 1, context))
    return widest


def _no_fit(system: System, seqs: int, context: int) -> str:
    dev, m = system.device, system.model
    need = weight_bytes(m, system.precision, system.dense_precision) + seqs * kept_tokens(system, context) * kv_bytes_per_token(
        m, system.kv
    )
    have = system.chips * weight_room(system)
    hint = "" if system.precision in ("int4", "fp4") else "; try a smaller --precision"
    return (
        f"does not fit: {m.key} at {system.precision} needs {need / 1e9:.0f} GB (weights + {seqs} x {context}-token KV) "
        f"but {system.chips} x {dev.key} hold {have / 1e9:.0f} GB usable{hint}"
    )


def mean_context(prompt_tokens: int, output_tokens: int) -> float:
    """Context a request's decode attends to on average: prompt + half its output."""
    return prompt_tokens + output_tokens / 2.0
