"""Analytic LLM inference timing: pure functions, no I/O, vectorisable over batch and context.

This module states the formulas and re-exports the modules that compute them:
:mod:`voicepipe.hardware.system` (efficiencies, the serving instance, byte and FLOP counts),
:mod:`voicepipe.hardware.sizing` (what fits: the engine's reserve, KV capacity, running sequences, the chip
count), :mod:`voicepipe.hardware.step` (one step's time), :mod:`voicepipe.hardware.collective` (the
all-reduce each stack runs) and :mod:`voicepipe.hardware.blockfp8` (block-scaled FP8 GEMM tiles).

Notation (per step of the serving engine): ``d`` sequences decode, each emitting ``q`` tokens (``q = 1``,
or ``γ + 1`` when a speculative step verifies ``γ`` drafts); ``K`` = KV tokens those sequences attend to
(sum of their contexts); ``n`` prompt tokens of ``s`` prompts (or chunks of prompts) are prefilled in the
same step on top of ``m`` tokens of context before them (cached prefixes, earlier chunks), each new token
attending on average to ``c̄ = Σ nᵢ·(mᵢ + nᵢ/2) / n``. ``T = d·q + n`` tokens go through the weights.

HBM devices (GPUs, TPUs), per chip of a tensor-parallel group of ``tp``::

    w, w_e = η_wq if the dense weights' (the routed experts') precision is weight-only on this device
             (dequantised in-kernel), else 1; the dense weights are at the checkpoint's own format where
             it keeps them apart from the experts (System.dense_format: gpt-oss's bf16 beside MXFP4);
             W_dense counts the output head's vocab·hidden at System.head_format (16-bit in a quantised
             run unless the stack quantises it: Stack.quantized_head, quantized_head_floor)
    t_W    = (W_dense/tp / w + W_exp(T)/tp / (w_e·η_moe)) / (η_mem · BW_s) + W_spill/tp / BW_offload
    t_KV   = KV(r·K/e_kv + m + T)/shards / (η_mem · BW_s)     (e_kv: the build's decode_kv_eff, else 1)
    t_GEMM = 2·T·(P_dense / (F_s(p_dense)·w·MFU) + P_exp / (F_s(precision)·w_e·min(MFU, s_moe))) / tp
             (s_moe: the share of F_s the routed experts' grouped GEMMs reach, Efficiency.moe_gemm_share)
             (P_dense less the head's vocab·hidden, which runs for the sampled rows only, d·q + s of
              them, at F_s of System.head_format: 16-bit beside quantised weights unless the stack
              quantises it)
    t_attn = 2·L·H·(a·q·K + p·n·c̄) / F_s(bf16) / (tp · MFU)
             (a, p = 2·hd; MLA decodes in the absorbed form over its latent, a = 2·kv_dim − rope, and
              prefills per head with its rotary key, p = 2·hd + rope)
    t_comm = [tp > 1] · 2·L · t_AR(T·hidden·2 B)            (the collective the stack runs for that size:
             its custom one-shot / two-shot kernel at α_c(tp), or NCCL at α(tp); voicepipe.hardware.collective)
    α(tp)  = α_2 · (1 + g·log2(tp/2))                       (α_2: the device's measured-class NCCL latency)
    t_gpu  = max(t_W, t_GEMM) + max(t_KV, t_attn) + t_comm + L·(t_layer + [eager]·t_eager) + L·(ops/10)·τ
             + L_moe·t_route   (t_route,block for block-scaled FP8 experts; ops: ModelSpec.layer_ops)
             + x(T)·t_W,dense + t_tile
             (x(T): the build's extra 16-bit dense GEMM time at M = T tokens, small_m_gemm_extra; t_tile: a
              block-scaled FP8 checkpoint's GEMMs with fewer output tiles than SMs, voicepipe.hardware.blockfp8)
    t_host = (t_step_fixed + (sequences in the step)·t_seq) / N       (between forwards)
    t_lch  = L·h_layer where the step runs piecewise CUDA graphs (and not eager), else 0   (launching)
    t_step = t_host + max(t_gpu, t_lch), or with async scheduling max(t_gpu, t_lch + t_host)
    t_step ← max(t_step, d·c_chunk) where a client streams the tokens over HTTP (System.ttft_timing
             "client"): the API process sends one chunk per decoder per step beside the engine
             (stack: t_layer, t_eager, t_step_fixed, t_seq, h_layer, cudagraph_mode, async_scheduling,
              c_chunk = stream_chunk_us; fitted: τ, the cost of ten operations of a layer beyond the stack's)
             [eager]: the step prefills (graphs are captured for decode only), or System.eager (no graphs)
             N: System.scheduler_steps for a decode-only step (multi-step scheduling), else 1

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
prefill of all but the last prompt token, then one decode step). Which prompts share a step is the serving
engine's (:mod:`voicepipe.hardware.engine`): up to the stack's ``prefill_token_budget``, chunked where the
stack chunks, or one whole prompt a step. A batch whose KV does not fit runs as many
sequences as fit (:func:`predict` says ``fits: false`` and the effective batch); most serving stacks allocate
KV blocks as sequences grow (paged KV), so that is what fits at the sequences' mean context, while
TensorRT-LLM reserves each request's full length at admission (:func:`kv_sequences`). No engine runs more
than its cap on running sequences (vLLM ``max_num_seqs``, SGLang ``max_running_requests``, TensorRT-LLM
``max_batch_size``): the run's own setting, else the stack's documented default (:func:`seq_cap`); the
server's slots are the smaller of the two (:func:`running_sequences`).

The constants η_mem, MFU, η_wq, η_moe and τ are fitted (:mod:`voicepipe.hardware.validate`); every
step is first split into raw parts (:class:`StepParts`, seconds at efficiency 1) that :func:`combine`
turns into time, so the fit evaluates thousands of constant sets over all points in one numpy call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from voicepipe.hardware.catalog import Device, ModelSpec, Stack
from voicepipe.hardware.collective import (
    allreduce_latency_s,
    allreduce_path,
    allreduce_s,
    custom_allreduce_latency_s,
)
from voicepipe.hardware.serving import DeviceServer
from voicepipe.hardware.sizing import (
    activation_peak_bytes,
    engine_reserve_bytes,
    ffn_width,
    kept_tokens,
    kv_capacity_tokens,
    kv_sequences,
    make_system,
    max_sequences,
    mean_context,
    memory_share,
    profile_shape,
    running_sequences,
    seq_cap,
    sram_units,
    tp_options,
    weight_room,
    weight_split,
    weights_fit,
)
from voicepipe.hardware.step import (
    BOOL_PARTS,
    Bound,
    StepParts,
    StepTime,
    allreduces_per_step,
    combine,
    decode_step_s,
    held_total,
    mixed_step_s,
    prefill_s,
    request_overhead_s,
    step_parts,
    step_time,
    tokens_per_step,
    tpot_s,
)
from voicepipe.hardware.system import (
    DEFAULT_EFFICIENCY,
    FITTED,
    MLA_ROPE_DIM,
    DoesNotFit,
    Efficiency,
    FArray,
    Speculative,
    System,
    attention_params,
    bytes_per_param,
    decode_attention_width,
    default_kv_precision,
    dense_weight_precision,
    expected_tokens_per_step,
    kv_bytes_per_token,
    kv_shards,
    matmul_params,
    prefill_attention_width,
    speculative_speedup,
    tp_replicated_params,
    weight_bytes,
    weight_read_params,
)
from voicepipe.hardware.workload import Lengths, steady, throughput

__all__ = [
    "BOOL_PARTS",
    "DEFAULT_EFFICIENCY",
    "FITTED",
    "MLA_ROPE_DIM",
    "Bound",
    "DoesNotFit",
    "Efficiency",
    "FArray",
    "Prediction",
    "Speculative",
    "StepParts",
    "StepTime",
    "System",
    "activation_peak_bytes",
    "allreduce_latency_s",
    "allreduce_path",
    "allreduce_s",
    "allreduces_per_step",
    "attention_params",
    "bytes_per_param",
    "combine",
    "custom_allreduce_latency_s",
    "decode_attention_width",
    "decode_step_s",
    "default_kv_precision",
    "dense_weight_precision",
    "engine_reserve_bytes",
    "expected_tokens_per_step",
    "ffn_width",
    "held_total",
    "kept_tokens",
    "kv_bytes_per_token",
    "kv_capacity_tokens",
    "kv_sequences",
    "kv_shards",
    "make_system",
    "matmul_params",
    "max_sequences",
    "mean_context",
    "memory_share",
    "mixed_step_s",
    "predict",
    "prefill_attention_width",
    "prefill_s",
    "profile_shape",
    "request_overhead_s",
    "ridge_point",
    "running_sequences",
    "seq_cap",
    "speculative_speedup",
    "sram_units",
    "step_parts",
    "step_time",
    "sustained_ridge_point",
    "tokens_per_step",
    "tp_options",
    "tp_replicated_params",
    "tpot_s",
    "weight_bytes",
    "weight_read_params",
    "weight_room",
    "weight_split",
    "weights_fit",
]


# ---------------------------------------------------------------- one-shot prediction


@dataclass(frozen=True)
class Prediction:
    hardware: str
    model: str
    precision: str
    kv_precision: str
    stack: str
    stack_build: str  # which build of the profile ran: its name on this device's maker (Stack.on)
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
    ttft_timing: str  # "client" (over the server's HTTP path) or "engine" (the engine's own timing)
    bound: str
    weights_gb: float
    kv_gb: float
    capacity_gb: float
    # what the engine keeps besides weights and KV on all chips (activation peak, non-torch memory), counted
    # against its memory budget before the KV pool is sized (engine_reserve_bytes); 0 for a stack without one
    engine_reserve_gb: float
    max_batch_fits: int  # sequences whose KV fits at this context (kv_sequences)
    max_seqs: int | None  # the engine's cap on running sequences (seq_cap); None: none beyond memory
    memory_ms: float
    compute_ms: float
    comm_ms: float
    overhead_ms: float
    note: str
    # the weights outside the routed experts (attention, dense and shared MLPs, head): ``precision`` unless
    # the checkpoint keeps them otherwise (gpt-oss: MXFP4 experts, bf16 rest; System.dense_format)
    dense_precision: str = ""
    # the embedding and output head: 16-bit in a quantised run unless the stack quantises them
    # (System.head_format)
    head_precision: str = ""
    # the running set outgrows the KV cache before it finishes (fewer fit at full length than run): on a
    # stack that grows its caches the engine evicts the newest and recomputes it (recompute preemption)
    preempts: bool = False

    def weights_label(self) -> str:
        """``int4`` or, where the rest of the checkpoint differs, ``int4 experts, bf16 rest``; ``, bf16 head``
        where the embedding and output head are kept at another precision than the rest."""
        label = self.precision
        if self.dense_precision and self.dense_precision != self.precision:
            label = f"{self.precision} experts, {self.dense_precision} rest"
        if self.head_precision and self.head_precision != (self.dense_precision or self.precision):
            label += f", {self.head_precision} head"
        return label

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
    timing: Literal["client", "engine"] | None = None,
    eager: bool = False,
    scheduler_steps: int = 1,
    max_seqs: int | None = None,
    max_num_tokens: int | None = None,
    lengths: Lengths = "fixed",
    attention_dp: bool = False,
) -> Prediction:
    """One request among ``batch`` clients each holding one in flight, as the serving engine runs them
    (:func:`voicepipe.hardware.workload.steady`: the burst that fills the device, then a measured round;
    ``batch`` 1: a request alone). ``ttft_ms`` is the measured requests' mean TTFT (queueing and prefill
    behind others included), ``tokens_per_second`` one user's decode rate (1 / mean time per output
    token), ``step_ms`` the mean step it sees, ``aggregate_tokens_per_second`` the device's output rate
    (``batch · O`` per request lifetime). The breakdown (memory, compute, ...) is of a decode step of the
    running batch at its mean context.

    The chip count is the smallest TP width holding the weights and one sequence (or ``tp``), whatever
    the batch, so ``predict`` and ``sweep`` agree. A batch whose KV does not fit, or that exceeds the
    engine's cap on running sequences, runs as many sequences as fit under the cap and queues the rest:
    ``fits`` is False, ``effective_batch`` is what runs, and the timings are for it. Raises DoesNotFit only
    when the weights (plus one sequence) fit at no width. ``timing`` picks the TTFT: "client" (the stack's
    HTTP path included), "engine", or None for the stack's default (``ttft_timing`` says which).
    ``eager``, ``scheduler_steps``, ``max_seqs`` and ``max_num_tokens`` are run settings of the served
    system (:class:`System`: no CUDA/HIP graphs; multi-step scheduling; the cap on running sequences; the
    step token budget, vLLM ``--max-num-batched-tokens`` / TensorRT-LLM ``--max_num_tokens``; None: the
    stack's default). ``lengths``: the clients' requests all at the stated lengths ("fixed"), or drawn
    around them (:func:`voicepipe.hardware.workload.request_lengths`: "uniform", "exponential").
    ``attention_dp``: each chip runs the attention of its own share of the ``batch`` sequences
    (:class:`System`; on two chips or more, :func:`make_system`).
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    ctx_max = prompt_tokens + output_tokens
    system = make_system(
        device, model, precision, tp=tp, seqs=batch if device.kind == "sram" else 1, context=ctx_max,
        eff=eff, kv_precision=kv_precision, stack=stack, timing=timing, eager=eager,
        scheduler_steps=scheduler_steps, max_seqs=max_seqs, max_num_tokens=max_num_tokens, attention_dp=attention_dp,
    )  # fmt: skip
    room = kv_sequences(system, prompt_tokens, output_tokens)
    limit = seq_cap(system)
    if device.kind == "sram":  # sized for the batch, so it all fits; the run's own cap still holds (DeviceServer)
        run = batch if limit is None else min(batch, limit)
    else:
        run = min(batch, running_sequences(system, prompt_tokens, output_tokens))
    ctx = mean_context(prompt_tokens, output_tokens)
    note = ""
    if run < batch and run < room:
        note = f"the engine runs at most {limit} sequences at once (its max_seqs): {run} at a time, the rest queue"
    elif run < batch:
        held = (
            f"reserved at their full {ctx_max} tokens"
            if system.serving.kv_admission == "reserve"
            else f"at their mean context of {ctx:.0f} tokens"
        )
        note = f"KV for {batch} sequences {held} exceeds memory: the server runs {run} at a time and queues the rest"
    whole = max_sequences(system, ctx_max)
    preempts = device.kind == "hbm" and system.serving.kv_admission == "grow" and 1 <= whole < min(run, batch)
    if preempts:
        grows = (f"{min(run, batch)} sequences outgrow the KV cache before they finish ({whole} fit at their full "
                 f"{ctx_max} tokens): the server evicts the newest and recomputes it later (recompute preemption)")  # fmt: skip
        note = f"{note}; {grows}" if note else grows
    st = step_time(system, run, run * ctx)
    server = DeviceServer(system, max_batch=max(run, 1), spec=spec, prompt_cache=False)
    engine = steady(server, batch, prompt_tokens, output_tokens, rounds=1 if batch == 1 else 2, lengths=lengths)
    per_user = 1.0 / engine.tpot_s
    step = engine.tpot_s * tokens_per_step(spec)
    cap = system.chips * device.capacity_bytes
    return Prediction(
        hardware=device.key,
        model=model.key,
        precision=system.precision,
        dense_precision=system.dense_format,
        head_precision=system.head_format,
        kv_precision=system.kv,
        stack=system.serving.key if device.kind == "hbm" else "vendor (SRAM, fitted)",
        stack_build=system.serving.name if device.kind == "hbm" else "the vendor's own (in the fitted layer time)",
        chips=system.chips,
        batch=batch,
        effective_batch=run,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        fits=run == batch,
        step_ms=step * 1e3,
        tokens_per_second=per_user,
        aggregate_tokens_per_second=throughput(engine, static=False),
        ttft_ms=engine.ttft_s * 1e3,
        ttft_timing=system.ttft_timing,
        bound=str(st.bound()),
        weights_gb=system.stored_weight_bytes / 1e9,
        kv_gb=batch * kept_tokens(system, ctx_max) * kv_bytes_per_token(model, system.kv) / 1e9,
        capacity_gb=cap / 1e9,
        engine_reserve_gb=system.chips * engine_reserve_bytes(system) / 1e9,
        max_batch_fits=room,
        max_seqs=limit,
        memory_ms=float(st.memory_s) * 1e3,
        compute_ms=float(st.compute_s) * 1e3,
        comm_ms=float(st.comm_s) * 1e3,
        overhead_ms=float(st.overhead_s) * 1e3,
        note=note,
        preempts=preempts,
    )


def ridge_point(device: Device, precision: str = "bf16") -> float:
    """Arithmetic intensity (FLOP/byte) where compute time equals memory time: peak / bandwidth."""
    return device.peak_flops(precision) / (float(device.mem_bw_tbs or 0) * 1e12)


def sustained_ridge_point(device: Device, precision: str = "bf16") -> float:
    """The ridge point the step model uses: sustained matmul FLOP/s over sustained bandwidth (before
    the fitted MFU and η_mem)."""
    return device.matmul_flops(precision) / device.stream_bytes_s
