"""Client: the user's side. Plays a scripted conversation in real time and is the stopwatch.

For each turn it speaks the words on their scripted timings (each word reaches the ASR after the
modelled uplink), marks the end of speech on its own monotonic clock, and listens for the reply: the
first audio chunk of the reply to the whole utterance is "heard" after the modelled downlink. Measured
voice-to-voice = heard − end of speech. It then plays the reply out (or moves on at first audio), waits
the turn's gap, and speaks the next turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from voicepipe.clock import now_ns, sleep_until_ns
from voicepipe.measure import measure
from voicepipe.messages import Envelope, Span
from voicepipe.records import EndpointMetrics, TurnRecord
from voicepipe.scenario import Scenario, Turn
from voicepipe.stages.base import Stage
from voicepipe.text import plain, speak

LEAD_NS = 20_000_000  # the script goes out this long before the first word


class TurnFailed(Exception):
    """The reply could not be produced (e.g. its endpoint request failed); carries the reason."""


@dataclass
class Listening:
    turn: int
    words: int
    end_of_speech_ns: int
    first: asyncio.Future[tuple[int, Envelope]]
    done: asyncio.Event = field(default_factory=asyncio.Event)
    play_until_ns: int = 0
    premature: bool = False  # a reply to a partial utterance arrived (or was cancelled)
    barge_in_ns: int = 0  # when the user started talking over the reply
    stopped_ns: int = 0  # when the reply audio stopped because of it
    reply: list[str] = field(default_factory=list)
    error: str = ""  # the reply failed (e.g. its endpoint dropped the stream)
    final_meta: dict[str, Any] | None = None  # the last audio chunk's metadata (a real model's usage)


class Client(Stage):
    name = "client"
    channels = ("tts/audio", "control/cancel")

    def __init__(self, *a, on_record: Callable[[TurnRecord], None] | None = None, **kw) -> None:
        super().__init__(*a, **kw)
        self.listening: dict[str, Listening] = {}
        self.on_record = on_record
        self.on("tts.audio", self.audio)
        self.on("control.cancel", self.cancel_seen)

    async def cancel_seen(self, env: Envelope) -> None:
        got = now_ns()
        lis = self.listening.get(env.session)
        if not lis or env.turn != lis.turn:
            return
        reason = env.payload.get("reason")
        if reason == "failed":  # the reply's LLM request failed (real endpoint): before or after first audio
            lis.error = str(env.payload.get("error", ""))
            if not lis.first.done():
                lis.first.set_exception(TurnFailed(lis.error))
            lis.done.set()
        elif reason == "user resumed":
            lis.premature = True
        elif reason == "barge-in" and lis.barge_in_ns and not lis.stopped_ns:
            # the stop crosses the return path to the speaker; the jitter buffer is dropped at once
            lis.stopped_ns = got + round(self.cfg.transport.stop_ms * 1e6)
            lis.play_until_ns = min(lis.play_until_ns, lis.stopped_ns)
            lis.done.set()

    async def audio(self, env: Envelope) -> None:
        got = now_ns()
        lis = self.listening.get(env.session)
        if lis is None or env.turn != lis.turn:
            return
        if int(env.payload.get("words", 0)) < lis.words:
            lis.premature = True  # a reply to the first part of the utterance: the endpoint was early
            return
        start = max(got + round(self.cfg.transport.downlink_ms * 1e6), lis.play_until_ns)
        lis.play_until_ns = start + round(float(env.payload.get("duration_ms", 0.0)) * 1e6)
        lis.reply.append(str(env.payload.get("text", "")))
        if not lis.first.done():
            lis.first.set_result((got, env))
        if env.payload.get("last"):
            lis.final_meta = env.payload.get("meta")
            lis.done.set()

    # -- playing a conversation -------------------------------------------------------------------
    async def play(self, scenario: Scenario, session: str) -> list[TurnRecord]:
        records: list[TurnRecord] = []
        try:
            for k, turn in enumerate(scenario.turns):
                records.append(await self._turn(scenario, session, k, turn))
        finally:
            self.listening.pop(session, None)
            end = Envelope(type="session.end", run=self.ctx.run, session=session)
            await self.bus.publish(end)
        return records

    async def _turn(self, scenario: Scenario, session: str, k: int, turn: Turn) -> TurnRecord:
        cfg = self.cfg
        run = self.ctx.run
        words = speak(turn.user, turn.words_per_minute or cfg.client.words_per_minute)
        script = {
            "user": plain(turn.user),
            "reply": turn.reply,
            "intent": turn.intent,
            "complexity": turn.complexity,
            "complete_at_pauses": turn.complete_at_pauses,
            "words": len(words),
        }
        if k == 0 and scenario.cache:
            script["cache"] = [e.model_dump() for e in scenario.cache]
        await self.bus.publish(Envelope(type="turn.script", run=run, session=session, turn=k, payload=script))
        t_start = now_ns() + LEAD_NS
        uplink = round(cfg.transport.uplink_ms * 1e6)
        loop = asyncio.get_running_loop()
        eos = t_start + round(words[-1].end_ms * 1e6)
        lis = Listening(turn=k, words=len(words), end_of_speech_ns=eos, first=loop.create_future())
        self.listening[session] = lis
        prev_end = 0.0
        for i, w in enumerate(words):
            # a word's audio starts reaching the ASR one uplink after the user starts saying it
            w_start = t_start + round(w.start_ms * 1e6)
            w_end = t_start + round(w.end_ms * 1e6)
            await sleep_until_ns(w_start + uplink)
            payload = {
                "text": w.text,
                "dur_ns": w_end - w_start,
                "index": i,
                "pause_before": w.start_ms - prev_end > 1.0,
                "last_word": i == len(words) - 1,
            }
            prev_end = w.end_ms
            span = Span(stage="transport", what="uplink", start_ns=w_end, dur_ns=uplink)
            await self.bus.publish(
                Envelope(type="user.word", run=run, session=session, turn=k, spans=[span], payload=payload)
            )
        record = await self._await_reply(scenario, session, k, turn, lis)
        # let the reply play out (or stop it), then the user's pause before speaking again
        if turn.barge_in_after_ms is not None and record.status == "ok" and record.first_audio_ns:
            await self._barge_in(session, k, record.first_audio_ns + round(turn.barge_in_after_ms * 1e6), lis)
            if lis.stopped_ns:
                record.barge_in_stop_ms = (lis.stopped_ns - lis.barge_in_ns) / 1e6
        elif cfg.client.playout == "full" and record.status == "ok":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lis.done.wait(), cfg.client.turn_timeout_s)
            await sleep_until_ns(lis.play_until_ns)
        else:
            await self.bus.publish(
                Envelope(type="control.cancel", run=run, session=session, turn=k, payload={"reason": "heard"})
            )
        if lis.error and record.status == "ok":  # heard a part, then the reply's request failed
            record.status, record.error = "failed", lis.error
        if record.status == "ok" and lis.final_meta and "endpoint" in lis.final_meta:
            fin = lis.final_meta  # a real model's counts are known once its reply is over
            record.endpoint = EndpointMetrics.model_validate(fin["endpoint"])
            record.input_tokens, record.output_tokens = int(fin["input_tokens"]), int(fin["output_tokens"])
            record.cost_usd = float(fin["cost_usd"])
        if self.on_record:
            self.on_record(record)
        payload = record.model_dump(mode="json")
        await self.bus.publish(
            Envelope(type="turn.record", run=run, session=session, turn=k, payload=payload)
        )
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
        span = Span(stage="transport", what="uplink", start_ns=at_ns, dur_ns=uplink)
        await self.bus.publish(
            Envelope(type="user.speech_start", run=self.ctx.run, session=session, turn=k, spans=[span])
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(lis.done.wait(), self.cfg.client.turn_timeout_s)
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
        }
        try:
            got, env = await asyncio.wait_for(lis.first, cfg.client.turn_timeout_s + 10)
        except TimeoutError:
            return TurnRecord(**base, status="timeout", premature_endpoint=lis.premature)
        except TurnFailed as exc:
            return TurnRecord(**base, status="failed", error=str(exc), premature_endpoint=lis.premature)
        downlink = round(cfg.transport.downlink_ms * 1e6)
        await sleep_until_ns(got + downlink)
        heard = now_ns()
        spans = [*env.spans, Span(stage="transport", what="downlink", start_ns=got, dur_ns=downlink)]
        m = measure(spans, lis.end_of_speech_ns, heard)
        meta = env.payload.get("meta", {})
        measured = m.measured_ns / 1e6
        return TurnRecord(
            **{**base, "backend": meta.get("backend", base["backend"])},
            transcript=plain(turn.user),
            reply_text=str(env.payload.get("text", "")),
            measured_ms=measured,
            predicted_ms=m.predicted_ns / 1e6,
            tax_ms=m.tax_ns / 1e6,
            within_budget=measured <= cfg.budget_ms,
            breakdown=m.parts,
            spans=spans,
            first_audio_ns=heard,
            path=meta.get("path", "agent"),
            route=meta.get("route", "single"),
            input_tokens=int(meta.get("input_tokens", 0)),
            output_tokens=int(meta.get("output_tokens", 0)),
            wasted_tokens=int(meta.get("wasted_tokens", 0)),
            cost_usd=float(meta.get("cost_usd", 0.0)),
            quality=meta.get("quality"),
            premature_endpoint=lis.premature or int(env.payload.get("segment", 0)) > 0,
            false_hit=bool(meta.get("false_hit", False)),
        )
