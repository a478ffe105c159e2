"""The step physics on plain numbers (the serving engine's hot path) equals the same physics on numpy
arrays (the fit's and the sweeps' path): voicepipe.hardware.num keeps one formula for both. Equal to a
few units in the last place, not bit for bit: numpy's vectorised power (MoE experts touched, (1 − k/E)^t)
may round a last bit differently from the C library's on some CPUs."""

from __future__ import annotations

import numpy as np
import pytest

from voicepipe.hardware import catalog, num
from voicepipe.hardware.step import mixed_step_s, step_parts, total_s
from voicepipe.hardware.system import System

RNG = np.random.default_rng(7)
VALUES = [0.0, 1.0, 2.5, -3.0, 1e-9, 7.0, 7.5, 8.5, 1e12]


@pytest.mark.parametrize("a", VALUES)
@pytest.mark.parametrize("b", VALUES)
def test_each_helper_on_numbers_gives_numpys_answer(a, b):
    assert num.maximum(a, b) == np.maximum(a, b) and isinstance(num.maximum(a, b), float)
    assert num.minimum(a, b) == np.minimum(a, b) and isinstance(num.minimum(a, b), float)
    for cond in (True, False):
        assert num.where(cond, a, b) == np.where(cond, a, b)
    assert num.where(a > b, a, b) == np.where(a > b, a, b)
    assert num.ceil(a) == np.ceil(a) and num.arr(a) == np.asarray(a, dtype=float)


def test_arrays_keep_numpys_shape_and_values():
    a, b = RNG.normal(size=5), RNG.normal(size=5)
    np.testing.assert_array_equal(num.maximum(a, b), np.maximum(a, b))
    np.testing.assert_array_equal(num.minimum(a, b), np.minimum(a, b))
    np.testing.assert_array_equal(num.where(a > b, a, 0.0), np.where(a > b, a, 0.0))
    np.testing.assert_array_equal(num.ceil(a), np.ceil(a))
    assert isinstance(num.arr([1, 2]), np.ndarray)


SYSTEMS = [
    ("h100-sxm", "llama-3.1-70b", "fp8", 4, "vllm"),
    ("h200-sxm", "deepseek-r1", "fp8", 8, "sglang"),
    ("mi300x", "mixtral-8x7b", "bf16", 2, "vllm-v0"),
    ("b200", "gpt-oss-120b", "fp4", 1, "trtllm"),
    ("cerebras-wse3", "llama-3.1-8b", "bf16", 1, None),
]


@pytest.mark.parametrize(("device", "model", "precision", "chips", "stack"), SYSTEMS)
def test_a_step_on_numbers_equals_the_step_on_arrays(device, model, precision, chips, stack):
    system = System(device=catalog.device(device), model=catalog.model(model), precision=precision, chips=chips,
                    stack=catalog.stack(stack) if stack else None)  # fmt: skip
    shapes = [(0, 0.0, 1000, 0, 1), (32, 32 * 1500.0, 0, 0, 1), (8, 9000.0, 512, 2048, 3), (1, 30000.0, 0, 0, 1)]
    for d, kv, n, c, ps in shapes:
        kw = {"prefill_tokens": n, "prefill_cached": c, "prefill_seqs": ps}
        scalar = step_parts(system, d, kv, **kw)
        array = step_parts(system, np.array([d]), np.array([kv]), **{k: np.array([v]) for k, v in kw.items()})
        for field in ("kv_s", "dense_s", "expert_s", "flops_s", "attn_s", "comm_s", "fixed_s", "serial_s", "launch_s"):
            want = float(np.asarray(getattr(array, field)).ravel()[0])
            assert float(getattr(scalar, field)) == pytest.approx(want, rel=1e-14, abs=1e-300), field
        want = float(np.asarray(total_s(system, array)).ravel()[0])
        assert total_s(system, scalar) == pytest.approx(want, rel=1e-14, abs=1e-300)
        assert isinstance(mixed_step_s(system, d, kv, prefill_tokens=n, prefill_cached=c), float)
