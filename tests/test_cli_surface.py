"""The command line as a person meets it: 80 columns, pipes, --version, logs on stderr, schemas, starters.

Commands run as subprocesses with COLUMNS=80 and stdout/stderr captured (so both are pipes, as in
``voicepipe ... | less``): every line fits in 80 columns, the numbers a user reads are there in full, and
stdout carries results only.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from tests.test_otel import Collector
from voicepipe import __version__
from voicepipe.compare import compare_rows, plan_variants
from voicepipe.config import load_config
from voicepipe.logs import configure, level_from_flags
from voicepipe.predict import predict
from voicepipe.records import TurnRecord
from voicepipe.scenario import load_scenario

WIDTH = 80


def vp(
    *args: str, width: int = WIDTH, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(width), "LINES": "24", "NO_COLOR": "1", "TERM": "dumb"}
    env.pop("VOICEPIPE_BROKER", None)
    return subprocess.run(
        [sys.executable, "-m", "voicepipe", *args], capture_output=True, text=True, env=env, cwd=cwd,
        timeout=timeout, check=False,
    )  # fmt: skip


def fits(text: str, width: int = WIDTH) -> None:
    # a suggested command stands alone on its line and is never wrapped, so that it copies whole
    long = [line for line in text.splitlines() if len(line) > width and not line.startswith("  voicepipe ")]
    assert not long, f"{len(long)} line(s) wider than {width}: {long[:3]}"


def ms(v: float | None) -> str:
    assert v is not None
    return f"{v:,.0f}"


def test_version_and_python_m() -> None:
    p = vp("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"voicepipe {__version__}"


def test_predict_at_80_columns_shows_every_number_in_full() -> None:
    p = vp("predict", "cafe-order")
    assert p.returncode == 0, p.stderr
    fits(p.stdout)
    cfg = load_config(None, [])
    preds = predict(cfg, [load_scenario("cafe-order")])
    for pr in preds:
        assert f" {ms(pr.predicted_ms)} " in p.stdout
        big = max(pr.breakdown, key=lambda b: b.ms)
        assert ms(big.ms) in p.stdout  # the largest part's number is not cut
    assert "next step:" in p.stdout and "predicted p50" in p.stdout
    assert "\n  voicepipe predict cafe-order " in p.stdout
    assert p.stderr == ""


def test_predict_format_json_is_pure_json_lines() -> None:
    p = vp("predict", "rapid-fire", "--format", "json")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == len(load_scenario("rapid-fire").turns)
    assert all(json.loads(line)["predicted_ms"] > 0 for line in lines)


def test_compare_predict_at_80_columns() -> None:
    vary = "agent.backend=sonnet-gpu,groq-llama-3.1-8b,cerebras-wse3/llama-3.1-8b"
    p = vp("compare", "cafe-order", "--predict", "--vary", vary)
    assert p.returncode == 0, p.stderr
    fits(p.stdout)
    variants = plan_variants([], [vary], [], None)
    runs = {
        label: [x.as_record(label) for x in predict(cfg, [load_scenario("cafe-order")])]
        for label, cfg in variants
    }
    for row in compare_rows(runs):
        assert ms(row.p50_ms) in p.stdout and ms(row.p90_ms) in p.stdout
        assert f"{row.within_budget * 100:.0f}%" in p.stdout
    for name in ("sonnet-gpu", "groq-llama-3.1-8b", "cerebras-wse3/llama-3.1-8b"):
        assert name in p.stdout


def cli(*args: str, cwd: Path | None = None) -> tuple[int, str, str]:
    """The app in this process (for commands whose output does not depend on the terminal width)."""
    from typer.testing import CliRunner

    from voicepipe.cli import app

    old = Path.cwd()
    if cwd:
        os.chdir(cwd)
    try:
        r = CliRunner().invoke(app, list(args))
    finally:
        os.chdir(old)
    return r.exit_code, r.stdout, r.stderr


def test_scenarios_and_schema_and_starter(tmp_path: Path) -> None:
    p = vp("scenarios")
    assert p.returncode == 0 and "cafe-order" in p.stdout and "hesitant-speaker" in p.stdout
    fits(p.stdout)
    for what, title in (("scenario", "Scenario"), ("config", "PipelineConfig"), ("messages", "Envelope")):
        code, out, err = cli("schema", what)
        assert code == 0, err
        assert json.loads(out)["title"] == title
    scen = json.loads(cli("schema", "scenario")[1])
    turn = scen["$defs"]["Turn"]["properties"]
    assert "[700]" in turn["user"]["description"] and "source" not in scen["properties"]
    code, _, err = cli("scenarios", "new", "my-call", cwd=tmp_path)
    assert code == 0, err
    sc = load_scenario(str(tmp_path / "my-call.yaml"))
    assert sc.name == "my-call" and len(sc.turns) >= 2 and sc.cache
    code, _, err = cli("scenarios", "new", "my-call", cwd=tmp_path)
    assert code == 2 and "already exists" in err
    code, out, err = cli("predict", str(tmp_path / "my-call.yaml"))
    assert code == 0, err


def test_every_command_has_help_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", str(WIDTH))  # typer builds its help console per call, from the env
    for cmd in (
        [], ["run"], ["compare"], ["predict"], ["stage"], ["scenarios"], ["scenarios", "new"], ["schema"],
    ):  # fmt: skip
        code, out, err = cli(*cmd, "--help")
        assert code == 0, (cmd, err)
        fits(out)
    opts = cli("run", "--help")[1]
    for flag in ("--json", "--format", "--wide", "--otlp-endpoint", "--otel", "--quiet"):
        assert flag in opts


@pytest.mark.broker
def test_run_piped_at_80_columns(tmp_path: Path) -> None:
    """A live run with stdout and stderr piped: a line per finished turn on stderr as it happens, the
    tables on stdout at 80 columns with every measured number whole, records = what the tables say."""
    sc = tmp_path / "two.yaml"
    sc.write_text(
        "name: two\nturns:\n  - user: Hello there.\n    reply: Hi! How can I help?\n"
        "  - user: What time is it?\n    reply: It is noon.\n",
        encoding="utf-8",
    )
    recs = tmp_path / "r.jsonl"
    collector = Collector()
    collector.thread.start()
    try:
        p = vp("run", str(sc), "--set", "client.playout=first_audio", "--json", str(recs),
               "--otlp-endpoint", collector.url, timeout=180)  # fmt: skip
    finally:
        collector.server.shutdown()
        collector.server.server_close()
    assert p.returncode == 0, p.stderr
    # the trace arrived at the collector as GenAI spans, one chat span per turn
    chats = [sp for sp in collector.spans() if sp.name == "chat sonnet-gpu"]
    assert len(chats) == 2 and all(sp.kind == sp.SPAN_KIND_CLIENT for sp in chats)
    assert f"otlp: {len(collector.spans())} spans pushed" in p.stderr
    fits(p.stdout)
    records = [TurnRecord.model_validate_json(line) for line in recs.read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert ms(r.measured_ms) in p.stdout and ms(r.predicted_ms) in p.stdout
        assert r.ttft_ms is not None and r.tts_ttfb_ms is not None and r.endpoint_delay_ms is not None
    turn_lines = [line for line in p.stderr.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in turn_lines] == ["[1/2", "[2/2"]
    assert "{" not in p.stdout  # no log or JSON on stdout in table mode
    assert "next step:" in p.stdout  # the sonnet baseline misses 800 ms


@pytest.mark.broker
def test_compare_live_piped_json(tmp_path: Path) -> None:
    """`compare --format json` with pipes: stdout is JSON lines only (one per turn and configuration),
    stderr counts the turns across configurations."""
    sc = tmp_path / "one.yaml"
    sc.write_text(
        "name: one\nturns:\n  - user: Hello there.\n    reply: Hi! How can I help?\n", encoding="utf-8"
    )
    p = vp("compare", str(sc), "--vary", "agent.backend=sonnet-gpu,groq-llama-3.1-8b", "--set",
           "client.playout=first_audio", "--format", "json", timeout=180)  # fmt: skip
    assert p.returncode == 0, p.stderr
    recs = [TurnRecord.model_validate_json(line) for line in p.stdout.splitlines()]
    assert sorted(r.label for r in recs) == ["agent.backend=groq-llama-3.1-8b", "agent.backend=sonnet-gpu"]
    assert [line.split("]")[0] for line in p.stderr.splitlines() if line.startswith("[")] == ["[1/2", "[2/2"]


def test_logs_go_to_stderr_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    buf = io.StringIO()
    configure("info", "json", buf)
    try:
        structlog.get_logger("voicepipe.test").warning("deadletter", stage="asr", reason="bad json")
        logging.getLogger("aiomqtt").error("lost connection")  # third-party: one level quieter, errors kept
        logging.getLogger("voicepipe.bus").info("connected")
        logging.getLogger("aiomqtt").info("chatty")  # held back at info
        structlog.get_logger("voicepipe.test").debug("hidden")
    finally:
        configure()
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [d["event"] for d in lines] == ["deadletter", "lost connection", "connected"]
    assert lines[0]["stage"] == "asr" and lines[0]["level"] == "warning" and "timestamp" in lines[0]
    assert lines[1]["logger"] == "aiomqtt"
    assert capsys.readouterr().out == ""


def test_console_logs_follow_sys_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    configure("warning", "console")
    structlog.get_logger("voicepipe.test").warning("handler failed", stage="tts")
    captured = capsys.readouterr()
    assert "handler failed" in captured.err and "stage=tts" in captured.err and captured.out == ""


def test_level_flags() -> None:
    assert level_from_flags(0, False) == "warning"
    assert level_from_flags(1, False) == "info"
    assert level_from_flags(5, False) == "debug"
    assert level_from_flags(2, True) == "error"
    assert level_from_flags(0, True, "DEBUG") == "debug"


def test_capacity_at_80_columns_shows_every_number_in_full(tmp_path: Path) -> None:
    out = tmp_path / "cap.jsonl"
    p = vp(
        "capacity", "cafe-order", "--vary", "agent.backend=groq-llama-3.1-8b,cerebras-llama-3.1-8b",
        "--sessions", "1,5", "--json", str(out), "--jobs", "1",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    fits(p.stdout)
    levels = [json.loads(line) for line in out.read_text().splitlines() if '"level"' in line]
    assert len(levels) == 4
    for lv in levels:  # the percentiles the JSON carries are printed whole
        for k in ("p50_ms", "p90_ms"):
            assert f" {ms(lv[k])} " in p.stdout, (k, lv[k])


def test_require_gates_predict_and_run_with_exit_1_after_printing_everything(tmp_path: Path) -> None:
    """--require for CI: a missed requirement exits 1 and names itself, after the usual output; met ones
    exit 0; a malformed one is a one-line error (exit 2) before anything runs."""
    from voicepipe.gate import values

    p90 = values([p.as_record() for p in predict(load_config(None, []), [load_scenario("cafe-order")])])[
        "p90"
    ]
    assert p90 is not None
    miss = vp("predict", "cafe-order", "--require", f"p90<={p90 - 1:.0f},ok>=1")
    assert miss.returncode == 1, miss.stderr
    assert "Predicted turns" in miss.stdout  # the predictions were printed first
    lines = [ln for ln in miss.stderr.splitlines() if "requirement" in ln]
    assert len(lines) == 1 and f"p90 <= {p90 - 1:.0f} ms not met" in lines[0], miss.stderr
    met = vp("predict", "cafe-order", "--require", f"p90<={p90 + 1:.0f}", "--require", "within>=0")
    assert met.returncode == 0, met.stderr
    bad = vp("predict", "cafe-order", "--require", "p90=800")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--require" in bad.stderr
    import yaml

    from tests.conftest import tiny_scenario

    sc, out = tmp_path / "tiny.yaml", tmp_path / "turns.jsonl"
    sc.write_text(yaml.safe_dump(tiny_scenario(turns=2).model_dump(mode="json")))
    fast = ["--set", "client.playout=first_audio", "--set", "agent.backend=cerebras-llama-3.1-8b"]
    run = vp("run", str(sc), *fast, "-q", "--json", str(out), "--require", "ok>=1,p50<=1")
    assert run.returncode == 1, run.stderr
    assert "requirement p50 <= 1 ms not met" in run.stderr and "requirement ok" not in run.stderr
    assert len(out.read_text().splitlines()) == 2  # everything measured was written


def test_shipped_configs_load_by_name_from_any_folder(tmp_path: Path) -> None:
    by_name = load_config("fast-lane")
    assert by_name.agent.backend == "cerebras-wse3/llama-3.1-8b"
    assert load_config("fast-lane.yaml") == by_name
    code, out, err = cli("predict", "cafe-order", "-c", "fast-lane", "--format", "json", cwd=tmp_path)
    assert code == 0, err
    assert json.loads(out.splitlines()[0])["backend"]
    # a file in the working folder wins over a shipped name
    (tmp_path / "fast-lane.yaml").write_text("agent: {backend: groq-lpu/llama-3.1-8b}\n")
    code, out, err = cli("predict", "cafe-order", "-c", "fast-lane.yaml", "--format", "json", cwd=tmp_path)
    assert code == 0, err
    assert any("groq-lpu" in json.loads(line)["backend"] for line in out.splitlines())


def test_scenarios_lists_the_shipped_configs() -> None:
    p = vp("scenarios")
    assert p.returncode == 0, p.stderr
    assert "shipped configs" in p.stdout
    for name in ("fast-lane", "council-vote", "router-rules", "baseline"):
        assert name in p.stdout
    assert "scenarios/configs/" not in p.stdout
    fits(p.stdout)


def test_advice_hints_name_shipped_configs_by_short_name() -> None:
    from voicepipe.report.advice import _flags, candidates

    (fast,) = [c for c in candidates("transport", load_config(None, [])) if c.config is not None]
    assert _flags(fast) == ["-c", "fast-lane"]
