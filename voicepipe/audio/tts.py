"""Real TTS stage: espeak-ng speaks each clause of the reply, streamed as audio frames on ``audio/down``.

Clauses are formed as in the modelled TTS (:func:`~voicepipe.stages.tts.split_clauses`). Each is synthesised
by espeak-ng as soon as it is complete (at ``tts.words_per_minute``, voice ``tts.voice``); its frames go out
paced at real time, :data:`LEAD_NS` ahead of playout (a real TTS streams, it does not dump a reply at once),
and the next clause is synthesised while the one before is still streaming. Beside the frames, one
``tts.audio`` message per clause carries the reply's text, its real duration and the turn's metadata to the
caller; the first carries the causal chain with a measured ``time to first audio`` span (text arrival to
synthesised audio) and ``lead silence`` (the synthesised audio's own silence before its first voiced sample,
by the caller's energy stopwatch: heard as part of the gap). A cancel or a barge-in stops the turn's tasks, and with them the frames.

With ``tts.engine`` a speech endpoint (:mod:`voicepipe.backends.speech`), each clause is posted as it is
complete and its audio streams back in chunks, cut into whole frames as they arrive: time to first audio is
the first chunk's arrival. An endpoint error fails the turn with its one-line reason.

A cache hit is the cache's ``tts.audio`` (its lookup and render are the cache's model); this stage plays its
answer as frames when that message arrives, from audio it rendered ahead (the config's and the scenario's
cache entries, spoken by espeak-ng when the first script names them). An answer it did not render ahead (a
learned entry) is rendered then, and that time falls in the turn's bus part.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import numpy as np

from voicepipe.audio import FRAME_NS, FRAME_SAMPLES, RATE
from voicepipe.audio.asr import measured_span
from voicepipe.audio.engines import espeak, first_voiced_sample, frames_of
from voicepipe.audio.frames import DOWN, Frame
from voicepipe.audio.wire import AudioPort
from voicepipe.backends.base import EndpointError
from voicepipe.backends.speech import is_url, speech_endpoint, synthesize_stream
from voicepipe.clock import now_ns, sleep_until_ns
from voicepipe.messages import Audio, Envelope, ReplyText, TurnScript, audio
from voicepipe.scenario import reply_speech_ms
from voicepipe.stages.tts import TTS, Reply

LEAD_NS = 60_000_000  # frames leave up to this long before they are due to play


class RealTTS(TTS):
    # tts/audio: the cache's answers, which this stage plays as frames
    channels: ClassVar[tuple[str, ...]] = (*TTS.channels, "tts/audio")
    prerender = True  # speak the cache's answers with espeak-ng ahead of time

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.port = AudioPort(self.bus, self.ctx.run, self.ctx.token)
        engine = self.cfg.tts.engine
        self.endpoint = speech_endpoint("tts", engine) if is_url(engine) else None
        self.down_seq: dict[str, int] = {}
        self.rendered: dict[str, asyncio.Task[np.ndarray]] = {}  # a cache answer's text -> its audio
        self.on(Audio, self.cached_answer)

    # -- the cache's answers (pre-rendered audio: the cache decides and sends tts.audio, this stage plays it)
    async def on_script(self, env: Envelope[TurnScript]) -> None:
        if self.prerender:
            ours = [e["answer"] for e in self.cfg.cache.entries]
            for text in [*ours, *(c.answer for c in env.payload.cache)]:
                self._render(text)

    def _render(self, text: str) -> asyncio.Task[np.ndarray]:
        task = self.rendered.get(text)
        if task is None:
            cfg = self.cfg.tts
            task = self.rendered[text] = asyncio.ensure_future(espeak(text, cfg.words_per_minute, cfg.voice))
        return task

    async def answer_frames(self, p: Audio) -> list[bytes]:
        """The cache answer's frames: its pre-rendered audio (rendered now if it was not: a learned entry)."""
        return frames_of(await self._render(p.text))

    async def cached_answer(self, env: Envelope[Audio]) -> None:
        if env.src.split("/", 1)[0] != "cache":
            return  # our own (or another replica's) audio, already playing
        self.spawn(env.session, (env.turn, env.payload.segment, "send"), self._play_answer(env))

    async def _play_answer(self, env: Envelope[Audio]) -> None:
        frames = await self.answer_frames(env.payload)
        out: asyncio.Queue[tuple[bytes, bool] | None] = asyncio.Queue()
        for i, f in enumerate(frames):
            out.put_nowait((f, i == len(frames) - 1))
        await self._send(env.session, env.turn, env.payload.segment, out)

    async def shutdown(self) -> None:
        for task in self.rendered.values():
            task.cancel()
        await super().shutdown()

    def forget(self, session: str) -> None:
        super().forget(session)
        self.down_seq.pop(session, None)

    async def _speak(self, first_env: Envelope[ReplyText], r: Reply, key: tuple[str, int, int]) -> None:
        session, turn, seg = key
        cfg = self.cfg.tts
        out: asyncio.Queue[tuple[bytes, bool] | None] = asyncio.Queue()
        self.spawn(session, (turn, seg, "send"), self._send(session, turn, seg, out))
        try:
            while True:
                clause, env, arrived, last = await r.queue.get()
                text = " ".join(clause)
                if self.endpoint is not None:
                    try:
                        await self._speak_endpoint(env, r, text, arrived, last, seg, out)
                    except EndpointError as exc:
                        await self.fail_turn(session, turn, f"tts endpoint: {exc}")
                        return
                    r.seq += 1
                    if last:
                        return
                    continue
                pcm = await espeak(text, cfg.words_per_minute, cfg.voice)
                ready = now_ns()
                spans = []
                if r.seq == 0:
                    spans = [*env.spans, measured_span("tts", "time to first audio", arrived, ready - arrived)]
                    lead = first_voiced_sample(pcm)  # the synthesis's silence before its first voiced sample
                    if lead:
                        lead_ns = lead * 1_000_000_000 // RATE
                        spans.append(measured_span("tts", "lead silence", ready, lead_ns))
                p = env.payload
                msg = audio(
                    seq=r.seq, text=text, duration_ms=len(pcm) * 1000.0 / RATE, last=last, words=p.words,
                    segment=seg, meta=p.meta,
                )  # fmt: skip
                await self.publish(self.reply(env, msg, spans))
                frames = frames_of(pcm)
                for i, f in enumerate(frames):
                    out.put_nowait((f, last and i == len(frames) - 1))
                r.seq += 1
                if last:
                    return
        finally:
            self.replies.get(session, {}).pop((turn, seg), None)

    async def _speak_endpoint(
        self, env: Envelope[ReplyText], r: Reply, text: str, arrived: int, last: bool, seg: int,
        out: asyncio.Queue[tuple[bytes, bool] | None],
    ) -> None:  # fmt: skip
        """One clause from the speech endpoint: its ``tts.audio`` at the first chunk (time to first audio =
        that chunk's arrival; the duration is the word model's estimate, the frames are the truth), then
        whole 20 ms frames as the chunks stream in, the last padded with silence."""
        p = env.payload
        carry = np.zeros(0, dtype=np.int16)
        first = True
        async for got, x in synthesize_stream(self.endpoint, text):  # type: ignore[arg-type]
            if first:
                first = False
                spans = []
                if r.seq == 0:
                    spans = [*env.spans, measured_span("tts", "time to first audio", arrived, got - arrived)]
                msg = audio(
                    seq=r.seq, text=text, duration_ms=reply_speech_ms(text, self.cfg.tts.words_per_minute),
                    last=last, words=p.words, segment=seg, meta=p.meta,
                )  # fmt: skip
                await self.publish(self.reply(env, msg, spans))
            carry = np.concatenate([carry, x])
            n = len(carry) // FRAME_SAMPLES * FRAME_SAMPLES
            for f in frames_of(carry[:n]):
                out.put_nowait((f, False))
            carry = carry[n:]
        tail = frames_of(carry) if len(carry) else [bytes(FRAME_SAMPLES * 2)]
        for i, f in enumerate(tail):
            out.put_nowait((f, last and i == len(tail) - 1))

    async def _send(self, session: str, turn: int, seg: int, out: asyncio.Queue[tuple[bytes, bool] | None]) -> None:
        """Frames in order, each no earlier than LEAD_NS before its playout time (playout starts with the
        first frame; a frame synthesised late goes at once)."""
        start = 0
        k = 0
        while True:
            item = await out.get()
            if item is None:
                return
            pcm, last = item
            if k == 0:
                start = now_ns()
            due = start + k * FRAME_NS - LEAD_NS
            if due > now_ns():
                await sleep_until_ns(due)
            seq = self.down_seq[session] = self.down_seq.get(session, -1) + 1
            self.port.send(session, Frame(DOWN, turn, seq, k * FRAME_NS, pcm, last, seg))
            k += 1
            if last:
                return
