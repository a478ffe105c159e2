"""The embedding and output head: 16-bit beside quantised weights where the stack keeps them so, at the
stack's own format where it quantises them, and logits computed only for the tokens a step samples."""

from __future__ import annotations

import numpy as np
import pytest

from voicepipe.hardware import catalog as cat
from voicepipe.hardware import model as hm
from voicepipe.hardware.system import _expert_split, table_bytes


def system(d: str, m: str, stack: str, precision: str, tp: int = 1) -> hm.System:
    return hm.make_system(cat.device(d), cat.model(m), precision=precision, tp=tp, stack=cat.stack(stack))


def test_a_quantised_run_keeps_the_head_and_embedding_at_16_bits_on_the_datacenter_stacks():
    m = cat.model("llama-3.1-8b")
    table = m.vocab * m.hidden
    for stack in ("vllm", "sglang", "trtllm"):
        s = system("h100-sxm", "llama-3.1-8b", stack, "fp8")
        assert s.head_format == s.embedding_format == "bf16"
        # one byte a weight, two for the embedding and the head (untied: two tables)
        assert s.stored_weight_bytes == pytest.approx(m.total_params + 2 * table)
    assert system("h100-sxm", "llama-3.1-8b", "vllm", "bf16").head_format == "bf16"


def test_stacks_that_quantise_the_head_store_it_at_their_own_format():
    m = cat.model("llama-3.1-8b")
    table = m.vocab * m.hidden
    rest = m.total_params - 2 * table
    int4, q6k = hm.bytes_per_param("int4"), table_bytes("q6_k")
    # GGUF: the head at Q6_K (never narrower), the untied embedding at the file's type
    gguf = system("rtx-4090", "llama-3.1-8b", "llama.cpp", "int4")
    assert (gguf.head_format, gguf.embedding_format) == ("q6_k", "int4")
    assert gguf.stored_weight_bytes == pytest.approx(rest * int4 + table * (q6k + int4))
    # ... a Q8_0 GGUF keeps its head at Q8_0
    assert system("rtx-4090", "llama-3.1-8b", "llama.cpp", "int8").head_format == "int8"
    # gpt-fast: every nn.Linear (the head) quantised, its nn.Embedding not
    fast = system("rtx-4090", "llama-3.1-8b", "gpt-fast", "int4")
    assert (fast.head_format, fast.embedding_format) == ("int4", "bf16")
    assert fast.stored_weight_bytes == pytest.approx(rest * int4 + table * (int4 + 2))
    # MLC q4f16_1: both
    mlc = system("rtx-4090", "llama-3.1-8b", "mlc", "int4")
    assert mlc.stored_weight_bytes == pytest.approx(hm.weight_bytes(m, "int4"))


def test_a_tied_model_stores_its_one_table_at_the_heads_format():
    m = cat.model("llama-3.2-3b")
    assert m.tied_embeddings
    table = m.vocab * m.hidden
    s = system("h100-sxm", "llama-3.2-3b", "vllm", "fp8")
    assert s.stored_weight_bytes == pytest.approx(m.total_params - table + 2 * table)


def test_a_16_bit_head_costs_a_small_quantised_model_its_share_of_the_decode_step():
    keep = system("rtx-4090", "llama-3.1-8b", "vllm", "int4")
    quant = system("rtx-4090", "llama-3.1-8b", "gpt-fast", "int4")
    m = keep.model
    extra = m.vocab * m.hidden * (2.0 - hm.bytes_per_param("int4"))  # the head's bytes beyond int4
    bw = keep.device.stream_bytes_s
    gap = float(hm.step_parts(keep, 1, 512).dense_s) - float(hm.step_parts(quant, 1, 512).dense_s)
    assert gap == pytest.approx(extra / bw, rel=1e-6)


def test_prefill_computes_logits_for_the_last_prompt_token_only():
    s = system("h100-sxm", "llama-3.1-8b", "vllm", "bf16")
    m = s.model
    one = hm.step_parts(s, 0, 0, prefill_tokens=1000, prefill_seqs=1)
    four = hm.step_parts(s, 0, 0, prefill_tokens=1000, prefill_seqs=4)
    # four prompts in the same tokens sample three more rows than one prompt: 3 head matmuls more
    rate = s.device.matmul_flops("bf16")
    assert float(four.flops_s) - float(one.flops_s) == pytest.approx(2 * 3 * m.vocab * m.hidden / rate, rel=1e-6)
    # against every prompt token through the head: 999 rows fewer
    body = 2 * hm.matmul_params(m) * 1000 - 2 * m.vocab * m.hidden * 999
    assert float(one.flops_s) == pytest.approx(body / rate, rel=1e-6)
    # a decode step samples every decoder: the head runs for each (and for every drafted token verified)
    d = hm.step_parts(s, np.array(8.0), 4000)
    assert float(d.flops_s) == pytest.approx(2 * hm.matmul_params(m) * 8 / rate, rel=1e-6)
    v = hm.step_parts(s, np.array(8.0), 4000, tokens_per_seq=4)
    assert float(v.flops_s) == pytest.approx(2 * hm.matmul_params(m) * 32 / rate, rel=1e-6)


