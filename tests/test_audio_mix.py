"""Real and modelled speech stages mixed on the same scenarios (issue 25), and barge-in over real audio.

Each mix is run end to end over the broker in real time: every turn is measured by the client's one
stopwatch (the audio caller's by ear, the word client's on the first ``tts.audio``), its breakdown sums to
the measured total, its record names the real and the modelled stages, and where there is a recording the
measured number is the gap read off it (by this file's own envelope detector, not the caller's windows).
Real engines, not mocks (`-m audio -n 0`; skipped where they are not installed, required under CI).
"""

from __future__ import annotations

import wave

import numpy as np
import pytest

from tests.conftest import fast_config
from tests.test_audio_e2e import MISSING, envelope, onset_in_recording, scenario  # noqa: F401  (skips)
from voicepipe.audio import RATE
from voicepipe.records import TurnRecord
from voicepipe.runner import run_pipeline
from voicepipe.scenario import CacheEntry, Scenario, Turn

pytestmark = pytest.mark.audio

CALLER = "client.voice=espeak-ng"
EAR = ("vad.engine=silero", "asr.engine=pocketsphinx")
VOICE = "tts.engine=espeak-ng"
STAGES = ["client", "vad", "asr", "tts"]


def plain_turns() -> Scenario:
    return Scenario(
        name="tea",
        turns=[
            Turn(user="I would like a cup of tea.", reply="Sure, a cup of tea coming up.", gap_ms=50),
            Turn(user="Yes please.", reply="Great, it will be ready soon.", gap_ms=50),
        ],
    )


def check_measured(recs: list[TurnRecord], real: list[str]) -> None:
    """Every turn measured, the breakdown summing to the measured total, the stages named."""
    assert [r.status for r in recs] == ["ok"] * len(recs), [r.error for r in recs]
    for r in recs:
        assert r.measured_ms is not None and r.measured_ms > 0
        assert sum(p.ms for p in r.breakdown) == pytest.approx(r.measured_ms, abs=1e-6)
        assert r.real_stages == real
        assert r.modelled_stages == [s for s in STAGES if s not in real]


def check_recording(recs: list[TurnRecord]) -> None:
    for r in recs:
        assert r.recording is not None and r.recording_eos_ms is not None and r.measured_ms is not None
        assert abs(onset_in_recording(r.recording, r.recording_eos_ms) - r.measured_ms) <= 20


def tts_part(r: TurnRecord) -> tuple[float, bool]:
    (p,) = [p for p in r.breakdown if (p.stage, p.what) == ("tts", "time to first audio")]
    return p.ms, p.modelled


async def test_real_asr_with_a_modelled_tts_is_heard_as_a_tone_and_measured_by_ear(tmp_path, mosquitto):
    cfg = fast_config(CALLER, *EAR, "asr.silence_ms=300", "tts.ttfb_ms=150", f"client.record={tmp_path}",
                      broker=mosquitto.url)  # fmt: skip
    res = await run_pipeline(cfg, [plain_turns()], 1)
    recs = sorted(res.records, key=lambda r: r.turn)
    check_measured(recs, ["client", "vad", "asr"])
    check_recording(recs)
    for r in recs:
        ms, modelled = tts_part(r)
        assert modelled and ms == pytest.approx(150, abs=1)  # the model's time to first audio, whole
        assert r.wer is not None and r.transcript  # the real ASR is scored
        assert not any(p.modelled for p in r.breakdown if p.stage == "asr")  # real endpointing, real decode
    assert res.stage_errors == 0


