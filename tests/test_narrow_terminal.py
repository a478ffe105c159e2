"""Output at 80 columns: long utterances stay a few lines, hidden columns are named, notes come after the
tables and wrap between words, and ``hardware validate`` prints a screenful by default."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from rich.console import Console

from tests.conftest import tiny_scenario
from tests.test_report import make_record
from voicepipe.hardware import validate as val
from voicepipe.report.table import SAID_LINES, print_predictions, print_turns
from voicepipe.report.term import Col, capped, hyphenated, print_fitted

LONG_SAID = " ".join(
    ["So here is the thing, I have been on hold since Monday morning when the engineer came round"] * 8
)


def _cli(*args: str, columns: int = 80, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """The CLI in a subprocess whose stdout and stderr share one pipe (so their order is kept)."""
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "dumb"}
    env.pop("FORCE_COLOR", None)
    return subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", *args], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def _rows(out: str, row_start: str) -> list[list[str]]:
    """The table's body as rows of lines: a row starts with a match of ``row_start``, its further lines
    with a blank first cell."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("─")) + 1
    rows: list[list[str]] = []
    for ln in lines[start:]:
        if rows and ln.startswith(" ") and ln.strip():
            rows[-1].append(ln)
        elif re.match(row_start, ln):
            rows.append([ln])
        else:
            break
    return rows


def test_capped_text_keeps_whole_words_and_marks_the_cut() -> None:
    out = capped(LONG_SAID, 20, 3).split("\n")
    assert len(out) == 3 and out[-1].endswith("…") and all(len(ln) <= 20 for ln in out)
    words = set(LONG_SAID.replace(",", "").split())
    assert all(w in words for ln in out for w in ln.rstrip("…").replace(",", "").split())
    assert capped("short text", 20, 3) == "short text"


def test_a_long_utterance_is_a_few_lines_in_the_turn_table_at_80_columns() -> None:
    recs = [make_record(i, session=f"support-call-{i % 2}") for i in range(4)]
    recs[1] = recs[1].model_copy(update={"user_text": LONG_SAID})
    buf = io.StringIO()
    print_turns(Console(file=buf, width=80, color_system=None), recs, 800.0)
    out = buf.getvalue()
    rows = _rows(out, r"support-call-\d ")
    assert len(rows) == 4
    assert all(len(r) <= SAID_LINES for r in rows), [len(r) for r in rows]
    assert "…" in "".join(rows[1]) and "So here is" in rows[1][0]
    assert max(len(ln.rstrip()) for ln in out.splitlines()) <= 80


def test_predict_at_80_columns_caps_the_cell_and_the_json_keeps_the_whole_utterance(tmp_path: Path) -> None:
    sc = tiny_scenario("long-talk", turns=3).model_dump(mode="json")
    sc["turns"][1]["user"] = LONG_SAID
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(sc))
    js = tmp_path / "pred.jsonl"
    r = _cli("predict", str(path), "--json", str(js))
    assert r.returncode == 0, r.stdout
    rows = _rows(r.stdout, r"\d ")
    assert len(rows) == 3 and all(len(row) <= SAID_LINES for row in rows), r.stdout
    table = r.stdout.split("next step")[0]  # the advice's command is never wrapped, so that it copies whole
    assert max(len(ln.rstrip()) for ln in table.splitlines()) <= 80
    said = [json.loads(line) for line in js.read_text().splitlines()]
    assert LONG_SAID in json.dumps(said)  # the whole text is in the JSON


def test_the_premature_endpoint_mark_keeps_its_column_and_a_dropped_path_column_is_named() -> None:
    recs = [make_record(i) for i in range(3)]  # every turn served by the agent path
    recs[1] = recs[1].model_copy(update={"premature_endpoint": True})
    buf = io.StringIO()
    print_turns(Console(file=buf, width=80, color_system=None), recs, 800.0)
    assert "agent!" in buf.getvalue()  # the mark is shown, so its column is too
    for width in (40, 48, 56):
        buf = io.StringIO()
        print_turns(Console(file=buf, width=width, color_system=None), recs, 800.0)
        out = buf.getvalue()
        if "agent!" not in out:
            assert "path" in _hidden(out).split(":")[1], out
            break
    else:
        raise AssertionError("the path column was never dropped: widen the range of widths")
    buf = io.StringIO()
    preds = [r.model_copy(update={"predicted_ms": 500.0}) for r in recs]
    print_predictions(Console(file=buf, width=36, color_system=None), preds, 800.0)
    out = buf.getvalue()
    assert "agent!" in out or "path" in _hidden(out).split(":")[1], out


