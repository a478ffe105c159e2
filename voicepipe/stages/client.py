"""Client: the user's side. Plays a scripted conversation in real time and is the stopwatch.

For each turn it speaks the words on their scripted timings (each word reaches the ASR after the
modelled uplink), marks the end of speech on its own monotonic clock, and listens for the reply: the
first audio chunk of the reply to the whole utterance is "heard" after the modelled downlink. Measured
voice-to-voice = heard − end of speech. It then plays the reply out (or moves on at first audio), waits
the turn's gap, and speaks the next turn.

Media time: each word carries its place on the turn's audio timeline (``media_ns``) and the silence that
follows it (``gap_after_ns``), so the ASR's decisions never depend on when the message arrived. Every turn
of a conversation yields exactly one record — ok, failed with the reason (a stage's error, an unmeasurable
reply), lost with the reason (the broker dropped its messages), or a timeout — whatever arrives on the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from voicepipe.clock import Latch, now_ns, sleep_until_ns, wait_within
from voicepipe.measure import measure
from voicepipe.messages import (
    Audio,
    CacheAnswer,
    Cancel,
    CancelReason,
    Envelope,
    SessionEnd,
    SpeechStart,
    TurnMeta,
    TurnScript,
    UserUtterance,
    UserWord,
)
from voicepipe.records import TurnRecord
from voicepipe.scenario import Scenario, Turn
from voicepipe.spans import modelled_span
from voicepipe.speech_mix import modelled_speech_stages
from voicepipe.stages.base import Stage
from voicepipe.text import plain, speak

log = structlog.get_logger("voicepipe.client")

LEAD_NS = 20_000_000  # the script goes out this long before the first word


@functools.lru_cache(maxsize=1024)
def spoken(utterance: str, words_per_minute: float) -> UserUtterance:
    """A scripted utterance as the client says it: each word's place on the media timeline (ns from the start
    of the utterance). Memoised: every session saying the same utterance sends the same payload (never
    changed once built; each message's envelope is its own)."""
    words = speak(utterance, words_per_minute)
    out = []
    prev_end = 0.0
    last = len(words) - 1
    for i, w in enumerate(words):
        start, end = round(w.start_ms * 1e6), round(w.end_ms * 1e6)
        word = UserWord(
            text=w.text,
            dur_ns=end - start,
            index=i,
            pause_before=w.start_ms - prev_end > 1.0,
            last_word=i == last,
            media_ns=start,
            gap_after_ns=None if i == last else max(0, round((words[i + 1].start_ms - w.end_ms) * 1e6)),
        )
        prev_end = w.end_ms
        out.append(word)
    return UserUtterance(words=out)


class TurnFailed(Exception):
    """The reply could not be produced (e.g. its endpoint request failed); carries the reason."""

    def __init__(self, reason: str, status: str = "failed") -> None:
        super().__init__(reason)
        self.status = status  # "failed", or "lost" when the broker dropped the turn's messages


@dataclass
class Early:
    """A reply to part of the utterance (a segment the ASR withdraws when the user resumes), as the user hears
    it: each chunk from its arrival plus the downlink, back to back, until the cancel (``USER_RESUMED``)
    reaches the client plus ``transport.stop_ms`` — as a barge-in stops a reply. Audio that arrives after
    the cancel is dropped unheard."""

    queued_until_ns: int = 0  # when the chunks heard so far end
    played: list[tuple[int, int]] = field(default_factory=list)  # (from, to) ns of each chunk as scheduled
    stop_ns: int | None = None  # the cancel reached the speaker: nothing after this is heard
    synthesised_ms: float = 0.0  # audio the TTS made for it (heard or not): TTS work thrown away

    def heard(self) -> list[tuple[int, int]]:
        stop = self.stop_ns
        out = []
        for a, b in self.played:
            b = b if stop is None else min(b, stop)
            if b > a:
                out.append((a, b))
        return out


def overlap_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Total time covered by both interval sets (each set's own overlaps counted once)."""

    def union(xs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for s, e in sorted(xs):
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            else:
                out.append((s, e))
        return out

    ua, ub = union(a), union(b)
    total = i = j = 0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        if hi > lo:
            total += hi - lo
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass
class Listening:
    turn: int
    words: int
    end_of_speech_ns: int
    first: asyncio.Future[tuple[int, Envelope[Audio]]]
    done: Latch = field(default_factory=Latch)  # the reply is over (played, stopped or failed)
    play_until_ns: int = 0
    premature: bool = False  # a reply to a partial utterance arrived (or was cancelled)
    barge_in_ns: int = 0  # when the user started talking over the reply
    stopped_ns: int = 0  # when the reply audio stopped because of it
    reply: list[str] = field(default_factory=list)
    error: str = ""  # the reply failed (e.g. its endpoint dropped the stream)
    final_meta: TurnMeta | None = None  # the last audio chunk's metadata (a real model's usage)
    status: str = "failed"  # what ``error`` makes of the turn: failed, or lost (messages dropped)
    speech: list[tuple[int, int]] = field(default_factory=list)  # the user's words on this clock (ns)
    early: dict[int, Early] = field(default_factory=dict)  # segment -> reply to part of the utterance

    def talked_over(self) -> dict[str, float | None]:
        """The record's talked-over fields: ``talked_over_ms`` (None when no early reply was heard) and
        ``wasted_audio_ms`` (audio synthesised for withdrawn segments)."""
        heard = [iv for e in self.early.values() for iv in e.heard()]
        return {
            "talked_over_ms": overlap_ns(heard, self.speech) / 1e6 if heard else None,
            "wasted_audio_ms": sum(e.synthesised_ms for e in self.early.values()),
        }


class Client(Stage):
    name = "client"
    channels = ("tts/audio", "control/cancel")

    def __init__(self, *a, on_record: Callable[[TurnRecord], None] | None = None, **kw) -> None:
        super().__init__(*a, **kw)
        self.listening: dict[str, Listening] = {}
        self.on_record = on_record
        self.on(Audio, self.audio)
        self.on(Cancel, self.cancel_seen)

    async def fail_turn(self, session: str, turn: int, reason: str, *, lost: bool = False) -> None:
        """The client itself saw the turn fail (its own handler) or lose messages: record it at once, whether
        or not the cancel it publishes comes back through a congested broker."""
        lis = self.listening.get(session)
        if lis is not None and lis.turn == turn and not lis.first.done():
            lis.error, lis.status = reason, "lost" if lost else "failed"
            lis.first.set_exception(TurnFailed(reason, lis.status))
            lis.done.set()
        await super().fail_turn(session, turn, reason, lost=lost)

    async def cancel_seen(self, env: Envelope[Cancel]) -> None:
        got = now_ns()
        lis = self.listening.get(env.session)
        if not lis or env.turn != lis.turn:
            return
        reason = env.payload.reason
        if reason in (
            CancelReason.FAILED,
            CancelReason.LOST,
        ):  # a request or a stage failed, or messages lost
            lis.error = env.payload.error or reason.value
            lis.status = "lost" if reason == CancelReason.LOST else "failed"
            if not lis.first.done():
                lis.first.set_exception(TurnFailed(lis.error, lis.status))
            lis.done.set()
        elif reason == CancelReason.USER_RESUMED:
            lis.premature = True
            early = lis.early.setdefault(env.payload.segment or 0, Early())
            if early.stop_ns is None:  # the stop crosses the return path, as a barge-in's does
                early.stop_ns = got + round(self.cfg.transport.stop_ms * 1e6)
        elif reason == CancelReason.BARGE_IN and lis.barge_in_ns and not lis.stopped_ns:
            # the stop crosses the return path to the speaker; the jitter buffer is dropped at once
            lis.stopped_ns = got + round(self.cfg.transport.stop_ms * 1e6)
            lis.play_until_ns = min(lis.play_until_ns, lis.stopped_ns)
            lis.done.set()

    async def audio(self, env: Envelope[Audio]) -> None:
        got = now_ns()
        lis = self.listening.get(env.session)
        if lis is None or env.turn != lis.turn:
            return
        p = env.payload
        if p.words > lis.words:
            await self.reject(env, f"out of range: a reply to {p.words} words, {lis.words} were spoken")
            return
        if p.words < lis.words:
            # a reply to the first part of the utterance: the endpoint was early, and the user hears it
            # (over their own words once they resume) until the withdrawal reaches the speaker
            lis.premature = True
            early = lis.early.setdefault(p.segment, Early())
            early.synthesised_ms += p.duration_ms
            if early.stop_ns is None:
                start = max(got + round(self.cfg.transport.downlink_ms * 1e6), early.queued_until_ns)
                early.queued_until_ns = start + round(p.duration_ms * 1e6)
                early.played.append((start, early.queued_until_ns))
            return
        start = max(got + round(self.cfg.transport.downlink_ms * 1e6), lis.play_until_ns)
        lis.play_until_ns = start + round(p.duration_ms * 1e6)
        lis.reply.append(p.text)
        if not lis.first.done():
            lis.first.set_result((got, env))
        if p.last:
            lis.final_meta = p.meta
            lis.done.set()

    # -- playing a conversation -------------------------------------------------------------------
    async def play(self, scenario: Scenario, session: str) -> list[TurnRecord]:
        """Every turn of ``scenario`` yields one record, whatever happens: a turn that raises is recorded as
        failed with the reason and the conversation goes on; turns a broken bus never let us play are
        recorded as lost with the reason."""
        records: list[TurnRecord] = []
        try:
            for k, turn in enumerate(scenario.turns):
                self.guard.open(session, k)
                try:
                    rec = await self._turn(scenario, session, k, turn)
                except (asyncio.CancelledError, KeyboardInterrupt):
                    raise
                except Exception as exc:  # a bug or a broken bus must cost this turn, not the run
                    log.warning("turn failed", session=session, turn=k, error=repr(exc))
                    self._failed(exc)
                    self.guard.counters.handler_errors += 1
                    rec = self._unplayed(scenario, session, k, turn, "failed", f"client: {exc!r}")
                    if self.on_record:
                        self.on_record(rec)
                    await asyncio.sleep(turn.gap_ms / 1e3)
                records.append(rec)
        finally:
            self.listening.pop(session, None)
            with contextlib.suppress(Exception):
                await self.publish(Envelope.of(SessionEnd(), self.ctx.run, session))
        return records

    def _unplayed(
        self, scenario: Scenario, session: str, k: int, turn: Turn, status: str, error: str
    ) -> TurnRecord:
        return TurnRecord(
            run=self.ctx.run, scenario=scenario.name, session=session, turn=k, user_text=plain(turn.user),
            budget_ms=self.cfg.budget_ms, backend=self.cfg.backend_label(), status=status, error=error,
        )  # fmt: skip

    async def _turn(self, scenario: Scenario, session: str, k: int, turn: Turn) -> TurnRecord:
        cfg = self.cfg
        run = self.ctx.run
        speech = spoken(turn.user, turn.words_per_minute or cfg.client.words_per_minute)
        first, last = speech.words[0], speech.words[-1]
        script = TurnScript(
            user=plain(turn.user),
            reply=turn.reply,
            intent=turn.intent,
            complexity=turn.complexity,
            complete_at_pauses=list(turn.complete_at_pauses),
            words=len(speech.words),
            cache=[CacheAnswer(questions=list(e.questions), answer=e.answer) for e in scenario.cache]
            if k == 0
            else [],
        )
        await self.publish(Envelope.of(script, run, session, k))
        t_start = now_ns() + LEAD_NS
        uplink = round(cfg.transport.uplink_ms * 1e6)
        loop = asyncio.get_running_loop()
        eos = t_start + last.media_ns + last.dur_ns
        lis = Listening(turn=k, words=len(speech.words), end_of_speech_ns=eos, first=loop.create_future(),
                        speech=[(t_start + w.media_ns, t_start + w.media_ns + w.dur_ns) for w in speech.words])  # fmt: skip
        self.listening[session] = lis
        # the utterance's audio starts reaching the ASR one uplink after the user starts saying it; the span
        # is the first word's uplink (the ASR moves it along the media timeline for each later word)
        await sleep_until_ns(t_start + first.media_ns + uplink)
        span = modelled_span("transport", "uplink", t_start + first.media_ns + first.dur_ns, uplink)
        await self.publish(Envelope.of(speech, run, session, k, [span]))
        # the turn's timeout counts from when the last word's audio starts reaching the ASR (as when each word
        # was a message of its own), not from the first: a long utterance must not eat into it
        await sleep_until_ns(t_start + last.media_ns + uplink)
        record = await self._await_reply(scenario, session, k, turn, lis)
        # let the reply play out (or stop it), then the user's pause before speaking again
        if turn.barge_in_after_ms is not None and record.status == "ok" and record.first_audio_ns:
            await self._barge_in(session, k, record.first_audio_ns + round(turn.barge_in_after_ms * 1e6), lis)
            if lis.stopped_ns:
                record.barge_in_stop_ms = (lis.stopped_ns - lis.barge_in_ns) / 1e6
        elif cfg.client.playout == "full" and record.status == "ok":
            with contextlib.suppress(TimeoutError):
                await wait_within(lis.done.future(), cfg.client.turn_timeout_s, cancel=False)
            await sleep_until_ns(lis.play_until_ns)
        else:
            await self.publish(Envelope.of(Cancel(reason=CancelReason.HEARD), run, session, k))
        if lis.error and record.status == "ok":  # heard a part, then the reply's request failed
            record.status, record.error = "failed", lis.error
        fin = lis.final_meta
        if record.status == "ok" and fin is not None and fin.endpoint is not None:
            # a real model's counts are known once its reply is over
            record.endpoint = fin.endpoint
            record.input_tokens, record.output_tokens = fin.input_tokens, fin.output_tokens
            record.cost_usd = fin.cost_usd
        away = self.bus.disruption_ms(t_start - LEAD_NS, now_ns())  # the broker lost or stalled meanwhile
        if away:
            record.broker_outage_ms = away
            if record.status == "timeout":
                record.status, record.error = "failed", "broker outage"
        if self.on_record:
            self.on_record(record)
        await self.publish(Envelope.of(record, run, session, k))
        await asyncio.sleep(turn.gap_ms / 1e3)
        return record

    async def _barge_in(self, session: str, k: int, at_ns: int, lis: Listening) -> None:
        """The user talks over the reply at ``at_ns``; wait until the reply audio stops (or ends)."""
        await sleep_until_ns(at_ns)
        if lis.done.is_set() and lis.play_until_ns <= at_ns:
            return  # the reply was already over: nothing to interrupt
        lis.barge_in_ns = at_ns
        uplink = round(self.cfg.transport.uplink_ms * 1e6)
        await sleep_until_ns(at_ns + uplink)
        span = modelled_span("transport", "uplink", at_ns, uplink)
        await self.publish(Envelope.of(SpeechStart(), self.ctx.run, session, k, [span]))
        with contextlib.suppress(TimeoutError):
            await wait_within(lis.done.future(), self.cfg.client.turn_timeout_s, cancel=False)
        await sleep_until_ns(lis.play_until_ns)

    async def _await_reply(
        self, scenario: Scenario, session: str, k: int, turn: Turn, lis: Listening
    ) -> TurnRecord:
        cfg = self.cfg
        base = {
            "run": self.ctx.run,
            "scenario": scenario.name,
            "session": session,
            "turn": k,
            "user_text": plain(turn.user),
            "budget_ms": cfg.budget_ms,
            "end_of_speech_ns": lis.end_of_speech_ns,
            "clock_offset_ns": time.time_ns() - time.monotonic_ns(),
            "backend": cfg.backend_label(),
            "real_stages": cfg.real_stages,  # a real TTS answering this word client, or none
            "modelled_stages": modelled_speech_stages(cfg.real_stages),
        }
        try:
            got, env = await wait_within(lis.first, cfg.client.turn_timeout_s + 10)
        except TimeoutError:
            return TurnRecord(**base, status="timeout", premature_endpoint=lis.premature, **lis.talked_over())
        except TurnFailed as exc:
            return TurnRecord(
                **base, status=exc.status, error=str(exc), premature_endpoint=lis.premature, **lis.talked_over()
            )
        downlink = round(cfg.transport.downlink_ms * 1e6)
        await sleep_until_ns(got + downlink)
        heard = now_ns()
        spans = [*env.spans, modelled_span("transport", "downlink", got, downlink)]
        try:
            m = measure(spans, lis.end_of_speech_ns, heard)
        except ValueError as exc:  # e.g. audio before the end of speech: not a reply this turn can have had
            return TurnRecord(**base, status="failed", error=f"unmeasurable reply: {exc}", **lis.talked_over())
        p = env.payload
        meta = p.meta
        measured = m.measured_ns / 1e6
        over = lis.talked_over()
        return TurnRecord(
            **{**base, "backend": meta.backend},
            transcript=plain(turn.user),
            reply_text=p.text,
            measured_ms=measured,
            predicted_ms=m.predicted_ns / 1e6,
            tax_ms=m.tax_ns / 1e6,
            # talking over the user is a miss, however fast the reply to the whole utterance came
            within_budget=measured <= cfg.budget_ms and over["talked_over_ms"] is None,
            breakdown=m.parts,
            spans=spans,
            first_audio_ns=heard,
            path=meta.path.value,
            route=meta.route,
            input_tokens=meta.input_tokens,
            output_tokens=meta.output_tokens,
            wasted_tokens=meta.wasted_tokens,
            cost_usd=meta.cost_usd,
            quality=meta.quality,
            premature_endpoint=lis.premature or p.segment > 0,
            false_hit=meta.false_hit,
            **over,
        )
