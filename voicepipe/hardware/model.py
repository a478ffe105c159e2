"""Analytic LLM inference timing: pure functions, no I/O, vectorisable over batch and context.

Notation (per step of the serving engine): ``d`` sequences decode, each emitting ``q`` tokens (``q = 1``,
or ``γ + 1`` when a speculative step verifies ``γ`` drafts); ``K`` = KV tokens those sequences attend to
(sum of their contexts); ``n`` prompt tokens are prefilled in the same step on top of ``m`` cached prefix
tokens. ``T = d·q + n`` tokens go through the weights.

HBM devices (GPUs, TPUs), per chip of a tensor-parallel group of ``tp``::

    t_mem  = (W_read(T)/tp + (K + m + T)·kv_bytes/shards) / (η_mem · BW)
    t_comp = (2·P_matmul·T + 4·L·H·hd·(q·K + n·(m + n/2))) / (tp · peak · MFU)
    t_comm = [tp > 1] · 2·L · (α_ar + 2·(tp−1)/tp · T·hidden·2 B / link_bw)
    t_step = max(t_mem, t_comp) + t_comm + L·t_layer + t_sched

SRAM machines (Cerebras wafers, Groq chips) are not bandwidth-bound at small batch; the token walks
through the layers and across the chips holding them::

    t_step = L·(τ_layer + W_read(T)/L / B_layer) + (units − 1)·t_hop + t_comp + t_kv

``W_read(T)`` is the weight bytes one step streams: every dense weight, and for MoE the expected share of
routed experts that ``T`` tokens touch, ``1 − (1 − k/E)^T`` (= the active params at T = 1). The input
embedding table is not streamed (one row per token) unless it is tied to the output head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from voicepipe.hardware.catalog import PRECISIONS, Device, ModelSpec, check_precision

Bound = Literal["memory", "compute", "latency"]
FArray = NDArray[np.float64]


class DoesNotFit(ValueError):
    """The configuration cannot hold the weights (and KV cache) it was asked to."""


@dataclass(frozen=True)
class Efficiency:
    """Software/hardware efficiency factors, one set for every HBM device (fitted, see docs)."""

    eta_mem: float = 0.80  # share of HBM bandwidth a decode step streams (published 0.72-0.92)
    mfu: float = 0.60  # share of dense peak FLOP/s in matmul-heavy work (published 0.3-0.7)
    layer_overhead_s: float = 5e-6  # per layer per step: kernel gaps, norms, rotary (CUDA-graphed)
    step_overhead_s: float = 1.0e-3  # per step: scheduler, sampling, detokenisation (serving stack)
    allreduce_latency_s: float = 6e-6  # one small-message all-reduce on NVLink/ICI (2 per layer at tp>1)
    usable_memory: float = 0.90  # share of HBM for weights + KV (rest: activations, runtime, fragments)
    usable_sram: float = 1.0  # SRAM machines map weights and KV directly


DEFAULT_EFFICIENCY = Efficiency()
KERNEL_ONLY = replace(DEFAULT_EFFICIENCY, step_overhead_s=0.0)  # a bare decode loop without a server


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


@dataclass(frozen=True)
class System:
    """One serving instance: a model on ``chips`` chips of a device at a precision."""

    device: Device
    model: ModelSpec
    precision: str
    chips: int
    eff: Efficiency = field(default=DEFAULT_EFFICIENCY)

    @property
    def name(self) -> str:
        return f"{self.device.key}/{self.model.key}"


# ---------------------------------------------------------------- bytes


def bytes_per_param(precision: str) -> float:
    return PRECISIONS[check_precision(precision)]


def kv_bytes_per_token(model: ModelSpec, precision: str) -> float:
    """KV-cache bytes per token (all layers): fp8 caches in 1 byte, everything else in 16 bits."""
    return model.kv_elems_per_token * (1.0 if precision == "fp8" else 2.0)


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


def weight_read_params(model: ModelSpec, tokens: ArrayLike) -> FArray:
    """Params one forward step over ``tokens`` tokens streams: dense + touched experts − embedding."""
    t = np.maximum(np.asarray(tokens, dtype=float), 1.0)
    dense, experts = _expert_split(model)
    touched = 1.0 - (1.0 - model.experts_active / model.experts) ** t if model.is_moe else 0.0
    not_streamed = 0.0 if model.tied_embeddings else model.embed_params
    return dense + experts * touched - not_streamed


def matmul_params(model: ModelSpec) -> float:
    """Params each token multiplies through (active, minus the untied input embedding lookup)."""
    return model.active_params - (0.0 if model.tied_embeddings else model.embed_params)


# ---------------------------------------------------------------- capacity


def kv_shards(model: ModelSpec, chips: int) -> int:
    """How many ways the KV cache splits across a TP group (KV heads can't split further; MLA: none)."""
    return 1 if model.kv_dim is not None else max(1, min(chips, model.kv_heads))


def max_sequences(system: System, context: int) -> int:
    """How many sequences of ``context`` tokens fit beside the weights (≥ 0)."""
    dev, m = system.device, system.model
    if dev.kind == "hbm":
        free = (
            dev.capacity_bytes * system.eff.usable_memory - weight_bytes(m, system.precision) / system.chips
        )
        per_seq = context * kv_bytes_per_token(m, system.precision) / kv_shards(m, system.chips)
    else:
        free = system.chips * dev.capacity_bytes * system.eff.usable_sram - weight_bytes(m, system.precision)
        per_seq = context * kv_bytes_per_token(m, system.precision)
    return max(0, math.floor(free / per_seq)) if free > 0 else 0


def sram_units(
    device: Device, model: ModelSpec, precision: str, seqs: int, context: int, eff: Efficiency
) -> int:
    """Chips/wafers an SRAM machine needs to hold the weights plus ``seqs`` KV caches of ``context``."""
    need = weight_bytes(model, precision) + seqs * context * kv_bytes_per_token(model, precision)
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
) -> System:
    """Size a system that holds the weights and ``seqs`` sequences of ``context`` tokens, or raise.

    HBM: the smallest power-of-two TP width (≤ ``max_tp``) that fits, or the given ``tp`` (checked).
    SRAM: the number of chips/wafers is derived from SRAM capacity (``tp`` is not accepted).
    """
    prec = check_precision(precision or model.default_precision)
    if device.kind == "sram":
        if tp is not None:
            raise ValueError(f"tp does not apply to {device.key}: its chip count follows from SRAM capacity")
        return System(device, model, prec, sram_units(device, model, prec, seqs, context, eff), eff)
    if tp is not None:
        if tp < 1 or tp > device.max_tp:
            raise ValueError(f"tp {tp} out of range for {device.key} (1..{device.max_tp})")
        system = System(device, model, prec, tp, eff)
        if max_sequences(system, context) < seqs:
            raise DoesNotFit(_no_fit(system, seqs, context))
        return system
    for width in tp_options(device):
        system = System(device, model, prec, width, eff)
        if max_sequences(system, context) >= seqs:
            return system
    raise DoesNotFit(_no_fit(System(device, model, prec, device.max_tp, eff), seqs, context))


