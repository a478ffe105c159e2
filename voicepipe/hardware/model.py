"""Analytic LLM inference timing: pure functions, no I/O, vectorisable over batch and context.

Notation (per step of the serving engine): ``d`` sequences decode, each emitting ``q`` tokens (``q = 1``,
or ``γ + 1`` when a speculative step verifies ``γ`` drafts); ``K`` = KV tokens those sequences attend to
(sum of their contexts); ``n`` prompt tokens are prefilled in the same step on top of ``m`` cached prefix
tokens. ``T = d·q + n`` tokens go through the weights.

HBM devices (GPUs, TPUs), per chip of a tensor-parallel group of ``tp``::

    w      = η_wq if the precision is weight-only on this device (dequantised in-kernel), else 1
    t_W    = (W_dense/tp / w + W_exp(T)/tp / (w·η_moe)) / (η_mem · BW_s) + W_spill/tp / BW_offload
    t_KV   = KV(r·K + m + T)/shards / (η_mem · BW_s)
    t_GEMM = 2·P_matmul·T / F_s(precision) / (tp · MFU · w)
    t_attn = 2·L·H·(a·q·K + 2·hd·n·(m + n/2)) / F_s(bf16) / (tp · MFU)
             (a = 2·hd; MLA decodes in the absorbed form over its latent: a = 2·kv_dim − rope)
    t_comm = [tp > 1] · 2·L · (α(tp) + 2·(tp−1)/tp · T·hidden·2 B / (link_BW · η_link))
    α(tp)  = α_2 · (1 + g·log2(tp/2))                       (α_2: the device's measured-class latency)
    t_step = max(t_W, t_GEMM) + max(t_KV, t_attn) + t_comm + L·(t_layer + τ) + L_moe·t_route
             + t_step_fixed + (sequences in the step)·t_seq
             (stack: t_layer, t_step_fixed, t_seq; fitted: τ, the per-layer cost beyond the stack's)

One roofline per kernel class: the weight GEMMs and attention are separate kernels run one after the
other, so each is bound by its own bytes or FLOPs and their times add.

``BW_s`` and ``F_s`` are the device's sustained bandwidth and matmul rate: published microbenchmark
figures (STREAM-like triad/copy, maximum achievable matmul FLOPS) where the catalog records them, else a
default share of the datasheet figure (the median of the recorded ones); η_mem and MFU are the shares
of those sustained rates that a serving step reaches.

``r`` is 1, or the GQA group (query heads per KV head) for a stack whose decode attention reads a shared
KV head once per query head (TensorRT-LLM before v0.7). ``shards`` is min(tp, KV heads) (an MLA latent:
1), or tp under attention data parallelism, where every chip also holds the full attention weights.

SRAM machines (Cerebras wafers, Groq chips) are not bandwidth-bound at small batch; the token walks
through the layers and across the chips holding them::

    t_step = L·(τ_layer + W_read(T)/L / B_layer) + (units − 1)·t_hop + t_comp + t_kv

``W_read(T)`` is the weight bytes one step streams: every dense weight, and for MoE the expected share of
routed experts that ``T`` tokens touch, ``1 − (1 − k/E)^T`` (= the active params at T = 1). The input
embedding table is not streamed (one row per token) unless it is tied to the output head.

TTFT adds the stack's per-request cost to the prefill step (a ``first_token_from_decode`` stack: the
prefill of all but the last prompt token, then one decode step). A batch whose KV does not fit runs as many
sequences as fit (:func:`predict` says ``fits: false`` and the effective batch); most serving stacks allocate
KV blocks as sequences grow (paged KV), so that is what fits at the sequences' mean context, while
TensorRT-LLM reserves each request's full length at admission (:func:`running_sequences`).

The constants η_mem, MFU, η_wq, η_moe and τ are fitted (:mod:`voicepipe.hardware.validate`); every
step is first split into raw parts (:class:`StepParts`, seconds at efficiency 1) that :func:`combine`
turns into time, so the fit evaluates thousands of constant sets over all points in one numpy call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from voicepipe.hardware.catalog import (
    PRECISIONS,
    Device,
    ModelSpec,
    Stack,
    check_kv_precision,
    check_precision,
    kv_rereads,
)
from voicepipe.hardware.catalog import stack as catalog_stack

Bound = Literal["memory", "compute", "latency"]
FArray = NDArray[np.float64]


class DoesNotFit(ValueError):
    """The configuration cannot hold the weights it was asked to (at any tensor-parallel width)."""


@dataclass(frozen=True)
class Efficiency:
    """Efficiency factors, one set for every HBM device (η_mem, MFU, η_wq, η_moe fitted; see docs §2)."""

    # fitted on every point of data/validation.yaml (`voicepipe hardware validate`; docs §2 and §3)
    eta_mem: float = 0.83  # share of the sustained (STREAM-like) bandwidth a native decode step streams
    mfu: float = 0.739  # share of the sustained (measured maximum) matmul FLOP/s a serving step reaches
    eta_wq: float = 1.0  # weight-only kernels' efficiency relative to native ones (dequant in the loop)
    eta_moe: float = 0.718  # expert (grouped-GEMM) streaming efficiency relative to dense GEMV + routing
    layer_s: float = 9.3e-6  # per layer per step on HBM devices beyond the stack's own gaps (launch, sync)
    ar_growth: float = 0.5  # all-reduce latency growth per doubling of the TP group beyond 2
    moe_route_s: float = 20e-6  # per MoE layer per step: router, top-k, permute, grouped-GEMM launches
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


def default_kv_precision(precision: str) -> str:
    """KV-cache format when none is given: the precision the model runs at if that is a KV format
    (bf16, fp16, fp8), else bf16 (int8/int4/fp4 weight formats keep a 16-bit cache)."""
    return precision if precision in ("bf16", "fp16", "fp8") else "bf16"


@dataclass(frozen=True)
class System:
    """One serving instance: a model on ``chips`` chips of a device at a precision, under a stack."""

    device: Device
    model: ModelSpec
    precision: str
    chips: int
    eff: Efficiency = field(default=DEFAULT_EFFICIENCY)
    kv_precision: str | None = None  # None: default_kv_precision(precision)
    stack: Stack | None = None  # None: the catalog's default stack
    # attention data parallelism (TensorRT-LLM/SGLang "attention DP" for MLA models): each chip runs the
    # attention of its own 1/chips of the sequences with a full copy of the attention weights
    attention_dp: bool = False

    @property
    def name(self) -> str:
        return f"{self.device.key}/{self.model.key}"

    @property
    def kv(self) -> str:
        return self.kv_precision or default_kv_precision(self.precision)

    @property
    def serving(self) -> Stack:
        return self.stack or catalog_stack()


# ---------------------------------------------------------------- bytes


def bytes_per_param(precision: str) -> float:
    return PRECISIONS[check_precision(precision)]


def kv_bytes_per_token(model: ModelSpec, precision: str) -> float:
    """KV-cache bytes per token (all layers) with KV elements stored at ``precision``."""
    return model.kv_elems_per_token * PRECISIONS[check_kv_precision(precision)]


def weight_bytes(model: ModelSpec, precision: str) -> float:
    """Bytes to hold every weight."""
    return model.total_params * bytes_per_param(precision)


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
    """Attention projection params, all layers: Q and O (heads × head_dim each), K and V (GQA heads, or
    the MLA latent projection, ``hidden × kv_dim``). Low-rank factors of MLA are not counted separately."""
    qo = 2 * model.heads * model.head_dim
    kv = model.kv_dim if model.kv_dim is not None else 2 * model.kv_heads * model.head_dim
    return float(model.layers * model.hidden * (qo + kv))


def weight_split(system: System) -> tuple[float, float]:
    """(weight bytes per chip in HBM, per chip spilled to the offload tier).

    Weights stay in HBM when they fit; a device with an offload tier (SambaNova's DDR) keeps half its
    usable HBM for KV and streams the rest of the weights from that tier.
    """
    dev = system.device
    per_chip = weight_bytes(system.model, system.precision) / system.chips
    if system.attention_dp:  # a full copy of the attention weights on every chip
        per_chip += (
            attention_params(system.model) * bytes_per_param(system.precision) * (1 - 1 / system.chips)
        )
    usable = dev.capacity_bytes * system.eff.usable_memory
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
    return in_hbm < dev.capacity_bytes * system.eff.usable_memory and spilled <= offload


def kv_capacity_tokens(system: System) -> float:
    """KV-cache tokens (summed over sequences) that fit beside the weights (≥ 0).

    The pool is ``usable_memory`` of the whole memory less the weights, or, for a stack that sizes it from
    what the loaded weights leave free (``kv_pool: free``, TensorRT-LLM), ``usable_memory`` of that."""
    dev, m = system.device, system.model
    if dev.kind == "hbm":
        if not weights_fit(system):
            return 0.0
        weights = weight_split(system)[0]
        if system.serving.kv_pool == "free":  # a share of what the weights leave free
            free = (dev.capacity_bytes - weights) * system.eff.usable_memory
        else:  # a share of the whole memory, less the weights
            free = dev.capacity_bytes * system.eff.usable_memory - weights
        per_token = kv_bytes_per_token(m, system.kv) / kv_shards(m, system.chips, system.attention_dp)
    else:
        free = system.chips * dev.capacity_bytes * system.eff.usable_sram - weight_bytes(m, system.precision)
        per_token = kv_bytes_per_token(m, system.kv)
    return max(0.0, free / per_token)


def kept_tokens(system: System, context: ArrayLike) -> ArrayLike:
    """KV tokens (full-token equivalents) one sequence of ``context`` keeps in memory: the window on local
    layers where the stack frees what falls out of it (:attr:`Stack.window_kv`), else every token. The
    kernels read only the window either way (:func:`step_parts`)."""
    if system.device.kind == "hbm" and system.serving.window_kv:
        return system.model.held(context)
    return context


def max_sequences(system: System, context: int) -> int:
    """How many sequences of ``context`` tokens fit beside the weights (≥ 0) (:func:`kept_tokens`)."""
    return max(0, math.floor(kv_capacity_tokens(system) / kept_tokens(system, context)))


def running_sequences(system: System, prompt_tokens: int, output_tokens: int) -> int:
    """How many sequences of ``prompt + output`` tokens a paged-KV server keeps running at once.

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


@dataclass(frozen=True)
class Lockstep:
    """A static batch of ``B`` equal requests started together that outgrows its paged KV cache.

    All ``B`` decode until their context reaches ``c1 = C/B`` (``C``: cache tokens); from then on only
    ``C/c`` fit at context ``c``, and a recompute-preempting stack (vLLM) evicts the rest, so the running
    batch falls to ``C/L`` by the end (``L = P + O``). The evicted sequences rejoin when the survivors
    finish: they re-prefill the ``C·ln(L/c1)`` tokens they had (one evicted at context ``c`` holds ``c``;
    ``C/c²`` are evicted per unit of context) and decode their remaining ``B·L − C − C·ln(L/c1)`` tokens
    over ``L − c1`` tail steps. Output tokens balance: ``B·(c1 − P)`` + ``C·ln(L/c1)`` (phase two, the
    shrinking batch) + the tail = ``B·O``."""

    full_steps: float  # steps with all B running: c1 − P
    shrink_steps: float  # steps while the batch shrinks from B to C/L: L − c1
    shrink_batch: float  # mean running batch over them: C·ln(L/c1) / (L − c1)
    capacity: float  # C: KV tokens held during them
    evicted: float  # sequences evicted: B − C/L
    reprefill_tokens: float  # C·ln(L/c1)
    tail_steps: float  # L − c1
    tail_batch: float  # mean running batch over the tail
    tail_context: float  # their mean context, (c1 + L)/2


def lockstep(capacity_tokens: float, batch: int, prompt_tokens: int, output_tokens: int) -> Lockstep | None:
    """How a static batch started at once outgrows its cache (see :class:`Lockstep`); None when its KV
    at the last token fits, or when not even the prompts plus one token each fit."""
    c, b, length = float(capacity_tokens), float(batch), float(prompt_tokens + output_tokens)
    if b * length <= c or c / b <= prompt_tokens + 1:
        return None
    c1 = c / b
    grown = c * math.log(length / c1)
    steps = length - c1
    tail = b * length - c - grown
    return Lockstep(
        full_steps=c1 - prompt_tokens,
        shrink_steps=steps,
        shrink_batch=grown / steps,
        capacity=c,
        evicted=b - c / length,
        reprefill_tokens=grown,
        tail_steps=steps,
        tail_batch=tail / steps,
        tail_context=(c1 + length) / 2.0,
    )


def sram_units(
    device: Device, model: ModelSpec, precision: str, seqs: int, context: int, eff: Efficiency, kv: str
) -> int:
    """Chips/wafers an SRAM machine needs to hold the weights plus ``seqs`` KV caches of ``context``."""
    need = weight_bytes(model, precision) + seqs * context * kv_bytes_per_token(model, kv)  # every token kept
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
) -> System:
    """Size a system that holds the weights and ``seqs`` sequences of ``context`` tokens.

    HBM: the smallest power-of-two TP width (≤ ``max_tp``) that holds them, or the given ``tp``. When no
    width holds ``seqs`` sequences, ``strict`` raises :class:`DoesNotFit`; otherwise the widest width
    whose weights fit is returned (the server will run as many sequences as fit). Weights that fit at no
    width always raise. SRAM: the chips/wafers follow from capacity (``tp`` is not accepted).
    """
    prec = check_precision(precision or model.default_precision)
    kv = check_kv_precision(kv_precision) if kv_precision else None

    def build(width: int) -> System:
        return System(device, model, prec, width, eff, kv, stack)

    if device.kind == "sram":
        if tp is not None:
            raise ValueError(f"tp does not apply to {device.key}: its chip count follows from SRAM capacity")
        probe = build(1)
        return build(sram_units(device, model, prec, seqs, context, eff, probe.kv))
    if tp is not None:
        if tp < 1 or tp > device.max_tp:
            raise ValueError(f"tp {tp} out of range for {device.key} (1..{device.max_tp})")
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
    need = weight_bytes(m, system.precision) + seqs * kept_tokens(system, context) * kv_bytes_per_token(
        m, system.kv
    )
    have = system.chips * dev.capacity_bytes * system.eff.usable_memory
    hint = "" if system.precision in ("int4", "fp4") else "; try a smaller --precision"
    return (
        f"does not fit: {m.key} at {system.precision} needs {need / 1e9:.0f} GB (weights + {seqs} x {context}-token KV) "
        f"but {system.chips} x {dev.key} hold {have / 1e9:.0f} GB usable{hint}"
    )


