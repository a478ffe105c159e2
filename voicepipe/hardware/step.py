"""One engine step's time: raw parts at efficiency 1 (:func:`step_parts`), then :func:`combine`.

The formulas are stated in :mod:`voicepipe.hardware.model`'s docstring; the sizes they read come from
:mod:`voicepipe.hardware.system` and :mod:`voicepipe.hardware.sizing` (the weight split), the all-reduce
from :mod:`voicepipe.hardware.collective`, the tile term from :mod:`voicepipe.hardware.blockfp8`. Pure
functions, vectorised over batch and context.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from voicepipe.hardware.blockfp8 import block_fp8_experts, system_kernel, tile_bound_extra_params
from voicepipe.hardware.catalog import (
    ModelSpec,
    Stack,
    kv_rereads,
)
from voicepipe.hardware.collective import allreduce_s
from voicepipe.hardware.num import arr, ceil, maximum, minimum, where
from voicepipe.hardware.sizing import weight_split
from voicepipe.hardware.specs import DENSE_LAYER_OPS
from voicepipe.hardware.system import (
    FArray,
    Speculative,
    System,
    _read_split,
    body_params,
    bytes_per_param,
    decode_attention_width,
    dp_keeps_mlps,
    dp_own_params,
    expected_tokens_per_step,
    kv_bytes_per_token,
    kv_shards,
    prefill_attention_width,
    routed_params,
    table_bytes,
    tp_replicated_params,
)

Bound = Literal["memory", "compute", "latency"]

# ---------------------------------------------------------------- time


@dataclass(frozen=True)
class StepParts:
    """One step's raw costs in seconds at efficiency 1; :func:`combine` applies the efficiencies."""

    kv_s: FArray  # KV bytes per chip / BW
    dense_s: FArray  # dense weight bytes per chip / BW
    expert_s: FArray  # routed-expert weight bytes per chip / BW
    spill_s: FArray  # weights streamed from the offload tier (at its full bandwidth)
    flops_s: FArray  # matmul FLOPs outside the routed experts per chip / sustained rate at their precision
    attn_s: FArray  # attention (scores, values) FLOPs per chip / sustained 16-bit rate
    comm_s: FArray  # all-reduces (latency + bandwidth), set constants
    fixed_s: FArray  # GPU-side fixed costs: per-layer gaps, MoE routing (SRAM: per-layer time, sweep)
    layers: FArray  # dense-layer equivalents the fitted τ applies to (HBM: L·ops/10; SRAM: none)
    weight_only: bool | NDArray[np.bool_]  # the weights outside the routed experts are dequantised in-kernel
    sram: bool | NDArray[np.bool_]
    serial_s: FArray | float = 0.0  # host work between forwards: per step, per running sequence
    launch_s: FArray | float = 0.0  # host time launching a piecewise-graphed forward (overlaps the GPU)
    overlap: bool | NDArray[np.bool_] = False  # async scheduling: serial_s overlaps the GPU too
    gap_s: FArray | float = 0.0  # async scheduling: the host time per step that overlaps nothing
    stream_s: FArray | float = 0.0  # the API process streaming the step's chunks (a floor: it runs beside)
    expert_flops_s: FArray | float = 0.0  # routed-expert matmul FLOPs per chip / sustained rate at the precision
    # the most of the sustained rate the routed experts' grouped GEMMs reach (Efficiency.moe_gemm_share;
    # 1 where no such ceiling applies): their math runs at min(MFU, this) of it
    expert_share: FArray | float = 1.0
    # the routed experts are dequantised in-kernel (their precision has no math here); with weight_only it
    # differs only where the experts and the rest are stored apart (ModelSpec.dense_precision: gpt-oss)
    expert_weight_only: bool | NDArray[np.bool_] = False
    # the parts of dense_s and flops_s in a native format beside weight-only dense weights (a 16-bit head
    # beside int4 layers): no in-kernel dequantisation, so η_wq does not apply to them
    native_s: FArray | float = 0.0
    native_flops_s: FArray | float = 0.0


