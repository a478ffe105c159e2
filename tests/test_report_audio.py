"""The HTML report's players and waveform strips for turns with recordings (voicepipe/report/audio.py)."""

from __future__ import annotations

import base64
import io
import re
import wave
from pathlib import Path

import numpy as np

import voicepipe.report.audio as raudio
from voicepipe.records import BreakdownPart, TurnRecord
from voicepipe.report.html import render_html

RATE = 16_000
EOS_MS = [2000.0, 6000.0]
MEASURED = [420.0, 910.0]


def recording(path: Path) -> Path:
    """A session: caller speaks until each end of speech, the agent answers MEASURED ms later."""
    x = np.zeros((RATE * 9, 2), dtype=np.int16)
    t = np.arange(RATE // 2)
    for eos, gap in zip(EOS_MS, MEASURED, strict=True):
        e = round(eos * RATE / 1000)
        x[e - RATE // 2 : e, 0] = (8000 * np.sin(t * 0.3)).astype(np.int16)
        a = round((eos + gap) * RATE / 1000)
        x[a : a + RATE // 2, 1] = (8000 * np.sin(t * 0.2)).astype(np.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(x.tobytes())
    return path


def records(path: Path | None) -> list[TurnRecord]:
    out = []
    for k, (eos, ms) in enumerate(zip(EOS_MS, MEASURED, strict=True)):
        out.append(
            TurnRecord(
                run="r", scenario="tea", session="tea-0", turn=k, user_text="a cup of tea", reply_text="Sure.",
                status="ok", measured_ms=ms, predicted_ms=ms, tax_ms=0.0, budget_ms=800.0,
                within_budget=ms <= 800, breakdown=[BreakdownPart(stage="asr", what="x", ms=ms, modelled=False)],
                spans=[], end_of_speech_ns=0, first_audio_ns=1, real_stages=["client", "vad", "asr", "tts"],
                recording=None if path is None else str(path), recording_eos_ms=eos,
            )
        )
    return out


def page(recs: list[TurnRecord]) -> str:
    return render_html({"real": recs}, {"real": {}})


def test_each_turn_with_a_recording_gets_a_player_whose_segment_holds_the_gap(tmp_path):
    html = page(records(recording(tmp_path / "tea-0.wav")))
    srcs = re.findall(r'<audio class="turn-audio"[^>]*src="data:audio/wav;base64,([^"]+)"', html)
    assert len(srcs) == 2
    for data, ms in zip(srcs, MEASURED, strict=True):
        with wave.open(io.BytesIO(base64.b64decode(data))) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (2, 1, 8000)
            x = np.frombuffer(w.readframes(w.getnframes()), dtype=np.uint8).reshape(-1, 2).astype(int) - 128
        onset = int(np.flatnonzero(np.abs(x[:, 1]) > 4)[0]) * 1000 / 8000
        assert abs(onset - (raudio.LEAD_MS + ms)) <= 2  # the agent starts where the record says, in the clip
        caller_end = int(np.flatnonzero(np.abs(x[:, 0]) > 4)[-1]) * 1000 / 8000
        assert abs(caller_end - raudio.LEAD_MS) <= 2  # ... and the caller stops at the end of speech


def _bar_ends(chart: str) -> list[float]:
    ends = []
    for g in re.findall(r'<g class="bar">(.*?)</g>', chart, re.S):
        rects = re.findall(r'<rect class="seg" x="([\d.]+)" y="[\d.]+" width="([\d.]+)"', g)
        ends.append(float(rects[-1][0]) + float(rects[-1][1]))
    return ends


def test_each_strip_marks_the_reply_onset_where_its_waterfall_bar_ends(tmp_path):
    html = page(records(recording(tmp_path / "tea-0.wav")))
    wide = re.findall(r'<div class="chart-wide">(.*?)</div>', html, re.S)
    waterfall = next(c for c in wide if "per-turn latency waterfall" in c)
    strips = [c for c in wide if "waveform of" in c]
    assert len(strips) == 2
    onsets = [float(re.search(r'<line class="onset" data-ms="[\d.]+" x1="([\d.]+)"', s).group(1)) for s in strips]
    for bar_end, onset in zip(_bar_ends(waterfall), onsets, strict=True):
        assert abs(bar_end - onset) < 0.05  # same pixel: the same time axis
    # the strip draws the agent's channel (below the midline) only from the onset on
    first = strips[0]
    agent_path = re.findall(r'<path d="([^"]*)" stroke="#d0712a"', first)[0]
    xs = [float(v) for v in re.findall(r"M([\d.]+) ", agent_path)]
    assert xs and min(xs) >= onsets[0] - 1.5


def test_past_the_embedding_budget_the_player_links_the_recording_with_a_time_fragment(tmp_path, monkeypatch):
    monkeypatch.setattr(raudio, "EMBED_BUDGET", 0)
    path = recording(tmp_path / "tea-0.wav")
    html = page(records(path))
    links = re.findall(r'<audio class="turn-audio"[^>]*src="(file://[^"]+)"', html)
    assert len(links) == 2 and "data:audio" not in html
    assert links[0].startswith(path.resolve().as_uri() + "#t=0.500,")


def test_records_without_recordings_add_no_players_or_strips():
    html = page(records(None))
    assert "<audio" not in html and "waveform of" not in html


def test_a_missing_recording_is_a_note_and_the_report_is_still_written(tmp_path):
    html = page(records(tmp_path / "gone.wav"))
    assert "<audio" not in html and "gone.wav" in html and "no such file" in html
    assert "per-turn latency waterfall" in html


def test_a_barge_in_turns_player_runs_on_to_the_stop_and_says_how_fast_the_agent_stopped(tmp_path):
    recs = records(recording(tmp_path / "tea-0.wav"))
    plain_end = raudio._segment(recs[0], 1000.0)[1]
    recs[0] = recs[0].model_copy(update={"barge_in_stop_ms": 180.0, "recording_stop_ms": 4500.0})
    assert raudio._segment(recs[0], 1000.0)[1] == 4500.0 + raudio.TAIL_MS > plain_end
    assert raudio._segment(recs[1], 1000.0)[1] == plain_end - EOS_MS[0] + EOS_MS[1]  # others unchanged
    html = page(recs)
    assert html.count("barge-in: the agent stopped 180 ms after the caller spoke over it") == 1
