"""The real caller: speaks each scripted utterance with espeak-ng as audio frames and times the reply by ear.

Per turn the caller sends the turn's script (as the modelled client does), synthesises the utterance
(:func:`~voicepipe.audio.engines.synthesize`: the turn's ``words_per_minute``, its pause markers kept as
silence), and streams it as 20 ms frames on ``audio/up`` in real time — frame ``i`` leaves when its last
sample has been spoken, ``(i + 1) * 20 ms`` after the utterance starts — followed by silence frames for as
long as the turn lasts (a microphone does not stop). The reply arrives as frames on ``audio/down``; each
plays at its arrival or when the frame before it ends, whichever is later (a jitter buffer).

The stopwatch is the signal: end of speech is the last voiced sample sent (5 ms windows above an energy
threshold, :func:`~voicepipe.audio.engines.voiced`), the reply starts at the first voiced sample played
after it, from a segment the ASR did not withdraw. ``measured_ms`` is the difference, on this process's
clock. No transport is modelled in this mode (no uplink/downlink spans): the audio's only path is the bus.
Reply audio heard before the end of speech marks the turn's endpoint premature. The ``tts.audio`` messages
give the turn's causal chain and metadata, ``asr.final`` its transcript and word error rate.

With ``client.record`` set, every session's conversation is written as a stereo WAV
(:mod:`voicepipe.audio.record`). A turn with ``wav`` streams that recording's samples instead of
synthesising (a real recorded caller); its word error rate is scored against ``user`` when the turn also
gives it, and not at all otherwise. Not yet here: barge-in over real audio.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from voicepipe.audio import FRAME_NS, RATE
from voicepipe.audio.engines import WINDOW, frames_of, last_voiced_sample, synthesize, voiced
from voicepipe.audio.frames import DOWN, UP, Frame
from voicepipe.audio.record import LEFT, RIGHT, Recorder, recording_path
from voicepipe.audio.wer import wer
from voicepipe.audio.wire import AudioPort
from voicepipe.clock import now_ns, sleep_until_ns
from voicepipe.config import PipelineConfig
from voicepipe.files import read_wav
from voicepipe.measure import measure
from voicepipe.messages import Audio, CacheAnswer, Cancel, CancelReason, Envelope, Final, TurnScript
from voicepipe.records import TurnRecord
from voicepipe.scenario import Scenario, Turn
from voicepipe.stages.client import LEAD_NS, Listening, TurnFailed, spoken
from voicepipe.stages.client import Client as _Client
from voicepipe.text import plain

REAL_STAGES = ["client", "vad", "asr", "tts"]
SILENCE = bytes(FRAME_NS * RATE // 10**9 * 2)


@dataclass
class Call:
    """One session's conversation as the caller hears it."""

    rec: Recorder
    turn: int = -1
    eos_ns: int = 0
    onset_ns: int | None = None
    onset_seg: int = -1
    premature: bool = False
    play_until_ns: int = 0
    withdrawn: set[int] = field(default_factory=set)
    audio: dict[int, Envelope[Audio]] = field(default_factory=dict)  # segment -> its first tts.audio
    finals: dict[int, str] = field(default_factory=dict)  # segment -> transcript
    reply: dict[int, list[str]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    mic_seq: int = -1
    speaking: bool = False


async def utterance(turn: Turn, words_per_minute: float, voice: str) -> np.ndarray:
    """What the caller says this turn: the turn's recording (``wav``, read through the file guard), else its
    ``user`` text spoken by espeak-ng."""
    if turn.wav is not None:
        return np.frombuffer(read_wav(turn.wav, "wav"), dtype="<i2").copy()
    return await synthesize(turn.user, words_per_minute, voice)


def said(turn: Turn) -> str:
    """The turn's text for records and tables: its ``user`` text, else the recording's file name."""
    return plain(turn.user) or f"(recording {Path(turn.wav or '').name})"


class Caller(_Client):
    @classmethod
    def channels_for(cls, cfg: PipelineConfig) -> tuple[str, ...]:
        return (*cls.channels, "asr/final")  # the transcript, for the turn's word error rate

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.port = AudioPort(self.bus, self.ctx.run, self.ctx.token)
        self.calls: dict[str, Call] = {}
        self.on(Audio, self.reply_audio)
        self.on(Cancel, self.cancel_real)
        self.on(Final, self.final_seen)

    async def run(self) -> None:
        await self.port.listen(DOWN, self._frame)
        await super().run()

    # -- what comes back ------------------------------------------------------------------------------
    def _current(self, env: Envelope) -> Call | None:
        call = self.calls.get(env.session)
        return call if call is not None and call.turn == env.turn else None

    async def reply_audio(self, env: Envelope[Audio]) -> None:
        call = self._current(env)
        if call is None:
            return
        p = env.payload
        call.audio.setdefault(p.segment, env)
        call.reply.setdefault(p.segment, []).append(p.text)

    async def final_seen(self, env: Envelope[Final]) -> None:
        call = self._current(env)
        if call is not None:
            call.finals[env.payload.segment] = env.payload.text

    async def cancel_real(self, env: Envelope[Cancel]) -> None:
        call = self._current(env)
        if call is None:
            return
        reason = env.payload.reason
        if reason == CancelReason.USER_RESUMED and env.payload.segment is not None:
            call.withdrawn.add(env.payload.segment)
            call.premature = True
            call.play_until_ns = min(call.play_until_ns, now_ns())  # the jitter buffer is dropped
        elif reason in (CancelReason.FAILED, CancelReason.LOST):
            lis = self.listening.get(env.session)
            status = "lost" if reason == CancelReason.LOST else "failed"
            if lis is not None and lis.turn == env.turn and not lis.first.done():
                lis.error, lis.status = env.payload.error or reason.value, status
                lis.first.set_exception(TurnFailed(lis.error, status))
            call.done.set()

    def _frame(self, session: str, frame: Frame, got: int) -> None:
        call = self.calls.get(session)
        if call is None or frame.turn != call.turn or frame.segment in call.withdrawn:
            return
        play = max(got, call.play_until_ns)
        call.play_until_ns = play + FRAME_NS
        x = np.frombuffer(frame.pcm, dtype="<i2")
        call.rec.put(RIGHT, play, x)
        if call.onset_ns is None:
            for w in np.flatnonzero(voiced(x)):
                at = play + round(int(w) * WINDOW * 1e9 / RATE)
                if at >= call.eos_ns:
                    call.onset_ns, call.onset_seg = at, frame.segment
                    lis = self.listening.get(session)
                    if lis is not None and lis.turn == call.turn and not lis.first.done():
                        lis.first.set_result((got, None))  # type: ignore[arg-type]
                    break
                call.premature = True  # reply audio while the caller was still speaking
        if frame.last and frame.segment == call.onset_seg:
            call.done.set()

    # -- speaking ---------------------------------------------------------------------------------------
    async def play(self, scenario: Scenario, session: str) -> list[TurnRecord]:
        call = self.calls[session] = Call(rec=Recorder(now_ns()))
        try:
            return await super().play(scenario, session)
        finally:
            self.calls.pop(session, None)
            self.port.gate.end(session)
            where = self.cfg.client.record
            if where:
                call.rec.write(recording_path(where, session))

    async def _mic(self, session: str, call: Call, turn: int, frames: list[bytes], t_start: int) -> None:
        """The utterance's frames, then silence, each when its last sample has been spoken."""
        i = 0
        while call.speaking or i < len(frames):
            await sleep_until_ns(t_start + (i + 1) * FRAME_NS)
            pcm = frames[i] if i < len(frames) else SILENCE
            if i < len(frames):
                call.rec.put(LEFT, t_start + i * FRAME_NS, np.frombuffer(pcm, dtype="<i2"))
            call.mic_seq += 1
            self.port.send(session, Frame(UP, turn, call.mic_seq, i * FRAME_NS, pcm, i == len(frames) - 1))
            i += 1

    async def _turn(self, scenario: Scenario, session: str, k: int, turn: Turn) -> TurnRecord:
        cfg = self.cfg
        run = self.ctx.run
        call = self.calls[session]
        wpm = turn.words_per_minute or cfg.client.words_per_minute
        words = len(spoken(turn.user, wpm).words) if plain(turn.user) else 0  # a bare recording: unknown
        script = TurnScript(
            user=said(turn), reply=turn.reply, intent=turn.intent, complexity=turn.complexity,
            complete_at_pauses=list(turn.complete_at_pauses), words=words,
            cache=[CacheAnswer(questions=list(e.questions), answer=e.answer) for e in scenario.cache]
            if k == 0 else [],
        )  # fmt: skip
        pcm = await utterance(turn, wpm, cfg.client.espeak_voice)
        last = last_voiced_sample(pcm)
        if last is None:
            what = f"the recording {turn.wav}" if turn.wav else "the synthesised utterance"
            raise RuntimeError(f"{what} has no voiced sample")
        frames = frames_of(pcm)
        call.turn, call.onset_ns, call.onset_seg, call.premature = k, None, -1, False
        call.withdrawn, call.audio, call.finals, call.reply = set(), {}, {}, {}
        call.done = asyncio.Event()
        await self.publish(Envelope.of(script, run, session, k))
        t_start = now_ns() + LEAD_NS
        call.eos_ns = t_start + round(last * 1e9 / RATE)
        lis = Listening(turn=k, words=words, end_of_speech_ns=call.eos_ns,
                        first=asyncio.get_running_loop().create_future())  # fmt: skip
        self.listening[session] = lis
        call.speaking = True
        mic = asyncio.create_task(self._mic(session, call, k, frames, t_start), name=f"mic-{session}")
        try:
            record = await self._heard(scenario, session, k, turn, call, lis)
            if record.status == "ok":
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(call.done.wait(), cfg.client.turn_timeout_s)
                await sleep_until_ns(call.play_until_ns)
        finally:
            call.speaking = False
            with contextlib.suppress(asyncio.CancelledError):
                await mic
        if self.on_record:
            self.on_record(record)
        await self.publish(Envelope.of(record, run, session, k))
        await asyncio.sleep(turn.gap_ms / 1e3)
        return record

    async def _heard(
        self, scenario: Scenario, session: str, k: int, turn: Turn, call: Call, lis: Listening
    ) -> TurnRecord:
        cfg = self.cfg
        where = cfg.client.record
        base = {
            "run": self.ctx.run, "scenario": scenario.name, "session": session, "turn": k,
            "user_text": said(turn), "budget_ms": cfg.budget_ms, "end_of_speech_ns": call.eos_ns,
            "backend": cfg.backend_label(), "real_stages": REAL_STAGES,
            "clock_offset_ns": time.time_ns() - time.monotonic_ns(),
            "recording": str(recording_path(where, session)) if where else None,
            "recording_eos_ms": call.rec.ms(call.eos_ns),
        }  # fmt: skip
        try:
            await asyncio.wait_for(lis.first, cfg.client.turn_timeout_s + (call.eos_ns - now_ns()) / 1e9)
        except TimeoutError:
            return TurnRecord(**base, status="timeout", premature_endpoint=call.premature)
        except TurnFailed as exc:
            return TurnRecord(**base, status=exc.status, error=str(exc), premature_endpoint=call.premature)
        onset, seg = call.onset_ns, call.onset_seg
        assert onset is not None
        # the clause's tts.audio left just before its frames, but at QoS 1 behind a busy broker it can trail
        # them: wait for it (it carries the chain and the metadata) up to the turn's timeout
        waited = now_ns() + round(cfg.client.turn_timeout_s * 1e9)
        while seg not in call.audio and now_ns() < waited:
            await asyncio.sleep(0.01)
        env = call.audio.get(seg)
        spans = list(env.spans) if env is not None else []
        m = measure(spans, call.eos_ns, onset)
        transcript = call.finals.get(seg, "")
        measured = m.measured_ns / 1e6
        meta = env.payload.meta if env is not None else None
        extra = {} if meta is None else {
            "backend": meta.backend, "path": meta.path.value, "route": meta.route,
            "input_tokens": meta.input_tokens, "output_tokens": meta.output_tokens, "cost_usd": meta.cost_usd,
            "quality": meta.quality, "false_hit": meta.false_hit, "wasted_tokens": meta.wasted_tokens,
        }  # fmt: skip
        return TurnRecord(
            **{**base, **extra},
            transcript=transcript,
            wer=wer(turn.user, transcript) if plain(turn.user) else None,  # a bare recording has no reference
            reply_text=env.payload.text if env is not None else "",
            measured_ms=measured, predicted_ms=m.predicted_ns / 1e6, tax_ms=m.tax_ns / 1e6,
            within_budget=measured <= cfg.budget_ms, breakdown=m.parts, spans=spans, first_audio_ns=onset,
            premature_endpoint=call.premature or seg > 0,
        )  # fmt: skip