BOOL_PARTS = ("weight_only", "sram", "overlap", "expert_weight_only")  # the StepParts fields that are flags


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


def allreduces_per_step(model: ModelSpec, tp: int) -> int:
    """Tensor parallelism all-reduces twice per layer (attention out, MLP out); none at tp 1."""
    return 2 * model.layers if tp > 1 else 0


def held_total(model: ModelSpec, tokens: ArrayLike, seqs: ArrayLike) -> FArray:
    """Full-token equivalent of ``tokens`` of cache spread over ``seqs`` sequences, each at their mean
    context (:meth:`ModelSpec.held`); the tokens themselves without local attention."""
    t = arr(tokens)
    if model.window is None:
        return t
    return t - model.local_layers / model.layers * maximum(
        t - arr(seqs) * model.window, 0.0
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
    prefill_span: ArrayLike | None = None,
    streamed: bool = True,
) -> StepParts:
    """Raw costs of one engine step (see the module docstring for the formulas).

    ``prefill_tokens`` may come from ``prefill_seqs`` prompts (or chunks of them) sharing the step, with
    ``prefill_cached`` tokens of context before them in all (cached prefixes, earlier chunks), whose KV the
    step reads. ``prefill_span`` is the mean context a new prompt token attends to (``Σ nᵢ·(cᵢ + nᵢ/2) / n``
    over the prompts); None: prompts of equal length, ``(c + n/2) / s``. ``streamed`` False leaves out
    the API process's floor (:func:`stream_s`; a speculative step applies it once to draft and verify)."""
    dev, m, eff = system.device, system.model, system.eff
    d = arr(decode_seqs)
    kv = arr(kv_tokens)
    q = arr(tokens_per_seq)
    n = arr(prefill_tokens)
    c = arr(prefill_cached)
    ps = maximum(arr(prefill_seqs), 1.0)
    span = (c + n / 2.0) / ps if prefill_span is None else arr(prefill_span)
    tokens = d * q + n
    zero = 0.0 * (tokens + kv + c)
    bpp = bytes_per_param(system.precision)  # the routed experts
    dense_prec = system.dense_format  # the rest: attention, dense and shared MLPs, router (the head: below)
    bpd = bytes_per_param(dense_prec)
    # the output head (vocab x hidden; tied: the embedding), streamed by every forward at its own format
    # (System.head_format: 16-bit beside quantised weights unless the stack quantises it)
    head_fmt = system.head_format
    bph = table_bytes(head_fmt)
    head_p = m.embed_params
    kvb = kv_bytes_per_token(m, system.kv)
    dense_p, expert_p = _read_split(m, tokens)
    # the head computes logits only where a token is sampled: every decoder's, and the last token of each
    # prompt (or chunk) in the step, not every prompt token
    sampled_prompt = n - maximum(n - ps, 0.0)
    # local attention: the decoders' cache at their mean context, the prompt's cached prefix, and the
    # span a new prompt token attends to, each capped at the window on the local layers
    cached = c
    if m.window is not None:
        kv, cached = held_total(m, kv, d), held_total(m, c, ps)
    attention = (
        2.0 * m.layers * m.heads * (decode_attention_width(m) * q * kv + prefill_attention_width(m) * n * m.held(span))
    )
    stk = system.serving
    # a decode kernel that does not share a GQA group's KV head reads it once per query head
    reread = kv_rereads(stk, m.gqa_group, local=m.window is not None)
    # the decode kernel may also stream what it reads below the modelled rate (Stack.decode_kv_eff)
    kv_bytes = (reread * kv / stk.decode_kv_eff + where(n > 0, cached, 0.0) + tokens) * kvb
    # tensor parallelism splits every step's work over the chips; a pipeline (llama.cpp's layer split)
    # runs the chips in turn, so a step costs one chip's time for all the work plus the hops between
    pipeline = dev.kind == "hbm" and stk.multi_chip == "pipeline" and system.chips > 1
    par = 1 if pipeline else system.chips
    # weights' matmuls run at the precision's rate; attention (scores, values) in 16-bit math
    # sustained (microbenchmarked) matmul rates; MFU is the share of them a serving step reaches
    # attention DP: a prompt's work on the weights its rank keeps to itself (dp_own_params: the
    # attention's, and the MLPs' where the stack keeps them on the rank) and its attention run on the rank
    # that owns it, so with s prompts the busiest rank holds ceil(s/chips) of them (TensorRT-LLM ADP
    # blog: "the iteration time is dominated by the slowest rank"); the rest (the routed experts, the
    # MLPs a stack splits over the group) and the decoders (spread over the ranks) split over the group
    local: FArray | float = 1.0 / par
    if system.attention_dp and par > 1:
        local = where(n > 0, ceil(ps / par) / ps, 1.0 / par)
    routed = routed_params(m)
    body = body_params(m)  # each token's matmuls outside the routed experts and the head
    own = dp_own_params(system) if par > 1 else 0.0
    pre_linear = 2.0 * n * (own * local + max(body - own, 0.0) / par)
    pre_attn = 2.0 * m.layers * m.heads * prefill_attention_width(m) * n * m.held(span)  # attention's own
    # projections every TP rank holds whole (MLA's down-projections) multiply every token on every rank
    rep = 0.0 if system.attention_dp or par == 1 else tp_replicated_params(m) * (1.0 - 1.0 / par)
    # the routed experts' matmuls at the run's precision; the rest at theirs (gpt-oss: bf16)
    expert_linear = 2.0 * routed * tokens
    head_flops = 2.0 * head_p * ((tokens - n) / par + sampled_prompt * local)
    native_head = dev.weight_only(dense_prec) and not dev.weight_only(head_fmt)
    flops_s = (
        (2.0 * body * (tokens - n)) / par + pre_linear + 2.0 * rep * tokens
    ) / dev.matmul_flops(dense_prec) + head_flops / dev.matmul_flops(head_fmt) + zero
    expert_flops_s = expert_linear / par / dev.matmul_flops(system.precision) + zero
    attn_s = ((attention - pre_attn) / par + pre_attn * local) / dev.matmul_flops("bf16") + zero
    if dev.kind == "hbm":
        # kernels launched from the host without a CUDA/HIP graph: a step that prefills (stacks capture
        # graphs for decode batches only), or every step under eager execution (System.eager)
        eager = (n > 0) | system.eager
        # multi-step scheduling (System.scheduler_steps): a decode-only step's host work is done once per
        # N steps; a step that prefills is scheduled alone (vLLM V0 runs prefills as single steps)
        host_steps = where(n > 0, 1.0, float(system.scheduler_steps))
        bw = dev.stream_bytes_s  # sustained (microbenchmarked) bandwidth; η_mem is the kernels' share of it
        tp = system.chips
        link = float(dev.link_gbs or 0) * 1e9 * eff.link_eff
        in_hbm, spilled = weight_split(system)
        hbm_share = in_hbm / (in_hbm + spilled)
        comm = zero
        if pipeline:  # one activation hand-off per chip boundary
            comm = (tp - 1) * (float(dev.allreduce_us or 0.0) * 1e-6 + tokens * m.hidden * 2.0 / link) + zero
        elif tp > 1:  # two all-reduces a layer of the step's activations, as the stack runs them
            comm = allreduces_per_step(m, tp) * allreduce_s(stk, dev, tp, tokens * m.hidden * 2.0, eff) + zero
        offload_bw = float(dev.offload_bw_tbs or 1.0) * 1e12
        # attention DP: every chip streams the whole of the weights it keeps (dp_own_params), not a 1/tp slice
        replicated = own * (1.0 - 1.0 / par) if system.attention_dp else rep
        # the output head (vocab x hidden, split over the ranks, whole on each where the ranks keep the MLPs:
        # dp_keeps_mlps) streams at its own format (System.head_format)
        head_share = 1.0 if dp_keeps_mlps(system) else 1.0 / par
        dense_bytes = ((dense_p - head_p) / par + replicated) * bpd + head_p * head_share * bph
        weights_s = dense_bytes + expert_p / par * bpp
        dense_s = dense_bytes * hbm_share / bw + zero
        head_s = head_p * head_share * bph * hbm_share / bw + zero  # the head's share of dense_s
        # a block-scaled FP8 GEMM with fewer output tiles than SMs streams on those SMs only, each at its
        # share of the sustained bandwidth (docs §1): a fixed GPU cost, outside η_mem
        kernel = system_kernel(system)
        tile_s = zero if kernel == "none" or pipeline else tile_bound_extra_params(
            m, kernel, tp, int(dev.sms or 1), tokens, system.attention_dp, stk.attention_dp_mlp == "own",
        ) * bpd * hbm_share / bw  # fmt: skip
        # a build without skinny GEMMs pays extra on its 16-bit dense GEMMs at small M (Stack.small_m_gemm_extra)
        # the 16-bit share of dense_s: all of it, or the head's where only the head is 16-bit
        sixteen = dense_s if dense_prec in ("bf16", "fp16") else head_s if head_fmt in ("bf16", "fp16") else zero
        return StepParts(
            kv_s=kv_bytes / (1 if pipeline else kv_shards(m, tp, system.attention_dp)) / bw + zero,
            dense_s=dense_s,
            expert_s=expert_p * bpp / par * hbm_share / bw + zero,
            spill_s=weights_s * (1.0 - hbm_share) / offload_bw + zero,
            flops_s=flops_s,
            attn_s=attn_s,
            comm_s=comm,
            fixed_s=zero
            + m.layers * (stk.layer_overhead_us + where(eager, stk.prefill_layer_overhead_us, 0.0)) * 1e-6
            + m.routed_layers * (eff.moe_route_block_s if block_fp8_experts(system) else eff.moe_route_s)
            + small_m_gemm_extra(stk, tokens) * sixteen
            + tile_s,
            layers=zero + m.layers * m.layer_ops / DENSE_LAYER_OPS,
            weight_only=dev.weight_only(dense_prec),
            sram=False,
            # per step, and per running sequence (schedule, prepare inputs, sample, detokenise), done once per
            # `scheduler_steps` decode steps under multi-step scheduling
            serial_s=zero
            + (stk.step_overhead_us + (d + where(n > 0, ps, 0.0)) * stk.seq_overhead_us) * 1e-6 / host_steps,
            # eager execution launches every kernel from the host, charged above per layer (no graph pieces)
            launch_s=zero + (0.0 if system.eager else launch_host_s(stk, m.layers, n)),
            overlap=stk.async_scheduling,
            gap_s=zero + stk.async_gap_us * 1e-6,
            stream_s=zero + (stream_s(system, d) if streamed else 0.0),
            expert_flops_s=expert_flops_s,
            expert_share=eff.moe_gemm_share,
            expert_weight_only=dev.weight_only(system.precision),
            native_s=head_s if native_head else zero,
            native_flops_s=zero + (head_flops / dev.matmul_flops(head_fmt) if native_head else 0.0),
        )
    layer_bw = float(dev.layer_bw_tbs or 0) * 1e12
    sweep = ((dense_p - head_p) * bpd + head_p * bph + expert_p * bpp) / layer_bw if layer_bw > 0 else zero
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
        expert_flops_s=expert_flops_s,
    )