def test_a_hyphenated_id_breaks_only_after_a_hyphen() -> None:
    pid = "trtllm05-h100-llama2-70b-fp8-tp4-b1-ttft-2048"
    buf = io.StringIO()
    print_fitted(Console(file=buf, width=30, color_system=None), [Col("id", justify="left", text=True),
                 Col("error")], [[hyphenated(pid), "+12 %"]])  # fmt: skip
    lines = [ln.split("+12")[0].rstrip() for ln in buf.getvalue().splitlines()[2:] if ln.strip()]
    assert "".join(ln.strip() for ln in lines) == pid
    assert all(ln.strip().endswith("-") for ln in lines[:-1]) and len(lines) > 1


def _hidden(out: str) -> str:
    """The note naming the hidden columns, its wrapped lines joined ("" when none)."""
    text = " ".join(out.split())
    return text[text.index("hidden at") :].split("(--wide")[0] if "hidden at" in text else ""


def _validate_ids(out: str) -> list[str]:
    """The ids of a ``hardware validate`` table, their broken lines joined again."""
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("id "))
    w = lines[head].index("tier") - 1
    ids: list[str] = []
    for ln in lines[head + 2 :]:
        if not ln.strip() or ln.startswith("─"):
            break
        cell, rest = ln[:w].strip(), ln[w:].strip()
        if ids and ids[-1].endswith("-") and cell and not rest[:1].isdigit():  # (a long reason wraps beside it)
            ids[-1] += cell
        elif rest[:1].isdigit():  # a row: the tier follows the id
            ids.append(cell)
        elif ids and not cell and rest:  # a long reason wrapping under a finished id
            continue
        else:
            break  # the table is over
    return ids


def test_hardware_validate_prints_the_summary_and_the_worst_rows_by_default() -> None:
    rep = val.run()
    every = {r.point.id for r in rep.rows}
    r = _cli("hardware", "validate")
    assert r.returncode == 0, r.stdout
    assert len(r.stdout.splitlines()) <= 60, len(r.stdout.splitlines())
    assert "tier 1: median" in r.stdout and "--all lists every row" in r.stdout
    ids = _validate_ids(r.stdout)
    assert 5 <= len(ids) < len(every) and set(ids) <= every  # no id cut or glued wrongly
    worst = sorted(rep.rows, key=lambda x: -abs(x.error or 0.0))
    assert ids[0] == worst[0].point.id
    r = _cli("hardware", "validate", "--all")
    assert r.returncode == 0
    ids = _validate_ids(r.stdout)
    assert sorted(ids) == sorted(every), set(every) ^ set(ids)
    assert "--all lists every row" not in r.stdout


def test_run_prints_its_notes_after_the_tables_wrapped_between_words(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_scenario(turns=2).model_dump(mode="json")))
    r = _cli("run", str(path), "--set", "client.playout=first_audio", "--set",
             "agent.backend=cerebras-llama-3.1-8b", "--set", "broker.probe=false", columns=60)  # fmt: skip
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    table = next(i for i, ln in enumerate(lines) if ln.startswith("Summary"))
    notes = [i for i, ln in enumerate(lines) if ln.startswith(("turns:", "bus:", "event-loop lag"))]
    assert len(notes) >= 2 and min(notes) > table, r.stdout
    end = next((i for i, ln in enumerate(lines) if ln.startswith("next step")), len(lines))
    assert all(len(ln) <= 60 for ln in lines[min(notes) : end]), r.stdout
    words = set(" ".join(lines[min(notes) : end]).split())
    assert {"received,", "dead-lettered,", "handler", "errors"} <= words  # no word split across lines
