"""Real TTS stage: espeak-ng speaks each clause of the reply, streamed as audio frames on ``audio/down``.

Clauses are formed as in the modelled TTS (:func:`~voicepipe.stages.tts.split_clauses`). Each is synthesised
by espeak-ng as soon as it is complete (at ``tts.words_per_minute``, voice ``tts.voice``); its frames go out
paced at real time, :data:`LEAD_NS` ahead of playout (a real TTS streams, it does not dump a reply at once),
and the next clause is synthesised while the one before is still streaming. Beside the frames, one
``tts.audio`` message per clause carries the reply's text, its real duration and the turn's metadata to the
caller; the first carries the causal chain with a measured ``time to first audio`` span (text arrival to
synthesised audio). A cancel or a barge-in stops the turn's tasks, and with them the frames.
"""

from __future__ import annotations

import asyncio

from voicepipe.audio import FRAME_NS, RATE
from voicepipe.audio.asr import measured_span
from voicepipe.audio.engines import espeak, frames_of
from voicepipe.audio.frames import DOWN, Frame
from voicepipe.audio.wire import AudioPort
from voicepipe.clock import now_ns, sleep_until_ns
from voicepipe.messages import Envelope, ReplyText, audio
from voicepipe.stages.tts import TTS, Reply

LEAD_NS = 60_000_000  # frames leave up to this long before they are due to play


class RealTTS(TTS):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.port = AudioPort(self.bus, self.ctx.run, self.ctx.token)
        self.down_seq: dict[str, int] = {}

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
                pcm = await espeak(text, cfg.words_per_minute, cfg.voice)
                ready = now_ns()
                spans = []
                if r.seq == 0:
                    spans = [*env.spans, measured_span("tts", "time to first audio", arrived, ready - arrived)]
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
