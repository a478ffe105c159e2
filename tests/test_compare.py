"""`voicepipe compare`: variant planning, row arithmetic, and one real two-configuration run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_scenario
from voicepipe.compare import (
    compare_rows,
    display_names,
    fmt_usd,
    join_parts,
    parse_vary,
    plan_variants,
    verdict,
)
from voicepipe.errors import UserError
from voicepipe.records import BreakdownPart, TurnRecord

# --- plan_variants -------------------------------------------------------------------------------------


def test_vary_one_axis_labels_and_configs():
    v = plan_variants([], ["agent.backend=sonnet-gpu,cerebras-llama-3.1-8b"], ["client.playout=first_audio"])
    assert [lab for lab, _ in v] == ["agent.backend=sonnet-gpu", "agent.backend=cerebras-llama-3.1-8b"]
    assert [c.agent.backend for _, c in v] == ["sonnet-gpu", "cerebras-llama-3.1-8b"]
    assert all(c.client.playout == "first_audio" for _, c in v)  # base --set reaches every variant


def test_vary_values_are_yaml_and_may_contain_slashes():
    v = plan_variants(None, ["asr.silence_ms=100, 300", "agent.backend=cerebras-wse3/llama-3.1-8b"])
    assert [c.asr.silence_ms for _, c in v] == [100.0, 300.0]
    assert all(c.agent.backend == "cerebras-wse3/llama-3.1-8b" for _, c in v)


def test_grid_is_the_cartesian_product_in_order():
    v = plan_variants([], ["agent.backend=sonnet-gpu,groq-llama-3.1-8b", "asr.silence_ms=200,500"])
    assert [lab for lab, _ in v] == [
        "agent.backend=sonnet-gpu, asr.silence_ms=200",
        "agent.backend=sonnet-gpu, asr.silence_ms=500",
        "agent.backend=groq-llama-3.1-8b, asr.silence_ms=200",
        "agent.backend=groq-llama-3.1-8b, asr.silence_ms=500",
    ]
    assert [(c.agent.backend, c.asr.silence_ms) for _, c in v][-1] == ("groq-llama-3.1-8b", 500.0)


def test_config_files_label_by_stem_and_one_file_is_the_base(tmp_path):
    a, b = tmp_path / "fast.yaml", tmp_path / "slow.yaml"
    a.write_text("agent:\n  backend: cerebras-llama-3.1-8b\n")
    b.write_text("agent:\n  backend: sonnet-gpu\nasr:\n  silence_ms: 500\n")
    v = plan_variants([a, b], [])
    assert [lab for lab, _ in v] == ["fast", "slow"]
    assert v[1][1].asr.silence_ms == 500
    based = plan_variants([b], ["agent.backend=groq-llama-3.1-8b,sonnet-gpu"])
    assert [lab for lab, _ in based] == ["agent.backend=groq-llama-3.1-8b", "agent.backend=sonnet-gpu"]
    assert all(c.asr.silence_ms == 500 for _, c in based)
    crossed = plan_variants([a, b], ["asr.silence_ms=100,200"])
    assert [lab for lab, _ in crossed] == [
        "fast, asr.silence_ms=100",
        "fast, asr.silence_ms=200",
        "slow, asr.silence_ms=100",
        "slow, asr.silence_ms=200",
    ]


def test_same_stem_in_two_folders_gets_distinct_labels(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    for d in ("x", "y"):
        (tmp_path / d / "cfg.yaml").write_text("seed: 1\n")
    labels = [lab for lab, _ in plan_variants([tmp_path / "x/cfg.yaml", tmp_path / "y/cfg.yaml"], [])]
    assert len(set(labels)) == 2


@pytest.mark.parametrize(
    ("configs", "vary", "sets", "needles"),
    [
        ([], ["agent.backend=sonnet-gpu,warp-drive"], [], ["agent.backend=warp-drive", "agent.backend"]),
        ([], ["asr.silence_ms=100,fast"], [], ["asr.silence_ms=fast", "asr.silence_ms"]),
        ([], ["asr.no_such=1,2"], [], ["asr.no_such=1", "unknown field"]),
        ([], ["agent.backend"], [], ["--vary", "agent.backend"]),
        ([], ["agent.backend=a,,b"], [], ["agent.backend", "empty value"]),
        ([], ["a=1", "b=2", "c=3"], [], ["at most 2"]),
        ([], ["asr.silence_ms=1", "asr.silence_ms=2"], [], ["asr.silence_ms", "twice"]),
        ([], ["agent.backend=sonnet-gpu"], ["agent.backend=groq-llama-3.1-8b"], ["--set", "agent.backend"]),
        ([], [], [], ["nothing to compare"]),
    ],
)
def test_bad_input_names_the_configuration_and_field(configs, vary, sets, needles):
    with pytest.raises(UserError) as exc:
        plan_variants(configs, vary, sets)
    msg = str(exc.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg


def test_bad_config_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("agent:\n  backend: warp-drive\n")
    good = tmp_path / "good.yaml"
    good.write_text("seed: 3\n")
    with pytest.raises(UserError, match=r"'bad'.*bad\.yaml.*agent\.backend"):
        plan_variants([good, bad], [])


def test_parse_vary_drops_duplicate_values():
    assert parse_vary(" agent.backend = a, b ,a").values == ("a", "b")


def test_display_names_factor_out_the_varied_fields():
    assert display_names(["agent.backend=a", "agent.backend=b"]) == ("agent.backend", ["a", "b"])
    assert display_names(["x=1, y=2", "x=1, y=3"]) == ("x · y", ["1 · 2", "1 · 3"])
    assert display_names(["fast", "slow"]) == ("config", ["fast", "slow"])
    assert display_names(["fast, x=1", "slow, x=1"])[0] == "config"


# --- compare_rows ----------------------------------------------------------------------------------------


def rec(label: str, ms: float | None, cost: float = 0.0, quality: float | None = None, agent: float = 0):
    return TurnRecord(
        run="r",
        label=label,
        scenario="s",
        session="s-0",
        turn=0,
        status="ok" if ms is not None else "timeout",
        measured_ms=ms,
        within_budget=ms is not None and ms <= 800,
        cost_usd=cost,
        quality=quality,
        breakdown=[
            BreakdownPart(stage="agent", what="ttft", ms=agent),
            BreakdownPart(stage="asr", what="endpoint wait", ms=200),
            BreakdownPart(stage="tts", what="first audio", ms=100),
            BreakdownPart(stage="transport", what="uplink", ms=50),
        ]
        if ms is not None
        else [],
    )


def test_compare_rows_arithmetic_and_best_marks():
    runs = {
        "slow": [rec("slow", v, 0.004, 0.9, agent=700) for v in (900, 1000, 1100)] + [rec("slow", None)],
        "fast": [rec("fast", v, 0.0001, 0.7, agent=100) for v in (150, 500, 700, 850)],
        "unknown": [rec("unknown", v, 0.001, None, agent=300) for v in (400, 600)],
    }
    slow, fast, unk = compare_rows(runs)
    assert [r.label for r in (slow, fast, unk)] == ["slow", "fast", "unknown"]
    assert (slow.turns, slow.answered) == (4, 3)
    assert slow.p50_ms == 1000 and slow.within_budget == 0.0
    assert fast.p50_ms == 600 and fast.within_budget == 0.75 and fast.under_200ms == 0.25
    assert fast.p90_ms == pytest.approx(805.0)
    assert slow.cost_per_turn_usd == pytest.approx(0.003)  # the timeout costs nothing and counts as a turn
    assert fast.cost_per_1k_usd == pytest.approx(0.1)
    assert slow.quality == pytest.approx(0.9) and unk.quality is None
    assert slow.stage_ms["agent"] == pytest.approx(700)
    assert [s for s, _ in slow.top_stages(3)] == ["agent", "asr", "tts"]
    assert fast.fits and unk.fits and not slow.fits
    assert unk.best_p50 and not fast.best_p50
    assert fast.cheapest and not slow.cheapest
    assert slow.best_quality and not fast.best_quality


def test_no_best_marks_when_rows_tie():
    rows = compare_rows({"a": [rec("a", 500, 0.001, 0.7)], "b": [rec("b", 500, 0.001, 0.7)]})
    assert not any(r.best_p50 or r.cheapest or r.best_quality for r in rows)


def test_verdict_names_fitting_configs_and_the_trade_off():
    rows = compare_rows(
        {
            "pricey": [rec("pricey", 400, 0.006)],
            "cheap": [rec("cheap", 1000, 0.001)],
            "mid": [rec("mid", 700, 0.002)],
        }
    )
    lines = verdict(rows)
    assert lines[0].startswith("p50 inside the 800 ms budget, cheapest first: mid")
    assert "pricey" in lines[0] and "cheap (" not in lines[0]
    assert "fastest pricey" in lines[1] and "cheapest cheap" in lines[1]
    assert "2.5× faster" in lines[1] and "6.0× the cost" in lines[1]
    none = verdict(compare_rows({"a": [rec("a", 1200)], "b": [rec("b", 900)]}))
    assert "closest: b (900 ms)" in none[0]
    assert not any("best case" in line for line in lines + none)


def test_verdict_says_a_hardware_backend_has_no_network_when_ranked_beside_a_service():
    def on(label: str, ms: float, backend: str) -> TurnRecord:
        return rec(label, ms, 0.001).model_copy(update={"backend": backend})

    mixed = verdict(compare_rows({"hw": [on("hw", 700, "h100-sxm/llama-3.1-8b")],
                                  "api": [on("api", 750, "cerebras-llama-3.1-8b")]}))  # fmt: skip
    assert "no API network" in mixed[-1] and "best case" in mixed[-1]
    same = verdict(compare_rows({"a": [on("a", 700, "h100-sxm/llama-3.1-8b")],
                                 "b": [on("b", 750, "cerebras-wse3/llama-3.1-8b")]}))  # fmt: skip
    assert not any("no API network" in line for line in same)
    # an endpoint is a service, though its label holds a slash; the cache and the council are neither
    served = verdict(compare_rows({"ep": [on("ep", 700, "endpoint:127.0.0.1:8080/my-model")],
                                   "hw": [on("hw", 750, "h100-sxm/llama-3.1-8b")]}))  # fmt: skip
    assert "no API network" in served[-1]
    cached = verdict(compare_rows({"a": [on("a", 300, "cache"), on("a", 700, "h100-sxm/llama-3.1-8b")],
                                   "b": [on("b", 650, "council:2")]}))  # fmt: skip
    assert not any("no API network" in line for line in cached)


def test_money_and_parts_formatting():
    assert [fmt_usd(v) for v in (0, 0.0068, 0.013, 0.57, 16.2, 1234)] == [
        "$0",
        "$0.0068",
        "$0.013",
        "$0.57",
        "$16.20",
        "$1,234",
    ]
    assert join_parts(["agent 900", "asr 300", "tts 200"], 20) == "agent 900 · asr 300\ntts 200"
    assert join_parts(["a 1", "b 2"]) == "a 1 · b 2"


# --- the command -----------------------------------------------------------------------------------------


def vp(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "100"}
    env.pop("VOICEPIPE_BROKER", None)
    return subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


def test_bad_vary_exits_2_with_one_line():
    r = vp("compare", "cafe-order", "--vary", "agent.backend=sonnet-gpu,warp-drive")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "agent.backend=warp-drive" in lines[0]


def test_compare_two_backends_end_to_end(tmp_path):
    sc = tmp_path / "tiny.yaml"
    sc.write_text(yaml.safe_dump(tiny_scenario(turns=2).model_dump(mode="json", exclude_defaults=True)))
    out = tmp_path / "turns.jsonl"
    r = vp(
        "compare",
        str(sc),
        "--vary",
        "agent.backend=sonnet-gpu,cerebras-llama-3.1-8b",
        "--set",
        "client.playout=first_audio",
        "--set",
        "client.turn_timeout_s=10",
        "--json",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    body = [ln for ln in r.stdout.splitlines() if ln.lstrip().startswith(("sonnet-gpu", "cerebras-llama"))]
    assert len(body) == 2, r.stdout  # one row per configuration
    assert "modelled" in r.stdout and "agent.backend" in r.stdout
    assert max(len(ln) for ln in r.stdout.splitlines()) <= 100

    recs = [TurnRecord.model_validate(json.loads(ln)) for ln in out.read_text().splitlines()]
    runs: dict[str, list[TurnRecord]] = {}
    for t in recs:
        runs.setdefault(t.label, []).append(t)
    assert set(runs) == {"agent.backend=sonnet-gpu", "agent.backend=cerebras-llama-3.1-8b"}
    assert all(len(v) == 2 for v in runs.values())
    sonnet, cerebras = compare_rows(runs)
    assert sonnet.p50_ms is not None and cerebras.p50_ms is not None
    assert sonnet.p50_ms > cerebras.p50_ms
    assert sonnet.cost_per_turn_usd > cerebras.cost_per_turn_usd > 0
    assert cerebras.best_p50 and cerebras.cheapest and sonnet.best_quality


def test_compare_predict_shows_the_uncertain_turns_beside_the_within_budget_share():
    from typer.testing import CliRunner

    from voicepipe.cli import app

    r = CliRunner().invoke(app, ["compare", "--predict", "cafe-order", "--vary",
                                 "agent.backend=h100-sxm/llama-3.1-8b,sonnet-gpu"], env={"COLUMNS": "160"})  # fmt: skip
    assert r.exit_code == 0, r.output
    from voicepipe.config import load_config
    from voicepipe.predict import predict
    from voicepipe.scenario import load_scenario

    recs = [p.as_record() for p in predict(load_config(None, ["agent.backend=h100-sxm/llama-3.1-8b"]),
                                           [load_scenario("cafe-order")])]  # fmt: skip
    n = sum(r.uncertain for r in recs)
    flat = " ".join(r.output.split())
    assert n > 0 and f"+{n}?" in flat and "not counted as within the budget" in flat
