"""How a live run ends: SIGINT / SIGTERM mid-run write every output asked for with the turns measured so
far and exit 130 / 143 with one error line and no traceback; a run whose turns could not be measured exits
3 and labels them with their cause; outages and stage deaths reach the summary JSON and the HTML report;
the README's exit-code table is the one in voicepipe.exitcodes. The subprocess tests use the embedded
broker and generous timeouts (the box is loaded)."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import fast_config, tiny_scenario
from voicepipe.exitcodes import ExitCode
from voicepipe.records import TurnRecord
from voicepipe.report.html import render_html
from voicepipe.runner import run_pipeline
from voicepipe.runresult import RunResult
from voicepipe.stopping import Interrupted, stop_on_signals

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--set", "client.playout=first_audio", "--set", "agent.backend=cerebras-llama-3.1-8b",
        "--set", "broker.probe=false"]  # fmt: skip


def _scenario(tmp_path: Path, turns: int) -> Path:
    sc = tmp_path / "tiny.yaml"
    sc.write_text(yaml.safe_dump(tiny_scenario(turns=turns).model_dump(mode="json")))
    return sc


def _outputs(tmp_path: Path) -> dict[str, Path]:
    names = {"--json": "a.jsonl", "--csv": "a.csv", "--report": "a.html", "--otel": "a.json",
             "--summary-json": "s.json"}  # fmt: skip
    return {opt: tmp_path / name for opt, name in names.items()}


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_run_writes_every_output_and_exits_with_its_code(tmp_path, sig, code):
    files = _outputs(tmp_path)
    args = [a for opt, p in files.items() for a in (opt, str(p))]
    proc = subprocess.Popen(
        [sys.executable, "-m", "voicepipe", "run", str(_scenario(tmp_path, 6)), "-n", "2", *args, *FAST],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    jsonl = files["--json"]
    while not (jsonl.exists() and jsonl.read_text().strip()):  # at least one turn measured
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr and len(stderr.splitlines()) <= 20, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and sig.name in errors[0], stderr

    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert 1 <= len(recs) < 12  # stopped mid-run, what was measured kept
    with files["--csv"].open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(recs)
    spans = json.loads(files["--otel"].read_text())
    assert spans  # the finished turns' traces
    summary = json.loads(files["--summary-json"].read_text())
    assert summary["turns"]["expected"] == 12
    assert summary["turns"]["completed"] == sum(r["status"] == "ok" for r in recs)
    assert summary["incidents"]["ended_by"] == sig.name
    html = files["--report"].read_text()
    assert html.rstrip().endswith("</html>") and 'id="incidents"' in html and sig.name in html


def test_a_run_whose_endpoint_cannot_be_reached_labels_turns_failed_and_exits_3(tmp_path):
    # port 9 on localhost: nothing listens, the connection is refused at once
    backend = json.dumps({"endpoint": "http://127.0.0.1:9/v1", "model": "m"})
    proc = subprocess.run(
        [sys.executable, "-m", "voicepipe", "run", str(_scenario(tmp_path, 2)), "--set", f"agent.backend={backend}",
         "--set", "client.playout=first_audio", "--set", "broker.probe=false",
         "--summary-json", str(tmp_path / "s.json")],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == ExitCode.TURNS_NOT_MEASURED == 3, proc.stderr
    turn_lines = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    assert len(turn_lines) == 2 and all(" failed " in t and "cannot connect" in t for t in turn_lines)
    assert "timeout" not in proc.stdout and "failed" in proc.stdout  # the turns table says why too
    assert "2 of 2 expected turns not measured" in proc.stderr and "Traceback" not in proc.stderr
    assert json.loads((tmp_path / "s.json").read_text())["turns"]["completed"] == 0


async def test_a_signal_lets_the_run_wind_down_and_hands_back_what_it_measured():
    cfg = fast_config("broker.probe=false")
    seen: list[TurnRecord] = []

    def on_record(r: TurnRecord) -> None:
        seen.append(r)
        if len(seen) == 1:
            os.kill(os.getpid(), signal.SIGUSR1)

    with pytest.raises(Interrupted) as got:
        await stop_on_signals(run_pipeline(cfg, [tiny_scenario(turns=3)], 2, on_record=on_record), (signal.SIGUSR1,))
    res = got.value.result
    assert got.value.signum == signal.SIGUSR1 and isinstance(res, RunResult)
    assert res.records == seen and 1 <= len(res.records) < 6 and res.expected_turns == 6
    assert res.summary_json()["incidents"]["ended_by"] == "SIGUSR1"  # type: ignore[index]
    assert res.accounting().lost.get("never played (run cut short)", 0) == 6 - len(res.records)
    assert res.open_tasks_after == 0 and not [t for t in asyncio.all_tasks() if t.get_name().startswith("stage-")]


def _record(i: int, outage_ms: float | None = None) -> TurnRecord:
    return TurnRecord(run="r", scenario="s", session="s-0", turn=i, measured_ms=500.0 + i, predicted_ms=450.0,
                      tax_ms=50.0 + i, within_budget=True, broker_outage_ms=outage_ms)  # fmt: skip


def test_outages_stalls_and_stage_deaths_reach_the_summary_json_and_the_report():
    s = 1_000_000_000
    res = RunResult(run="r", broker="b", records=[_record(0), _record(1, 2400.0), _record(2, 900.0)])
    res.broker_outages = [(10 * s, 12 * s), (11 * s, 12 * s + s // 2)]  # two clients saw one outage
    res.broker_stalls = [(20 * s, 21 * s)]
    res.reconnects = 4
    res.deaths = ["w1 (tts.1): exited with code -9"]
    res.outage = "broker 127.0.0.1:1883 unreachable for more than 2 s (broker.outage_window_s)"
    inc = res.summary_json()["incidents"]
    assert inc["broker"] == {  # type: ignore[index]
        "outages": 1, "outage_longest_ms": 2500.0, "outages_ms": [2500.0], "stalls": 1,
        "stall_longest_ms": 1000.0, "stalls_ms": [1000.0], "reconnects": 4, "turns_affected": 2,
        "turn_outage_max_ms": 2400.0,
    }  # fmt: skip
    assert inc["stage_deaths"] == res.deaths and inc["ended_by"].startswith("broker outage: broker 127")  # type: ignore[index]
    html = render_html({"cfg": res.records}, {}, incidents={"cfg": res.incidents()})
    section = html[html.index('id="incidents"') :].split("</section>")[0]
    for text in ("run ended early", "outage_window_s", "lost 1 time(s), longest 2,500 ms", "4 client reconnect",
                 "stalled 1 time(s)", "2 turn(s) overlapped", "2,400 ms", "w1 (tts.1): exited with code -9"):  # fmt: skip
        assert text in section, text


def test_a_report_has_no_incidents_section_when_nothing_happened_but_counts_outages_from_records_alone():
    quiet = render_html({"cfg": [_record(0), _record(1)]}, {})
    assert 'id="incidents"' not in quiet
    # a report of records alone (no run result): the turns' broker_outage_ms still shows
    html = render_html({"cfg": [_record(0), _record(1, 1200.0)]}, {})
    assert 'id="incidents"' in html and "1 turn(s) overlapped" in html and "1,200 ms" in html


def test_the_readme_lists_every_exit_code_and_no_other():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Exit codes") :].split("\n## ", 1)[0]
    documented = {int(m) for m in re.findall(r"^\|\s*`?(\d+)`?\s*\|", table, re.M)}
    assert documented == {int(c) for c in ExitCode}


def test_sigterm_stops_a_live_compare_with_what_it_measured_written(tmp_path):
    out, table, report = tmp_path / "a.jsonl", tmp_path / "a.csv", tmp_path / "a.html"
    proc = subprocess.Popen(
        [sys.executable, "-m", "voicepipe", "compare", str(_scenario(tmp_path, 6)),
         "--vary", "agent.backend=cerebras-llama-3.1-8b,groq-llama-3.1-8b", "--json", str(out), "--csv", str(table),
         "--report", str(report), "--set", "client.playout=first_audio", "--set", "broker.probe=false"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.TERMINATED, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "SIGTERM" in errors[0] and "Traceback" not in stderr, stderr
    recs = out.read_text().splitlines()
    assert 1 <= len(recs) < 12 and len(table.read_text().splitlines()) == len(recs) + 1
    assert 'id="incidents"' in report.read_text()
