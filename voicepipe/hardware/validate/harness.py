"""What a benchmark harness sets when a published run leaves it at the harness's own default.

``trtllm-bench`` (TensorRT-LLM's benchmark) sizes the engine's ``max_batch_size`` itself when the run gives
none: ``trtllm-bench build --dataset`` for the TensorRT engines of v0.12-v0.17, and ``trtllm-bench
throughput`` for the PyTorch backend (``get_settings`` in ``tensorrt_llm/bench/benchmark/utils/general.py``)
both call ``calc_engine_setting`` in ``tensorrt_llm/bench/build/tuning.py``, which estimates how many
requests of the dataset's average ISL + OSL fit in the KV cache and rounds that up ("slightly optimistic";
the runtime's own KV admission then decides what really runs):

    engine_GiB   = total parameters × bytes per weight / 2^30       (bf16/fp16 2, fp8 1, NVFP4 0.5, else 2)
    token_GiB    = 2 · layers · max(tp, KV heads) · head_dim · bytes per KV element / 2^30
                   (an MLA latent: layers · latent width · bytes per KV element)
    requests     = (device GiB · GPUs − engine_GiB) · 0.95 / (token_GiB · (ISL + OSL))
    raw          = min(requests, 4096)                              (pipeline stages: 1 here)
    max_batch    = max(64, 32·⌈raw/32⌉) below 256, 128·⌈raw/128⌉ below 1,024, else 256·⌈raw/256⌉

0.95 is the function's default KV share and the fraction NVIDIA's perf-overview pages say they use "in
majority of cases" (``--kv_cache_free_gpu_mem_fraction 0.95``). Under attention data parallelism the
LLM API's ``max_batch_size`` is per rank (the DeepSeek-R1 blog's "max_batch_size 384 per rank" at
concurrency 3,072 on 8 GPUs), so the engine's cap is the ranks times it. Every quantity is one the point
states (model, precision, KV precision, chips, device, lengths), so the rule is applied as is.
"""

from __future__ import annotations

import math

from voicepipe.hardware.sizing import GIB
from voicepipe.hardware.system import System

TRTLLM_BENCH_KV_SHARE = 0.95  # calc_engine_setting's kv_cache_gpu_mem_fraction default
TRTLLM_BENCH_MAX_REQUESTS = 4096  # finetune_setting: "Cap total batch size to avoid decoder buffer size ..."
TRTLLM_BENCH_MAX_TOKENS = 32768  # finetune_setting: "Cap num tokens to avoid TRT activation buffer becoming too large"
_WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5}  # tuning.py BYTES_PER_ELEM (else 2)


def _kv_requests(system: System, input_len: int, output_len: int) -> float:
    """Requests of ``input_len + output_len`` tokens calc_engine_setting estimates fit the KV cache."""
    m = system.model
    per_param = _WEIGHT_BYTES.get(system.precision, 2.0)
    per_kv = _WEIGHT_BYTES.get(system.kv, 2.0)
    if m.kv_dim is not None:
        token = m.layers * m.kv_dim * per_kv / GIB
    else:
        token = 2 * m.layers * max(system.chips, m.kv_heads) * m.head_dim * per_kv / GIB
    engine = m.total_params * per_param / GIB
    available = system.device.capacity_bytes / GIB * system.chips - engine
    return available * TRTLLM_BENCH_KV_SHARE / (token * (input_len + output_len))


def trtllm_bench_max_batch(system: System, input_len: int, output_len: int) -> int:
    """``max_batch_size`` as trtllm-bench's tuning heuristic sets it for ``system`` and a dataset of
    ``input_len`` / ``output_len`` tokens (module docstring), times the ranks under attention DP."""
    raw = min(_kv_requests(system, input_len, output_len), TRTLLM_BENCH_MAX_REQUESTS)
    if raw < 256:
        batch = max(64, 32 * math.ceil(raw / 32))
    elif raw < 1024:
        batch = 128 * math.ceil(raw / 128)
    else:
        batch = 256 * math.ceil(raw / 256)
    return batch * (system.chips if system.attention_dp else 1)


def trtllm_bench_max_num_tokens(system: System, input_len: int, output_len: int) -> int:
    """``max_num_tokens`` as trtllm-bench's tuning heuristic sets it (``finetune_setting``): the batch
    before rounding times ``1 + ISL/OSL``, at most 32,768, rounded up to 256 below 4,096 (at least 2,048),
    to 512 below 8,192, else to 1,024."""
    raw_bs = min(_kv_requests(system, input_len, output_len), TRTLLM_BENCH_MAX_REQUESTS)
    raw = min(raw_bs * (1 + input_len / max(output_len, 1)), TRTLLM_BENCH_MAX_TOKENS)
    if raw < 4096:
        return max(2048, 256 * math.ceil(raw / 256))
    if raw < 8192:
        return 512 * math.ceil(raw / 512)
    return 1024 * math.ceil(raw / 1024)