# ---------------------------------------------------------------- time


@dataclass(frozen=True)
class StepParts:
    """One step's raw costs in seconds at efficiency 1; :func:`combine` applies the efficiencies."""

    kv_s: FArray  # KV bytes per chip / BW
    dense_s: FArray  # dense weight bytes per chip / BW
    expert_s: FArray  # routed-expert weight bytes per chip / BW
    spill_s: FArray  # weights streamed from the offload tier (at its full bandwidth)
    flops_s: FArray  # weight-matmul FLOPs per chip / sustained rate at the precision
    attn_s: FArray  # attention (scores, values) FLOPs per chip / sustained 16-bit rate
    comm_s: FArray  # all-reduces (latency + bandwidth), set constants
    fixed_s: FArray  # stack per-step and per-layer costs (SRAM: per-layer time, sweep)
    layers: FArray  # layers whose fitted per-layer cost τ applies (HBM: all; SRAM: none)
    weight_only: bool | NDArray[np.bool_]
    sram: bool | NDArray[np.bool_]


@dataclass(frozen=True)
class StepTime:
    """One engine step's time and its parts (seconds; arrays broadcast over the inputs)."""

    memory_s: FArray
    compute_s: FArray
    comm_s: FArray
    overhead_s: FArray
    total_s: FArray

    def bound(self) -> NDArray[np.str_]:
        """Largest term: 'memory', 'compute', or 'latency' (fixed overheads, hops, collectives)."""
        fixed = self.comm_s + self.overhead_s
        return np.where(
            (self.memory_s >= self.compute_s) & (self.memory_s >= fixed),
            "memory",
            np.where(self.compute_s >= fixed, "compute", "latency"),
        )


