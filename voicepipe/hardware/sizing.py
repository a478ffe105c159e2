"""What fits on a system, and the system that holds a configuration (docs/hardware-model.md §1).

The serving engine's own memory per chip besides the weights and the KV cache (:func:`engine_reserve_bytes`:
its start-up profile's activation peak and non-torch memory, against the stack's memory share), where the
weights sit (:func:`weight_split`: HBM or an offload tier), how many KV tokens and sequences fit beside
them (paged or reserved KV, :func:`kv_sequences`), how many the engine runs at once (at most its cap,
:func:`seq_cap`; :func:`running_sequences`), and the smallest tensor-parallel width that holds a
configuration (:func:`make_system`). Pure functions over :mod:`voicepipe.hardware.system`'s types and byte
counts.
"""

from __future__ import annotations

import math
from typing import Literal

from voicepipe.errors import UnsupportedSetting
from voicepipe.hardware.catalog import Device, ModelSpec, Stack, check_kv_precision, check_precision
from voicepipe.hardware.catalog import stack as catalog_stack
from voicepipe.hardware.system import (
    DEFAULT_EFFICIENCY,
    DoesNotFit,
    Efficiency,
    System,
    attention_params,
    bytes_per_param,
    dp_keeps_mlps,
    dp_own_params,
    kv_bytes_per_token,
    kv_shards,
    table_bytes,
    tp_replicated_params,
    weight_bytes,
)

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


def prefill_budget(system: System) -> int | None:
    """Tokens one engine step may carry on this system: the run's own ``System.max_num_tokens``, else the
    stack's ``prefill_token_budget``; None: one whole prompt a step (also on SRAM machines, which stream one
    token through the layers)."""
    if system.device.kind != "hbm":
        return None
    if system.max_num_tokens is not None:
        return system.max_num_tokens
    return system.serving.prefill_token_budget


def profile_shape(system: System) -> tuple[int, int]:
    """(tokens, sequence slots) of the stack's start-up profile on this device: the large-device defaults
    where :func:`large_device`, else the ordinary ones; the slots are the run's own cap where it sets one
    (``System.max_seqs``: vLLM profiles its sampler over ``max_num_seqs`` sequences), the tokens the run's
    own step budget (``System.max_num_tokens``: its forward over ``max_num_batched_tokens``)."""
    mem = system.serving.memory
    if mem is None:
        return 0, 0
    tokens, seqs = mem.tokens, mem.seqs
    if large_device(system):
        tokens = mem.large_tokens if mem.large_tokens is not None else mem.tokens
        seqs = mem.large_seqs if mem.large_seqs is not None else mem.seqs
    if seqs and system.max_seqs is not None:
        seqs = system.max_seqs
    if tokens and system.max_num_tokens is not None:  # it profiles a forward over the run's own step budget
        tokens = system.max_num_tokens
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
    kept on the system once worked out (:attr:`System.memo`)."""
    got = system.memo.get("weight_split")
    if got is None:
        got = system.memo["weight_split"] = _weight_split(system)
    return got  # type: ignore[return-value]


def _weight_split(system: System) -> tuple[float, float]:
    """(weight bytes per chip in HBM, per chip spilled to the offload tier).

    Weights stay in HBM when they fit; a device with an offload tier (SambaNova's DDR) keeps half its
    usable HBM for KV and streams the rest of the weights from that tier.
    """
    dev = system.device
    per_chip = system.stored_weight_bytes / system.chips
    dense = bytes_per_param(system.dense_format)  # attention and MLA projections are outside the experts
    if system.attention_dp:  # a full copy of the weights each rank keeps to itself (dp_own_params), the head too
        per_chip += dp_own_params(system) * dense * (1 - 1 / system.chips)
        if dp_keeps_mlps(system):
            per_chip += system.model.embed_params * table_bytes(system.head_format) * (1 - 1 / system.chips)
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
            - system.stored_weight_bytes
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
    dense: str | None = None, head: str | None = None, embedding: str | None = None,
) -> int:  # fmt: skip
    """Chips/wafers an SRAM machine needs to hold the weights plus ``seqs`` KV caches of ``context``
    (``head``, ``embedding``: the output head's and the embedding's formats, :attr:`System.head_format`,
    :attr:`System.embedding_format`)."""
    need = weight_bytes(model, precision, dense, head, embedding) + seqs * context * kv_bytes_per_token(model, kv)
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
    max_num_tokens: int | None = None,
    attention_dp: bool = False,
) -> System:
    """Size a system that holds the weights and ``seqs`` sequences of ``context`` tokens.

    HBM: the smallest power-of-two TP width (≤ ``max_tp``) that holds them, or the given ``tp``. When no
    width holds ``seqs`` sequences, ``strict`` raises :class:`DoesNotFit`; otherwise the widest width
    whose weights fit is returned (the server will run as many sequences as fit). Weights that fit at no
    width always raise. SRAM: the chips/wafers follow from capacity (``tp`` is not accepted). ``eager``,
    ``scheduler_steps``, ``max_seqs`` and ``max_num_tokens`` are run settings (:class:`System`); the last
    two change what vLLM's start-up profile reserves (:func:`profile_shape`), the others do not change the
    sizing.
    ``dense_precision`` is the checkpoint's own format outside the routed experts (:class:`System`).
    ``attention_dp``: each chip runs the attention of its own share of the sequences (:class:`System`), which
    takes a group of two or more: the smallest such width (or ``tp``, refused below 2).
    """
    prec = check_precision(precision or model.default_precision)
    kv = check_kv_precision(kv_precision) if kv_precision else None

    def build(width: int) -> System:
        return System(
            device, model, prec, width, eff, kv, stack, timing=timing, eager=eager,
            scheduler_steps=scheduler_steps, max_seqs=max_seqs, dense_precision=dense_precision,
            max_num_tokens=max_num_tokens, attention_dp=attention_dp,
        )  # fmt: skip

    if device.kind == "sram":
        if attention_dp:
            build(1)  # the run-setting check: an SRAM machine has no attention DP to set
        if tp is not None:
            raise ValueError(f"tp does not apply to {device.key}: its chip count follows from SRAM capacity")
        probe = build(1)
        return build(sram_units(device, model, prec, seqs, context, eff, probe.kv, dense_precision, probe.head_format,
                                probe.embedding_format))  # fmt: skip
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
    if attention_dp:
        build(2 if device.max_tp >= 2 else 1)  # the run-setting check (the stack's switch) before the width's
        widths = [w for w in widths if w >= 2]
        if not widths:
            raise UnsupportedSetting("attention_dp", "it spreads the requests over a tensor-parallel group's "
                                     f"chips: it needs --tp 2 or more{' (this device runs one)' if device.max_tp < 2 else ''}")  # fmt: skip
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
    need = system.stored_weight_bytes + seqs * kept_tokens(system, context) * kv_bytes_per_token(
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
