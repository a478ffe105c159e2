"""A serving-stack profile's build per device maker (``Stack.platforms``, :meth:`Stack.on`): vLLM V0's upstream
ROCm build decodes with a kernel that re-reads a GQA group's KV head per query head on AMD devices, and only
there; AMD's own images are a profile of their own (``vllm-rocm-amd``). Docs: hardware-model.md §1, §3."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml
from pydantic import ValidationError

from voicepipe.hardware import catalog as cat
from voicepipe.hardware import model as hm
from voicepipe.hardware import validate as val
from voicepipe.hardware.catalog import Stack
from voicepipe.hardware.system import System


def _system(dev: str, mdl: str, stack: str, tp: int = 1) -> System:
    return hm.make_system(cat.device(dev), cat.model(mdl), "fp16", tp=tp, stack=cat.stack(stack))


def _kv_s(s: System, seqs: int = 64, ctx: int = 3072) -> float:
    return float(hm.step_parts(s, seqs, seqs * ctx).kv_s)


def test_device_maker_is_the_first_word_of_its_catalog_name():
    assert cat.device("mi300x").maker == "AMD" and cat.device("mi250").maker == "AMD"
    assert cat.device("h100-sxm").maker == "NVIDIA" and cat.device("gaudi2").maker == "Intel"


def test_a_profiles_amd_build_applies_on_amd_devices_and_not_on_nvidia_ones():
    v0 = cat.stack("vllm-v0")
    amd, nvidia = _system("mi300x", "llama-3.1-8b", "vllm-v0"), _system("h100-sxm", "llama-3.1-8b", "vllm-v0")
    assert v0.gqa_kv_shared and "AMD" in v0.platforms
    assert nvidia.serving is v0  # NVIDIA devices run the profile as written
    assert not amd.serving.gqa_kv_shared  # the upstream ROCm build: paged_attention_v1/v2
    assert amd.serving.key == "vllm-v0"  # still the same profile (evidence, interval cells)
    assert amd.serving.name != v0.name and "ROCm" in amd.serving.name  # ...which says which build it is
    assert amd.serving.seq_overhead_us == v0.seq_overhead_us  # what the build does not change is the profile's
    assert "paged_attention_v1/v2" in amd.serving.sources["gqa_kv_shared"]


def test_the_rocm_build_rereads_kv_per_query_head_of_a_gqa_group_only():
    # Llama-3.1-8B: 32 query heads over 8 KV heads -> each KV head read 4 times by the upstream V0 ROCm build,
    # which also streams what it reads at decode_kv_eff of the modelled rate
    up, amd_img = _system("mi300x", "llama-3.1-8b", "vllm-v0"), _system("mi300x", "llama-3.1-8b", "vllm-rocm-amd")
    e = up.serving.decode_kv_eff
    assert 0.0 < e < 1.0 and amd_img.serving.decode_kv_eff == 1.0
    assert 3.8 / e * _kv_s(amd_img) < _kv_s(up) < 4.0 / e * _kv_s(amd_img)  # new tokens are written once
    # an MHA model (Llama-2-7B: 32 KV heads) has nothing to share: only the kernel's rate differs
    mha_up, mha_img = _kv_s(_system("mi300x", "llama-2-7b", "vllm-v0")), _kv_s(_system("mi300x", "llama-2-7b", "vllm-rocm-amd"))
    assert 0.95 / e * mha_img < mha_up < 1.0 / e * mha_img
    # on an NVIDIA device vllm-v0 and AMD's image profile run the same kernels: identical steps
    h_v0, h_amd = _system("h100-sxm", "llama-3.1-8b", "vllm-v0"), _system("h100-sxm", "llama-3.1-8b", "vllm-rocm-amd")
    assert float(hm.step_time(h_v0, 64, 64 * 3072).total_s) == float(hm.step_time(h_amd, 64, 64 * 3072).total_s)


def test_predict_says_which_build_it_modelled():
    dev, mdl = cat.device("mi300x"), cat.model("llama-3.1-8b")
    amd = hm.predict(dev, mdl, batch=64, tp=1, stack=cat.stack("vllm-v0"))
    img = hm.predict(dev, mdl, batch=64, tp=1, stack=cat.stack("vllm-rocm-amd"))
    assert amd.stack == "vllm-v0" and amd.stack_build == cat.stack("vllm-v0").on("AMD").name
    assert img.stack_build == cat.stack("vllm-rocm-amd").name
    assert amd.step_ms > img.step_ms  # the re-reads cost time at batch 64
    nv = hm.predict(cat.device("h100-sxm"), mdl, batch=64, tp=1, stack=cat.stack("vllm-v0"))
    assert nv.stack_build == cat.stack("vllm-v0").name


def _stack(**platforms: dict[str, object]) -> Stack:
    raw = yaml.safe_load((resources.files("voicepipe.hardware") / "data" / "stacks.yaml").read_text())
    return Stack(key="t", **{**raw["stacks"]["vllm"], "platforms": platforms})


def test_a_maker_build_needs_a_name_a_known_field_and_a_source_for_each_change():
    ok = _stack(AMD={"name": "x", "gqa_kv_shared": False, "sources": {"gqa_kv_shared": "a kernel's source"}})
    assert not ok.on("AMD").gqa_kv_shared and ok.on("NVIDIA") is ok
    assert ok.on("AMD") is ok.on("AMD")  # built once
    with pytest.raises(ValidationError, match="no source for gqa_kv_shared"):
        _stack(AMD={"name": "x", "gqa_kv_shared": False})
    with pytest.raises(ValidationError, match="no name"):
        _stack(AMD={"gqa_kv_shared": False, "sources": {"gqa_kv_shared": "s"}})
    with pytest.raises(ValidationError, match="unknown field"):
        _stack(AMD={"name": "x", "gqa_kv_shared_typo": False, "sources": {"gqa_kv_shared_typo": "s"}})
    with pytest.raises(ValidationError, match="step_overhead_us"):  # a build is validated as a profile
        _stack(AMD={"name": "x", "step_overhead_us": -1, "sources": {"step_overhead_us": "s"}})


def test_validation_points_follow_the_build_their_notes_name():
    """The rule of the ROCm pass (docs §3): a V0 build on AMD that carries the ROCm custom paged attention (AMD's
    images, upstream from v0.6.2) is vllm-rocm-amd; Argonne's upstream v0.6.1 ROCm build stays vllm-v0."""
    pts = val.points()
    amd_img = [p for p in pts if p.stack == "vllm-rocm-amd"]
    assert amd_img and all(cat.device(p.device).maker == "AMD" for p in amd_img)
    assert all("rocm pass" in (p.notes or "") for p in amd_img)
    argonne = [p for p in pts if p.id.startswith(("anl-mi", "anl2-mi")) and p.stack.startswith("vllm")]
    assert argonne and all(p.stack == "vllm-v0" and "v0.6.1" in (p.notes or "") for p in argonne)


