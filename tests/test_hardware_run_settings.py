"""Run settings of a served system that published points state in their notes: eager execution (no
CUDA/HIP graphs: vLLM --enforce-eager, SGLang --disable-cuda-graph) and vLLM V0's multi-step scheduling
(--num-scheduler-steps N). They reach System from the CLI, the agent's backend and a validation point."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from voicepipe.backends import build_backend
from voicepipe.cli import app
from voicepipe.errors import UnsupportedSetting
from voicepipe.hardware import catalog as cat
from voicepipe.hardware import model as hm
from voicepipe.hardware import validate as val

runner = CliRunner()
DEV, MDL = "h100-sxm", "llama-3.1-8b"


def _system(stack: str = "vllm-v0", **kw: object) -> hm.System:
    return hm.System(cat.device(DEV), cat.model(MDL), "bf16", 1, stack=cat.stack(stack), **kw)  # type: ignore[arg-type]


def test_eager_execution_adds_the_eager_launch_cost_to_every_decode_step_and_leaves_a_prefill_step_alone():
    graphed, eager = _system(), _system(eager=True)
    stk, layers = graphed.serving, graphed.model.layers
    assert stk.prefill_layer_overhead_us > 0
    for batch in (1, 16, 256):  # a decode step: the same kernels, launched from the host layer by layer
        slow = float(hm.step_time(eager, batch, batch * 2048).total_s)
        fast = float(hm.step_time(graphed, batch, batch * 2048).total_s)
        assert slow - fast == pytest.approx(layers * stk.prefill_layer_overhead_us * 1e-6, rel=1e-9)
    # a step that prefills is launched eagerly either way (stacks capture graphs for decode batches only)
    for decoders in (0, 8):
        args = (decoders, decoders * 2048)
        assert float(hm.step_time(eager, *args, prefill_tokens=1024).total_s) == float(
            hm.step_time(graphed, *args, prefill_tokens=1024).total_s
        )
    assert float(hm.prefill_s(eager, 1024)) == float(hm.prefill_s(graphed, 1024))


def test_multi_step_scheduling_does_a_decode_steps_host_work_once_per_n_steps():
    one, many = _system(), _system(scheduler_steps=8)
    stk = one.serving
    assert stk.step_overhead_us > 0 and stk.seq_overhead_us > 0
    for batch in (1, 64):
        host = (stk.step_overhead_us + batch * stk.seq_overhead_us) * 1e-6
        saved = float(
            hm.step_time(one, batch, batch * 1024).total_s - hm.step_time(many, batch, batch * 1024).total_s
        )
        assert saved == pytest.approx(host * (1 - 1 / 8), rel=1e-9)
    # a prefill runs as a single step (vLLM V0 schedules it alone), so its host work is paid in full
    assert float(hm.step_time(many, 4, 4096, prefill_tokens=512).total_s) == float(
        hm.step_time(one, 4, 4096, prefill_tokens=512).total_s
    )
    with pytest.raises(ValueError, match="scheduler_steps"):
        _system(scheduler_steps=0)


def test_the_settings_change_nothing_by_default():
    assert _system() == replace(_system(), eager=False, scheduler_steps=1)


def test_a_setting_the_stack_or_device_has_no_switch_for_is_refused_everywhere_not_priced(tmp_path):
    # the profile names the switch (Stack.eager_flag, Stack.scheduler_steps_flag); without it the model
    # would price a run nobody can start: TensorRT-LLM has no --enforce-eager, V1 vLLM and SGLang no
    # multi-step scheduling, an SRAM machine neither
    assert cat.stack("vllm-v0").scheduler_steps_flag and cat.stack("sglang").eager_flag
    for stack, kw in (
        ("trtllm", {"eager": True}),
        ("vllm", {"scheduler_steps": 4}),
        ("sglang", {"scheduler_steps": 2}),
    ):
        with pytest.raises(UnsupportedSetting, match=f"{next(iter(kw))}: the {stack} stack profile has no"):
            _system(stack, **kw)
    sram = hm.make_system(cat.device("cerebras-wse3"), cat.model(MDL))
    for kw in ({"eager": True}, {"scheduler_steps": 8}):
        with pytest.raises(UnsupportedSetting, match="SRAM machine"):
            replace(sram, **kw)  # type: ignore[arg-type]
    # the CLI names its option in one line, exit 2; the agent's backend names its key
    for args, flag in (
        (["--stack", "trtllm", "--eager"], "--eager"),
        (["--scheduler-steps", "4"], "--scheduler-steps"),
    ):
        for cmd in ("predict", "sweep"):
            out = runner.invoke(app, ["hardware", cmd, "-H", DEV, "-m", MDL, "--tp", "1", *args])
            assert out.exit_code == 2 and "Traceback" not in out.output, out.output
            assert f"{flag}: the " in out.output
    with pytest.raises(ValueError, match="eager: the trtllm stack profile"):
        build_backend({"hardware": DEV, "model": MDL, "tp": 1, "stack": "trtllm", "eager": True})
    anchor = tmp_path / "a.yaml"
    anchor.write_text("ttft_ms: {median: 40, p90: 50}\ntokens_per_s: 80\n")
    with pytest.raises(ValueError, match="eager: an anchored backend keeps"):
        build_backend({"hardware": DEV, "model": MDL, "anchor": str(anchor), "eager": True})


def _json(args: list[str]) -> dict[str, object]:
    out = runner.invoke(app, [*args, "--format", "json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_predict_and_sweep_take_the_settings_to_the_system():
    base = ["hardware", "predict", "-H", DEV, "-m", MDL, "--tp", "1", "--stack", "vllm-v0", "--batch", "4"]
    plain, eager = _json(base), _json([*base, "--eager"])
    steps = _json([*base, "--scheduler-steps", "8"])
    assert (plain["eager"], eager["eager"], steps["scheduler_steps"]) == (False, True, 8)
    layers, stk = cat.model(MDL).layers, cat.stack("vllm-v0")
    assert float(eager["step_ms"]) - float(plain["step_ms"]) == pytest.approx(  # type: ignore[arg-type]
        layers * stk.prefill_layer_overhead_us * 1e-3, rel=0.05
    )  # the mean step a request sees: decode steps, and its one prefill step, which eager leaves alone
    assert float(steps["step_ms"]) < float(plain["step_ms"])  # type: ignore[arg-type]
    assert float(eager["ttft_ms"]) == pytest.approx(float(plain["ttft_ms"]), rel=1e-9)  # type: ignore[arg-type]
    sweep = ["hardware", "sweep", "-H", DEV, "-m", MDL, "--tp", "1", "--stack", "vllm-v0", "--batches", "4"]
    s_plain, s_eager = _json(sweep), _json([*sweep, "--eager", "--scheduler-steps", "8"])
    assert (s_eager["eager"], s_eager["scheduler_steps"]) == (True, 8)
    row = next(r for r in s_eager["rows"] if r["batch"] == 4)  # type: ignore[attr-defined]
    p = hm.predict(cat.device(DEV), cat.model(MDL), batch=4, tp=1, stack=stk, eager=True, scheduler_steps=8)
    assert row["step_ms"] == pytest.approx(p.step_ms, rel=1e-12)  # a sweep row is `predict` with the settings
    assert row["step_ms"] != next(r for r in s_plain["rows"] if r["batch"] == 4)["step_ms"]  # type: ignore[attr-defined]
    bad = runner.invoke(app, [*base, "--scheduler-steps", "0"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def test_an_anchored_prediction_refuses_the_settings_in_one_line(tmp_path):
    anchor = tmp_path / "a.yaml"
    anchor.write_text("ttft_ms: {median: 40, p90: 50}\ntokens_per_s: 80\n")
    out = runner.invoke(
        app, ["hardware", "predict", "-H", DEV, "-m", MDL, "--anchor", str(anchor), "--eager"]
    )
    assert out.exit_code == 2 and "--eager" in out.output and "Traceback" not in out.output


def test_the_agents_backend_takes_the_settings():
    b = build_backend(
        {"hardware": DEV, "model": MDL, "tp": 1, "stack": "vllm-v0", "eager": True, "scheduler_steps": 4}
    )
    assert (b.system.eager, b.system.scheduler_steps) == (True, 4)
    assert "+eager" in b.name and "+steps4" in b.name
    assert b.describe()["eager"] is True
    plain = build_backend({"hardware": DEV, "model": MDL, "tp": 1})
    assert (plain.system.eager, plain.system.scheduler_steps) == (False, 1)
    for bad in ({"eager": "yes"}, {"scheduler_steps": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            build_backend({"hardware": DEV, "model": MDL, **bad})


def _point(**kw: object) -> val.Point:
    base = dict(id="t", device=DEV, chips=1, model=MDL, precision="bf16", prompt_tokens=1024, output_tokens=64,
                batch=4, stack="vllm-v0", metric="tpot_ms", date="2024", source="test", tier=1, value=10.0)  # fmt: skip
    return val.Point(**{**base, **kw})


def test_a_points_settings_parse_and_reach_its_system():
    for kw in ({}, {"chips": None}):  # published chips, or sized by the model
        x = val.prepare(_point(eager=True, scheduler_steps=15, **kw))
        assert x.system is not None and (x.system.eager, x.system.scheduler_steps) == (True, 15)
        d = val.prepare(_point(**kw))
        assert d.system is not None and (d.system.eager, d.system.scheduler_steps) == (False, 1)
    with pytest.raises(ValidationError):
        _point(scheduler_steps=0)


def test_a_point_stating_a_setting_its_stack_has_no_switch_for_is_not_answered_rather_than_a_crash():
    for kw in ({}, {"chips": None}):  # published chips, or sized by the model
        x = val.prepare(_point(stack="trtllm", eager=True, **kw))
        assert x.system is None and x.reason is not None and "eager: the trtllm stack profile" in x.reason


def test_every_shipped_point_carries_the_settings_its_notes_state():
    # the rule, written before the errors were looked at: `eager: true` exactly where the notes say the
    # run disabled CUDA/HIP graphs; `scheduler_steps: N` where they say --num-scheduler-step(s) N
    seen = 0
    for p in val.points():
        says_eager = bool(re.search(r"enforce[-_]eager|disable[-_]cuda[-_]graph", p.notes))
        assert p.eager == says_eager, p.id
        steps = re.search(r"num[-_]scheduler[-_]steps?[ =](\d+)", p.notes)
        assert p.scheduler_steps == (int(steps.group(1)) if steps else 1), p.id
        seen += says_eager
    assert seen == 8  # dstack's Llama-3.1-405B FP8 rows on 8x MI300X (the H100 rows ran with graphs)
