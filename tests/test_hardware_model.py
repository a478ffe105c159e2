"""Analytic hardware model: catalog, formulas, calibration points."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

import voicepipe.backends.reference as hw
from voicepipe.hardware import catalog as cat
from voicepipe.hardware import model as hm

DEVICES = [
    "a100-40gb",
    "a100-80gb",
    "h100-sxm",
    "h200-sxm",
    "b200",
    "tpu-v5e",
    "tpu-v6e",
    "cerebras-wse3",
    "groq-lpu",
]
MODELS = [
    "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.3-70b", "llama-3.1-405b",
    "llama-2-7b", "llama-2-70b", "mixtral-8x7b", "qwen3-0.6b", "qwen3-4b", "qwen3-8b", "qwen3-32b",
    "qwen3-235b-a22b", "gpt-oss-20b", "gpt-oss-120b", "glm-4.7", "kimi-k2",
]  # fmt: skip


def dev(name: str) -> cat.Device:
    return cat.devices()[name]


def mdl(name: str) -> cat.ModelSpec:
    return cat.models()[name]


def sys_(d: str, m: str, tp: int | None = None, seqs: int = 1, context: int = 4096) -> hm.System:
    return hm.make_system(dev(d), mdl(m), tp=tp, seqs=seqs, context=context)


# ---------------------------------------------------------------- catalog


def test_catalog_has_every_issue_entry():
    assert set(DEVICES) <= set(cat.devices())
    assert set(MODELS) <= set(cat.models())


def test_every_model_has_quality_and_sources():
    for m in cat.models().values():
        # a benchmark-only shape (gpt-j-6b, falcon-180b) may carry no score, but says why
        assert m.quality is None or 0 < m.quality.score <= 100, m.key
        assert m.sources["config"] and m.sources["params"] and m.sources["quality"]
        for price in m.prices.values():
            assert price.source


def test_device_without_a_source_is_rejected():
    raw = cat.devices()["h100-sxm"].model_dump()
    raw["sources"] = {k: v for k, v in raw["sources"].items() if k != "mem_bw_tbs"}
    with pytest.raises(ValidationError, match="mem_bw_tbs"):
        cat.Device(**raw)


def test_moe_split_reproduces_active_params():
    for name in ("mixtral-8x7b", "qwen3-235b-a22b", "gpt-oss-120b", "kimi-k2"):
        m = mdl(name)
        expected = m.active_params - (0 if m.tied_embeddings else m.embed_params)
        assert float(hm.weight_read_params(m, 1)) == pytest.approx(expected, rel=1e-9)


# ---------------------------------------------------------------- formulas


def test_step_monotone_in_batch_and_context():
    s = sys_("h100-sxm", "llama-3.1-8b", seqs=256, context=2048)
    b = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256])
    step = hm.decode_step_s(s, b, 1024)
    assert np.all(np.diff(step) > 0)
    per_user = 1 / step
    assert np.all(np.diff(per_user) < 0)
    assert np.all(np.diff(b * per_user) > 0)
    ctx = np.array([128, 512, 2048, 8192])
    assert np.all(np.diff(hm.decode_step_s(s, 8, ctx)) > 0)
    # broadcasting over both axes at once
    grid = hm.decode_step_s(s, b[:, None], ctx[None, :])
    assert grid.shape == (9, 4)
    assert np.all(np.diff(grid, axis=0) > 0) and np.all(np.diff(grid, axis=1) > 0)


@pytest.mark.parametrize("device", ["a100-40gb", "a100-80gb", "h100-sxm", "h200-sxm", "b200", "tpu-v6e"])
def test_memory_bound_at_batch_one_on_hbm(device):
    s = sys_(device, "llama-3.1-8b")
    st = hm.step_time(s, 1, 1024)
    assert str(st.bound()) == "memory"
    assert float(st.memory_s) > 10 * float(st.compute_s)


def test_ridge_point_and_crossover():
    h100 = dev("h100-sxm")
    assert hm.ridge_point(h100) == pytest.approx(295, rel=0.01)
    assert hm.ridge_point(dev("h200-sxm")) == pytest.approx(206, rel=0.01)
    # with no KV, compute catches up with memory where batch = sustained ridge * MFU / eta_mem (dense
    # bf16 model; sustained = the microbenchmarked bandwidth and matmul rate the step model uses)
    s = sys_("h100-sxm", "llama-3.1-8b", seqs=1)
    b = np.arange(1, 2000)
    st = hm.step_time(s, b, 0)
    crossover = int(b[np.argmax(st.compute_s >= st.memory_s)])
    expected = hm.sustained_ridge_point(h100) * s.eff.mfu / s.eff.eta_mem
    assert crossover == pytest.approx(expected, rel=0.03)
    past = hm.step_time(s, 2 * crossover, 0)
    assert float(past.compute_s) > float(past.memory_s)  # past the ridge the GEMMs outlast the weight stream
    # without a server's per-sequence host work (the bare CUDA-graphed loop) the step is compute-bound there;
    # under vLLM the host's 20 µs a sequence is of the same order as a token's matmul time
    bare = hm.make_system(dev("h100-sxm"), mdl("llama-3.1-8b"), seqs=1, stack=cat.stack("none"))
    assert str(hm.step_time(bare, 2 * crossover, 0).bound()) == "compute"


def test_tensor_parallel_splits_weights_and_pays_allreduce():
    one = sys_("h200-sxm", "llama-3.1-8b", tp=1)
    two = sys_("h200-sxm", "llama-3.1-8b", tp=2)
    a, b = hm.step_time(one, 1, 1024), hm.step_time(two, 1, 1024)
    assert float(b.memory_s) == pytest.approx(float(a.memory_s) / 2, rel=0.01)
    assert float(a.comm_s) == 0 and float(b.comm_s) > 0
    assert float(a.total_s) / 2 < float(b.total_s) < float(a.total_s)


def test_kv_cache_is_gqa_aware():
    assert hm.kv_bytes_per_token(mdl("llama-3.1-8b"), "bf16") == 32 * 2 * 8 * 128 * 2
    assert hm.kv_bytes_per_token(mdl("llama-2-7b"), "bf16") == 32 * 2 * 32 * 128 * 2  # MHA: 4x more
    assert hm.kv_bytes_per_token(mdl("kimi-k2"), "fp8") == 61 * 576  # MLA latent
    s8 = sys_("a100-80gb", "llama-3.1-8b", seqs=16)
    s7 = sys_("a100-80gb", "llama-2-7b", seqs=16)
    extra8 = float(hm.step_time(s8, 16, 16 * 4000).memory_s - hm.step_time(s8, 16, 16).memory_s)
    extra7 = float(hm.step_time(s7, 16, 16 * 4000).memory_s - hm.step_time(s7, 16, 16).memory_s)
    assert extra7 == pytest.approx(4 * extra8, rel=0.01)


def test_moe_reads_only_active_experts_at_small_batch():
    m = mdl("mixtral-8x7b")
    read1 = float(hm.weight_read_params(m, 1))
    read_many = float(hm.weight_read_params(m, 512))
    assert read1 < 0.3 * m.total_params
    assert read_many == pytest.approx(m.total_params - m.embed_params, rel=1e-3)
    t = np.array([1, 2, 4, 8, 16, 64])
    assert np.all(np.diff(hm.weight_read_params(m, t)) > 0)
    # Mixtral decodes at batch 1 faster than a dense model of its total size on the same GPUs
    moe = sys_("h100-sxm", "mixtral-8x7b", tp=2)
    dense = sys_("h100-sxm", "llama-3.1-70b", tp=2)
    assert float(hm.decode_step_s(moe, 1, 1024)) < 0.4 * float(hm.decode_step_s(dense, 1, 1024))


def test_fits_and_does_not_fit():
    with pytest.raises(hm.DoesNotFit, match=r"llama-3\.1-405b"):
        hm.make_system(dev("a100-40gb"), mdl("llama-3.1-405b"))
    with pytest.raises(hm.DoesNotFit):
        hm.make_system(dev("h100-sxm"), mdl("llama-3.1-70b"), tp=1)
    s = hm.make_system(dev("h100-sxm"), mdl("llama-3.1-70b"), tp=2)
    n = hm.max_sequences(s, 4096)
    assert n >= 1
    with pytest.raises(hm.DoesNotFit):
        hm.make_system(dev("h100-sxm"), mdl("llama-3.1-70b"), tp=2, seqs=n + 1, context=4096)
    # fp8 halves the weights: 405B fits on 8 x H100 at fp8 but not at bf16
    assert hm.make_system(dev("h100-sxm"), mdl("llama-3.1-405b"), precision="fp8").chips == 8
    with pytest.raises(hm.DoesNotFit):
        hm.make_system(dev("h100-sxm"), mdl("llama-3.1-405b"), precision="bf16")


def test_unknown_precision_is_an_error():
    with pytest.raises(ValueError, match="precision"):
        hm.make_system(dev("h100-sxm"), mdl("llama-3.1-8b"), precision="fp3")


def test_sram_chips_follow_capacity():
    groq = hm.make_system(dev("groq-lpu"), mdl("llama-3.1-70b"), context=1280)
    assert groq.chips == pytest.approx(576, rel=0.15)
    assert hm.make_system(dev("cerebras-wse3"), mdl("llama-3.1-8b")).chips == 1
    assert hm.make_system(dev("cerebras-wse3"), mdl("llama-3.1-70b")).chips == 4
    more = hm.make_system(dev("groq-lpu"), mdl("llama-3.1-70b"), seqs=64, context=4096)
    assert more.chips > groq.chips
    assert float(hm.decode_step_s(more, 1, 1024)) > float(hm.decode_step_s(groq, 1, 1024))  # more hops


def test_sram_per_layer_time_in_published_band():
    for d, m in (
        ("cerebras-wse3", "llama-3.1-8b"),
        ("groq-lpu", "llama-3.1-70b"),
        ("groq-lpu", "llama-3.1-8b"),
    ):
        s = hm.make_system(dev(d), mdl(m))
        st = hm.step_time(s, 1, 1024)
        per_layer = float(st.overhead_s) / s.model.layers
        assert 17e-6 <= per_layer <= 42e-6, (d, m, per_layer)
        assert str(st.bound()) == "latency"


def test_every_fitting_pair_predicts():
    answered = 0
    for d in cat.devices().values():
        for m in cat.models().values():
            try:
                p = hm.predict(d, m)
            except hm.DoesNotFit:
                continue
            answered += 1
            assert p.fits and p.tokens_per_second > 0 and p.ttft_ms > 0 and p.chips >= 1
            assert p.bound in ("memory", "compute", "latency")
    assert answered >= 140


def test_efficiencies_within_published_ranges():
    from voicepipe.hardware.validate import BOUNDS

    e = hm.DEFAULT_EFFICIENCY
    for name, (lo, hi) in BOUNDS.items():  # fitted inside the published ranges (docs §2)
        assert lo <= getattr(e, name) <= hi, name


# ---------------------------------------------------------------- speculative decoding


def test_speculative_closed_form_exact():
    assert float(hm.expected_tokens_per_step(0.8, 4)) == (1 - 0.8**5) / (1 - 0.8)
    assert float(hm.expected_tokens_per_step(0.0, 4)) == 1.0
    assert float(hm.expected_tokens_per_step(1.0, 4)) == 5.0
    assert float(hm.speculative_speedup(0.8, 4, 0.05)) == ((1 - 0.8**5) / (1 - 0.8)) / (4 * 0.05 + 1)
    a = np.array([0.5, 0.7, 0.9])
    assert np.all(np.diff(hm.expected_tokens_per_step(a, 3)) > 0)


def test_speculative_speedup_matches_closed_form_when_memory_bound_and_shrinks_with_batch():
    s = sys_("h200-sxm", "llama-3.1-70b", seqs=256, context=1280)
    spec = hm.Speculative(alpha=0.8, gamma=4, draft_cost=0.05)
    plain1, spec1 = hm.tpot_s(s, 1, 1024), hm.tpot_s(s, 1, 1024, spec)
    assert float(plain1 / spec1) == pytest.approx(float(hm.speculative_speedup(0.8, 4, 0.05)), rel=0.02)
    plain_big, spec_big = hm.tpot_s(s, 256, 1024), hm.tpot_s(s, 256, 1024, spec)
    assert float(plain_big / spec_big) < float(plain1 / spec1) - 0.3


# ---------------------------------------------------------------- calibration


@pytest.fixture(scope="module")
def points() -> list[hw.CalibrationPoint]:
    return hw.calibration()


def test_every_calibration_point_within_its_tolerance(points):
    bad = [(p.name, p.published, p.predicted) for p in points if not p.ok]
    assert not bad


def test_doc_residual_table_matches_model():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "hardware-model.md").read_text()
    m = re.search(r"<!-- residuals:begin -->\n(.*?)\n<!-- residuals:end -->", doc, re.S)
    assert m, "docs/hardware-model.md lacks the residual table markers"
    assert m.group(1).strip() == hw.residual_table().strip(), (
        "regenerate: python -c 'import voicepipe.backends.reference as r; r.update_doc()'"
    )


def _load_gpu_bench(monkeypatch):
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_decode.py"
    spec = importlib.util.spec_from_file_location("gpu_decode", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_decode", bench)
    spec.loader.exec_module(bench)
    return bench


def test_gpu_bench_dry_run_plans_without_torch(monkeypatch, capsys):
    bench = _load_gpu_bench(monkeypatch)
    rows = bench.main(["--dry-run", "--shape", "8b", "--batches", "1,8", "--ttft-prompts", "16"])
    assert [(r["what"], r["weights"]) for r in rows] == [
        (w, f) for f in ("bf16", "fp8", "int4") for w in ("decode", "decode", "ttft")
    ]
    decode = {(r["weights"], r["batch"]): r for r in rows if r["what"] == "decode"}
    # int4 streams fewer bytes than bf16 at batch 1; fp8 is native on the H200
    assert decode[("int4", 1)]["model_kernel_ms"] < decode[("bf16", 1)]["model_kernel_ms"]
    assert decode[("fp8", 1)]["model_kernel_ms"] < decode[("bf16", 1)]["model_kernel_ms"]
    assert all(r["model_kernel_ms"] > 0 for r in rows) and "measured_ms" not in rows[0]
    assert "plan" in capsys.readouterr().out


def test_gpu_bench_runs_a_tiny_shape_on_cpu(monkeypatch):
    pytest.importorskip("torch")
    bench = _load_gpu_bench(monkeypatch)
    rows = bench.main(
        ["--shape", "tiny", "--device", "cpu", "--weights", "bf16", "--batches", "1,2", "--steps", "2",
         "--context", "32", "--ttft-prompts", "8", "--out", ""]
    )  # fmt: skip
    assert [(r["what"], r["batch"]) for r in rows] == [("decode", 1), ("decode", 2), ("ttft", 1)]
    assert all(float(r["measured_ms"]) > 0 for r in rows)
    kernel, serving = bench.modelled("h200-sxm", "llama-3.1-8b", 1, 1024)
    assert serving - kernel == pytest.approx(cat.stack().step_overhead_us * 1e-6)


def test_gpu_bench_quick_plan_is_the_device_check(monkeypatch, capsys):
    bench = _load_gpu_bench(monkeypatch)
    rows = bench.main(["--quick", "--dry-run"])
    decode = {(r["shape"], r["weights"], r["batch"]) for r in rows if r["what"] == "decode"}
    ttft = {(r["shape"], r["weights"], r["prompt"]) for r in rows if r["what"] == "ttft"}
    for shape in ("1b", "8b"):
        for fmt in ("bf16", "fp8", "int4"):
            assert {(shape, fmt, 1), (shape, fmt, 8)} <= decode
            assert (shape, fmt, 16) in ttft
    assert {r["batch"] for r in rows if r["what"] == "decode"} == {1, 8}
    # an explicit flag still wins over the quick defaults
    rows = bench.main(["--quick", "--dry-run", "--batches", "4", "--shape", "8b", "--weights", "bf16"])
    assert [r["batch"] for r in rows if r["what"] == "decode"] == [4]
    assert bench.QUICK_BUDGET_S < 300


def test_a_tensor_parallel_width_must_divide_the_heads_but_a_layer_split_takes_any_count():
    from voicepipe.hardware import catalog
    from voicepipe.hardware.sizing import make_system

    dev, mdl = catalog.device("a100-80gb"), catalog.model("llama-3.1-8b")  # 32 heads
    with pytest.raises(ValueError, match="32 attention heads do not split 3 ways"):
        make_system(dev, mdl, tp=3)
    assert make_system(dev, mdl, tp=2).chips == 2
    assert make_system(dev, mdl, tp=3, stack=catalog.stack("llama.cpp")).chips == 3  # layers split over chips
