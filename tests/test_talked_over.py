"""Talking over the user is a miss (issue 26): a reply to part of the utterance that the user hears.

Under fast silence endpointing a mid-sentence pause ends the turn early; a fast backend's reply to the
first half reaches the user's ear during the pause and keeps playing until the ASR's withdrawal (the user
resumed) reaches the speaker. Such a turn records how long that audio overlapped the user's words, counts
the thrown-away generation and synthesis as waste, and is a miss whatever its latency — on virtual time
(predict, ``runner.simulate``) and live over the embedded broker alike.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from voicepipe import gate
from voicepipe.config import load_config
from voicepipe.predict import LIVE_ONLY, PREDICT_ONLY, predict
from voicepipe.records import summarise
from voicepipe.report import render_html
from voicepipe.report.table import print_predictions, print_summary, print_turns
from voicepipe.runner import run_pipeline, simulate
from voicepipe.scenario import Scenario, Turn, load_scenario
from voicepipe.stages.client import overlap_ns

ROOT = Path(__file__).resolve().parent.parent
HESITANT = ROOT / "scenarios" / "hesitant-speaker.yaml"
FAST_LANE = ROOT / "scenarios" / "configs" / "fast-lane.yaml"
# a fast pipeline with 200 ms silence endpointing: a mid-sentence pause ends the turn
SHORT_SILENCE = ("asr.endpointing=silence", "asr.silence_ms=200", "asr.finalize_ms=80", "tts.ttfb_ms=150")


def fast(*sets: str):
    return load_config(FAST_LANE, [*SHORT_SILENCE, *sets])


def one_turn(user: str, reply: str) -> Scenario:
    return Scenario(name="talk", turns=[Turn(user=user, reply=reply, gap_ms=50, complete_at_pauses=[False])])


LONG_REPLY = "Of course, a table for four people. Which day would you like to come in, and at what time?"


def test_overlap_counts_time_covered_by_both_sets_once():
    assert overlap_ns([(0, 10), (5, 20)], [(15, 30)]) == 5  # the agent's chunks overlap each other
    assert overlap_ns([(0, 10)], [(10, 20)]) == 0  # touching is not overlapping
    assert overlap_ns([(0, 100)], [(10, 20), (30, 40), (90, 200)]) == 30
    assert overlap_ns([], [(0, 10)]) == 0


def test_a_reply_heard_in_the_pause_and_cut_after_the_user_resumes_is_a_miss_with_waste():
    cfg = fast()
    rec = simulate(cfg, [one_turn("I'd like to book, um, [1200] a table for four.", LONG_REPLY)]).records[0]
    assert rec.status == "ok" and rec.premature_endpoint
    # its latency from the real end of speech is well inside the budget, yet it is a miss
    assert rec.measured_ms is not None and rec.measured_ms < cfg.budget_ms
    assert rec.talked_over and not rec.within_budget
    # the reply was heard during the pause and played on over the resumed words until the withdrawal
    # (sent when the ASR hears the user resume, one uplink after they do) reached the speaker: zero hops
    # on virtual time, so exactly the uplink plus the stop's return path
    assert rec.talked_over_ms == pytest.approx(cfg.transport.uplink_ms + cfg.transport.stop_ms, abs=1e-6)
    # the whole withdrawn reply was generated (a fast backend finishes before the user resumes) and synthesised
    assert rec.wasted_tokens > 0 and rec.wasted_audio_ms > 0


def test_a_reply_heard_and_over_before_the_user_resumes_still_talked_over_them():
    rec = simulate(fast(), [one_turn("I'd like to book, um, [2500] a table for four.", "Sure.")]).records[0]
    assert rec.premature_endpoint
    assert rec.talked_over_ms == 0.0  # the agent spoke only in the pause: no overlap...
    assert rec.talked_over and not rec.within_budget  # ...but it answered mid-sentence: a miss


def test_a_reply_withdrawn_before_it_is_heard_is_waste_but_not_talking_over():
    # the user resumes soon after the premature endpoint: the early reply is cancelled before its audio
    # reaches the ear (its generation may have begun: that work is still wasted)
    rec = simulate(fast(), [one_turn("I'd like to book, um, [330] a table for four.", LONG_REPLY)]).records[0]
    assert rec.premature_endpoint
    assert rec.talked_over_ms is None and not rec.talked_over
    assert rec.within_budget == (rec.measured_ms is not None and rec.measured_ms <= rec.budget_ms)


def test_hesitant_speaker_under_fast_silence_endpointing_is_reported_talked_over_everywhere():
    sc = load_scenario(HESITANT)
    cfg = fast()
    records = simulate(cfg, [sc]).records
    over = [r for r in records if r.talked_over]
    assert over and all(not r.within_budget for r in over)
    assert any(r.talked_over_ms and r.talked_over_ms > 0 for r in over)
    assert all(r.measured_ms is not None and r.measured_ms < cfg.budget_ms for r in over)  # fast, still missed
    s = summarise(records)
    assert s.talked_over == len(over)
    assert s.talked_over_line() == f"talked over the user on {len(over)} of {len(records)} turns"
    assert s.within_budget <= (len(records) - len(over)) / len(records)
    # the gate: talked_over is the count of turns talked over
    reqs = gate.parse(["talked_over<=0"])
    assert gate.values(records)["talked_over"] == len(over)
    assert gate.missed(reqs, records) and not gate.missed(gate.parse([f"talked_over<={len(over)}"]), records)
    # tables: the mark on each talked-over turn, and the summary line
    buf = io.StringIO()
    con = Console(file=buf, width=200, color_system=None)
    print_turns(con, records, cfg.budget_ms)
    print_summary(con, {"": records})
    text = buf.getvalue()
    assert text.count("✗»") >= len(over) and s.talked_over_line() in text
    # the HTML report
    html = render_html({"": records}, {"": {}}, budget_ms=cfg.budget_ms)
    assert s.talked_over_line() in html and "talked over (" in html
    # predict says the same, in its table and JSON
    preds = predict(cfg, [sc])
    assert [p.talked_over_ms for p in preds] == [r.talked_over_ms for r in records]
    assert [p.to_json()["within_budget"] for p in preds] == [r.within_budget for r in records]
    buf = io.StringIO()
    print_predictions(Console(file=buf, width=200, color_system=None), [p.as_record() for p in preds])
    assert s.talked_over_line() in buf.getvalue()


def test_smart_endpointing_talks_over_only_where_the_pause_sounded_final():
    sc = load_scenario(HESITANT)
    smart = simulate(load_config(FAST_LANE, []), [sc]).records
    short = simulate(fast(), [sc]).records
    # smart endpointing waits out the pauses the scenario marks incomplete; it still ends the turn at a
    # pause marked complete ("Yes, Friday. [900] Oh, and ...") and the fast reply talks over the rest
    marked_final = {k for k, t in enumerate(sc.turns) if any(t.complete_at_pauses)}
    assert marked_final and {r.turn for r in smart if r.talked_over} == marked_final
    assert summarise(smart).talked_over < summarise(short).talked_over
    assert not gate.missed(gate.parse(["talked_over<=1"]), smart)
    assert gate.missed(gate.parse(["talked_over<=0"]), smart)


async def test_live_run_talks_over_the_user_as_predicted():
    cfg = fast("client.turn_timeout_s=10")
    sc = one_turn("I'd like to book, um, [1500] a table for four.", LONG_REPLY)
    res = await run_pipeline(cfg, [sc], 1)
    rec = res.records[0]
    assert res.stage_errors == 0 and rec.status == "ok" and rec.premature_endpoint
    # the withdrawal crossed real bus hops: at least the modelled uplink and stop, plus what the bus took
    assert rec.talked_over_ms is not None
    assert rec.talked_over_ms >= cfg.transport.uplink_ms + cfg.transport.stop_ms - 1.0
    assert not rec.within_budget and rec.wasted_tokens > 0 and rec.wasted_audio_ms > 0
    assert summarise(res.records).talked_over_line() == "talked over the user on 1 of 1 turns"


def vp(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_cli_run_and_predict_gate_on_talking_over_and_write_the_same_fields(tmp_path):
    scen = tmp_path / "talk.yaml"
    scen.write_text(
        "name: talk\nturns:\n"
        '  - user: "I\'d like to book, um, [1500] a table for four."\n'
        f'    reply: "{LONG_REPLY}"\n'
        "    complete_at_pauses: [false]\n    gap_ms: 50\n",
        encoding="utf-8",
    )
    sets = [a for s in (*SHORT_SILENCE, "client.turn_timeout_s=10") for a in ("--set", s)]
    common = [str(scen), "-c", str(FAST_LANE), *sets, "--require", "talked_over<=0"]
    live = vp("run", *common, "--json", str(tmp_path / "run.jsonl"), "--wide", cwd=tmp_path)
    assert live.returncode == 1, live.stderr  # the gate's exit code for a missed requirement
    assert "talked_over <= 0 turns not met" in live.stderr
    assert "talked over the user on 1 of 1 turns" in live.stdout and "✗»" in live.stdout
    pred = vp("predict", *common, "--json", str(tmp_path / "pred.jsonl"), "--wide", cwd=tmp_path)
    assert pred.returncode == 1, pred.stderr
    assert "talked over the user on 1 of 1 turns" in pred.stdout
    run_row = json.loads((tmp_path / "run.jsonl").read_text().splitlines()[0])
    pred_row = json.loads((tmp_path / "pred.jsonl").read_text().splitlines()[0])
    assert run_row["talked_over_ms"] > 0 and pred_row["talked_over_ms"] > 0
    assert run_row["within_budget"] is pred_row["within_budget"] is False
    assert run_row["wasted_tokens"] > 0 and pred_row["wasted_tokens"] > 0
    # issue 26 item 3: predict writes what run writes, less what only a live run has (and its own two)
    assert set(run_row) - LIVE_ONLY == set(pred_row) - PREDICT_ONLY
    assert set(run_row) >= LIVE_ONLY and not PREDICT_ONLY & set(run_row)
    for k in ("barge_in_stop_ms", "false_hit", "wasted_tokens", "talked_over_ms", "wasted_audio_ms"):
        assert k in pred_row
