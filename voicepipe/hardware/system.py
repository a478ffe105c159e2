"""The system a step runs on: efficiencies, speculative decoding and byte counts.

Pure functions over the catalog (:mod:`voicepipe.hardware.catalog`): the efficiency constants
(:class:`Efficiency`), speculative decoding's expected tokens a step, the serving instance
(:class:`System`: a model on chips of a device at a precision under a stack), and how many bytes and
FLOPs the weights, the KV cache and attention take per token. What fits on a system and the width that
holds a configuration are in :mod:`voicepipe.hardware.sizing`; the step formulas that use both are in
:mod:`voicepipe.hardware.step`; :mod:`voicepipe.hardware.model` states them all and re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from voicepipe.errors import UnsupportedSetting
from voicepipe.hardware.catalog import (
    HEAD_FORMATS,
    PRECISIONS,
    BlockFp8Gemm,
    Device,
    ModelSpec,
    Stack,
    check_kv_precision,
    check_precision,
)
from voicepipe.hardware.catalog import stack as catalog_stack
from voicepipe.hardware.catalog import stacks as catalog_stacks
from voicepipe.hardware.num import arr, maximum

FArray = NDArray[np.float64]


class DoesNotFit(ValueError):
    """The configuration cannot hold the weights it was asked to (at any tensor-parallel width)."""


@dataclass(frozen=True)
class Efficiency:
    """Efficiency factors, one set for every HBM device (η_mem, MFU, η_wq, η_moe fitted; see docs §2)."""

    # fitted on every answerable point of data/validation*.yaml (`voicepipe hardware validate`; docs §2, §3)
    eta_mem: float = 0.868  # share of the sustained (STREAM-like) bandwidth a native decode step streams
    mfu: float = 0.763  # share of the sustained (measured maximum) matmul FLOP/s a serving step reaches
    eta_wq: float = 1.0  # weight-only kernels' efficiency relative to native ones (dequant in the loop)
    eta_moe: float = 0.662  # expert (grouped-GEMM) streaming efficiency relative to dense GEMV + routing
    layer_s: float = 4.2e-05  # per dense-layer equivalent per step on HBM devices beyond the stack's own
    # gaps (launch, sync): a layer counts ModelSpec.layer_ops / DENSE_LAYER_OPS of them (an MLA+MoE layer 1.8)
    ar_growth: float = 0.5  # all-reduce latency growth per doubling of the TP group beyond 2
    # per MoE layer per step: top-k, alignment, grouped-GEMM launches (the router GEMM is one of
    # ModelSpec.layer_ops); the intercept of published fused-MoE kernel times against the expert bytes
    # they touch, 24.5-26.6 µs (docs §2, tenth pass)
    moe_route_s: float = 25e-6
    # the same for block-scaled FP8 experts (DeepSeek-V3/R1, Kimi K2 at fp8: per-token-group activation
    # quantisation, block scales): the mean intercept of the two published DeepSeek-shape fused-MoE tables,
    # SGLang PR #11816 (B200, TP 8) 45.8 µs and vLLM PR #36559 (H200, TP 2) 37.5 µs (docs §3, nineteenth pass)
    moe_route_block_s: float = 41.7e-6
    link_eff: float = 0.45  # share of link bandwidth NCCL reaches at 0.1-10 MB messages
    # the share of the sustained matmul rate the routed experts' grouped GEMMs reach where they are
    # compute-bound: the median of three tuned fused-MoE kernel benchmarks at their largest published batch,
    # net of t_route — vLLM PR #24700 (H100, Mixtral-8x7B bf16 at TP 2 shapes, 1,536 tokens: 0.62), vLLM
    # PR #44818 (H200, Gemma-4 bf16, 4,096 tokens: 0.42), DeepGEMM PR #73 (H800, DeepSeek-shape fp8
    # grouped GEMMs: 0.79-0.94); a dense step's GEMMs run at MFU of it (docs §3, thirty-second pass)
    moe_gemm_share: float = 0.62
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
    # the run's own step token budget (TensorRT-LLM --max_num_tokens, vLLM --max-num-batched-tokens, as its
    # source or its harness set it); None: the stack's documented default (sizing.prefill_budget)
    max_num_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.scheduler_steps < 1:
            raise ValueError(f"scheduler_steps must be >= 1, got {self.scheduler_steps}")
        if self.eager or self.scheduler_steps > 1 or self.attention_dp:
            self._check_run_settings()
        if self.max_seqs is not None and self.max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {self.max_seqs}")
        if self.max_num_tokens is not None and self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {self.max_num_tokens}")
        if self.dense_precision is not None:
            check_precision(self.dense_precision)

    def _check_run_settings(self) -> None:
        """Refuse a run setting the stack has no switch for (:attr:`Stack.eager_flag`,
        :attr:`Stack.scheduler_steps_flag`, :attr:`Stack.attention_dp_flag`): the model would price a run nobody
        can start."""
        if self.device.kind != "hbm":
            setting = "eager" if self.eager else "scheduler_steps" if self.scheduler_steps > 1 else "attention_dp"
            raise UnsupportedSetting(setting, f"{self.device.key} is an SRAM machine running its vendor's compiled "
                                              "program: no CUDA graphs, host scheduler steps or attention DP to set")  # fmt: skip
        stk = self.serving
        for setting, on, flag, what in (
            ("eager", self.eager, stk.eager_flag, "switch to run without CUDA/HIP graphs"),
            ("scheduler_steps", self.scheduler_steps > 1, stk.scheduler_steps_flag, "multi-step scheduling"),
            ("attention_dp", self.attention_dp, stk.attention_dp_flag, "attention data parallelism"),
        ):  # fmt: skip
            if on and not flag:
                have = sorted(k for k, s in catalog_stacks().items() if getattr(s, f"{setting}_flag"))
                raise UnsupportedSetting(setting, f"the {stk.key} stack profile has no {what} (profiles that do: "
                                                  f"{', '.join(have)})")  # fmt: skip

    @property
    def dense_format(self) -> str:
        """The precision the weights outside the routed experts stream at (:func:`dense_weight_precision`)."""
        return dense_weight_precision(self.model, self.precision, self.dense_precision)

    @property
    def head_format(self) -> str:
        """The format the output head is stored and streamed at (:func:`head_weight_precision`)."""
        return head_weight_precision(self.dense_format, self.serving)

    @property
    def embedding_format(self) -> str:
        """The format the input embedding table is stored at (:func:`embedding_weight_precision`)."""
        return embedding_weight_precision(self.dense_format, self.serving)

    @property
    def stored_weight_bytes(self) -> float:
        """Bytes to hold every weight of the model as this system stores them (:func:`weight_bytes`)."""
        return weight_bytes(
            self.model, self.precision, self.dense_precision, self.head_format, self.embedding_format
        )

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
    def memo(self) -> dict[str, object]:
        """Quantities derived from this (frozen) system, kept once worked out because every engine step reads
        them (:func:`voicepipe.hardware.sizing.weight_split`)."""
        return {}


# ---------------------------------------------------------------- bytes


def bytes_per_param(precision: str) -> float:
    return PRECISIONS[check_precision(precision)]


def kv_bytes_per_token(model: ModelSpec, precision: str) -> float:
    """KV-cache bytes per token (all layers) with KV elements stored at ``precision``."""
    return model.kv_elems_per_token * PRECISIONS[check_kv_precision(precision)]


def dense_weight_precision(model: ModelSpec, precision: str, stated: str | None = None) -> str:
    """The precision of the weights outside the routed experts (attention, dense and shared MLPs, router;
    the embedding and output head of a quantised run aside, :func:`head_weight_precision`) of a run at
    ``precision``: ``stated`` where the run's checkpoint says (a GGUF's own layout), else the model's
    published checkpoint's (``ModelSpec.dense_precision``: gpt-oss keeps them in bf16 beside MXFP4 experts)
    when the run is at that checkpoint's precision, else ``precision``."""
    if stated is not None:
        return check_precision(stated)
    if model.dense_precision is not None and precision == model.default_precision:
        return model.dense_precision
    return precision


