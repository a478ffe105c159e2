"""The embedding and output head: 16-bit beside quantised weights where the stack keeps them so, and logits
computed only for the tokens a step samples."""

from __future__ import annotations

import numpy as np
import pytest

from voicepipe.hardware import catalog as cat
from voicepipe.hardware import model as hm


def system(d: str, m: str, stack: str, precision: str, tp: int = 1) -> hm.System:
    return hm.make_system(cat.device(d), cat.model(m), precision=precision, tp=tp, stack=cat.stack(stack))


def test_a_quantised_run_keeps_the_head_at_16_bits_on_the_datacenter_stacks():
    m = cat.model("llama-3.1-8b")
    head = m.vocab * m.hidden
    for stack in ("vllm", "sglang", "trtllm"):
        s = system("h100-sxm", "llama-3.1-8b", stack, "fp8")
        assert s.head_format == "bf16"
        # one byte a weight, two for the embedding and the head (untied: two tables)
        assert s.stored_weight_bytes == pytest.approx(m.total_params + 2 * head)
    assert system("h100-sxm", "llama-3.1-8b", "vllm", "bf16").head_format == "bf16"


def test_stacks_that_quantise_the_head_stream_it_at_the_weights_format():
    for stack in ("llama.cpp", "gpt-fast", "mlc"):
        s = system("rtx-4090", "llama-3.1-8b", stack, "int4")
        assert s.head_format == "int4"
        assert s.stored_weight_bytes == pytest.approx(hm.weight_bytes(s.model, "int4"))


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
    # a decode step samples every decoder: the head runs for each
    d = hm.step_parts(s, np.array(8.0), 4000)
    assert float(d.flops_s) == pytest.approx(2 * hm.matmul_params(m) * 8 / rate, rel=1e-6)


def test_predict_names_a_16_bit_head_beside_quantised_weights():
    p = hm.predict(cat.device("h100-sxm"), cat.model("llama-3.1-8b"), precision="fp8", stack=cat.stack("vllm"))
    assert p.head_precision == "bf16" and p.weights_label() == "fp8, bf16 head"
    gguf = hm.predict(cat.device("rtx-4090"), cat.model("llama-3.1-8b"), precision="int4", stack=cat.stack("llama.cpp"))
    assert gguf.weights_label() == "int4"
    assert hm.predict(cat.device("h100-sxm"), cat.model("llama-3.1-8b")).weights_label() == "bf16"