def small_m_gemm_extra(stack: Stack, tokens: ArrayLike) -> FArray:
    """The stack's extra 16-bit dense GEMM time for a step of ``tokens`` tokens (M), as a multiple of the
    dense weights' streaming time at the sustained bandwidth: ``small_m_gemm_extra[M − 1]`` for M up to its
    length, else 0 (vectorised over ``tokens``)."""
    m = arr(tokens)
    m = float(round(m)) if isinstance(m, float) else np.rint(m)  # half to even, as np.rint
    out = 0.0 * m
    for i, extra in enumerate(stack.small_m_gemm_extra):
        out = where(m == i + 1, extra, out)
    return out


def launch_host_s(stack: Stack, layers: int, prefill_tokens: ArrayLike) -> FArray:
    """Host seconds to launch one step's forward: ``layers × host_layer_us`` where the step runs
    piecewise CUDA graphs (every step under ``cudagraph_mode`` "piecewise"; under "full_and_piecewise" only
    a step that prefills, a decode-only step replaying one full graph), else 0."""
    piecewise = arr(prefill_tokens) > 0
    if stack.cudagraph_mode == "piecewise":
        piecewise = piecewise | True  # every step (an array stays one)
    return where(piecewise, layers * stack.host_layer_us * 1e-6, 0.0)


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
    w = where(parts.weight_only, arr(eta_wq), 1.0)
    we = where(parts.expert_weight_only, arr(eta_wq), 1.0)  # the routed experts'
    eta = arr(eta_mem)
    u = arr(mfu)
    native, native_flops = arr(parts.native_s), arr(parts.native_flops_s)
    dense = (parts.dense_s - native) / w + native
    weights = (dense + parts.expert_s / (we * arr(eta_moe))) / eta + parts.spill_s
    cache = parts.kv_s / eta
    # weight-only kernels dequantise inside the GEMM (not the native parts beside them)
    # the routed experts' grouped GEMMs: the dense share of the rate, at most their own (moe_gemm_share)
    expert_u = minimum(u, arr(parts.expert_share))
    matmul = ((parts.flops_s - native_flops) / w + native_flops) / u + parts.expert_flops_s / (expert_u * we)
    attention = parts.attn_s / u  # attention math is 16-bit whatever the weight format
    memory, compute = weights + cache, matmul + attention
    # HBM: one roofline per kernel class, run one after the other on the stream: the weight GEMMs
    # (weight bytes vs matmul FLOPs) and attention (KV bytes vs attention FLOPs) do not overlap.
    # SRAM: the token walks layers, so its parts add up.
    busy = where(parts.sram, memory + compute, maximum(weights, matmul) + maximum(cache, attention))
    gpu = busy + parts.comm_s + parts.fixed_s + parts.layers * arr(layer_s)
    engine = host_bound(gpu, parts.launch_s, parts.serial_s, parts.overlap, parts.gap_s)
    return memory, compute, maximum(engine, arr(parts.stream_s))