async def test_a_modelled_asr_with_a_real_tts_for_the_word_client_and_for_the_audio_caller(
    tmp_path, mosquitto
):
    # the word client times the real TTS's first tts.audio (plus the modelled downlink)
    res = await run_pipeline(
        fast_config(VOICE, "tts.words_per_minute=170", broker=mosquitto.url), [plain_turns()], 1
    )
    recs = sorted(res.records, key=lambda r: r.turn)
    check_measured(recs, ["tts"])
    for r in recs:
        ms, modelled = tts_part(r)
        assert not modelled and ms > 0  # espeak-ng's own synthesis time
        assert {p.stage for p in r.breakdown if p.modelled} >= {"asr", "transport"}
    # the audio caller, heard by ear: the modelled ASR endpoints on the words placed on the real audio
    cfg = fast_config(CALLER, VOICE, "asr.silence_ms=300", f"client.record={tmp_path}", broker=mosquitto.url)
    res = await run_pipeline(cfg, [plain_turns()], 1)
    recs = sorted(res.records, key=lambda r: r.turn)
    check_measured(recs, ["client", "tts"])
    check_recording(recs)
    for r in recs:
        assert not tts_part(r)[1]
        assert r.wer is None  # a modelled ASR returns the script: nothing to score
        wait = [p for p in r.breakdown if (p.stage, p.what) == ("asr", "endpoint wait")]
        # the modelled wait starts at the end of the last placed word: the caller's end of speech
        assert wait and wait[0].modelled and wait[0].ms == pytest.approx(300, abs=1)
    assert res.stage_errors == 0


async def test_all_modelled_stages_answering_an_audio_caller_and_a_pause_that_ends_the_turn_early(
    tmp_path, mosquitto
):
    cfg = fast_config(CALLER, "asr.endpointing=silence", "asr.silence_ms=200", f"client.record={tmp_path}",
                      broker=mosquitto.url)  # fmt: skip
    res = await run_pipeline(cfg, [scenario()], 1)  # "I would like [1200] a cup of tea."
    recs = sorted(res.records, key=lambda r: r.turn)
    check_measured(recs, ["client"])
    check_recording(recs)
    # the scripted pause is as long to the modelled ASR as in the audio: it endpoints in it, the reply to
    # "I would like" plays into the pause and over the resumed words, and talking over the user is a miss
    assert recs[0].premature_endpoint and recs[0].talked_over and not recs[0].within_budget
    assert recs[0].talked_over_ms is not None and recs[0].talked_over_ms >= 0
    assert not recs[1].talked_over
    assert res.stage_errors == 0


def right_channel_voiced_ms(path: str, from_ms: float, to_ms: float) -> float:
    with wave.open(path) as w:
        x = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, 2)[:, 1]
    e = envelope(x[round(from_ms * RATE / 1000) : round(to_ms * RATE / 1000)])
    return float(np.count_nonzero(e > 250)) * 1000 / RATE


LONG = ("We are open from seven in the morning until six in the evening on weekdays, and from eight until "
        "four on Saturdays.")  # fmt: skip


def barge_scenario() -> Scenario:
    return Scenario(
        name="barge",
        turns=[
            Turn(user="Tell me about your opening hours.", reply=LONG, barge_in_after_ms=900,
                 barge_in="okay, thanks", gap_ms=300),
            Turn(user="Thanks.", reply="You are welcome.", gap_ms=50),
        ],
    )  # fmt: skip


@pytest.mark.parametrize("ear", ["real", "vad only", "modelled"])
async def test_a_barge_in_over_real_audio_stops_the_agent(tmp_path, mosquitto, ear):
    sets = {"real": (*EAR, VOICE), "vad only": ("vad.engine=silero", VOICE), "modelled": (VOICE,)}[ear]
    cfg = fast_config(CALLER, *sets, "asr.silence_ms=400", f"client.record={tmp_path}", broker=mosquitto.url)
    res = await run_pipeline(cfg, [barge_scenario()], 1)
    recs = sorted(res.records, key=lambda r: r.turn)
    ears = {"real": ["vad", "asr"], "vad only": ["vad"], "modelled": []}[ear]
    check_measured(recs, ["client", *ears, "tts"])
    check_recording(recs)
    r = recs[0]
    # the agent stopped: a real VAD's onset (min_speech_ms of speech) or the modelled detection, then the
    # stop's trip (~50-350 ms on a loaded 2-core box); long before the ~7 s reply would have played out
    assert r.barge_in_stop_ms is not None and 0 < r.barge_in_stop_ms < 3000, r.barge_in_stop_ms
    assert r.recording is not None and r.measured_ms is not None and r.recording_eos_ms is not None
    onset = r.recording_eos_ms + r.measured_ms
    # the record places the stop in the recording: the barge-in starts at the next mic frames past 900 ms
    # (plus any late wake-up on a loaded box), and the stop is barge_in_stop_ms after that
    stop = r.recording_stop_ms
    assert stop is not None and 0 <= stop - (onset + 900 + r.barge_in_stop_ms) <= 250
    # the agent's channel: its reply until the stop, then nothing (the next turn's reply comes later)
    assert right_channel_voiced_ms(r.recording, onset, stop) > 500
    assert right_channel_voiced_ms(r.recording, stop + 5, stop + 1000) == 0
    assert recs[1].barge_in_stop_ms is None and recs[1].status == "ok"
    assert res.stage_errors == 0


