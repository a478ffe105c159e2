"""The types of the hardware catalog: a device, a model, a serving stack, with the sources of their numbers.

Every numeric field of an entry must have a source string of the same name under ``sources`` (models
group their architecture numbers under ``config`` and parameter counts under ``params``); validation
fails otherwise, so a number cannot enter the catalog without its provenance. Loading the shipped
entries, and a user's own files, is :mod:`voicepipe.hardware.catalog`'s (and :mod:`~voicepipe.hardware.byo`'s).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from voicepipe.hardware.num import maximum

PRECISIONS: dict[str, float] = {
    # bytes per weight; int4 carries one 8-bit scale per 32 weights (MXFP4 / group-wise int4) = 4.25 bits
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 4.25 / 8,
    # fp4: NVFP4 = 4-bit E2M1 values + one FP8 scale per 16 (4.5 bits); MXFP4 (8-bit scale per 32) is 4.25
    "fp4": 4.5 / 8,
}
# head-only formats, bytes per weight: GGUF's Q6_K (210 B per 256), llama.cpp's output.weight (llama-quant.cpp)
HEAD_FORMATS: dict[str, float] = {"q6_k": 6.5625 / 8}
# share of the datasheet bandwidth a STREAM-like kernel sustains where no measurement is recorded: the
# median of the devices with a `stream_bw_tbs` in data/devices.yaml (recorded shares 0.72-0.93, median 0.86; docs §2)
STREAM_SHARE_DEFAULT = 0.86
# share of the datasheet dense peak a matmul microbenchmark sustains where none is recorded: the median of
# the recorded `matmul_tflops` (Maximum Achievable Matmul FLOPS, 0.51-0.97; docs §2)
MAMF_SHARE_DEFAULT = 0.77
KV_PRECISIONS = ("bf16", "fp16", "fp8", "int8", "fp4")  # KV-cache element formats serving stacks offer
# the kernel a stack build runs a block-scaled FP8 checkpoint's dense GEMMs with, as far as its small-M speed
# goes (docs §1, *Block-scaled FP8 GEMMs at small M*): "tile_bound" (one SM per 128-column output tile, no
# split-K: Triton w8a8_block_fp8_matmul, CUTLASS sm90 blockwise), "deepgemm" (one SM per tile, the tile
# narrowed to 16 columns to fill the SMs), "none" (no tile limit modelled)
BlockFp8Gemm = Literal["tile_bound", "deepgemm", "none"]


# bytes per vendor "GB" of device memory (binary, see Device.capacity_bytes)
HBM_GB = float(2**30)


class Device(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = ""
    name: str
    kind: Literal["hbm", "sram"]
    peak_tflops: dict[str, float]
    price_per_chip_hour: float = Field(gt=0)
    sources: dict[str, str]
    # HBM devices
    memory_gb: float | None = Field(default=None, gt=0)
    mem_bw_tbs: float | None = Field(default=None, gt=0)
    # sustained bandwidth a published STREAM-like microbenchmark reaches on this device (None: not
    # published; STREAM_SHARE_DEFAULT of the datasheet figure is assumed)
    stream_bw_tbs: float | None = Field(default=None, gt=0)
    # dense matmul FLOP/s a published microbenchmark reaches, per precision (TFLOPS; absent precisions:
    # MAMF_SHARE_DEFAULT of the datasheet peak)
    matmul_tflops: dict[str, float] = Field(default_factory=dict)
    link_gbs: float | None = Field(default=None, gt=0)
    max_tp: int = Field(default=1, ge=1)
    allreduce_us: float | None = Field(default=None, gt=0)  # small-message all-reduce latency at tp 2
    # small-message latency (µs) of the stacks' custom one-shot all-reduce replayed in a CUDA/HIP graph, by
    # TP width (voicepipe.hardware.collective); empty: no custom path here (PCIe-only, TPU, Gaudi)
    custom_allreduce_us: dict[int, float] = Field(default_factory=dict)
    offload_gb: float | None = Field(default=None, gt=0)  # a slower tier weights may spill to (DDR)
    offload_bw_tbs: float | None = Field(default=None, gt=0)
    # SRAM devices
    sram_gb: float | None = Field(default=None, gt=0)
    sram_bw_tbs: float | None = Field(default=None, gt=0)
    layer_us: float | None = Field(default=None, gt=0)
    layer_bw_tbs: float | None = Field(default=None, ge=0)
    hop_us: float | None = Field(default=None, ge=0)
    # streaming multiprocessors (NVIDIA) or compute units (AMD) per chip: how many output tiles a GEMM
    # kernel runs at once (None: not recorded; no tile-bound GEMM term)
    sms: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _complete(self) -> Device:
        need = (
            ("memory_gb", "mem_bw_tbs", "link_gbs")
            if self.kind == "hbm"
            else ("sram_gb", "sram_bw_tbs", "layer_us", "layer_bw_tbs", "hop_us")
        )
        missing = [f for f in need if getattr(self, f) is None]
        if missing:
            raise ValueError(f"{self.kind} device lacks {', '.join(missing)}")
        if "bf16" not in self.peak_tflops:
            raise ValueError("peak_tflops needs a bf16 entry")
        if self.kind == "hbm" and self.max_tp > 1 and self.allreduce_us is None:
            raise ValueError("hbm device with max_tp > 1 lacks allreduce_us")
        if (self.offload_gb is None) != (self.offload_bw_tbs is None):
            raise ValueError("offload_gb and offload_bw_tbs go together")
        numeric = [*need, "peak_tflops", "price_per_chip_hour"] + (["max_tp"] if self.kind == "hbm" else [])
        numeric += [
            f
            for f in ("allreduce_us", "offload_gb", "offload_bw_tbs", "stream_bw_tbs", "sms")
            if getattr(self, f) is not None
        ]
        numeric += ["matmul_tflops"] if self.matmul_tflops else []
        if self.custom_allreduce_us:
            if any(w < 2 or us <= 0 for w, us in self.custom_allreduce_us.items()):
                raise ValueError("custom_allreduce_us: widths >= 2 and latencies > 0")
            numeric.append("custom_allreduce_us")
        unsourced = [f for f in numeric if not self.sources.get(f)]
        if unsourced:
            raise ValueError(f"no source for {', '.join(unsourced)}")
        return self

    def peak_flops(self, precision: str) -> float:
        """Dense FLOP/s per chip for matmuls at ``precision`` (weight-only formats fall back to bf16)."""
        return self.peak_tflops.get(precision, self.peak_tflops["bf16"]) * 1e12

    def matmul_flops(self, precision: str) -> float:
        """Sustained dense matmul FLOP/s at ``precision`` (weight-only formats run at the bf16 rate): the
        published microbenchmark figure, else the datasheet peak times the share the device's measured
        bf16 matmul reaches, else times MAMF_SHARE_DEFAULT."""
        rate = precision if precision in self.peak_tflops else "bf16"
        if rate in self.matmul_tflops:
            return self.matmul_tflops[rate] * 1e12
        if "bf16" in self.matmul_tflops:  # an unmeasured precision at the share the bf16 matmul reaches
            return self.peak_flops(rate) * self.matmul_tflops["bf16"] / self.peak_tflops["bf16"]
        return self.peak_flops(rate) * MAMF_SHARE_DEFAULT

    def weight_only(self, precision: str) -> bool:
        """True when ``precision`` has no math of its own here: weights are dequantised to bf16 in-kernel."""
        return precision not in self.peak_tflops and precision not in ("bf16", "fp16")

    @property
    def stream_bytes_s(self) -> float:
        """Sustained HBM bandwidth (B/s): the published microbenchmark figure, else the datasheet
        figure times STREAM_SHARE_DEFAULT (the median share of the recorded devices)."""
        if self.stream_bw_tbs is not None:
            return self.stream_bw_tbs * 1e12
        return float(self.mem_bw_tbs or 0.0) * 1e12 * STREAM_SHARE_DEFAULT

    @property
    def maker(self) -> str:
        """Who makes the device, as its catalog name starts ("NVIDIA", "AMD", "Intel", "Google", ...): the key
        a stack profile's per-maker build (``Stack.platforms``) and the interval cells are looked up by."""
        return self.name.split()[0] if self.name else self.key

    @property
    def capacity_bytes(self) -> float:
        """Memory (HBM) or SRAM bytes per chip.

        A GPU/accelerator vendor's memory figure is binary: "80 GB" is 80 GiB (five 16 GiB HBM3 stacks;
        nvidia-smi reports an H100 80GB HBM3 as 81,559 MiB = 85.5e9 bytes), so HBM/GDDR capacity is read as
        GiB. SRAM figures (Cerebras, Groq) stay decimal, as their fitted constants were set with them."""
        if self.kind == "hbm":
            return float(self.memory_gb or 0.0) * HBM_GB
        return float(self.sram_gb or 0.0) * 1e9


