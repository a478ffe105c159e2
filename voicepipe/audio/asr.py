"""Real ASR stage: VAD endpointing and PocketSphinx streaming on the caller's audio frames.

Frames arrive on ``audio/up`` (:class:`~voicepipe.audio.wire.AudioPort`). Each session's frames are handled
in order by one task: every frame goes through the VAD (``vad.engine``) and into the session's PocketSphinx
decoder, both in an engine host process (:mod:`voicepipe.audio.hosts`: PocketSphinx holds the GIL, so on
the event loop or in a thread it would delay every other session's frames and the bus's messages). The
endpointing strategies of the modelled ASR run on the VAD's output in media time (frames, not
arrival): speech for ``vad.min_speech_ms`` opens a stretch of speech; a run of non-speech frames as long as
the endpoint wait (``silence``: ``asr.silence_ms``; ``smart``: ``smart_complete_ms`` or
``smart_incomplete_ms`` by :func:`~voicepipe.stages.asr.looks_complete` on the live hypothesis) ends the
turn. Then the decoder closes the utterance and the final transcript goes out as ``asr.final`` — the same
messages the modelled ASR sends, so router, cache and council act on what was really recognised. Partials
(``asr.partial``) go out when the hypothesis changes, at most every 100 ms of audio.

Speech after an endpoint means the user was not done: the segment is withdrawn (``control.cancel``, reason
``user resumed``) and the turn goes on as the next segment, whose transcript is everything recognised in the
turn so far. Once the segment's reply has begun (its ``tts.audio`` seen) that speech is a barge-in instead:
the VAD's onset goes out as ``user.speech_start`` (``vad``: detected, so the TTS stops at once and drops the
turn's work), and the turn goes on as the next segment all the same. Spans are measured (not modelled):
``vad decision`` the media time from the last voiced sample
(by the caller's own energy stopwatch, :func:`~voicepipe.audio.engines.voiced`) to the end of the first
frame the VAD calls silence — the VAD's hangover plus that frame's own 20 ms, which must be heard whole
before it is judged; placed just before that frame's arrival —, ``endpoint wait`` from the
arrival of the first silent frame to the endpoint decision, ``finalise`` the decoder's own time to close
the utterance. What no span covers is the tool's: the bus hops and scheduling.

With ``asr.engine`` a speech endpoint (:mod:`voicepipe.backends.speech`) the VAD still endpoints here; the
segment's audio (since the turn began, or since the last endpoint) is posted at the endpoint and
``finalise`` is the request's whole time, the transcript's streamed deltas included. There are no partials
before the endpoint (a batch transcription API has none), so smart endpointing sees an empty hypothesis
and waits ``smart_incomplete_ms``; the session's later frames queue while the request runs. An endpoint
error fails the turn with its one-line reason.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import ClassVar

from voicepipe.audio import FRAME_MS, FRAME_NS, RATE
from voicepipe.audio.engines import make_vad
from voicepipe.audio.frames import UP, Frame
from voicepipe.audio.hosts import EngineFailed, EnginePool, Hears, InlineListener, Listener
from voicepipe.audio.wire import AudioPort
from voicepipe.backends.base import EndpointError
from voicepipe.backends.speech import is_url, speech_endpoint, transcribe
from voicepipe.clock import now_ns
from voicepipe.messages import Audio, Cancel, CancelReason, Envelope, Final, Partial, SpeechStart
from voicepipe.spans import Span
from voicepipe.stages.asr import looks_complete
from voicepipe.stages.base import Stage

PARTIAL_EVERY = 5  # frames (100 ms) between partial hypotheses


def measured_span(stage: str, what: str, start_ns: int, dur_ns: int) -> Span:
    return Span(stage=stage, what=what, start_ns=start_ns, dur_ns=max(0, dur_ns), modelled=False)


@dataclass
class Ear:
    """One session's listening state for its current turn."""

    turn: int
    buffer: Buffer | None  # the segment's audio, for a speech endpoint
    listener: Listener | InlineListener | None = None  # VAD and decoder (voicepipe.audio.hosts)
    queue: asyncio.Queue[tuple[Frame, int]] = field(default_factory=asyncio.Queue)
    segment: int = 0
    speech_run: int = 0  # consecutive speech frames
    silence_run: int = 0  # consecutive non-speech frames since speech
    in_speech: bool = False
    finalised: bool = False
    silence_from_ns: int = 0  # arrival of the first non-speech frame after speech
    voiced_until_ns: int = 0  # media time just after the last voiced sample heard (the caller's stopwatch)
    decision_ns: int = 0  # media time from there to the end of the first non-speech frame: the VAD's own lag
    before: list[str] = field(default_factory=list)  # text of the turn's earlier (withdrawn) segments
    since_partial: int = 0
    last_partial: str = ""
    closed: str = ""  # the hypothesis of the segment last endpointed
    replying: bool = False  # the reply to the segment last endpointed has begun (its tts.audio seen)

    def text(self, hyp: str) -> str:
        return " ".join([*self.before, hyp]).strip()