def stream_s(system: System, decoders: ArrayLike) -> FArray:
    """The server's API process's time to stream one step's chunks to clients, ``decoders ×
    stream_chunk_us``, where the system's tokens reach a client over HTTP (:attr:`System.ttft_timing`
    "client"); else 0. The process runs beside the engine, so a step takes at least this long (the engine
    cannot hand out tokens faster than they are streamed) and below it costs nothing: a serial
    per-chunk cost caps the server at ``1 / stream_chunk_us`` chunks a second across all clients."""
    d = arr(decoders)
    if system.device.kind != "hbm" or system.ttft_timing != "client":
        return 0.0 * d
    return d * system.serving.stream_chunk_us * 1e-6


def host_bound(
    gpu: ArrayLike, launch: ArrayLike, serial: ArrayLike, overlap: ArrayLike, gap: ArrayLike = 0.0
) -> FArray:
    """A step's time from its GPU time and its host work. The host launches the forward while the GPU
    runs it (CUDA launches are asynchronous), so the forward takes the longer of the GPU time and the
    launch time; the host's work between forwards (scheduling, input preparation, sampling, output
    processing) adds to it, unless the stack schedules the next step while the GPU runs this one
    (``overlap``), when the step is the longer of the GPU time and all the host work, plus the ``gap``
    that overlaps nothing."""
    g, lh, sh = (arr(v) for v in (gpu, launch, serial))
    return where(overlap, maximum(g, lh + sh) + arr(gap), sh + maximum(g, lh))


