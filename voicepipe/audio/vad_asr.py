"""A real VAD endpointing for a modelled recogniser: ``vad.engine`` silero or webrtc with ``asr.engine: model``.

The real ASR stage (:class:`~voicepipe.audio.asr.RealASR`) runs unchanged on the caller's frames — the VAD's
decision per frame, the endpointing strategies on its output, resumptions and barge-ins — but its decoder is
:class:`Scripted`: it "recognises" exactly the words the caller said so far, as placed on the audio
(the caller sends them for a modelled ASR: :mod:`voicepipe.audio.align`), up to each frame's place in
the turn's audio (its media time: a frame lost on the way holds nothing back). So the endpoint is the real VAD's, the transcript the script's (no word error rate is scored),
and ``finalise`` is the modelled ``asr.finalize_ms`` (a modelled span), after the measured ``endpoint wait``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from voicepipe.audio import FRAME_NS
from voicepipe.audio.asr import Ear, RealASR, measured_span
from voicepipe.audio.hosts import EngineFailed, EnginePool, Hears, InlineListener, Listener
from voicepipe.clock import now_ns, rng_for, sleep_until_ns
from voicepipe.messages import Envelope, Final, UserUtterance, UserWord
from voicepipe.spans import modelled_span


class Scripted:
    """The :class:`~voicepipe.audio.engines.Recognizer` interface over the caller's placed words."""

    def __init__(self) -> None:
        self.source: Callable[[], list[UserWord]] = list
        self.frames = 0  # the media position this turn, in frames (those fed, or the last one's place)
        self.taken = 0  # words already returned by finish()

    def reset(self, source: Callable[[], list[UserWord]]) -> None:
        self.source, self.frames, self.taken = source, 0, 0

    def start(self) -> None:
        pass

    def feed(self, pcm: bytes) -> None:
        self.frames += 1

    def _heard(self) -> list[UserWord]:
        at = self.frames * FRAME_NS
        return [w for w in self.source() if w.media_ns + w.dur_ns <= at]

    def partial(self) -> str:
        return " ".join(w.text for w in self._heard()[self.taken :])

    def finish(self) -> str:
        heard = self._heard()
        out = " ".join(w.text for w in heard[self.taken :])
        self.taken = len(heard)
        return out


class ScriptedListener:
    """A VAD-only listener (its hypothesis empty) with the script's transcript: the interface
    :class:`~voicepipe.audio.asr.RealASR` hears through."""

    def __init__(self, vad: Listener | InlineListener, script: Scripted) -> None:
        self.vad, self.script = vad, script

    async def hear(self, pcm: bytes, media_ns: int = 0) -> tuple[bool, str, int]:
        speech, _, end = await self.vad.hear(pcm)
        self.script.feed(pcm)
        # the media position is the frame's own: a frame lost on the way does not hold back the script
        self.script.frames = max(self.script.frames, media_ns // FRAME_NS + 1)
        return speech, self.script.partial(), end

    async def finish(self) -> str:
        await self.vad.finish()  # closes the listener's utterance (its VAD keeps its state, as the real ASR's)
        return self.script.finish()


class VadASR(RealASR):
    # user/utterance: the caller's placed words, what the script recogniser knows
    channels: ClassVar[tuple[str, ...]] = (*RealASR.channels, "user/utterance")

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.pool = EnginePool(self.pool.vad_args, with_rec=False)  # the VAD only: the script recognises
        self.words: dict[tuple[str, int], list[UserWord]] = {}
        self.on(UserUtterance, self.utterance)

    async def utterance(self, env: Envelope[UserUtterance]) -> None:
        for key in [k for k in self.words if k[0] == env.session and k[1] < env.turn - 1]:
            del self.words[key]
        self.words[(env.session, env.turn)] = env.payload.words

    def forget(self, session: str) -> None:
        super().forget(session)
        for key in [k for k in self.words if k[0] == session]:
            del self.words[key]

    async def _listen(self, session: str, ear: Ear) -> None:
        key = (session, ear.turn)
        script = Scripted()
        script.reset(lambda: self.words.get(key, []))
        try:
            ear.listener = await self.pool.open()
            await self._hear(session, ear, ScriptedListener(ear.listener, script))
        finally:
            if ear.listener is not None:
                self.pool.release(ear.listener)
                ear.listener = None

    async def _endpoint(self, session: str, ear: Ear, listener: Hears) -> None:
        decided = now_ns()
        try:
            hyp = await listener.finish()
        except EngineFailed as exc:  # its engine host is gone: the turn fails with the reason (as RealASR)
            await self.fail_turn(session, ear.turn, f"asr engine: {exc}")
            ear.in_speech, ear.finalised, ear.silence_run = False, True, 0
            return
        ear.in_speech, ear.finalised, ear.silence_run = False, True, 0
        text = ear.text(hyp)
        ear.closed = hyp
        rng = rng_for(self.cfg.seed, session, ear.turn, ear.segment, "asr")
        fin = round(self.cfg.asr.finalize_ms.sample_ms(rng) * 1e6)
        spans = [
            measured_span("asr", "vad decision", ear.silence_from_ns - ear.decision_ns, ear.decision_ns),
            measured_span("asr", "endpoint wait", ear.silence_from_ns, decided - ear.silence_from_ns),
            modelled_span("asr", "finalise", decided, fin),
        ]
        await sleep_until_ns(decided + fin)
        final = Final(text=text, words=len(text.split()), segment=ear.segment)
        await self.publish(Envelope.of(final, self.ctx.run, session, ear.turn, spans))
