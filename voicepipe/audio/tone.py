"""A modelled TTS answering an audio caller: each clause's modelled audio played as frames of a tone.

The audio caller times the reply by ear (the first reply sample above the energy threshold), so a modelled
TTS must make a sound it can hear: :class:`ToneTTS` runs the modelled TTS unchanged (its modelled time to
first audio, its clause durations at ``tts.words_per_minute``) and, for every ``tts.audio`` it publishes,
streams a tone (:data:`TONE_HZ`, well above the threshold from its first 5 ms window) lasting that clause's
modelled duration on ``audio/down``, paced in real time as the real TTS paces its frames. The reply's onset
in the caller's ear, its length and its stop at a barge-in are then the model's, heard the same way as a
real voice, and the recording carries the tone where a real TTS would have spoken. The breakdown's ``tts``
part is the modelled span; the frames' trip to the caller is the bus's, as for real audio.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np

from voicepipe.audio import FRAME_NS, FRAME_SAMPLES, RATE
from voicepipe.audio.tts import RealTTS
from voicepipe.messages import Audio, Envelope
from voicepipe.stages.tts import TTS

TONE_HZ = 220.0
TONE_PEAK = 4000  # RMS ~2830: far above the caller's voiced threshold (300), far below clipping


def tone_frames(duration_ms: float, phase: int = 0) -> list[bytes]:
    """``duration_ms`` of the tone (at least one frame) as 20 ms s16le frames, starting at sample ``phase``
    of the tone (so consecutive clauses join without a click)."""
    n = max(1, math.ceil(duration_ms * 1e6 / FRAME_NS))
    t = (np.arange(n * FRAME_SAMPLES) + phase) / RATE
    x = np.round(TONE_PEAK * np.sin(2 * np.pi * TONE_HZ * t)).astype("<i2")
    return [x[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES].tobytes() for i in range(n)]


class ToneTTS(RealTTS):
    """The modelled TTS (:class:`~voicepipe.stages.tts.TTS`), heard: its ``tts.audio`` also as tone frames."""

    _speak = TTS._speak  # the modelled synthesis, not espeak-ng
    prerender = False

    async def answer_frames(self, p: Audio) -> list[bytes]:
        return tone_frames(p.duration_ms)  # the cache's answer, as long as the model says

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.outs: dict[tuple[str, int, int], asyncio.Queue[tuple[bytes, bool] | None]] = {}
        self.phase: dict[tuple[str, int, int], int] = {}

    def forget(self, session: str) -> None:
        super().forget(session)
        for d in (self.outs, self.phase):
            for k in [k for k in d if k[0] == session]:
                del d[k]

    async def publish(self, env: Envelope, *, qos: int | None = None) -> None:
        await super().publish(env, qos=qos)
        p = env.payload
        if not isinstance(p, Audio) or env.src.split("/", 1)[0] != "tts":
            return
        key = (env.session, env.turn, p.segment)
        out = self.outs.get(key)
        if out is None or p.seq == 0:
            out = self.outs[key] = asyncio.Queue()
            self.phase[key] = 0
            self.spawn(env.session, (env.turn, p.segment, "send"), self._tone(key, out))
        frames = tone_frames(p.duration_ms, self.phase[key])
        self.phase[key] += len(frames) * FRAME_SAMPLES
        for i, f in enumerate(frames):
            out.put_nowait((f, p.last and i == len(frames) - 1))

    async def _tone(self, key: tuple[str, int, int], out: asyncio.Queue[tuple[bytes, bool] | None]) -> None:
        session, turn, seg = key
        try:
            await self._send(session, turn, seg, out)
        finally:
            if self.outs.get(key) is out:
                del self.outs[key]
                self.phase.pop(key, None)