def test_vllm_v0_decodes_a_sliding_window_model_with_the_per_head_kernel_on_nvidia():
    # Mistral-7B v0.1 (window 4096, 32 query heads over 8 KV heads): V0's selector falls back to XFormers
    mistral_v0, mistral_v1 = _system("h100-sxm", "mistral-7b", "vllm-v0"), _system("h100-sxm", "mistral-7b", "vllm")
    assert 3.8 * _kv_s(mistral_v1) < _kv_s(mistral_v0) < 4.0 * _kv_s(mistral_v1)
    # the same shapes without a window keep FlashAttention, which shares the KV head
    llama_v0, llama_v1 = _system("h100-sxm", "llama-3.1-8b", "vllm-v0"), _system("h100-sxm", "llama-3.1-8b", "vllm")
    assert _kv_s(llama_v0) == _kv_s(llama_v1)
    assert cat.kv_rereads(cat.stack("vllm-v0"), 4.0, local=True) == 4.0
    assert cat.kv_rereads(cat.stack("vllm-v0"), 4.0) == cat.kv_rereads(cat.stack("vllm"), 4.0, local=True) == 1.0


def test_the_upstream_rocm_build_pays_for_its_small_m_gemms_at_one_and_two_tokens_only():
    # vLLM V0 upstream before skinny GEMMs: 16-bit dense GEMMs at M = 1, 2 run hipBLASLt's general kernels
    up, img = _system("mi300x", "llama-3.1-8b", "vllm-v0"), _system("mi300x", "llama-3.1-8b", "vllm-rocm-amd")
    extra = up.serving.small_m_gemm_extra
    assert len(extra) == 2 and extra[0] > extra[1] > 0 and img.serving.small_m_gemm_extra == ()

    def fixed(s: System, seqs: int) -> float:
        return float(hm.step_parts(s, seqs, seqs * 2048).fixed_s)

    dense = float(hm.step_parts(up, 1, 2048).dense_s)  # dense weights over the sustained bandwidth
    for seqs, x in ((1, extra[0]), (2, extra[1]), (3, 0.0), (64, 0.0)):
        assert fixed(up, seqs) - fixed(img, seqs) == pytest.approx(x * dense)
    # for fp8 weights only on the 16-bit head (the figure is for fp16/bf16 GEMMs), and not on an NVIDIA
    # device (no AMD build there)
    fp8 = hm.make_system(cat.device("mi300x"), cat.model("llama-3.1-8b"), "fp8", tp=1, stack=cat.stack("vllm-v0"))
    fp8_img = hm.make_system(cat.device("mi300x"), cat.model("llama-3.1-8b"), "fp8", tp=1, stack=cat.stack("vllm-rocm-amd"))
    m = fp8.model
    head_s = m.vocab * m.hidden * 2.0 / fp8.device.stream_bytes_s  # the bf16 head over the sustained bandwidth
    assert fixed(fp8, 1) - fixed(fp8_img, 1) == pytest.approx(extra[0] * head_s)
    assert fixed(_system("h100-sxm", "llama-3.1-8b", "vllm-v0"), 1) == fixed(_system("h100-sxm", "llama-3.1-8b", "vllm-rocm-amd"), 1)
    # a prompt step (M = prompt length) pays nothing
    assert float(hm.step_parts(up, 0, 0, prefill_tokens=2048).fixed_s) == float(hm.step_parts(img, 0, 0, prefill_tokens=2048).fixed_s)