async def test_a_real_asr_that_answered_in_a_pause_stops_when_the_caller_resumes_and_the_turn_is_a_miss(
    tmp_path, mosquitto
):
    # a 2.5 s pause under a 200 ms endpoint wait: the answer to "I would like" plays in the pause, the caller
    # resumes over it, the real VAD hears that while the agent speaks and stops it; the rest of the
    # utterance joins the turn and its reply is measured from the real end of speech
    sc = Scenario(name="tea2", turns=[Turn(user="I would like [2500] a cup of tea.", reply=LONG, gap_ms=50)])
    cfg = fast_config(CALLER, *EAR, VOICE, "asr.silence_ms=200", "client.turn_timeout_s=15",
                      f"client.record={tmp_path}", broker=mosquitto.url)  # fmt: skip
    res = await run_pipeline(cfg, [sc], 1)
    (r,) = res.records
    check_measured([r], STAGES)
    check_recording([r])
    assert r.premature_endpoint and r.talked_over and not r.within_budget
    assert r.talked_over_ms is not None and r.talked_over_ms < 2000  # cut when it stopped, not the ~7 s reply
    assert "tea" in (r.transcript or "") or len((r.transcript or "").split()) > 3  # the whole utterance
    assert res.stage_errors == 0


@pytest.mark.parametrize("voice", ["modelled", "real"])
async def test_a_cache_hit_is_heard_by_the_audio_caller(tmp_path, mosquitto, voice):
    # the cache decides and sends tts.audio; the TTS stage plays the answer as frames (a tone of the modelled
    # length, or espeak-ng audio rendered when the first script named the entry)
    sc = Scenario(
        name="faq",
        turns=[Turn(user="What time do you close?", reply="We close at six tonight.", gap_ms=50)],
        cache=[CacheEntry(questions=["what time do you close"], answer="We close at six tonight.")],
    )
    sets = (CALLER, "cache.enabled=true", "router.cache_first=true", *((VOICE,) if voice == "real" else ()))
    cfg = fast_config(*sets, f"client.record={tmp_path}", broker=mosquitto.url)
    res = await run_pipeline(cfg, [sc], 1)
    recs = list(res.records)
    check_measured(recs, ["client", *(["tts"] if voice == "real" else [])])
    check_recording(recs)
    assert recs[0].path == "cache"
    assert res.stage_errors == 0


async def test_a_real_vad_endpoints_the_audio_for_a_modelled_recogniser(tmp_path, mosquitto):
    cfg = fast_config(CALLER, "vad.engine=silero", "asr.silence_ms=200", f"client.record={tmp_path}",
                      broker=mosquitto.url)  # fmt: skip
    res = await run_pipeline(cfg, [scenario()], 1)  # "I would like [1200] a cup of tea."
    recs = sorted(res.records, key=lambda r: r.turn)
    check_measured(recs, ["client", "vad"])
    check_recording(recs)
    assert recs[0].premature_endpoint  # the real VAD heard the scripted pause as silence
    assert recs[0].transcript == "I would like a cup of tea."  # the script recogniser: every word, once
    for r in recs:
        parts = {(p.stage, p.what): p.modelled for p in r.breakdown}
        assert parts[("asr", "endpoint wait")] is False and parts[("asr", "finalise")] is True
        assert r.wer is None
    assert res.stage_errors == 0