def _no_fit(system: System, seqs: int, context: int) -> str:
    dev, m = system.device, system.model
    need = weight_bytes(m, system.precision) + seqs * context * kv_bytes_per_token(m, system.precision)
    have = system.chips * dev.capacity_bytes * system.eff.usable_memory
    hint = "" if system.precision in ("int4",) else "; try a smaller --precision"
    return (
        f"does not fit: {m.key} at {system.precision} needs {need / 1e9:.0f} GB for weights + "
        f"{seqs} x {context}-token KV, {system.chips} x {dev.key} hold {have / 1e9:.0f} GB usable{hint}"
    )


# ---------------------------------------------------------------- time


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
    dev, m, eff = system.device, system.model, system.eff
    d = np.asarray(decode_seqs, dtype=float)
    kv = np.asarray(kv_tokens, dtype=float)
    q = np.asarray(tokens_per_seq, dtype=float)
    n = np.asarray(prefill_tokens, dtype=float)
    c = np.asarray(prefill_cached, dtype=float)
    tokens = d * q + n
    bpp = bytes_per_param(system.precision)
    kvb = kv_bytes_per_token(m, system.precision)
    w_read = weight_read_params(m, tokens) * bpp
    attn_dim = m.heads * m.head_dim
    flops = 2.0 * matmul_params(m) * tokens + 4.0 * m.layers * attn_dim * (q * kv + n * (c + n / 2.0))
    peak = dev.peak_flops(system.precision) * eff.mfu * system.chips
    compute = flops / peak
    kv_bytes = (kv + np.where(n > 0, c, 0.0) + tokens) * kvb
    zero = np.zeros_like(compute)
    if dev.kind == "hbm":
        bw = eff.eta_mem * float(dev.mem_bw_tbs or 0) * 1e12
        memory = (w_read / system.chips + kv_bytes / kv_shards(m, system.chips)) / bw
        tp = system.chips
        if tp > 1:
            ring = 2.0 * (tp - 1) / tp * tokens * m.hidden * 2.0 / (float(dev.link_gbs or 0) * 1e9)
            comm = 2.0 * m.layers * (eff.allreduce_latency_s + ring)
        else:
            comm = zero
        overhead = zero + m.layers * eff.layer_overhead_s + eff.step_overhead_s
        total = np.maximum(memory, compute) + comm + overhead
    else:
        layer_bw = float(dev.layer_bw_tbs or 0) * 1e12
        sweep = w_read / layer_bw if layer_bw > 0 else zero
        memory = kv_bytes / (system.chips * float(dev.sram_bw_tbs or 0) * 1e12 * eff.eta_mem)
        overhead = zero + m.layers * float(dev.layer_us or 0) * 1e-6 + sweep
        comm = zero + (system.chips - 1) * float(dev.hop_us or 0) * 1e-6
        total = overhead + comm + compute + memory
    return StepTime(memory + zero, compute, comm + zero, overhead, total)


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
    """TTFT on an idle device: one forward pass over the uncached prompt (≥ 1 token) emits token 0."""
    p = np.asarray(prompt_tokens, dtype=float)
    c = np.minimum(np.asarray(cached_tokens, dtype=float), np.maximum(p - 1.0, 0.0))
    return mixed_step_s(system, 0, 0, prefill_tokens=np.maximum(p - c, 1.0), prefill_cached=c)


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
    chips: int
    batch: int
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
) -> Prediction:
    """Idle-device timing of one request among ``batch`` identical ones (raises DoesNotFit)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    ctx_max = prompt_tokens + output_tokens
    system = make_system(device, model, precision, tp=tp, seqs=batch, context=ctx_max, eff=eff)
    ctx = mean_context(prompt_tokens, output_tokens)
    st = step_time(system, batch, batch * ctx)
    step = float(decode_step_s(system, batch, ctx, spec))
    per_user = tokens_per_step(spec) / step
    cap = system.chips * device.capacity_bytes
    return Prediction(
        hardware=device.key,
        model=model.key,
        precision=system.precision,
        chips=system.chips,
        batch=batch,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        fits=True,
        step_ms=step * 1e3,
        tokens_per_second=per_user,
        aggregate_tokens_per_second=per_user * batch,
        ttft_ms=float(prefill_s(system, prompt_tokens)) * 1e3,
        bound=str(st.bound()),
        weights_gb=weight_bytes(model, system.precision) / 1e9,
        kv_gb=batch * ctx_max * kv_bytes_per_token(model, system.precision) / 1e9,
        capacity_gb=cap / 1e9,
        max_batch_fits=max_sequences(system, ctx_max),
        memory_ms=float(st.memory_s) * 1e3,
        compute_ms=float(st.compute_s) * 1e3,
        comm_ms=float(st.comm_s) * 1e3,
        overhead_ms=float(st.overhead_s) * 1e3,
    )


def ridge_point(device: Device, precision: str = "bf16") -> float:
    """Arithmetic intensity (FLOP/byte) where compute time equals memory time: peak / bandwidth."""
    return device.peak_flops(precision) / (float(device.mem_bw_tbs or 0) * 1e12)
