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
gives it, and not at all otherwise.

The other speech stages may be modelled (:mod:`voicepipe.speech_mix`): a modelled ASR gets the turn's words
placed on this audio (:func:`~voicepipe.audio.align.aligned`) as their audio starts, beside the frames; a
modelled TTS answers in tone frames (:mod:`voicepipe.audio.tone`). The stopwatch is the same. A turn's
``barge_in_after_ms`` has the caller speak its ``barge_in`` text over the reply that long after the
reply's onset (the frames replace the microphone's silence from the next frame on); a modelled VAD gets
``user.speech_start`` at the barge-in's first voiced sample, a real one hears it. ``barge_in_stop_ms`` is
from that sample to when the reply stopped in the caller's ear (the stop's ``control.cancel``, or the
reply's end if sooner). Reply audio heard before the end of speech is talking over the caller
(``talked_over_ms``: its overlap with the caller's voiced stretches, cut at any stop): a miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from voicepipe.audio import FRAME_NS, RATE
from voicepipe.audio.align import aligned
from voicepipe.audio.engines import (
    WINDOW,
    first_voiced_sample,
    frames_of,
    last_voiced_sample,
    synthesize,
    synthesize_parts,
    voiced,
)
from voicepipe.audio.frames import DOWN, UP, Frame
from voicepipe.audio.record import LEFT, RIGHT, Recorder, recording_path
from voicepipe.audio.wer import wer
from voicepipe.audio.wire import AudioPort
from voicepipe.clock import now_ns, sleep_until_ns
from voicepipe.config import PipelineConfig
from voicepipe.files import read_wav
from voicepipe.measure import measure
from voicepipe.messages import (
    Audio,
    CacheAnswer,
    Cancel,
    CancelReason,
    Envelope,
    Final,
    SpeechStart,
    TurnScript,
    UserUtterance,
)
from voicepipe.records import TurnRecord
from voicepipe.scenario import Scenario, Turn
from voicepipe.spans import shifted
from voicepipe.speech_mix import modelled_speech_stages
from voicepipe.stages.client import LEAD_NS, Listening, TurnFailed, overlap_ns, spoken
from voicepipe.stages.client import Client as _Client
from voicepipe.text import plain

SILENCE = bytes(FRAME_NS * RATE // 10**9 * 2)
Parts = list[tuple[str, int, int]]  # spoken stretches: (text, first sample, end sample)


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
    audio_got: dict[int, int] = field(default_factory=dict)  # segment -> when that arrived
    frame_got: dict[int, int] = field(default_factory=dict)  # segment -> when its first frame arrived
    finals: dict[int, str] = field(default_factory=dict)  # segment -> transcript
    reply: dict[int, list[str]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    mic_seq: int = -1
    speaking: bool = False
    speech: list[tuple[int, int]] = field(default_factory=list)  # the caller's voiced stretches (ns)
    early: list[tuple[int, int]] = field(default_factory=list)  # reply audio heard before the end of speech
    played: set[int] = field(default_factory=set)  # segments whose audio was heard
    barge: tuple[int, list[bytes]] | None = None  # the barge-in's first mic frame index, and its frames
    barge_ns: int = 0  # its first voiced sample (on this clock)
    stopped_ns: int = 0  # the reply's audio stopped for the barge-in
    stopped: asyncio.Event = field(default_factory=asyncio.Event)

    def stop(self, at_ns: int) -> None:
        """The reply's audio stops here: the jitter buffer is dropped; early audio is cut at the stop."""
        self.play_until_ns = min(self.play_until_ns, at_ns)
        self.early = [(a, min(b, at_ns)) for a, b in self.early if a < at_ns]
        self.rec.clear(RIGHT, at_ns)


def stretches(x: np.ndarray, origin_ns: int) -> list[tuple[int, int]]:
    """The voiced stretches of ``x`` (runs of voiced 5 ms windows) as (from, to) ns from ``origin_ns``."""
    v = voiced(x).astype(np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], v, [0]])))
    w = WINDOW * 1e9 / RATE
    pairs = zip(edges[::2], edges[1::2], strict=True)
    return [(origin_ns + round(a * w), origin_ns + round(b * w)) for a, b in pairs]


