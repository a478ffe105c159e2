"""Each speech stage real or modelled on its own (issue 25): which mixes are refused, which stage class
plays each box, the words a modelled ASR gets from an audio caller, the tone a modelled TTS plays to it.
The script recogniser of a real VAD with a modelled ASR returns the words heard so far. No speech engine is
needed here (the end-to-end mixes are tests/test_audio_mix.py, `-m audio`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from voicepipe.audio import FRAME_BYTES, FRAME_NS, RATE
from voicepipe.audio.align import aligned
from voicepipe.audio.asr import Ear, RealASR
from voicepipe.audio.caller import Caller
from voicepipe.audio.engines import first_voiced_sample, last_voiced_sample, voiced
from voicepipe.audio.hosts import EngineFailed
from voicepipe.audio.tone import ToneTTS, tone_frames
from voicepipe.audio.tts import RealTTS
from voicepipe.audio.vad_asr import Scripted, ScriptedListener, VadASR
from voicepipe.config import load_config
from voicepipe.errors import UserError
from voicepipe.stages.asr import ASR
from voicepipe.stages.client import Client, spoken
from voicepipe.stages.tts import TTS
from voicepipe.stageset import stage_class

CALLER = "client.voice=espeak-ng"
EAR = ("vad.engine=silero", "asr.engine=pocketsphinx")


@pytest.mark.parametrize(
    ("sets", "classes", "real"),
    [
        ((), (Client, ASR, TTS), []),
        (("tts.engine=espeak-ng",), (Client, ASR, RealTTS), ["tts"]),
        ((CALLER,), (Caller, ASR, ToneTTS), ["client"]),
        ((CALLER, "tts.engine=espeak-ng"), (Caller, ASR, RealTTS), ["client", "tts"]),
        ((CALLER, *EAR), (Caller, RealASR, ToneTTS), ["client", "vad", "asr"]),
        ((CALLER, "vad.engine=webrtc"), (Caller, VadASR, ToneTTS), ["client", "vad"]),
        ((CALLER, *EAR, "tts.engine=espeak-ng"), (Caller, RealASR, RealTTS), ["client", "vad", "asr", "tts"]),
    ],
)
def test_every_mix_that_can_run_loads_and_picks_a_class_per_stage(sets, classes, real):
    cfg = load_config(None, list(sets))
    assert tuple(stage_class(n, cfg) for n in ("client", "asr", "tts")) == classes
    assert cfg.real_stages == real
    assert stage_class("agent", cfg).__name__ == "Agent"


@pytest.mark.parametrize(
    ("sets", "field", "says"),
    [
        (EAR, "asr.engine", "client.voice espeak-ng or wav"),  # a real ASR needs audio to hear
        ((CALLER, "asr.engine=pocketsphinx"), "vad.engine", "silero or webrtc"),
        (("vad.engine=webrtc",), "vad.engine", "client.voice espeak-ng or wav"),
    ],
)
def test_a_mix_that_cannot_run_is_one_line_naming_the_field(sets, field, says):
    with pytest.raises(UserError) as e:
        load_config(None, list(sets))
    line = str(e.value)
    assert "\n" not in line and field in line and says in line


def test_words_are_placed_on_the_voiced_audio_pause_for_pause():
    # two "spoken" stretches of noise with a 900 ms silence between, each with lead/trail silence of its own
    rng = np.random.default_rng(0)
    z = lambda ms: np.zeros(round(ms * RATE / 1000), np.int16)  # noqa: E731
    n = lambda ms: (rng.normal(0, 3000, round(ms * RATE / 1000))).astype(np.int16)  # noqa: E731
    a, b = np.concatenate([z(50), n(700), z(40)]), np.concatenate([z(60), n(500), z(30)])
    pcm = np.concatenate([a, z(900), b])
    parts = [("I would like", 0, len(a)), ("some tea", len(a) + len(z(900)), len(pcm))]
    words = aligned(spoken("I would like [900] some tea", 150), pcm, parts).words
    assert [w.text for w in words] == ["I", "would", "like", "some", "tea"]
    first, last = first_voiced_sample(pcm), last_voiced_sample(pcm)
    assert first is not None and last is not None
    assert words[0].media_ns == round(first * 1e9 / RATE)
    assert words[-1].media_ns + words[-1].dur_ns == round(last * 1e9 / RATE)  # the caller's end of speech
    # the gap after "like" is the real silence between the voiced stretches (~40 + 900 + 60 ms)
    gap = words[2].gap_after_ns
    assert gap is not None and abs(gap / 1e6 - 1000) < 15
    assert all(w.gap_after_ns is not None and w.gap_after_ns < 200e6 for w in words[:2] + words[3:4])
    assert words[-1].gap_after_ns is None and words[-1].last_word
    # a recording (no parts): one stretch over its voiced samples
    rec = aligned(spoken("some tea", 150), b, None).words
    vb = first_voiced_sample(b)
    assert vb is not None and rec[0].media_ns == round(vb * 1e9 / RATE)


def test_the_modelled_reply_is_a_tone_voiced_from_its_first_window_for_its_modelled_length():
    frames = tone_frames(1010.0)
    assert len(frames) == 51 and all(len(f) == FRAME_BYTES for f in frames)  # 1010 ms: 51 frames of 20 ms
    x = np.frombuffer(b"".join(frames), dtype="<i2")
    assert voiced(x).all()  # heard from its first sample window to its last
    joined = np.frombuffer(b"".join(tone_frames(40.0) + tone_frames(40.0, phase=640)), dtype="<i2")
    assert np.array_equal(joined, np.frombuffer(b"".join(tone_frames(80.0)), dtype="<i2"))  # no click


@pytest.mark.parametrize(
    "said", ["What time do you close?", "I would like [1200] a cup of tea.", "a b c d e f g"]
)
@pytest.mark.parametrize("samples", [16000, 25600, 32127, 7919])
def test_placed_words_never_overlap_whatever_the_rounding(said, samples):
    pcm = np.full(samples, 3000, dtype=np.int16)
    words = aligned(spoken(said, 150), pcm, None).words
    end = 0
    for w in words:
        assert w.media_ns >= end and w.dur_ns >= 0  # what the bus guard checks (else: a dead letter)
        end = w.media_ns + w.dur_ns
    assert end == round(samples // 80 * 80 * 1e9 / RATE)  # the last word ends at the last voiced window


def test_the_script_recogniser_returns_the_words_heard_so_far_once_each():
    words = aligned(spoken("one two [500] three four", 150), np.full(RATE * 3, 3000, np.int16), None).words
    rec = Scripted()
    rec.reset(lambda: words)
    for _ in range(round((words[1].media_ns + words[1].dur_ns) / 20e6) + 1):
        rec.feed(b"")
    assert rec.partial() == "one two" and rec.finish() == "one two"
    assert rec.partial() == "" and rec.finish() == ""  # nothing new since the endpoint
    for _ in range(150):
        rec.feed(b"")
    assert rec.finish() == "three four"


def test_a_vad_only_asr_whose_engine_host_died_fails_the_turn_with_the_reason():
    # the listener's host is gone at the endpoint: the turn fails naming it (as the real ASR's does), no
    # final goes out, and the segment is closed (not an exception out of the stage's listen task)
    class Dead:
        async def hear(self, pcm: bytes) -> tuple[bool, str, int]:
            return False, "", -1

        async def finish(self) -> str:
            raise EngineFailed("asr engine process exited (code 1)")

    failed: list[str] = []
    published: list[object] = []

    async def fail_turn(session: str, turn: int, reason: str) -> None:
        failed.append(reason)

    async def publish(env: object, **kw: object) -> None:
        published.append(env)

    stage = SimpleNamespace(cfg=load_config(None, []), ctx=SimpleNamespace(run="r"), fail_turn=fail_turn,
                            publish=publish)  # fmt: skip
    ear = Ear(turn=0, buffer=None, in_speech=True)
    asyncio.run(VadASR._endpoint(stage, "s-0", ear, Dead()))  # type: ignore[arg-type]
    assert failed == ["asr engine: asr engine process exited (code 1)"] and not published
    assert ear.finalised and not ear.in_speech


def test_the_script_recogniser_hears_by_each_frames_media_time_when_frames_are_lost():
    # frames lost on the way (the gate counts them) do not hold the script back: after the frame whose
    # place in the audio ends past the second word, both words are heard, however few frames arrived
    words = aligned(spoken("one two [500] three four", 150), np.full(RATE * 3, 3000, np.int16), None).words

    class Vad:
        async def hear(self, pcm: bytes, media_ns: int = 0) -> tuple[bool, str, int]:
            return True, "", -1

        async def finish(self) -> str:
            return ""

    script = Scripted()
    script.reset(lambda: words)
    lis = ScriptedListener(Vad(), script)  # type: ignore[arg-type]
    last = (words[1].media_ns + words[1].dur_ns) // FRAME_NS  # the frame the second word ends in
    got = [asyncio.run(lis.hear(bytes(FRAME_BYTES), i * FRAME_NS))[1] for i in (0, last // 2, last)]
    assert got[0] == "" and got[-1] == "one two"  # three frames fed, the last at the second word's end
    assert asyncio.run(lis.finish()) == "one two"