def allreduce_latency_s(device: Device, tp: int, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Small-message all-reduce latency of a ``tp``-wide group: α_2 · (1 + g · log2(tp / 2)); 0 at tp 1."""
    if tp <= 1:
        return 0.0
    return float(device.allreduce_us or 0.0) * 1e-6 * (1.0 + eff.ar_growth * math.log2(tp / 2.0))


def allreduces_per_step(model: ModelSpec, tp: int) -> int:
    """Tensor parallelism all-reduces twice per layer (attention out, MLP out); none at tp 1."""
    return 2 * model.layers if tp > 1 else 0


def held_total(model: ModelSpec, tokens: ArrayLike, seqs: ArrayLike) -> FArray:
    """Full-token equivalent of ``tokens`` of cache spread over ``seqs`` sequences, each at their mean
    context (:meth:`ModelSpec.held`); the tokens themselves without local attention."""
    t = np.asarray(tokens, dtype=float)
    if model.window is None:
        return t
    return t - model.local_layers / model.layers * np.maximum(
        t - np.asarray(seqs, dtype=float) * model.window, 0.0
    )


def step_parts(
    system: System,
    decode_seqs: ArrayLike,
    kv_tokens: ArrayLike,
    *,
    tokens_per_seq: ArrayLike = 1,
    prefill_tokens: ArrayLike = 0,
    prefill_cached: ArrayLike = 0,
    prefill_seqs: ArrayLike = 1,
) -> StepParts:
    """Raw costs of one engine step (see the module docstring for the formulas).

    ``prefill_tokens`` may be ``prefill_seqs`` prompts of equal length (a batch arriving at once):
    attention then costs each prompt its own ``(n/s)²/2``."""
    dev, m, eff = system.device, system.model, system.eff
    d = np.asarray(decode_seqs, dtype=float)
    kv = np.asarray(kv_tokens, dtype=float)
    q = np.asarray(tokens_per_seq, dtype=float)
    n = np.asarray(prefill_tokens, dtype=float)
    c = np.asarray(prefill_cached, dtype=float)
    ps = np.maximum(np.asarray(prefill_seqs, dtype=float), 1.0)
    tokens = d * q + n
    zero = 0.0 * (tokens + kv + c)
    bpp = bytes_per_param(system.precision)
    kvb = kv_bytes_per_token(m, system.kv)
    dense_p, expert_p = _read_split(m, tokens)
    linear = 2.0 * matmul_params(m) * tokens
    # local attention: the decoders' cache at their mean context, the prompt's cached prefix, and the
    # span a new prompt token attends to, each capped at the window on the local layers
    cached = c
    if m.window is not None:
        kv, cached = held_total(m, kv, d), held_total(m, c, ps)
    attention = (
        2.0
        * m.layers
        * m.heads
        * (decode_attention_width(m) * q * kv + 2.0 * m.head_dim * n * m.held(c + n / (2.0 * ps)))
    )
    stk = system.serving
    # a decode kernel that does not share a GQA group's KV head reads it once per query head
    reread = kv_rereads(stk, m.gqa_group)
    kv_bytes = (reread * kv + np.where(n > 0, cached, 0.0) + tokens) * kvb
    # tensor parallelism splits every step's work over the chips; a pipeline (llama.cpp's layer split)
    # runs the chips in turn, so a step costs one chip's time for all the work plus the hops between
    pipeline = dev.kind == "hbm" and stk.multi_chip == "pipeline" and system.chips > 1
    par = 1 if pipeline else system.chips
    # weights' matmuls run at the precision's rate; attention (scores, values) in 16-bit math
    # sustained (microbenchmarked) matmul rates; MFU is the share of them a serving step reaches
    flops_s = linear / dev.matmul_flops(system.precision) / par + zero
    attn_s = attention / dev.matmul_flops("bf16") / par + zero
    if dev.kind == "hbm":
        bw = dev.stream_bytes_s  # sustained (microbenchmarked) bandwidth; η_mem is the kernels' share of it
        tp = system.chips
        link = float(dev.link_gbs or 0) * 1e9 * eff.link_eff
        in_hbm, spilled = weight_split(system)
        hbm_share = in_hbm / (in_hbm + spilled)
        comm = zero
        if pipeline:  # one activation hand-off per chip boundary
            comm = (tp - 1) * (float(dev.allreduce_us or 0.0) * 1e-6 + tokens * m.hidden * 2.0 / link) + zero
        elif tp > 1:
            ring = 2.0 * (tp - 1) / tp * tokens * m.hidden * 2.0 / link
            comm = allreduces_per_step(m, tp) * (allreduce_latency_s(dev, tp, eff) + ring) + zero
        offload_bw = float(dev.offload_bw_tbs or 1.0) * 1e12
        # attention DP: every chip streams the whole attention weights, not a 1/tp slice of them
        replicated = attention_params(m) * (1.0 - 1.0 / par) if system.attention_dp else 0.0
        weights_s = ((dense_p + expert_p) / par + replicated) * bpp
        return StepParts(
            kv_s=kv_bytes / (1 if pipeline else kv_shards(m, tp, system.attention_dp)) / bw + zero,
            dense_s=(dense_p / par + replicated) * bpp * hbm_share / bw + zero,
            expert_s=expert_p * bpp / par * hbm_share / bw + zero,
            spill_s=weights_s * (1.0 - hbm_share) / offload_bw + zero,
            flops_s=flops_s,
            attn_s=attn_s,
            comm_s=comm,
            fixed_s=zero
            + m.layers * (stk.layer_overhead_us + np.where(n > 0, stk.prefill_layer_overhead_us, 0.0)) * 1e-6
            + m.routed_layers * eff.moe_route_s
            + stk.step_overhead_us * 1e-6
            # host work per running sequence (schedule, prepare inputs, sample, detokenise)
            + (d + np.where(n > 0, ps, 0.0)) * stk.seq_overhead_us * 1e-6,
            layers=zero + m.layers,
            weight_only=dev.weight_only(system.precision),
            sram=False,
        )
    layer_bw = float(dev.layer_bw_tbs or 0) * 1e12
    sweep = (dense_p + expert_p) * bpp / layer_bw if layer_bw > 0 else zero
    return StepParts(
        kv_s=kv_bytes / (system.chips * float(dev.sram_bw_tbs or 0) * 1e12) + zero,
        dense_s=zero,
        expert_s=zero,
        spill_s=zero,
        flops_s=flops_s,
        attn_s=attn_s,
        comm_s=zero + (system.chips - 1) * float(dev.hop_us or 0) * 1e-6,
        fixed_s=zero + m.layers * float(dev.layer_us or 0) * 1e-6 + sweep,
        layers=zero,
        weight_only=False,
        sram=True,
    )


def rank_local_prefill_parts(system: System, prompt_tokens: float) -> StepParts:
    """Under attention data parallelism, the work of one prompt's prefill that stays on the chip that
    owns the sequence: the non-expert matmuls (attention projections, dense layers, shared experts, head)
    and its attention, at that chip's rate (not split over the group). The routed experts run
    expert-parallel over the whole group and are not counted. Weight bytes are not counted either (the
    step that carries the prompt streams them anyway), so only the compute terms are set."""
    dev, m = system.device, system.model
    n = float(prompt_tokens)
    _, experts = _expert_split(m)
    local = matmul_params(m) - experts * (m.experts_active / m.experts if m.is_moe else 0.0)
    attention = 2.0 * m.layers * m.heads * 2.0 * m.head_dim * n * m.held(n / 2.0)
    zero = np.zeros(())
    return StepParts(
        kv_s=zero,
        dense_s=zero,
        expert_s=zero,
        spill_s=zero,
        flops_s=zero + 2.0 * local * n / dev.matmul_flops(system.precision),
        attn_s=zero + attention / dev.matmul_flops("bf16"),
        comm_s=zero,
        fixed_s=zero,
        layers=zero,
        weight_only=dev.weight_only(system.precision),
        sram=False,
    )


def combine(
    parts: StepParts,
    eta_mem: ArrayLike,
    mfu: ArrayLike,
    eta_wq: ArrayLike,
    eta_moe: ArrayLike,
    layer_s: ArrayLike = 0.0,
) -> tuple[FArray, FArray, FArray]:
    """(memory, compute, total) seconds from raw parts and efficiencies (arrays broadcast: the fit
    passes a column of candidate constants against a row of points)."""
    w = np.where(parts.weight_only, np.asarray(eta_wq, dtype=float), 1.0)
    eta = np.asarray(eta_mem, dtype=float)
    u = np.asarray(mfu, dtype=float)
    weights = (parts.dense_s / w + parts.expert_s / (w * np.asarray(eta_moe))) / eta + parts.spill_s
    cache = parts.kv_s / eta
    matmul = parts.flops_s / (u * w)  # weight-only kernels dequantise inside the GEMM
    attention = parts.attn_s / u  # attention math is 16-bit whatever the weight format
    memory, compute = weights + cache, matmul + attention
    # HBM: one roofline per kernel class, run one after the other on the stream: the weight GEMMs
    # (weight bytes vs matmul FLOPs) and attention (KV bytes vs attention FLOPs) do not overlap.
    # SRAM: the token walks layers, so its parts add up.
    busy = np.where(parts.sram, memory + compute, np.maximum(weights, matmul) + np.maximum(cache, attention))
    return (
        memory,
        compute,
        busy + parts.comm_s + parts.fixed_s + parts.layers * np.asarray(layer_s, dtype=float),
    )


def step_time(
    system: System,
    decode_seqs: ArrayLike,
    kv_tokens: ArrayLike,
    *,
    tokens_per_seq: ArrayLike = 1,
    prefill_tokens: ArrayLike = 0,
    prefill_cached: ArrayLike = 0,
) -> StepTime:
    """Time of one engine step (see the module docstring for the formulas)."""
    parts = step_parts(
        system,
        decode_seqs,
        kv_tokens,
        tokens_per_seq=tokens_per_seq,
        prefill_tokens=prefill_tokens,
        prefill_cached=prefill_cached,
    )
    e = system.eff
    memory, compute, total = combine(parts, e.eta_mem, e.mfu, e.eta_wq, e.eta_moe, e.layer_s)
    return StepTime(memory, compute, parts.comm_s, parts.fixed_s + parts.layers * e.layer_s, total)


def mixed_step_s(
    system: System,
    decode_seqs: ArrayLike,
    kv_tokens: ArrayLike,
    *,
    prefill_tokens: ArrayLike = 0,
    prefill_cached: ArrayLike = 0,
    spec: Speculative | None = None,
) -> FArray:
    """Seconds for one continuous-batching step: ``decode_seqs`` decode while ``prefill_tokens`` prefill.

    With speculative decoding the decoders first run γ draft steps costing ``c`` target steps each, then
    the target verifies γ + 1 tokens per sequence: ``γ·c·t(d, q=1) + t(d, q=γ+1, n)``.
    """
    d = np.asarray(decode_seqs, dtype=float)
    if spec is None:
        return step_time(
            system, d, kv_tokens, prefill_tokens=prefill_tokens, prefill_cached=prefill_cached
        ).total_s
    verify = step_time(
        system,
        d,
        kv_tokens,
        tokens_per_seq=spec.gamma + 1,
        prefill_tokens=prefill_tokens,
        prefill_cached=prefill_cached,
    ).total_s
    draft = spec.gamma * spec.draft_cost * step_time(system, d, kv_tokens).total_s
    return verify + np.where(d > 0, draft, 0.0)


def tokens_per_step(spec: Speculative | None) -> float:
    return 1.0 if spec is None else float(expected_tokens_per_step(spec.alpha, spec.gamma))


def prefill_s(system: System, prompt_tokens: ArrayLike, cached_tokens: ArrayLike = 0) -> FArray:
    """TTFT on an idle device: the stack's per-request cost plus one forward pass over the uncached
    prompt (≥ 1 token; it streams every weight even for a short prompt) that emits token 0 — or, for a
    stack whose first token comes from a decode step (``first_token_from_decode``), a pass over all but
    the prompt's last token and then one decode step."""
    p = np.asarray(prompt_tokens, dtype=float)
    c = np.minimum(np.asarray(cached_tokens, dtype=float), np.maximum(p - 1.0, 0.0))
    if system.device.kind == "hbm" and system.serving.first_token_from_decode:
        # the prefill pass leaves the prompt's last token to the first decode step, which emits token 0
        n = p - c - 1.0
        step = np.where(
            n > 0, mixed_step_s(system, 0, 0, prefill_tokens=np.maximum(n, 1.0), prefill_cached=c), 0.0
        )
        step = step + mixed_step_s(system, 1, p)
    else:
        step = mixed_step_s(system, 0, 0, prefill_tokens=np.maximum(p - c, 1.0), prefill_cached=c)
    return step + request_overhead_s(system)


def request_overhead_s(system: System) -> float:
    """Per-request fixed cost on TTFT (HBM devices: the serving stack's; SRAM: in the fitted layer time)."""
    return 0.0 if system.device.kind == "sram" else system.serving.request_overhead_ms * 1e-3


def decode_step_s(
    system: System, batch: ArrayLike, context: ArrayLike, spec: Speculative | None = None
) -> FArray:
    """Seconds per decode step for ``batch`` sequences of mean ``context`` tokens each."""
    b = np.asarray(batch, dtype=float)
    return mixed_step_s(system, b, b * np.asarray(context, dtype=float), spec=spec)


def tpot_s(system: System, batch: ArrayLike, context: ArrayLike, spec: Speculative | None = None) -> FArray:
    """Seconds per output token for one of ``batch`` sequences: step / E[tokens per step]."""
    return decode_step_s(system, batch, context, spec) / tokens_per_step(spec)


def mean_context(prompt_tokens: int, output_tokens: int) -> float:
    """Context a request's decode attends to on average: prompt + half its output."""
    return prompt_tokens + output_tokens / 2.0


# ---------------------------------------------------------------- one-shot prediction


@dataclass(frozen=True)
class Prediction:
    hardware: str
    model: str
    precision: str
    kv_precision: str
    stack: str
    chips: int
    batch: int
    effective_batch: int
    prompt_tokens: int
    output_tokens: int
    fits: bool
    step_ms: float
    tokens_per_second: float
    aggregate_tokens_per_second: float
    ttft_ms: float
    bound: str
    weights_gb: float
    kv_gb: float
    capacity_gb: float
    max_batch_fits: int
    memory_ms: float
    compute_ms: float
    comm_ms: float
    overhead_ms: float
    note: str

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def predict(
    device: Device,
    model: ModelSpec,
    *,
    precision: str | None = None,
    batch: int = 1,
    prompt_tokens: int = 1024,
    output_tokens: int = 256,
    tp: int | None = None,
    spec: Speculative | None = None,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    kv_precision: str | None = None,
    stack: Stack | None = None,
) -> Prediction:
    """Idle-device timing of one request among ``batch`` identical ones.

    The chip count is the smallest TP width holding the weights and one sequence (or ``tp``), whatever
    the batch, so ``predict`` and ``sweep`` agree. A batch whose KV does not fit runs as many sequences
    as fit and queues the rest: ``fits`` is False, ``effective_batch`` is what runs, and the timings are
    for it. Raises DoesNotFit only when the weights (plus one sequence) fit at no width.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    ctx_max = prompt_tokens + output_tokens
    system = make_system(
        device, model, precision, tp=tp, seqs=batch if device.kind == "sram" else 1, context=ctx_max,
        eff=eff, kv_precision=kv_precision, stack=stack,
    )  # fmt: skip
    room = running_sequences(system, prompt_tokens, output_tokens)
    run = batch if device.kind == "sram" else min(batch, room)
    ctx = mean_context(prompt_tokens, output_tokens)
    note = ""
    if run < batch:
        held = (
            f"reserved at their full {ctx_max} tokens"
            if system.serving.kv_admission == "reserve"
            else f"at their mean context of {ctx:.0f} tokens"
        )
        note = f"KV for {batch} sequences {held} exceeds memory: the server runs {run} at a time and queues the rest"
    st = step_time(system, run, run * ctx)
    step = float(decode_step_s(system, run, ctx, spec))
    per_user = tokens_per_step(spec) / step
    cap = system.chips * device.capacity_bytes
    return Prediction(
        hardware=device.key,
        model=model.key,
        precision=system.precision,
        kv_precision=system.kv,
        stack=system.serving.key if device.kind == "hbm" else "vendor (SRAM, fitted)",
        chips=system.chips,
        batch=batch,
        effective_batch=run,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        fits=run == batch,
        step_ms=step * 1e3,
        tokens_per_second=per_user,
        aggregate_tokens_per_second=per_user * run,
        ttft_ms=float(prefill_s(system, prompt_tokens)) * 1e3,
        bound=str(st.bound()),
        weights_gb=weight_bytes(model, system.precision) / 1e9,
        kv_gb=batch * kept_tokens(system, ctx_max) * kv_bytes_per_token(model, system.kv) / 1e9,
        capacity_gb=cap / 1e9,
        max_batch_fits=room,
        memory_ms=float(st.memory_s) * 1e3,
        compute_ms=float(st.compute_s) * 1e3,
        comm_ms=float(st.comm_s) * 1e3,
        overhead_ms=float(st.overhead_s) * 1e3,
        note=note,
    )


def ridge_point(device: Device, precision: str = "bf16") -> float:
    """Arithmetic intensity (FLOP/byte) where compute time equals memory time: peak / bandwidth."""
    return device.peak_flops(precision) / (float(device.mem_bw_tbs or 0) * 1e12)


def sustained_ridge_point(device: Device, precision: str = "bf16") -> float:
    """The ridge point the step model uses: sustained matmul FLOP/s over sustained bandwidth (before
    the fitted MFU and η_mem)."""
    return device.matmul_flops(precision) / device.stream_bytes_s