class Quality(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    benchmark: str
    score: float = Field(ge=0, le=100)


class PublicPrice(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    source: str


DENSE_MLP_OPS = 4.0  # a dense MLP block's operations (ModelSpec.layer_ops)
DENSE_LAYER_OPS = 10.0  # a dense GQA layer's (the unit the per-layer constant τ is fitted in)


class ModelSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = ""
    layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab: int = Field(gt=0)
    params_total_b: float = Field(gt=0)
    params_active_b: float | None = Field(default=None, gt=0)
    experts: int = Field(default=1, ge=1)
    experts_active: int = Field(default=1, ge=1)
    moe_layers: int | None = Field(default=None, gt=0)  # layers with routed experts (MoE; default all)
    kv_dim: int | None = Field(default=None, gt=0)
    # MLA: rank of the query's low-rank down-projection (DeepSeek-V3: q_lora_rank 1536); None: a full-rank query
    q_lora_rank: int | None = Field(default=None, gt=0)
    # intermediate width of the dense layers' MLP (DeepSeek-V3: intermediate_size 18432) and of the shared
    # experts of an MoE layer, all together (moe_intermediate_size x n_shared_experts: 2048); None: not
    # recorded, or no shared expert (the block-scaled FP8 GEMM term reads both; layer_ops counts a shared
    # expert's operations where shared_ffn is set)
    dense_ffn: int | None = Field(default=None, gt=0)
    shared_ffn: int | None = Field(default=None, gt=0)
    # the model's FP8 checkpoint scales its weights in square blocks of this many (DeepSeek-V3/R1, Kimi K2:
    # quantization_config weight_block_size [128, 128]): at fp8 its dense GEMMs run the stack's
    # block-scaled kernel (Stack.block_fp8_gemm); None: per-tensor/per-channel scales
    fp8_weight_block: int | None = Field(default=None, gt=0)
    # local attention: ``local_layers`` of the layers attend to (and cache) only the last ``window``
    # tokens: sliding windows (Mistral 7B v0.1, Gemma 2/3, gpt-oss) or chunked attention (Llama 4, whose
    # chunk bound is taken as a window: an upper bound on what a chunked layer holds)
    window: int | None = Field(default=None, gt=0)
    local_layers: int = Field(default=0, ge=0)
    tied_embeddings: bool = False
    default_precision: str = "bf16"
    # the precision the published checkpoint keeps outside the routed experts where only the experts are
    # stored at ``default_precision`` (gpt-oss: MXFP4 experts; attention, router, embedding and head in
    # bf16); None: every weight at the run's precision (a quantised run's embedding and head aside: System.
    # head_format). Applies to a run at ``default_precision`` (the published checkpoint), not to one
    # quantised otherwise (:func:`voicepipe.hardware.system.dense_weight_precision`)
    dense_precision: str | None = None
    quality: Quality | None = None
    prices: dict[str, PublicPrice] = Field(default_factory=dict)
    sources: dict[str, str]

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        for f in ("config", "params"):
            if not self.sources.get(f):
                raise ValueError(f"no source for {f}")
        if self.quality is not None and not self.sources.get("quality"):
            raise ValueError("no source for quality")
        if self.default_precision not in PRECISIONS:
            raise ValueError(f"default_precision {self.default_precision!r} not in {sorted(PRECISIONS)}")
        if self.dense_precision is not None:
            if self.dense_precision not in PRECISIONS:
                raise ValueError(f"dense_precision {self.dense_precision!r} not in {sorted(PRECISIONS)}")
            if self.experts < 2:
                raise ValueError("dense_precision applies to MoE models (the weights outside the routed experts)")
            if not self.sources.get("dense_precision"):
                raise ValueError("no source for dense_precision")
        if (self.experts > 1) != (self.params_active_b is not None):
            raise ValueError("MoE models need experts > 1 and params_active_b together")
        if self.experts_active > self.experts:
            raise ValueError("experts_active > experts")
        if self.params_active_b is not None and self.params_active_b > self.params_total_b:
            raise ValueError("params_active_b > params_total_b")
        if (self.window is None) != (self.local_layers == 0):
            raise ValueError("window and local_layers go together (local attention needs both)")
        if self.local_layers > self.layers:
            raise ValueError("local_layers > layers")
        if self.moe_layers is not None and self.moe_layers > self.layers:
            raise ValueError("moe_layers > layers")
        return self

    def held(self, context: Any) -> Any:
        """Full-token KV a sequence of ``context`` tokens (or an array) holds: local layers keep ``window``."""
        w = self.window
        return context if w is None else context - self.local_layers / self.layers * maximum(context - w, 0)

    @property
    def is_moe(self) -> bool:
        return self.experts > 1

    @property
    def routed_layers(self) -> int:
        """Layers that route tokens to experts (0 for a dense model)."""
        return 0 if not self.is_moe else (self.moe_layers or self.layers)

    @property
    def layer_ops(self) -> float:
        """Operations (kernels) a decode step runs per layer, on average over the layers, fused as every
        serving stack fuses them (residual add + norm, QKV, SiLU-and-mul; docs/hardware-model.md §1 and §3,
        nineteenth pass): attention GQA/MHA 6 (norm, QKV GEMM, rotary, cache write, attention, output GEMM) or MLA
        absorbed 12 (norm, q_a GEMM, q_a norm, q_b GEMM, kv_a GEMM, kv_a norm, W_UK batched GEMM, rotary,
        cache write, attention, W_UV batched GEMM, output GEMM; 10 without a query down-projection); MLP
        dense 4 (norm, gate-up GEMM, SiLU-and-mul, down GEMM), MoE 2 outside the routed chain that
        ``moe_route_s`` prices from top-k on (norm, router GEMM) and 3 more for shared experts where the model
        records them (``shared_ffn``: gate-up, activation, down)."""
        attention = 6.0 if self.kv_dim is None else (12.0 if self.q_lora_rank is not None else 10.0)
        moe = 2.0 + (3.0 if self.shared_ffn is not None else 0.0)
        routed = self.routed_layers
        return attention + (routed * moe + (self.layers - routed) * DENSE_MLP_OPS) / self.layers

    @property
    def total_params(self) -> float:
        return self.params_total_b * 1e9

    @property
    def active_params(self) -> float:
        return (self.params_active_b or self.params_total_b) * 1e9

    @property
    def embed_params(self) -> float:
        """Input embedding table (one row read per token; the rest of it is never streamed at decode)."""
        return float(self.vocab * self.hidden)

    @property
    def head_params(self) -> float:
        """Params of the input embedding and the output head as stored (one table when they are tied)."""
        return self.embed_params * (1.0 if self.tied_embeddings else 2.0)

    @property
    def gqa_group(self) -> float:
        """Query heads per KV head (1 for MHA and for MLA, whose latent every head reads once)."""
        return 1.0 if self.kv_dim is not None else self.heads / self.kv_heads

    @property
    def kv_elems_per_token(self) -> int:
        """KV-cache elements stored per token, all layers (GQA-aware; MLA via ``kv_dim``)."""
        per_layer = self.kv_dim if self.kv_dim is not None else 2 * self.kv_heads * self.head_dim
        return self.layers * per_layer


class EngineMemory(BaseModel):
    """What a serving engine keeps on each GPU besides the weights and the KV cache (docs §1, *Engine memory*).

    A stack sizes its KV pool from a memory budget (``share`` of the device memory: vLLM's
    gpu_memory_utilization, SGLang's mem_fraction_static by TP width; unset: ``Efficiency.usable_memory``)
    less the weights and this reserve, per GPU:

        reserve = context (non-torch memory the engine counts: CUDA context, NCCL / all-reduce buffers)
                + max(tokens · 2 B · (2·hidden + 3·ffn/tp),  seqs · vocab · logit_bytes)

    the activation peak of the start-up profile: one forward pass of ``tokens`` tokens (the residual and
    normed input, the gated MLP's up-projection and activation) or the sampler over ``seqs`` sequences'
    logits, whichever is larger (they do not overlap). Devices with at least ``large_gpu_gib`` of memory
    whose catalog key does not start with one of ``large_gpu_except`` profile ``large_tokens`` /
    ``large_seqs`` instead (vLLM V1's hardware-dependent defaults). Every number carries a source."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    share: float | None = Field(default=None, gt=0, le=1)
    share_by_tp: dict[int, float] = Field(default_factory=dict)  # TP width -> share (the largest key <= tp)
    context_gib: float = Field(default=0.0, ge=0)  # per GPU at TP 1
    context_tp_gib: float | None = Field(default=None, ge=0)  # per GPU at TP > 1 (None: context_gib)
    tokens: int = Field(default=0, ge=0)  # tokens the start-up profile runs through the model
    seqs: int = Field(default=0, ge=0)  # sequence slots whose logits the profile samples
    # bytes per sequence slot and vocabulary entry the sampler holds at its peak
    logit_bytes: float = Field(default=0.0, ge=0)
    large_gpu_gib: float | None = Field(default=None, gt=0)
    large_gpu_except: tuple[str, ...] = ()
    large_tokens: int | None = Field(default=None, ge=0)
    large_seqs: int | None = Field(default=None, ge=0)
    sources: dict[str, str]

    @model_validator(mode="after")
    def _sourced(self) -> EngineMemory:
        given = [f for f, info in type(self).model_fields.items()
                 if f != "sources" and getattr(self, f) != info.get_default(call_default_factory=True)]  # fmt: skip
        missing = [f for f in given if not self.sources.get(f)]
        if missing:
            raise ValueError(f"memory: no source for {', '.join(sorted(missing))}")
        if (self.large_gpu_gib is None) != (self.large_tokens is None and self.large_seqs is None):
            raise ValueError("memory: large_gpu_gib and large_tokens/large_seqs go together")
        return self


class Stack(BaseModel):
    """A serving stack's fixed costs (vLLM, SGLang, TensorRT-LLM, llama.cpp, ...); see data/stacks.yaml."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = ""
    name: str
    step_overhead_us: float = Field(ge=0)  # per engine step: scheduling, sampling, detokenisation
    layer_overhead_us: float = Field(ge=0)  # per layer per step: kernel gaps, norms, rotary
    # extra per layer launched eagerly (no CUDA/HIP graph): a step that prefills, or any step of an eager run
    prefill_layer_overhead_us: float = Field(ge=0)
    request_overhead_ms: float = Field(ge=0)  # per request, on TTFT, inside the engine: admit, first sample
    # per request, on TTFT, only where a client times it over HTTP: the OpenAI-compatible server's path
    # (HTTP, chat template and tokenisation, hand-off to the engine, detokenise and stream back)
    client_overhead_ms: float = Field(default=0.0, ge=0)
    # how this stack's TTFT is taken by default: "client" (a benchmark client over HTTP, the way a server
    # is used) or "engine" (the engine's own benchmark, no HTTP); System.timing overrides it
    timing: Literal["client", "engine"] = "engine"
    seq_overhead_us: float = Field(default=0.0, ge=0)  # per running sequence per step, host side
    # serial CPU time of the server's API process per streamed chunk (one per running request per step:
    # detokenise, build the response object, serialise and send it), only where a client streams the
    # tokens over HTTP (System.ttft_timing "client"). The API process runs beside the engine, so it bounds
    # a step from below (decoders x this) instead of adding to it: the server streams at most 1/this
    # chunks per second whatever the GPU does (0: no published ceiling)
    stream_chunk_us: float = Field(default=0.0, ge=0)
    # host time per layer to launch a forward whose attention runs eagerly between CUDA-graph pieces
    # (vLLM V1's piecewise graphs): it overlaps the GPU's work, so such a forward takes the longer of the
    # two (0: the forward replays whole graphs, or the per-layer host work is inside layer_overhead_us)
    host_layer_us: float = Field(default=0.0, ge=0)
    # which steps launch piecewise: "piecewise" (every step: vLLM V1 before v0.11) or
    # "full_and_piecewise" (decode-only steps replay one full graph, steps that prefill run piecewise)
    cudagraph_mode: Literal["piecewise", "full_and_piecewise"] = "full_and_piecewise"
    # True: the host schedules step n+1 while the GPU runs step n (vLLM's async scheduling, SGLang's overlap
    # scheduler): the per-step and per-sequence host work overlaps the forward instead of adding to it
    async_scheduling: bool = False
    # with async scheduling, the host time a step that overlaps nothing (sampled tokens to the next inputs)
    async_gap_us: float = Field(default=0.0, ge=0)
    multi_chip: Literal["tensor", "pipeline"] = "tensor"  # how it spreads a model over several chips
    # attention DP (System.attention_dp; attention_dp_flag: the stack's switch for it, "" none): the dense MLPs and
    # shared experts run "own" (whole on each rank over its own tokens) or "split" (over the group, tokens gathered)
    attention_dp_flag: str = ""
    attention_dp_mlp: Literal["own", "split"] = "own"
    # False: the decode attention kernel reads a GQA group's shared KV head once per query head
    gqa_kv_shared: bool = True
    # False: as gqa_kv_shared False, but only for a model with local (sliding-window) attention, which the stack
    # decodes with another kernel (vLLM V0 up to v0.6.3 on CUDA: XFormers with its paged attention, not FlashAttention)
    local_gqa_kv_shared: bool = True
    # query heads one read of a KV head serves (a decode kernel with that many heads per thread block,
    # taken at the largest power of two ≤ it that divides the GQA group); None: the whole group
    gqa_heads_per_read: int | None = Field(default=None, ge=1)
    # share of the modelled KV streaming rate (η_mem × sustained bandwidth) the decode attention kernel
    # reaches on the cache it reads, re-reads included (1: the rate of the stack's native kernel; a build
    # that decodes with a general kernel another maker's devices were tuned for reaches less)
    decode_kv_eff: float = Field(default=1.0, gt=0, le=1)
    # extra time of the 16-bit dense weight GEMMs in a step of M tokens (entry M − 1: M = 1, 2, ...) as a
    # multiple of the dense weight bytes over the device's sustained bandwidth: a build whose small-M GEMMs
    # run a BLAS library's general kernels where the stack's own build runs skinny-GEMM kernels (empty: none)
    small_m_gemm_extra: tuple[float, ...] = ()
    # True: the prefill pass covers the prompt but its last token, and the first output token comes from
    # the first decode step (TurboMind before v0.1.0's unified pass; TTFT = prefill(P − 1) + one decode step)
    first_token_from_decode: bool = False
    # True: the KV cache keeps only a local layer's window (what falls out is freed: vLLM's hybrid KV-cache
    # manager, TensorRT-LLM's per-window pools, llama.cpp's SWA cache), so a sequence holds ModelSpec.held
    # tokens; False: every token on every layer stays allocated (the kernels still read only the window)
    window_kv: bool = False
    # the output head and the input embedding of a quantised run: 16-bit unless the stack's format quantises
    # them (GGUF, gpt-fast, MLC), the head then never narrower than quantized_head_floor (a HEAD_FORMATS
    # key: GGUF's Q6_K); System.head_format, System.embedding_format
    quantized_head: bool = False
    quantized_head_floor: Literal["q6_k"] | None = None
    quantized_embedding: bool = False
    # how the scheduler admits a request into the KV cache: "grow" (paged blocks allocated as it grows, so
    # the running batch is what fits at the mean context: vLLM, SGLang, LMDeploy) or "reserve" (prompt +
    # maximum output reserved at admission, never evicted: TensorRT-LLM's default GUARANTEED_NO_EVICT)
    kv_admission: Literal["grow", "reserve"] = "grow"
    # how the KV pool is sized: "total" (a share of the whole memory less the weights: vLLM, SGLang) or
    # "free" (a share of what the loaded weights leave: TensorRT-LLM); the share is Efficiency.usable_memory
    kv_pool: Literal["total", "free"] = "total"
    # the KV-cache format when none is given: "weights" (theirs if a KV format, else bf16: TensorRT-LLM) or
    # "activations" (16-bit whatever the weights: vLLM's and SGLang's "auto"), system.default_kv_precision
    kv_default: Literal["weights", "activations"] = "weights"
    # tokens one engine step may carry (the decoders' tokens first, then waiting prompts' prefill tokens, in
    # arrival order: vLLM's max_num_batched_tokens, SGLang's chunked_prefill_size, TensorRT-LLM's
    # max_num_tokens); None: one whole prompt per step, alone with the decoders
    prefill_token_budget: int | None = Field(default=None, ge=1)
    # True: a prompt longer than the room left in a step is split, its rest continuing in the next steps
    # (chunked prefill); False: it waits for a step with room (one alone in a step always runs). Applies
    # where the step has a budget: the profile's, or a run's own (System.max_num_tokens)
    prefill_chunked: bool = False
    # False: a step that prefills carries no decoders, who wait for it (SGLang's prefill batches without
    # --enable-mixed-chunk); True: prefill shares the step with the decoders (vLLM V1, TensorRT-LLM)
    prefill_mixed: bool = True
    # 1: the scheduler forms the next batch while a step runs (an overlap scheduler), so a request arriving
    # mid-step runs a step later (engine._State.receive); 0: it forms each batch between steps
    schedule_ahead: int = Field(default=0, ge=0, le=1)
    # what the engine keeps per GPU besides weights and KV (activation peak, non-torch memory) and the share
    # of memory it budgets; None: nothing (the pool is Efficiency.usable_memory of the memory less the weights)
    memory: EngineMemory | None = None
    # the engine's default cap on sequences running at once (vLLM max_num_seqs, SGLang max_running_requests,
    # TensorRT-LLM max_batch_size), and the cap on a device the memory block's large-device rule picks
    # (memory.large_gpu_gib / large_gpu_except: vLLM V1's 1,024 on H100-class GPUs); None: no cap beyond
    # what fits in memory. System.max_seqs (the run's own setting) overrides both (system.seq_cap)
    max_seqs: int | None = Field(default=None, ge=1)
    max_seqs_large: int | None = Field(default=None, ge=1)
    # the all-reduce it runs for tensor parallelism (voicepipe.hardware.collective): "nccl" (NCCL/RCCL for every
    # message) or "custom" (its own one-shot kernel below allreduce_oneshot_bytes, two-shot below
    # allreduce_max_bytes, NCCL above; on devices with a custom path, Device.custom_allreduce_us). The limits
    # are by TP width, each entry holding for groups up to that width; wider groups run NCCL
    allreduce: Literal["nccl", "custom"] = "nccl"
    allreduce_oneshot_bytes: dict[int, int] = Field(default_factory=dict)
    allreduce_max_bytes: dict[int, int] = Field(default_factory=dict)
    # the kernel this build runs a block-scaled FP8 checkpoint's dense GEMMs with (BlockFp8Gemm; a run's own
    # setting, System.block_fp8_gemm, overrides it)
    block_fp8_gemm: BlockFp8Gemm = "none"
    # the run settings this stack has a switch for ("": none, and a run asking for it is refused): the option
    # that turns its CUDA/HIP graphs off (System.eager: vLLM --enforce-eager, SGLang --disable-cuda-graph) and
    # the one that schedules N decode steps at once (System.scheduler_steps: vLLM V0 --num-scheduler-steps)
    eager_flag: str = ""
    scheduler_steps_flag: str = ""
    # the build of this profile on one maker's devices, where it differs ("AMD": the ROCm build): the fields
    # that differ, a ``name`` saying which build it is, and ``sources`` for each field (see Stack.on)
    platforms: dict[str, dict[str, Any]] = Field(default_factory=dict)
    sources: dict[str, str]
    _builds: dict[str, Stack] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _sourced(self) -> Stack:
        missing = [
            f
            for f in ("step_overhead_us", "layer_overhead_us", "request_overhead_ms")
            if not self.sources.get(f)
        ]
        for f in ("seq_overhead_us", "client_overhead_ms", "host_layer_us", "async_gap_us", "stream_chunk_us"):
            if getattr(self, f) > 0 and not self.sources.get(f):
                missing.append(f)
        if self.timing != "engine" and not self.sources.get("timing"):
            missing.append("timing")
        for flag in ("gqa_kv_shared", "local_gqa_kv_shared"):
            if not getattr(self, flag) and not self.sources.get(flag):
                missing.append(flag)
        if self.gqa_heads_per_read is not None and not self.sources.get("gqa_heads_per_read"):
            missing.append("gqa_heads_per_read")
        if self.decode_kv_eff != 1.0 and not self.sources.get("decode_kv_eff"):
            missing.append("decode_kv_eff")
        if any(x < 0 for x in self.small_m_gemm_extra):
            raise ValueError("small_m_gemm_extra: an extra time cannot be negative")
        if self.small_m_gemm_extra and not self.sources.get("small_m_gemm_extra"):
            missing.append("small_m_gemm_extra")
        if self.prefill_token_budget is not None and not self.sources.get("prefill_token_budget"):
            missing.append("prefill_token_budget")
        if not self.prefill_mixed and not self.sources.get("prefill_mixed"):
            missing.append("prefill_mixed")
        for f in ("max_seqs", "max_seqs_large"):
            if getattr(self, f) is not None and not self.sources.get(f):
                missing.append(f)
        if self.max_seqs_large is not None and (self.memory is None or self.memory.large_gpu_gib is None):
            raise ValueError("max_seqs_large needs memory.large_gpu_gib (the large-device rule)")
        if self.allreduce == "custom":
            if not self.allreduce_oneshot_bytes or not self.allreduce_max_bytes:
                raise ValueError("allreduce custom needs allreduce_oneshot_bytes and allreduce_max_bytes")
            missing += [f for f in ("allreduce", "allreduce_oneshot_bytes", "allreduce_max_bytes")
                        if not self.sources.get(f)]  # fmt: skip
        if self.block_fp8_gemm != "none" and not self.sources.get("block_fp8_gemm"):
            missing.append("block_fp8_gemm")
        for f, on in (("eager_flag", self.eager_flag), ("scheduler_steps_flag", self.scheduler_steps_flag),
                      ("attention_dp_flag", self.attention_dp_flag), ("attention_dp_mlp", self.attention_dp_flag)):
            missing += [f] if on and not self.sources.get(f) else []
        if self.host_layer_us > 0 and not self.sources.get("cudagraph_mode"):
            missing.append("cudagraph_mode")
        for flag in ("first_token_from_decode", "window_kv", "prefill_chunked", "async_scheduling", "quantized_head",
                     "quantized_head_floor", "quantized_embedding", "schedule_ahead"):  # fmt: skip
            if getattr(self, flag) and not self.sources.get(flag):
                missing.append(flag)
        for key, default in (("kv_admission", "grow"), ("kv_pool", "total"), ("kv_default", "weights")):
            if getattr(self, key) != default and not self.sources.get(key):
                missing.append(key)
        if missing:
            raise ValueError(f"no source for {', '.join(missing)}")
        for maker in self.platforms:
            self._build(maker)  # each maker's build must be a valid, sourced profile itself
        return self

    def __copy__(self) -> Stack:
        """A shallow copy with builds of its own: ``model_copy(update=...)`` changes the copy's fields after
        this, so a build cached on the original (or one the copy would cache into a shared dict) would be
        the wrong profile's (:meth:`on`)."""
        copied = super().__copy__()
        copied._builds = {}
        return copied

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Stack:
        copied = super().__deepcopy__(memo)
        copied._builds = {}  # as __copy__: a deep copy may be updated too (model_copy(deep=True, update=...))
        return copied

    def on(self, maker: str) -> Stack:
        """This profile as it runs on ``maker``'s devices (:attr:`Device.maker`): the profile itself, or with
        the fields of its ``platforms[maker]`` build in place (e.g. vLLM V0's ROCm build on AMD devices),
        whose ``name`` says which build it is and whose ``sources`` replace the profile's for those fields.
        The result is a profile without ``platforms`` of its own, validated like any other."""
        if maker not in self.platforms:
            return self
        if maker not in self._builds:
            self._builds[maker] = self._build(maker)
        return self._builds[maker]

    def _build(self, maker: str) -> Stack:
        """The ``platforms[maker]`` build (see :meth:`on`); ValueError for a field a profile does not have,
        a build without a ``name``, or a changed field without its source."""
        over = self.platforms[maker]
        unknown = set(over) - (set(Stack.model_fields) - {"key", "platforms"})
        if unknown or "name" not in over:
            why = f"unknown field(s) {', '.join(sorted(unknown))}" if unknown else "no name for the build"
            raise ValueError(f"platforms.{maker}: {why}")
        changed = {k: v for k, v in over.items() if k != "sources"}
        given = over.get("sources") or {}
        missing = [f for f in changed if f != "name" and not given.get(f)]
        if missing:
            raise ValueError(f"platforms.{maker}: no source for {', '.join(missing)}")
        base = self.model_dump(exclude={"platforms", "sources"})
        return Stack(**{**base, **changed, "sources": {**self.sources, **given}})


def kv_rereads(stack: Stack, group: float, local: bool = False) -> float:
    """How many times a decode step reads each KV head: 1 for a kernel that serves the whole GQA group
    from one read, the group size for one that reads it once per query head (``gqa_kv_shared: false``, or
    ``local_gqa_kv_shared: false`` for a model with local attention, ``local``), else the group over the
    heads one read serves (``gqa_heads_per_read``)."""
    if not stack.gqa_kv_shared or (local and not stack.local_gqa_kv_shared):
        return group
    if stack.gqa_heads_per_read is None or group <= 1:
        return 1.0
    g = round(group)
    h = stack.gqa_heads_per_read
    while h > 1 and g % h:
        h //= 2
    return g / h


class QualityOnly(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    quality: Quality
    sources: dict[str, str]
