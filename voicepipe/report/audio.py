"""Hear it in the report: a player and a waveform strip per turn, for turns whose records have a recording.

Records of a real-audio run with ``--record DIR`` name their session's stereo WAV (caller left, agent right,
on the client's timeline: :mod:`voicepipe.audio.record`) and where the turn's end of speech lies in it
(``recording_eos_ms``). Under each configuration's waterfall, :func:`hear_it` draws for each drawn turn:

* **A waveform strip on the waterfall's time axis.** The same label column, plot edges and x scale as the
  waterfall chart above it (the same ``x_max``, label and note widths, the same nice ticks), so x = 0 is the
  end of the user's speech and a millisecond falls on the same pixel as in the bar. The caller's channel is
  drawn above the midline, the agent's below, as the peak level per pixel column; a line marks the turn's
  measured first reply audio (``measured_ms``), which is where the bar ends: the gap you see is the gap in
  the file.
* **A player** (``<audio controls>``) of the segment from :data:`LEAD_MS` before the end of speech to
  :data:`TAIL_MS` after the strip's right edge, so you hear the end of the question, the gap and the start
  of the reply. The segment is embedded as a ``data:`` URI of a small WAV — stereo, 8 kHz, 8-bit unsigned
  PCM (each pair of 16 kHz samples averaged), about 16 kB per second, enough to hear a gap and a voice, not
  a hi-fi copy — while the page's embedded audio stays under :data:`EMBED_BUDGET` bytes. Past that the
  player links the session's WAV itself as an absolute ``file://`` URI with a ``#t=start,end`` media
  fragment (the full-quality file; it plays on the machine that holds the recordings, and a page moved
  without them has a dead link, said beside the player).

The recordings are read through the file guard (:func:`voicepipe.files.read_bytes`, at most
:data:`MAX_RECORDING_BYTES`); one that is missing, too large or not a 16 kHz stereo 16-bit WAV is named in a
note and its turns get no player: a report is still written. Turns without a recording add nothing.
"""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from voicepipe.errors import UserError
from voicepipe.files import read_bytes
from voicepipe.records import TurnRecord
from voicepipe.report.svg import _svg_open, esc, fit_middle, nice_ticks

RATE = 16_000  # the recordings' rate (voicepipe.audio.RATE)
PREVIEW_RATE = 8_000
LEAD_MS = 1500.0  # the player starts this long before the end of speech
TAIL_MS = 1000.0  # ... and ends this long after the strip's right edge
EMBED_BUDGET = 4 * 1024 * 1024  # base64 bytes of audio embedded in one page; later turns link the file
MAX_RECORDING_BYTES = 512 * 1024 * 1024  # ~70 minutes of a session's stereo 16 kHz s16
STRIP_H = 44.0
CALLER, AGENT = "#3563a8", "#d0712a"


class Recordings:
    """The sessions' recordings, each read once per report, and the page's embedding budget."""

    def __init__(self, budget: int | None = None) -> None:
        self._cache: dict[str, np.ndarray | str] = {}
        self.left = EMBED_BUDGET if budget is None else budget
        self.problems: list[str] = []

    def samples(self, path: str) -> np.ndarray | None:
        """(n, 2) int16 samples of a recording, or None (its problem noted once)."""
        if path not in self._cache:
            try:
                self._cache[path] = _stereo(read_bytes(path, MAX_RECORDING_BYTES, "recording"))
            except UserError as exc:
                self._cache[path] = str(exc)
            except (wave.Error, EOFError, ValueError) as exc:
                self._cache[path] = f"recording: {path}: {exc}"
            got = self._cache[path]
            if isinstance(got, str):
                self.problems.append(got)
        got = self._cache[path]
        return None if isinstance(got, str) else got