def test_a_copy_of_a_profile_builds_its_own_maker_builds():
    # model_copy(update=...) changes the copy's fields after copying: a build cached on the original must not
    # answer for the copy, nor a copy's build land in the original's cache (the catalog's profiles are shared)
    src = {"name": "x", "gqa_kv_shared": False, "sources": {"gqa_kv_shared": "a kernel's source"}}
    for deep in (False, True):
        base = _stack(AMD=src)
        first = base.model_copy(update={"step_overhead_us": 999.0}, deep=deep)
        assert first.on("AMD").step_overhead_us == 999.0  # the copy's build, worked out first...
        assert base.on("AMD").step_overhead_us == base.step_overhead_us != 999.0  # ...is not the original's
        later = base.model_copy(update={"step_overhead_us": 998.0}, deep=deep)
        assert later.on("AMD").step_overhead_us == 998.0  # the original's cached build is not the copy's
        assert base.on("AMD") is base.on("AMD")  # each still builds once


def test_kernel_efficiencies_of_a_build_need_a_source_and_sane_values():
    with pytest.raises(ValidationError, match="no source for decode_kv_eff"):
        _stack(AMD={"name": "x", "decode_kv_eff": 0.5})
    with pytest.raises(ValidationError, match="no source for small_m_gemm_extra"):
        _stack(AMD={"name": "x", "small_m_gemm_extra": [0.2]})
    with pytest.raises(ValidationError):
        _stack(AMD={"name": "x", "decode_kv_eff": 1.5, "sources": {"decode_kv_eff": "s"}})
    with pytest.raises(ValidationError, match="negative"):
        _stack(AMD={"name": "x", "small_m_gemm_extra": [-0.1], "sources": {"small_m_gemm_extra": "s"}})
    ok = _stack(AMD={"name": "x", "decode_kv_eff": 0.5, "sources": {"decode_kv_eff": "s"}})
    assert ok.on("AMD").decode_kv_eff == 0.5 and ok.decode_kv_eff == 1.0