def table_bytes(fmt: str) -> float:
    """Bytes per weight of an embedding or head format: a precision, or a head-only one (HEAD_FORMATS)."""
    return HEAD_FORMATS[fmt] if fmt in HEAD_FORMATS else bytes_per_param(fmt)


def head_weight_precision(dense_format: str, stack: Stack) -> str:
    """The format the output head (``vocab x hidden``) is stored and streamed at, in a run whose weights
    outside the routed experts are at ``dense_format``: that format where it is 16-bit already; in a
    quantised run 16 bits, unless the stack quantises the head too (``Stack.quantized_head``: GGUF, gpt-fast,
    MLC), then the weights' format or the stack's floor where that is wider (``quantized_head_floor``:
    GGUF's Q6_K). The checkpoint tools and kernels of the datacenter stacks leave the head out of
    quantisation: NVIDIA ModelOpt's FP8, INT8, INT4-AWQ and NVFP4 configs all carry
    ``"*lm_head*": {"enable": False}`` (modelopt/torch/quantization/config.py ``_default_disabled_quantizer_cfg``,
    https://github.com/NVIDIA/TensorRT-Model-Optimizer/blob/09914046803993961dfefe763ba04fffed76aaec/modelopt/torch/quantization/config.py),
    and vLLM's FP8 method quantises ``LinearBase`` layers, MoE experts and the KV cache only
    (``Fp8Config.get_quant_method`` returns None for the ``ParallelLMHead``, an embedding;
    vllm/model_executor/layers/quantization/fp8.py)."""
    dense = bytes_per_param(dense_format)
    if dense >= 2.0:
        return dense_format
    if not stack.quantized_head:
        return "bf16"
    floor = stack.quantized_head_floor
    return floor if floor is not None and HEAD_FORMATS[floor] > dense else dense_format