def _stereo(raw: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(raw)) as w:
        shape = (w.getnchannels(), w.getsampwidth(), w.getframerate())
        if shape != (2, 2, RATE):
            raise ValueError(f"expected a 16 kHz stereo 16-bit WAV, not {shape[0]} ch {8 * shape[1]}-bit {shape[2]} Hz")
        pcm = w.readframes(w.getnframes())
    return np.frombuffer(pcm[: len(pcm) // 4 * 4], dtype="<i2").reshape(-1, 2)


def preview_wav(x: np.ndarray) -> bytes:
    """(n, 2) int16 at 16 kHz as a stereo 8 kHz 8-bit unsigned PCM WAV (pairs of samples averaged)."""
    n = len(x) // 2 * 2
    half = (x[:n:2].astype(np.int32) + x[1:n:2].astype(np.int32)) // 2
    u8 = np.clip(half // 256 + 128, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(1)
        w.setframerate(PREVIEW_RATE)
        w.writeframes(u8.tobytes())
    return buf.getvalue()


def _segment(r: TurnRecord, x_max_ms: float) -> tuple[float, float]:
    """The player's [start, end] in ms of the recording."""
    eos = r.recording_eos_ms or 0.0
    end = max(eos + x_max_ms, r.recording_stop_ms or 0.0)  # a barge-in: on to where the agent stopped
    return max(0.0, eos - LEAD_MS), end + TAIL_MS


def player(r: TurnRecord, x: np.ndarray, x_max_ms: float, recs: Recordings) -> str:
    start, end = _segment(r, x_max_ms)
    cut = x[round(start * RATE / 1000) : round(end * RATE / 1000)]
    data = base64.b64encode(preview_wav(cut)).decode("ascii")
    title = f"{r.session} turn {r.turn}: from {LEAD_MS / 1000:g} s before the end of speech"
    if len(data) <= recs.left:
        recs.left -= len(data)
        src, note = f"data:audio/wav;base64,{data}", "8 kHz preview"
    else:
        uri = Path(r.recording or "").resolve().as_uri()
        src, note = f"{uri}#t={start / 1000:.3f},{end / 1000:.3f}", "links the recording file"
    if r.barge_in_stop_ms is not None:
        note += f"; barge-in: the agent stopped {r.barge_in_stop_ms:,.0f} ms after the caller spoke over it"
    return (
        f'<audio class="turn-audio" controls preload="none" title="{esc(title)}" src="{esc(src)}"></audio>'
        f'<span class="note">{esc(note)}</span>'
    )


def strip(
    r: TurnRecord, x: np.ndarray, label: str, width: float, label_w: float, note_w: float, x_max: float
) -> str:
    """The turn's two channels from its end of speech on, on the waterfall's x axis (see the docstring)."""
    x0, x1 = label_w, width - max(16.0, note_w)
    hi = nice_ticks(x_max)[-1]
    cols = max(1, int(x1 - x0))
    eos = round((r.recording_eos_ms or 0.0) * RATE / 1000)
    span = hi * RATE / 1000
    mid = STRIP_H / 2
    paths = []
    for ch, colour, sign in ((0, CALLER, -1), (1, AGENT, 1)):
        d = []
        for c in range(cols):
            a, b = eos + round(c * span / cols), eos + round((c + 1) * span / cols)
            seg = x[max(0, a) : max(0, b), ch]
            peak = float(np.abs(seg.astype(np.int32)).max()) / 32768 if len(seg) else 0.0
            if peak > 0.003:
                h = max(0.5, peak * (mid - 3))
                d.append(f"M{x0 + c + 0.5:.1f} {mid:.1f}v{sign * h:.1f}")
        paths.append(f'<path d="{"".join(d)}" stroke="{colour}" stroke-width="1" fill="none"/>')
    marks = ""
    if r.measured_ms is not None:
        mx = x0 + (x1 - x0) * min(max(r.measured_ms, 0.0), hi) / hi
        marks = (
            f'<line class="onset" data-ms="{r.measured_ms:.1f}" x1="{mx:.2f}" x2="{mx:.2f}" y1="1" '
            f'y2="{STRIP_H - 1:.0f}" stroke="#222" stroke-dasharray="2 2"/>'
        )
    aria = f"waveform of {label}: caller above, agent below, from the end of speech"
    return (
        _svg_open(width, STRIP_H, aria)
        + f'<text x="{x0 - 8:.1f}" y="{mid + 4:.1f}" text-anchor="end" font-size="11">{esc(fit_middle(label, x0 - 12, 11))}</text>'
        + f'<line x1="{x0:.1f}" x2="{x1:.1f}" y1="{mid:.1f}" y2="{mid:.1f}" stroke="#ccc"/>'
        + "".join(paths)
        + marks
        + "</svg>"
    )


def hear_it(
    recs_shown: Sequence[TurnRecord],
    labels: Sequence[str],
    x_max: float,
    label_w: Callable[[float], float],
    note_w: float,
    both_widths: Callable[[Callable[[float], str]], str],
    recordings: Recordings,
) -> str:
    """Players and waveform strips for the drawn turns that have a recording ('' when none has)."""
    rows = []
    for r, label in zip(recs_shown, labels, strict=True):
        if not r.recording or r.recording_eos_ms is None:
            continue
        x = recordings.samples(r.recording)
        if x is None:
            continue

        def draw(width: float, r: TurnRecord = r, x: np.ndarray = x, label: str = label) -> str:
            return strip(r, x, label, width, label_w(width), note_w, x_max)

        rows.append(f'<div class="hear">{both_widths(draw)}{player(r, x, x_max, recordings)}</div>')
    if not rows and not recordings.problems:
        return ""
    notes = "".join(f'<p class="note">{esc(p)}</p>' for p in dict.fromkeys(recordings.problems))
    head = (
        '<p class="note">Hear it: each strip is the turn\'s recording on the waterfall\'s time axis (caller '
        "above, agent below; the dashed line is the measured first reply audio, where the bar ends); the "
        "player starts 1.5 s before the end of speech.</p>"
        if rows
        else ""
    )
    return head + "".join(rows) + notes