class Buffer:
    """The segment's audio, kept for a speech endpoint (no partials)."""

    def __init__(self) -> None:
        self._pcm = bytearray()

    def feed(self, pcm: bytes) -> None:
        self._pcm += pcm

    def take(self) -> bytes:
        out, self._pcm = bytes(self._pcm), bytearray()
        return out


class RealASR(Stage):
    name = "asr"
    # tts/audio: is the agent speaking (speech is a barge-in) or not yet (the user resumed)
    channels: ClassVar[tuple[str, ...]] = ("turn/script", "tts/audio")

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.ears: dict[str, Ear] = {}
        v = self.cfg.vad
        vad_args = (v.engine, v.threshold, v.webrtc_mode)
        make_vad(*vad_args)  # the engine is present (a one-line error here, not in an engine host)
        engine = self.cfg.asr.engine
        self.endpoint = speech_endpoint("asr", engine) if is_url(engine) else None
        self.pool = EnginePool(vad_args, with_rec=self.endpoint is None)
        self.port = AudioPort(self.bus, self.ctx.run, self.ctx.token)
        self.on(Audio, self.reply_began)

    async def reply_began(self, env: Envelope[Audio]) -> None:
        ear = self.ears.get(env.session)
        if ear is not None and ear.finalised and env.turn == ear.turn and env.payload.segment == ear.segment:
            ear.replying = True

    async def run(self) -> None:
        self.pool.idle.append(await self.pool.open())  # one decoder loaded before the first caller speaks
        await self.port.listen(UP, self._frame)
        await super().run()

    async def shutdown(self) -> None:
        await super().shutdown()
        await self.pool.stop()

    def forget(self, session: str) -> None:
        self.ears.pop(session, None)  # its listen task (cancelled) hands its listener back to the pool
        self.port.gate.end(session)

    def _frame(self, session: str, frame: Frame, arrived: int) -> None:
        if session in self.guard.ended:
            return
        ear = self.ears.get(session)
        if ear is None or frame.turn > ear.turn:
            if ear is not None:
                self.cancel(session, lambda k: True)
            ear = self.ears[session] = Ear(
                turn=frame.turn, buffer=None if self.endpoint is None else Buffer()
            )
            self.spawn(session, (frame.turn, "listen"), self._listen(session, ear))
        elif frame.turn < ear.turn:
            return  # audio of a turn already over
        ear.queue.put_nowait((frame, arrived))

    async def _listen(self, session: str, ear: Ear) -> None:
        """The turn's frames in order through its listener (the engines, in an engine host); the listener
        goes back to the pool when the turn's listening ends (a new turn, the session's end, a cancel)."""
        try:
            ear.listener = await self.pool.open()
            await self._hear(session, ear, ear.listener)
        finally:
            if ear.listener is not None:
                self.pool.release(ear.listener)
                ear.listener = None

    async def _hear(self, session: str, ear: Ear, listener: Hears) -> None:
        cfg = self.cfg
        min_speech = max(1, round(cfg.vad.min_speech_ms / FRAME_MS))
        while True:
            frame, arrived = await ear.queue.get()
            speech, hyp, end = await listener.hear(frame.pcm, frame.media_ns)
            if end >= 0:
                ear.voiced_until_ns = frame.media_ns + end * 1_000_000_000 // RATE
            if ear.buffer is not None:
                ear.buffer.feed(frame.pcm)
            if speech:
                ear.speech_run += 1
                if ear.speech_run >= min_speech:
                    if ear.finalised:  # the user went on after we endpointed: that endpoint was premature
                        await self._resumed(session, ear)
                    ear.in_speech = True
                    ear.silence_run = 0
            else:
                ear.speech_run = 0
                if ear.in_speech:
                    if ear.silence_run == 0:
                        ear.silence_from_ns = arrived
                        ear.decision_ns = max(0, frame.media_ns + FRAME_NS - ear.voiced_until_ns)
                    ear.silence_run += 1
                    wait = self._wait_ms(ear.text(hyp))
                    if ear.silence_run * FRAME_MS >= wait:
                        await self._endpoint(session, ear, listener)
                        continue
            ear.since_partial += 1
            if ear.in_speech and ear.since_partial >= PARTIAL_EVERY:
                ear.since_partial = 0
                await self._partial(session, ear, hyp)

    def _wait_ms(self, text: str) -> float:
        a = self.cfg.asr
        if a.endpointing == "silence":
            return a.silence_ms
        return (a.smart_complete_ms if looks_complete(text) else a.smart_incomplete_ms) + a.smart_inference_ms

    async def _partial(self, session: str, ear: Ear, hyp: str) -> None:
        text = ear.text(hyp)
        if text == ear.last_partial or not text:
            return
        ear.last_partial = text
        payload = Partial(text=text, words=len(text.split()), segment=ear.segment)
        await self.publish(Envelope.of(payload, self.ctx.run, session, ear.turn), qos=0)

    async def _endpoint(self, session: str, ear: Ear, listener: Hears) -> None:
        decided = now_ns()
        if ear.buffer is not None:  # a speech endpoint transcribes the segment's audio (measured)
            try:
                hyp = (await transcribe(self.endpoint, ear.buffer.take())).text  # type: ignore[arg-type]
            except EndpointError as exc:
                await self.fail_turn(session, ear.turn, f"asr endpoint: {exc}")
                ear.in_speech, ear.finalised, ear.silence_run = False, True, 0
                return
        else:  # the decoder's own finalisation, measured (in its engine host, plus the pipe's round trip)
            try:
                hyp = await listener.finish()
            except EngineFailed as exc:
                await self.fail_turn(session, ear.turn, f"asr engine: {exc}")
                ear.in_speech, ear.finalised, ear.silence_run = False, True, 0
                return
        done = now_ns()
        ear.in_speech, ear.finalised, ear.silence_run = False, True, 0
        text = ear.text(hyp)
        ear.closed = hyp
        spans = [
            measured_span("asr", "vad decision", ear.silence_from_ns - ear.decision_ns, ear.decision_ns),
            measured_span("asr", "endpoint wait", ear.silence_from_ns, decided - ear.silence_from_ns),
            measured_span("asr", "finalise", decided, done - decided),
        ]
        final = Final(text=text, words=len(text.split()), segment=ear.segment)
        await self.publish(Envelope.of(final, self.ctx.run, session, ear.turn, spans))

    async def _resumed(self, session: str, ear: Ear) -> None:
        if ear.replying:  # the agent is speaking: a barge-in, and the VAD's onset is its detection
            await self.publish(Envelope.of(SpeechStart(vad=True), self.ctx.run, session, ear.turn))
        else:
            cancel = Cancel(segment=ear.segment, reason=CancelReason.USER_RESUMED)
            await self.publish(Envelope.of(cancel, self.ctx.run, session, ear.turn))
        ear.replying = False
        if ear.closed:
            ear.before.append(ear.closed)
        ear.closed = ""
        ear.segment += 1
        ear.finalised = False
        ear.last_partial = ""