async def utterance(turn: Turn, words_per_minute: float, voice: str) -> tuple[np.ndarray, Parts | None]:
    """What the caller says this turn: the turn's recording (``wav``, read through the file guard), else its
    ``user`` text spoken by espeak-ng (with where each spoken stretch lies in it)."""
    if turn.wav is not None:
        return np.frombuffer(read_wav(turn.wav, "wav"), dtype="<i2").copy(), None
    return await synthesize_parts(turn.user, words_per_minute, voice)


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
        if p.segment not in call.audio:
            call.audio[p.segment], call.audio_got[p.segment] = env, now_ns()
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
            call.stop(now_ns())
        elif reason == CancelReason.BARGE_IN:
            got = now_ns()
            if call.barge_ns:  # our barge-in stopped the reply: as heard, when its audio ended
                call.stopped_ns = min(got, call.play_until_ns)
                call.stopped.set()
            else:  # the agent stopped for the caller's own words (it was talking over them)
                call.withdrawn |= call.played
                call.premature = True
            call.stop(got)
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
        call.played.add(frame.segment)
        call.frame_got.setdefault(frame.segment, got)
        if call.onset_ns is None:
            for w in np.flatnonzero(voiced(x)):
                at = play + round(int(w) * WINDOW * 1e9 / RATE)
                if at >= call.eos_ns:
                    call.onset_ns, call.onset_seg = at, frame.segment
                    lis = self.listening.get(session)
                    if lis is not None and lis.turn == call.turn and not lis.first.done():
                        lis.first.set_result((got, None))  # type: ignore[arg-type]
                    break
                call.premature = True  # reply audio while the caller was still speaking: talked over
                call.early.append((at, at + round(WINDOW * 1e9 / RATE)))
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
        """The utterance's frames, then silence (or the barge-in's frames from their index), each when its
        last sample has been spoken."""
        i = 0
        while call.speaking or i < len(frames) or (call.barge and i < call.barge[0] + len(call.barge[1])):
            await sleep_until_ns(t_start + (i + 1) * FRAME_NS)
            b = call.barge
            if b is not None and b[0] <= i < b[0] + len(b[1]):
                pcm, last = b[1][i - b[0]], i == b[0] + len(b[1]) - 1
            else:
                pcm, last = (frames[i], i == len(frames) - 1) if i < len(frames) else (SILENCE, False)
            if pcm is not SILENCE:
                call.rec.put(LEFT, t_start + i * FRAME_NS, np.frombuffer(pcm, dtype="<i2"))
            call.mic_seq += 1
            self.port.send(session, Frame(UP, turn, call.mic_seq, i * FRAME_NS, pcm, last))
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
        pcm, parts = await utterance(turn, wpm, cfg.client.espeak_voice)
        last = last_voiced_sample(pcm)
        if last is None:
            what = f"the recording {turn.wav}" if turn.wav else "the synthesised utterance"
            raise RuntimeError(f"{what} has no voiced sample")
        frames = frames_of(pcm)
        words_msg = None if "asr" in cfg.real_stages else aligned(spoken(turn.user, wpm), pcm, parts)
        barge = None
        if turn.barge_in_after_ms is not None:  # said over the reply: synthesised now, not when it is due
            barge = await synthesize(turn.barge_in, wpm, cfg.client.espeak_voice)
        call.turn, call.onset_ns, call.onset_seg, call.premature = k, None, -1, False
        call.withdrawn, call.audio, call.finals, call.reply = set(), {}, {}, {}
        call.audio_got, call.frame_got = {}, {}
        call.early, call.played, call.barge, call.barge_ns, call.stopped_ns = [], set(), None, 0, 0
        call.done, call.stopped = asyncio.Event(), asyncio.Event()
        await self.publish(Envelope.of(script, run, session, k))
        t_start = now_ns() + LEAD_NS
        call.eos_ns = t_start + round(last * 1e9 / RATE)
        call.speech = stretches(pcm, t_start)
        lis = Listening(turn=k, words=words, end_of_speech_ns=call.eos_ns,
                        first=asyncio.get_running_loop().create_future())  # fmt: skip
        self.listening[session] = lis
        call.speaking = True
        mic = asyncio.create_task(self._mic(session, call, k, frames, t_start), name=f"mic-{session}")
        sent = None
        if words_msg is not None:  # a modelled ASR: the words, placed on the audio, as their audio starts
            at = t_start + words_msg.words[0].media_ns
            sent = asyncio.create_task(self._words(Envelope.of(words_msg, run, session, k), at))
        try:
            record = await self._heard(scenario, session, k, turn, call, lis)
            if record.status == "ok" and barge is not None and record.first_audio_ns:
                await self._speak_over(session, k, call, record, turn, barge, t_start)
            elif record.status == "ok":
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(call.done.wait(), cfg.client.turn_timeout_s)
                await sleep_until_ns(call.play_until_ns)
        finally:
            call.speaking = False
            for task in (mic, sent):
                if task is not None:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        call.turn = -1  # the turn is over: what still arrives for it (a reply to the barge-in) goes unheard
        if self.on_record:
            self.on_record(record)
        await self.publish(Envelope.of(record, run, session, k))
        await asyncio.sleep(turn.gap_ms / 1e3)
        return record

    async def _words(self, env: Envelope[UserUtterance], at_ns: int) -> None:
        await sleep_until_ns(at_ns)
        await self.publish(env)

    async def _speak_over(
        self, session: str, k: int, call: Call, record: TurnRecord, turn: Turn, barge: np.ndarray, t_start: int
    ) -> None:  # fmt: skip
        """The caller speaks ``barge`` over the reply ``barge_in_after_ms`` after its onset (unless the reply
        is over by then) and waits until the reply's audio stops. A real VAD (the real ASR) hears it in the
        frames (in the real ASR stage); a modelled one gets ``user.speech_start`` at its first voiced sample."""
        assert record.first_audio_ns is not None and turn.barge_in_after_ms is not None
        at = record.first_audio_ns + round(turn.barge_in_after_ms * 1e6)
        await sleep_until_ns(at)
        if call.done.is_set() and call.play_until_ns <= at:
            return  # the reply was already over: nothing to interrupt
        i = -(-(now_ns() - t_start) // FRAME_NS) + 1  # the first mic frame not yet on its way
        first = first_voiced_sample(barge) or 0
        call.barge_ns = t_start + i * FRAME_NS + round(first * 1e9 / RATE)
        call.barge = (i, frames_of(barge))
        if "vad" not in self.cfg.real_stages:
            await sleep_until_ns(call.barge_ns)
            await self.publish(Envelope.of(SpeechStart(), self.ctx.run, session, k))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(call.stopped.wait(), self.cfg.client.turn_timeout_s)
        await sleep_until_ns(call.play_until_ns)
        if call.stopped_ns:
            record.barge_in_stop_ms = (call.stopped_ns - call.barge_ns) / 1e6
            if self.cfg.client.record:
                record.recording_stop_ms = call.rec.ms(call.stopped_ns)

    async def _heard(
        self, scenario: Scenario, session: str, k: int, turn: Turn, call: Call, lis: Listening
    ) -> TurnRecord:
        cfg = self.cfg
        where = cfg.client.record
        base = {
            "run": self.ctx.run, "scenario": scenario.name, "session": session, "turn": k,
            "user_text": said(turn), "budget_ms": cfg.budget_ms, "end_of_speech_ns": call.eos_ns,
            "backend": cfg.backend_label(), "real_stages": cfg.real_stages,
            "modelled_stages": modelled_speech_stages(cfg.real_stages),
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
        # the chain ends where its tts.audio arrived; the frames that followed it out of the TTS are the
        # audio's path: one that overtook the message (QoS 0 beside QoS 1) moves the chain back to its arrival
        early = call.frame_got.get(seg, 0) - call.audio_got.get(seg, 0)
        if env is not None and early < 0:
            spans = shifted(spans, early)
        m = measure(spans, call.eos_ns, onset)
        transcript = call.finals.get(seg, "")
        measured = m.measured_ns / 1e6
        meta = env.payload.meta if env is not None else None
        # the caller talked over: reply audio heard while it was still speaking (a miss, however fast the
        # reply to the whole utterance); its overlap with the caller's voiced stretches, cut at any stop
        over = overlap_ns(call.early, call.speech) / 1e6 if call.early else None
        extra = {} if meta is None else {
            "backend": meta.backend, "path": meta.path.value, "route": meta.route,
            "input_tokens": meta.input_tokens, "output_tokens": meta.output_tokens, "cost_usd": meta.cost_usd,
            "quality": meta.quality, "false_hit": meta.false_hit, "wasted_tokens": meta.wasted_tokens,
        }  # fmt: skip
        return TurnRecord(
            **{**base, **extra},
            transcript=transcript,
            # scored only for a real ASR (a modelled one returns the script), and not for a bare recording
            wer=wer(turn.user, transcript) if plain(turn.user) and "asr" in cfg.real_stages else None,
            reply_text=env.payload.text if env is not None else "",
            measured_ms=measured, predicted_ms=m.predicted_ns / 1e6, tax_ms=m.tax_ns / 1e6,
            within_budget=measured <= cfg.budget_ms and over is None, talked_over_ms=over,
            breakdown=m.parts, spans=spans, first_audio_ns=onset,
            premature_endpoint=call.premature or seg > 0,
        )  # fmt: skip