def test_a_16_bit_head_beside_fp8_weights_runs_at_the_16_bit_rate():
    s = system("h100-sxm", "llama-3.1-8b", "vllm", "fp8")
    m, dev = s.model, s.device
    head = m.vocab * m.hidden
    got = float(hm.step_parts(s, np.array(64.0), 64 * 1000).flops_s)
    want = 2 * 64 * ((hm.matmul_params(m) - head) / dev.matmul_flops("fp8") + head / dev.matmul_flops("bf16"))
    assert got == pytest.approx(want, rel=1e-6)


def test_under_attention_dp_a_prompts_sampled_row_stays_on_its_rank():
    mdl = cat.model("deepseek-v3")
    dp = hm.System(cat.device("h200-sxm"), mdl, "fp8", 8, stack=cat.stack("sglang"), attention_dp=True)
    two = float(hm.step_parts(dp, 0, 0, prefill_tokens=2000, prefill_seqs=2).flops_s)
    # two prompts on two of the 8 ranks: the busiest rank multiplies one prompt's tokens (half the step's)
    # through the attention's projections, and one sampled row through the 16-bit head; SGLang splits the
    # MLPs outside the routed experts over the group on both prompts' tokens (Stack.attention_dp_mlp)
    _, experts = _expert_split(mdl)
    head = mdl.vocab * mdl.hidden
    body = hm.matmul_params(mdl) - experts * mdl.experts_active / mdl.experts - head
    attn = hm.attention_params(mdl)
    dev = dp.device
    want = 2 * (attn * 1000 + (body - attn) * 2000 / 8) / dev.matmul_flops("fp8") + 2 * head * 1 / dev.matmul_flops("bf16")
    assert two == pytest.approx(want, rel=1e-6)


def test_sram_machines_size_their_chips_with_the_heads_format():
    dev, m = cat.device("groq-lpu"), cat.model("llama-3.1-8b")
    s = hm.make_system(dev, m, precision="int4", stack=cat.stack("groq"))
    need = s.stored_weight_bytes + 1 * 4096 * hm.kv_bytes_per_token(m, s.kv)
    assert s.head_format == "bf16" and s.stored_weight_bytes > hm.weight_bytes(m, "int4")
    assert s.chips >= need / (dev.capacity_bytes * s.eff.usable_sram)


def test_predict_names_a_16_bit_head_beside_quantised_weights():
    p = hm.predict(cat.device("h100-sxm"), cat.model("llama-3.1-8b"), precision="fp8", stack=cat.stack("vllm"))
    assert p.head_precision == "bf16" and p.weights_label() == "fp8, bf16 head"
    gguf = hm.predict(cat.device("rtx-4090"), cat.model("llama-3.1-8b"), precision="int4", stack=cat.stack("llama.cpp"))
    assert gguf.weights_label() == "int4, q6_k head"
    assert hm.predict(cat.device("h100-sxm"), cat.model("llama-3.1-8b")).weights_label() == "bf16"


def test_every_head_floor_a_stack_may_name_has_a_byte_count():
    from typing import get_args

    floor = cat.Stack.model_fields["quantized_head_floor"].annotation
    named = {a for arg in get_args(floor) for a in (get_args(arg) or (arg,)) if isinstance(a, str)}
    assert named == set(cat.HEAD_FORMATS)


def test_weight_only_efficiency_spares_a_16_bit_head_beside_int4_layers():
    s = system("a100-80gb", "llama-3.1-8b", "vllm", "int4")  # int4 is weight-only on an A100
    parts = hm.step_parts(s, np.array(1.0), 1000)
    m = s.model
    head_s = m.vocab * m.hidden * 2.0 / s.device.stream_bytes_s
    assert float(parts.native_s) == pytest.approx(head_s)
    memory_at = lambda wq: float(hm.combine(parts, 1.0, 1.0, wq, 1.0)[0])  # noqa: E731
    # halving η_wq doubles the int4 layers' bytes' time, not the head's
    assert memory_at(0.5) - memory_at(1.0) == pytest.approx(float(parts.dense_s) - head_s)
    # a stack that quantises its head has nothing native there
    assert float(hm.step_parts(system("a100-80gb", "llama-3.1-8b", "gpt-fast", "int4"), 1, 1000).native_s) == 0.0
