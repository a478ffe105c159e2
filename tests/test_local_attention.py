"""Local attention (sliding windows, Llama 4's chunks): a local layer caches and reads at most ``window``
tokens, so long contexts cost less KV memory and bandwidth; at or below the window nothing changes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from voicepipe.hardware import catalog
from voicepipe.hardware.byo import load_hf_config
from voicepipe.hardware.model import decode_step_s, make_system, max_sequences, predict

GEMMA = catalog.model("gemma-3-27b")


def without_window(m: catalog.ModelSpec) -> catalog.ModelSpec:
    return m.model_copy(update={"window": None, "local_layers": 0})


def test_a_sequence_holds_the_window_on_local_layers():
    assert GEMMA.held(1000) == 1000  # inside the window: every layer holds every token
    assert GEMMA.held(1024) == 1024
    # 10 global layers hold all 32,768; 52 local ones 1,024: 32,768 - 52/62 x 31,744
    assert GEMMA.held(32768) == pytest.approx(32768 - 52 / 62 * (32768 - 1024))
    assert np.all(np.diff(GEMMA.held(np.arange(1, 70000, 997))) > 0)  # still grows (the global layers)


def test_local_attention_saves_memory_and_time_only_past_the_window():
    dev = catalog.device("h100-sxm")
    full = without_window(GEMMA)
    sys_w = make_system(dev, GEMMA, "bf16", context=4096)
    sys_f = make_system(dev, full, "bf16", context=4096)
    assert sys_w.chips == sys_f.chips
    assert max_sequences(sys_w, 32768) > 3 * max_sequences(sys_f, 32768)
    assert max_sequences(sys_w, 1024) == max_sequences(sys_f, 1024)
    for ctx in (256, 1024):
        assert decode_step_s(sys_w, 8, ctx) == pytest.approx(decode_step_s(sys_f, 8, ctx))
    contexts = np.array([2048.0, 8192.0, 32768.0])
    w, f = decode_step_s(sys_w, 32, contexts), decode_step_s(sys_f, 32, contexts)
    assert np.all(w < f) and np.all(np.diff(w) > 0)
    long = predict(dev, GEMMA, batch=16, prompt_tokens=30000, output_tokens=500)
    assert long.kv_gb < predict(dev, full, batch=16, prompt_tokens=30000, output_tokens=500).kv_gb / 3


def test_memory_holds_the_window_only_where_the_stack_frees_it():
    """SGLang keeps every token of a Gemma layer allocated (its hybrid SWA pool is off for Gemma 2/3): the
    same reads as vLLM, but no more sequences fit than with full attention."""
    dev = catalog.device("h100-sxm")
    assert catalog.stack("vllm").window_kv and not catalog.stack("sglang").window_kv
    keeps = make_system(dev, GEMMA, "bf16", context=4096, stack=catalog.stack("sglang"))
    frees = make_system(dev, GEMMA, "bf16", context=4096, stack=catalog.stack("vllm"))
    full = make_system(dev, without_window(GEMMA), "bf16", context=4096, stack=catalog.stack("sglang"))
    assert max_sequences(keeps, 32768) == max_sequences(full, 32768) < max_sequences(frees, 32768)
    assert decode_step_s(keeps, 8, 32768) < decode_step_s(full, 8, 32768)


def test_a_window_needs_its_layer_count():
    with pytest.raises(ValueError, match="window and local_layers go together"):
        without_window(GEMMA).model_validate({**GEMMA.model_dump(), "local_layers": 0})
    with pytest.raises(ValueError, match="local_layers > layers"):
        catalog.ModelSpec.model_validate({**GEMMA.model_dump(), "local_layers": 63})


def hf(tmp_path, cfg: dict) -> catalog.ModelSpec:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    load_hf_config.cache_clear()
    return load_hf_config(str(p))


BASE = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 24,
        "intermediate_size": 4096, "vocab_size": 32000}  # fmt: skip


def test_gpt_oss_layer_types(tmp_path):
    # openai/gpt-oss-20b config.json (the fields the model reads): alternating sliding/full layers
    m = hf(tmp_path, {
        "model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880, "intermediate_size": 2880,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
        "num_local_experts": 32, "num_experts_per_tok": 4, "hidden_act": "silu", "tie_word_embeddings": False,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "quantization_config": {"quant_method": "mxfp4"},
    })  # fmt: skip
    assert (m.window, m.local_layers) == (128, 12)
    assert m.default_precision == "int4"  # MXFP4: 4.25 bits, as the catalog records gpt-oss
    assert m.params_total_b == pytest.approx(20.9, rel=0.05)  # model card: 21B total (20.9B)
    cat = catalog.model("gpt-oss-20b")
    assert (cat.window, cat.local_layers, cat.layers) == (m.window, m.local_layers, m.layers)


def test_gemma3_pattern_llama4_chunks_mistral_and_switched_off(tmp_path):
    gemma = {"model_type": "gemma3", "text_config": {**BASE, "num_hidden_layers": 62, "sliding_window": 1024,
             "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh"}}  # fmt: skip
    assert (hf(tmp_path, gemma).window, hf(tmp_path, gemma).local_layers) == (1024, 52)
    llama4 = {"text_config": {**BASE, "num_hidden_layers": 48, "attention_chunk_size": 8192,
              "no_rope_layers": [1, 1, 1, 0] * 12}}  # fmt: skip
    assert (hf(tmp_path, llama4).window, hf(tmp_path, llama4).local_layers) == (8192, 36)
    llama4_interval = {"text_config": {**BASE, "num_hidden_layers": 48, "attention_chunk_size": 8192}}
    assert hf(tmp_path, llama4_interval).local_layers == 36
    mistral = {**BASE, "model_type": "mistral", "num_hidden_layers": 32, "sliding_window": 4096}
    assert (hf(tmp_path, mistral).window, hf(tmp_path, mistral).local_layers) == (4096, 32)
    offs = [
        {**BASE, "model_type": "mistral", "sliding_window": None},
        {**BASE, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False},
        {**BASE, "model_type": "qwen3", "sliding_window": 4096},  # Qwen's switch defaults to off
        # a window on a layout not known here (DeepSeek-V4-style compressed attention): full, never tiny
        {**BASE, "model_type": "deepseek_v4", "sliding_window": 128, "index_topk": 512},
    ]
    for off in offs:
        assert hf(tmp_path, off).window is None, off
    qwen_on = {**BASE, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}
    assert hf(tmp_path, {**qwen_on, "max_window_layers": 20}).local_layers == 4  # layers 20.. slide
    assert (
        hf(tmp_path, {**qwen_on, "num_hidden_layers": 32}).local_layers == 4
    )  # default max_window_layers 28
    exaone = {**BASE, "model_type": "exaone4", "sliding_window": 4096, "sliding_window_pattern": "LLLG"}
    assert hf(tmp_path, exaone).local_layers == 18  # 24 layers, 3 of every 4 local
    baichuan = {
        **BASE,
        "model_type": "baichuan_m1",
        "sliding_window": 8192,
        "sliding_window_layers": [1, 3, 5, 7],
    }
    assert hf(tmp_path, baichuan).local_layers == 4


def test_a_bad_window_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json: sliding_window: must be an integer >= 1"):
        hf(tmp_path, {**BASE, "model_type": "mistral", "sliding_window": "wide"})
    with pytest.raises(
        ValueError, match=r"config\.json: sliding_window_pattern: expected an integer or a string"
    ):
        hf(tmp_path, {**BASE, "sliding_window": 4096, "sliding_window_pattern": "LLXG"})


def test_minimax_m2_all_softmax_attention_is_read(tmp_path):
    m = hf(tmp_path, {**BASE, "attn_type_list": [1] * 24})  # MiniMax-M2: every layer ordinary attention
    assert m.window is None and m.layers == 24


@pytest.mark.parametrize(
    ("extra", "field"),
    [({"layer_types": ["linear_attention"] * 3 + ["full_attention"]}, "layer_types: linear_attention layers"),
     ({"hybrid_override_pattern": "M-M*-"}, "hybrid_override_pattern: hybrid models"),
     ({"model_type": "jamba"}, "model_type: jamba: state-space"),
     ({"attn_type_list": [0, 0, 0, 1]}, "attn_type_list: linear-attention")],
)  # fmt: skip
def test_layers_that_are_not_attention_are_refused_not_misread(tmp_path, extra, field):
    """A Qwen3-Next (3 linear-attention layers per full one), Nemotron-H or Jamba config read as attention
    would count KV on every layer and attention weights where Mamba blocks are: refused in one line."""
    with pytest.raises(ValueError, match=rf"config\.json: {field}"):
        hf(tmp_path, {**BASE, **extra})
