"""Bring your own model or device: a Hugging Face ``config.json`` or a device YAML file, read offline.

:func:`load_hf_config` maps the fields of a ``config.json`` to a :class:`~voicepipe.hardware.specs.
ModelSpec`: dense and GQA (``num_key_value_heads``), MoE (``num_local_experts`` / ``num_experts`` /
``n_routed_experts`` with ``num_experts_per_tok``, shared experts, ``first_k_dense_replace``,
``moe_intermediate_size``), MLA (``kv_lora_rank`` + ``qk_rope_head_dim`` cached per token per layer) and
local attention (sliding windows and Llama 4's chunks: :func:`_local_attention`).
Parameter counts are computed from the shapes (attention, gated MLP or experts, norms, embeddings);
multimodal configs are read from their ``text_config``. :func:`load_device` reads a YAML mapping with
the fields of a catalog device (``voicepipe hardware show h100-sxm``) and checks it the same way.

Both files are read through the file guard (:mod:`voicepipe.files`: regular files only, size and depth
bounded). Errors are one line naming the file and the field (``ValueError``; the CLI exits 2 on them).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from voicepipe.errors import UserError
from voicepipe.files import read_json, read_yaml_mapping
from voicepipe.hardware.specs import Device, ModelSpec
from voicepipe.limits import MAX_MODEL_JSON_BYTES

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "bf16", "fp8": "fp8"}


def _first(cfg: dict[str, Any], *names: str) -> Any:
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return None


class _Reader:
    """Typed access to a config dict; every error names the file and the field."""

    def __init__(self, path: str, cfg: dict[str, Any]) -> None:
        self.path, self.cfg = path, cfg

    def fail(self, field: str, msg: str) -> ValueError:
        return ValueError(f"{self.path}: {field}: {msg}")

    def int_(self, *names: str, default: int | None = None, lo: int = 1) -> int:
        value = _first(self.cfg, *names)
        if value is None:
            if default is not None:
                return default
            raise self.fail(names[0], "missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise self.fail(names[0], f"must be an integer >= {lo}, got {value!r}")
        return value


def _gated(cfg: dict[str, Any]) -> bool:
    """Whether the MLP has gate + up projections (SwiGLU/GeGLU); GPT-2/J/NeoX/Falcon/Phi-2 do not."""
    act = str(_first(cfg, "hidden_act", "activation_function", "hidden_activation") or "silu")
    return any(a in act for a in ("silu", "swish", "gelu_pytorch_tanh")) and cfg.get("model_type") not in (
        "gptj",
        "gpt_neox",
        "falcon",
        "gpt2",
    )


_LOCAL_TYPES = ("sliding_attention", "chunked_attention")
_ATTENTION_TYPES = ("full_attention", *_LOCAL_TYPES)
# fields that mark layers which are not attention (linear attention, Mamba/SSM blocks): their weights and
# recurrent state differ from an attention layer's, so reading such a config as attention would be wrong
_HYBRID_FIELDS = (
    "hybrid_override_pattern",  # Nemotron-H
    "layers_block_type",  # Zamba, Bamba
    "attn_layer_indices",
    "attn_layer_period",  # Jamba
    "full_attention_interval",  # Qwen3-Next
)
# architectures that are state-space or recurrent throughout, or mix such layers in
_HYBRID_TYPES = ("mamba", "mamba2", "jamba", "falcon_h1", "nemotron_h", "zamba", "zamba2", "bamba",
                 "granitemoehybrid", "qwen3_next", "recurrent_gemma", "rwkv", "lfm2", "falcon_mamba")  # fmt: skip


def _no_hybrid(r: _Reader, cfg: dict[str, Any]) -> None:
    """Refuse (one line naming the field) a config with layers that are not attention."""
    types = cfg.get("layer_types")
    if isinstance(types, list):
        other = sorted({str(t) for t in types if t not in _ATTENTION_TYPES})
        if other:
            raise r.fail("layer_types", f"{', '.join(other)} layers are not modelled (attention layers only)")
    kinds = cfg.get("attn_type_list")  # MiniMax: 0 = lightning (linear) attention, 1 = softmax attention
    if isinstance(kinds, list) and 0 in kinds:
        raise r.fail("attn_type_list", "linear-attention layers (0) are not modelled (attention layers only)")
    for f in _HYBRID_FIELDS:
        if cfg.get(f) is not None:
            raise r.fail(f, "hybrid models (linear-attention or state-space layers) are not modelled")
    if cfg.get("model_type") in _HYBRID_TYPES:
        raise r.fail("model_type", f"{cfg['model_type']}: state-space or hybrid layers are not modelled")


# architectures whose ``sliding_window``, with nothing else said, applies to every layer
_SLIDE_EVERY_LAYER = ("mistral", "mixtral", "phi3", "starcoder2")
_QWEN = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def _local_attention(r: _Reader, cfg: dict[str, Any], layers: int) -> tuple[int | None, int]:
    """(window, local layers) of a config's local attention, or (None, 0).

    Read from, in order: ``layer_types`` (newer transformers: "sliding_attention" / "chunked_attention"
    per layer); Llama 4's ``attention_chunk_size`` on its RoPE layers (``no_rope_layers``: 1 = RoPE,
    chunked; else every ``no_rope_layer_interval``-th layer global); ``sliding_window_layers`` (the local
    layers' indices); ``sliding_window_pattern`` (Gemma 3: every N-th layer global; EXAONE 4: a string
    such as "LLLG", L = local); Gemma 2 (alternating); Qwen's ``use_sliding_window`` with
    ``max_window_layers`` (transformers: the layers from there on slide; default 28); a plain
    ``sliding_window`` on every layer only for the architectures known to do that (Mistral 7B v0.1,
    Mixtral, Phi-3, StarCoder2). A null window, Qwen's switch off, or a window on an architecture whose
    layout is not known here reads as full attention (more KV than the truth, never less)."""
    chunk = _first(cfg, "attention_chunk_size")
    window_field = "attention_chunk_size" if chunk is not None else "sliding_window"
    if _first(cfg, window_field) is None or cfg.get("use_sliding_window") is False:
        return None, 0
    window = r.int_(window_field)
    kind = cfg.get("model_type")
    types = cfg.get("layer_types")
    pattern = _first(cfg, "sliding_window_pattern")
    listed = cfg.get("sliding_window_layers")
    if isinstance(types, list) and types:
        local = sum(1 for t in types[:layers] if t in _LOCAL_TYPES)
    elif chunk is not None:
        nope = cfg.get("no_rope_layers")
        if isinstance(nope, list) and nope:
            local = sum(1 for v in nope[:layers] if v)
        else:
            every = r.int_("no_rope_layer_interval", default=4)
            local = layers - layers // every
    elif isinstance(listed, list):
        local = len({i for i in listed if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers})
    elif isinstance(pattern, str):
        if not pattern or set(pattern.upper()) - {"L", "G"}:
            raise r.fail(
                "sliding_window_pattern", f"expected an integer or a string of L and G, got {pattern!r}"
            )
        local = sum(1 for i in range(layers) if pattern.upper()[i % len(pattern)] == "L")
    elif pattern is not None:
        every = r.int_("sliding_window_pattern")
        local = layers - layers // every
    elif kind == "gemma2":
        local = layers - layers // 2
    elif kind in _QWEN:
        if cfg.get("use_sliding_window") is not True:
            return None, 0
        local = layers - min(r.int_("max_window_layers", default=28, lo=0), layers)
    elif kind in _SLIDE_EVERY_LAYER:
        local = layers
    else:
        return None, 0
    return (window, local) if local > 0 else (None, 0)


@cache
def load_hf_config(path: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face ``config.json`` (raises ValueError naming the file and field)."""
    source = str(path)
    try:
        raw = read_json(path, MAX_MODEL_JSON_BYTES)
    except UserError as exc:  # the file guard's one line, which names the file
        raise ValueError(str(exc)) from None
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: top level must be a JSON object")
    cfg: dict[str, Any] = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    r = _Reader(source, cfg)
    _no_hybrid(r, cfg)
    layers = r.int_("num_hidden_layers", "n_layer", "num_layers")
    hidden = r.int_("hidden_size", "n_embd", "d_model")
    heads = r.int_("num_attention_heads", "n_head", "num_heads")
    kv_heads = r.int_("num_key_value_heads", "num_kv_heads", default=heads)
    if cfg.get("multi_query") is True and "num_kv_heads" not in cfg:
        kv_heads = 1
    head_dim = r.int_("head_dim", default=hidden // heads)
    vocab = r.int_("vocab_size")
    inter = r.int_("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    tied = bool(cfg.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)))
    experts = r.int_("num_local_experts", "num_experts", "n_routed_experts", default=1)
    top_k = r.int_("num_experts_per_tok", "num_experts_per_token", "moe_topk", default=1)
    if experts > 1 and top_k > experts:
        raise r.fail("num_experts_per_tok", f"{top_k} > number of experts {experts}")
    kv_lora = _first(cfg, "kv_lora_rank")
    kv_dim: int | None = None
    q_rank: int | None = None
    if kv_lora is not None:  # multi-head latent attention (DeepSeek-V2/V3, Kimi K2)
        rope = r.int_("qk_rope_head_dim")
        nope = r.int_("qk_nope_head_dim")
        v_dim = r.int_("v_head_dim")
        q_lora = _first(cfg, "q_lora_rank")
        q_rank = r.int_("q_lora_rank") if q_lora else None
        kv_lora = r.int_("kv_lora_rank")
        kv_dim = kv_lora + rope
        q_in = hidden * q_lora + q_lora * heads * (nope + rope) if q_lora else hidden * heads * (nope + rope)
        attn = q_in + hidden * (kv_lora + rope) + kv_lora * heads * (nope + v_dim) + heads * v_dim * hidden
        head_dim = (
            nope  # the catalog's convention for MLA: the no-rope score width (= v_head_dim for DeepSeek)
        )
    else:
        attn = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp_mats = 3 if _gated(cfg) else 2
    dense_mlp = mlp_mats * hidden * inter
    total = active = 0.0
    moe_layers = 0
    shared_ffn: int | None = None
    if experts > 1:
        expert_inter = r.int_("moe_intermediate_size", "expert_intermediate_size", default=inter)
        shared = r.int_("n_shared_experts", "num_shared_experts", default=0, lo=0)
        shared_inter = r.int_("shared_expert_intermediate_size", default=expert_inter * max(shared, 1))
        first_dense = r.int_("first_k_dense_replace", default=0, lo=0)
        step = r.int_("interleave_moe_layer_step", "decoder_sparse_step", default=1)
        moe_layers = len([i for i in range(first_dense, layers) if (i + 1) % step == 0 or step == 1])
        dense_layers = layers - moe_layers
        one_expert = mlp_mats * hidden * expert_inter
        shared_p = (
            mlp_mats * hidden * shared_inter if shared or "shared_expert_intermediate_size" in cfg else 0
        )
        router = hidden * experts
        shared_ffn = shared_inter if shared_p else None
        total = (
            layers * attn + dense_layers * dense_mlp + moe_layers * (experts * one_expert + shared_p + router)
        )
        active = (
            layers * attn + dense_layers * dense_mlp + moe_layers * (top_k * one_expert + shared_p + router)
        )
    else:
        total = active = layers * (attn + dense_mlp)
    embed = vocab * hidden * (1 if tied else 2)
    total, active = total + embed, active + embed
    window, local_layers = _local_attention(r, cfg, layers)
    dtype = str(cfg.get("torch_dtype") or raw.get("torch_dtype") or "bfloat16")
    quant: dict[str, Any] = (
        raw["quantization_config"] if isinstance(raw.get("quantization_config"), dict) else {}
    )
    qmethod = str(quant.get("quant_method", ""))
    # MXFP4 (gpt-oss) as int4: 4.25 bits per weight, dequantised in the kernel (the catalog's gpt-oss default)
    precision = "fp8" if qmethod == "fp8" else "int4" if qmethod in ("awq", "gptq", "mxfp4") else None
    # an MXFP4 checkpoint that leaves the attention unconverted (gpt-oss: modules_to_not_convert names
    # self_attn, the router, the embedding and lm_head) stores only the experts in 4 bits, the rest in its dtype
    skipped = quant.get("modules_to_not_convert") or []
    dense = (
        _DTYPES.get(dtype, "bf16")
        if qmethod == "mxfp4" and experts > 1 and any("self_attn" in str(x) for x in skipped)
        else None
    )
    # an FP8 checkpoint scaled in square blocks (DeepSeek-V3: weight_block_size [128, 128]) runs the stack's
    # block-scaled GEMM kernel (docs §1, Block-scaled FP8 GEMMs at small M)
    block = quant.get("weight_block_size")
    fp8_block: int | None = None
    if qmethod == "fp8" and isinstance(block, list) and len(block) == 2 and block[0] == block[1]:
        fp8_block = block[0] if isinstance(block[0], int) and block[0] > 0 else None
    fields: dict[str, Any] = {
        "key": source,
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab": vocab,
        "params_total_b": total / 1e9,
        "params_active_b": active / 1e9 if experts > 1 else None,
        "experts": experts,
        "experts_active": top_k if experts > 1 else 1,
        "moe_layers": moe_layers if experts > 1 else None,
        "kv_dim": kv_dim,
        "q_lora_rank": q_rank,
        "dense_ffn": inter if experts == 1 or layers > moe_layers else None,
        "shared_ffn": shared_ffn,
        "fp8_weight_block": fp8_block,
        "window": window,
        "local_layers": local_layers,
        "tied_embeddings": tied,
        "default_precision": precision or _DTYPES.get(dtype, "bf16"),
        "dense_precision": dense,
        "sources": {
            "config": f"{source} (read offline)",
            "params": f"computed from the shapes in {source}",
            "quality": "none: a user-supplied config.json carries no benchmark score",
            **({"dense_precision": f"{source}: quantization_config.modules_to_not_convert"} if dense else {}),
        },
    }
    try:
        return ModelSpec(**fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "config"
        raise ValueError(f"{source}: {loc}: {err['msg'].removeprefix('Value error, ')}") from None


@cache
def load_device(path: str) -> Device:
    """A Device from a YAML file with the fields of a catalog device (one-line errors name the field)."""
    source = str(path)
    try:
        data = read_yaml_mapping(Path(path), "a device mapping")
    except UserError as exc:  # the file guard's one line, which names the file
        raise ValueError(str(exc)) from None
    data.setdefault("name", Path(path).stem)
    data.setdefault("sources", {})
    try:
        return Device(key=source, **data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = (
            "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        )
        raise ValueError(f"{source}: {loc + ': ' if loc else ''}{msg}") from None
    except TypeError as exc:
        raise ValueError(f"{source}: {exc}") from None