def embedding_weight_precision(dense_format: str, stack: Stack) -> str:
    """The format the input embedding table is stored at: ``dense_format`` where it is 16-bit or the stack
    quantises the table (``Stack.quantized_embedding``: GGUF's token_embd, MLC's quantize_embedding), else
    16 bits (no quantiser replaces an ``nn.Embedding``: ModelOpt, llm-compressor, AWQ/GPTQ, vLLM's FP8,
    gpt-fast). It is never streamed whole (one row a token), so it weighs only in memory."""
    if stack.quantized_embedding or bytes_per_param(dense_format) >= 2.0:
        return dense_format
    return "bf16"


def weight_bytes(
    model: ModelSpec, precision: str, dense: str | None = None, head: str | None = None, embedding: str | None = None
) -> float:
    """Bytes to hold every weight: the routed experts at ``precision``, the output head at ``head``
    (:func:`head_weight_precision`) and the input embedding at ``embedding`` (one table, the head's, when
    they are tied), the rest at :func:`dense_weight_precision` (``dense``: the run's own statement of it);
    None: the head or the embedding with the rest."""
    rest, experts = _expert_split(model)
    dense_fmt = dense_weight_precision(model, precision, dense)
    table = float(model.vocab * model.hidden)
    tables = table * table_bytes(head or dense_fmt)
    if not model.tied_embeddings:
        tables += table * table_bytes(embedding or dense_fmt)
    return (rest - model.head_params) * bytes_per_param(dense_fmt) + tables + experts * bytes_per_param(precision)


def _expert_split(model: ModelSpec) -> tuple[float, float]:
    """(dense params, routed-expert params) from total/active and top-k of E."""
    if not model.is_moe:
        return model.total_params, 0.0
    share = model.experts_active / model.experts
    experts = (model.total_params - model.active_params) / (1.0 - share)
    return model.total_params - experts, experts


def _read_split(model: ModelSpec, tokens: ArrayLike) -> tuple[FArray, FArray]:
    """(dense params streamed, routed-expert params streamed) by one step over ``tokens`` tokens."""
    t = maximum(arr(tokens), 1.0)
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


def routed_params(model: ModelSpec) -> float:
    """Routed-expert params each token multiplies through (its top-k of E; 0 for a dense model)."""
    _, experts = _expert_split(model)
    return experts * (model.experts_active / model.experts if model.is_moe else 0.0)


def body_params(model: ModelSpec) -> float:
    """Params each token multiplies through outside the routed experts and the output head: attention,
    dense MLPs, shared experts, routers."""
    return matmul_params(model) - routed_params(model) - model.embed_params


def dp_own_params(system: System) -> float:
    """Params an attention-DP rank holds whole and runs over its own tokens only (0 without attention DP):
    the attention's, and where the stack keeps the MLPs on the rank too (``Stack.attention_dp_mlp`` "own")
    every param outside the routed experts and the head (:func:`body_params`; at least the attention's, which
    a model's rounded published active count can put below it: Qwen3 MoE)."""
    if not system.attention_dp:
        return 0.0
    attention = attention_params(system.model)
    return max(body_params(system.model), attention) if dp_keeps_mlps(system) else attention


def dp_keeps_mlps(system: System) -> bool:
    """Whether each rank of an attention-DP group keeps the MLPs, and the output head, whole
    (``Stack.attention_dp_mlp`` "own": TensorRT-LLM, whose LM head is replicated under attention DP unless
    the prototype ``enable_lm_head_tp_in_adp`` is set; vLLM, whose DP ranks are whole engines)."""
    return system.attention_dp and system.serving.attention_dp_mlp == "own"


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