def total_s(system: System, parts: StepParts) -> FArray:
    """A step's seconds from its parts under the system's efficiencies (:func:`combine`'s total alone: the
    serving engine's hot path, which needs no breakdown)."""
    e = system.eff
    return combine(parts, e.eta_mem, e.mfu, e.eta_wq, e.eta_moe, e.layer_s)[2]


def step_time(
    system: System,
    decode_seqs: ArrayLike,
    kv_tokens: ArrayLike,
    *,
    tokens_per_seq: ArrayLike = 1,
    prefill_tokens: ArrayLike = 0,
    prefill_cached: ArrayLike = 0,
    prefill_seqs: ArrayLike = 1,
    prefill_span: ArrayLike | None = None,
    streamed: bool = True,
) -> StepTime:
    """Time of one engine step (see the module docstring for the formulas); ``streamed`` as
    :func:`step_parts`."""
    parts = step_parts(
        system,
        decode_seqs,
        kv_tokens,
        tokens_per_seq=tokens_per_seq,
        prefill_tokens=prefill_tokens,
        prefill_cached=prefill_cached,
        prefill_seqs=prefill_seqs,
        prefill_span=prefill_span,
        streamed=streamed,
    )
    e = system.eff
    memory, compute, total = combine(parts, e.eta_mem, e.mfu, e.eta_wq, e.eta_moe, e.layer_s)
    # everything that is neither a kernel's bytes/FLOPs nor a collective: the GPU-side fixed costs and
    # what the host adds beyond the GPU's work
    busy = combine(replace(parts, comm_s=0.0 * parts.comm_s, fixed_s=0.0 * parts.fixed_s, serial_s=0.0,
                           launch_s=0.0, gap_s=0.0, stream_s=0.0, layers=0.0 * parts.layers), e.eta_mem, e.mfu, e.eta_wq, e.eta_moe)[2]  # fmt: skip
    return StepTime(memory, compute, parts.comm_s, total - busy - parts.comm_s, total)


def mixed_step_s(
    system: System,
    decode_seqs: ArrayLike,
    kv_tokens: ArrayLike,
    *,
    prefill_tokens: ArrayLike = 0,
    prefill_cached: ArrayLike = 0,
    spec: Speculative | None = None,
    prefill_seqs: ArrayLike = 1,
    prefill_span: ArrayLike | None = None,
) -> FArray:
    """Seconds for one continuous-batching step: ``decode_seqs`` decode while ``prefill_tokens`` prefill.

    With speculative decoding the decoders first run γ draft steps costing ``c`` target steps each, then
    the target verifies γ + 1 tokens per sequence: ``γ·c·t(d, q=1) + t(d, q=γ+1, n)``. Either way the step
    lasts at least the API process's time to stream its chunks (:func:`stream_s`; one a decoder).
    """
    d = arr(decode_seqs)
    verify = total_s(system, step_parts(
        system, d, kv_tokens, tokens_per_seq=1 if spec is None else spec.gamma + 1, prefill_tokens=prefill_tokens,
        prefill_cached=prefill_cached, prefill_seqs=prefill_seqs, prefill_span=prefill_span, streamed=spec is None,
    ))  # fmt: skip
    if spec is None:
        return verify
    draft = spec.gamma * spec.draft_cost * total_s(system, step_parts(system, d, kv_tokens, streamed=False))
    return maximum(verify + where(d > 0, draft, 0.0), stream_s(system, d))


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
    """Per-request fixed cost on TTFT (HBM devices: the serving stack's; SRAM: in the fitted layer time):
    the engine's own (``request_overhead_ms``: admit, first sample), plus, for a TTFT timed by a client
    over HTTP (:attr:`System.ttft_timing`), the server's path around it (``client_overhead_ms``)."""
    if system.device.kind == "sram":
        return 0.0
    stk = system.serving
    client = stk.client_overhead_ms if system.ttft_timing == "client" else 0.0
    return (stk.request_overhead_ms + client) * 1e-3


def decode_step_s(
    system: System, batch: ArrayLike, context: ArrayLike, spec: Speculative | None = None
) -> FArray:
    """Seconds per decode step for ``batch`` sequences of mean ``context`` tokens each."""
    b = np.asarray(batch, dtype=float)
    return mixed_step_s(system, b, b * np.asarray(context, dtype=float), spec=spec)


def tpot_s(system: System, batch: ArrayLike, context: ArrayLike, spec: Speculative | None = None) -> FArray:
    """Seconds per output token for one of ``batch`` sequences: step / E[tokens per step]."""
    return decode_step_s(system, batch, context, spec) / tokens_per_step(spec)
