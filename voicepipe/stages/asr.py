"""ASR: partial transcripts while the user speaks, endpointing, then the final transcript.

Receives each spoken word as its audio starts arriving (after the uplink), with its duration. Every word
resets the endpoint timer, which starts counting silence when the word's audio ends; when it runs
out (``silence``: a fixed wait; ``smart``: short if the utterance looks complete, long if not, plus the
detector's inference time) the turn is endpointed, and the final transcript follows after the modelled
finalisation latency. A word that arrives after an endpoint means the user was not done: the segment is
cancelled downstream (a premature endpoint) and the turn continues as the next segment.

Media time (issue 10): whether a silence ends the turn is decided from the audio timeline the client stamps on
each word (``gap_after_ns``: the silence before the next word), not from whether the next word's message
happened to arrive in time — the message stands for audio a streaming ASR would hear in order, so an
overloaded event loop that delivers a word late makes the endpoint late (tax), never premature. Words are
heard strictly in order, each after the previous word's silence has been handled.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from voicepipe.clock import now_ns, rng_for, sleep_until_ns
from voicepipe.config import ASRConfig
from voicepipe.messages import Cancel, CancelReason, Envelope, Final, Partial, Span, UserWord
from voicepipe.stages.base import Stage
from voicepipe.text import normalise


def looks_complete(text: str) -> bool:
    """Text heuristic for smart endpointing: does the utterance read as finished?

    Ends in sentence punctuation, or does not end in a filler / conjunction / preposition.
    """
    words = normalise(text).split()
    if not words:
        return False
    tail = text.rstrip()
    if tail.endswith(("?", ".", "!")):
        return True
    if tail.endswith((",", "-", "—", "…")):
        return False
    dangling = {
        "um", "uh", "er", "erm", "hmm", "and", "or", "but", "so", "because", "the", "a", "an", "to",
        "of", "with", "for", "like", "i", "my", "is", "was", "if", "then", "that", "in", "on", "at",
        "maybe", "think", "want", "need", "are", "be",
    }  # fmt: skip
    return words[-1] not in dangling


def endpoint_wait_ms(cfg: ASRConfig, text: str, annotated_complete: bool | None) -> tuple[float, float]:
    """(silence wait, detector inference) in ms before the turn is declared over."""
    if cfg.endpointing == "silence":
        return cfg.silence_ms, 0.0
    complete = (
        annotated_complete
        if cfg.smart_source == "annotation" and annotated_complete is not None
        else looks_complete(text)
    )
    wait = cfg.smart_complete_ms if complete else cfg.smart_incomplete_ms
    return wait, cfg.smart_inference_ms


def wait_of(cfg: ASRConfig, text: str, annotated: bool | None) -> float:
    wait, infer = endpoint_wait_ms(cfg, text, annotated)
    return wait + infer


@dataclass
class Utterance:
    turn: int
    words: list[str] = field(default_factory=list)
    segment: int = 0
    finalised: bool = False  # the current segment has been sent as final
    partials: int = 0  # words covered by the last partial sent
    pauses_seen: int = 0
    complete_at_pauses: list[bool] = field(default_factory=list)
    last: Envelope | None = None
    # words (with their arrival instants) waiting to be heard, and whether a listener is hearing them: one
    # task per utterance hears its words in order, each after the previous word's silence was handled
    queue: deque[tuple[Envelope, int]] = field(default_factory=deque)
    listening: bool = False
    wake: asyncio.Future[None] | None = None  # the listener waits here for the utterance's next word
    heard_until: int = 0  # when the last word heard ends (its audio's scheduled end, not when we woke)


NEVER = 2**62  # the silence after the last word: it lasts until the turn is over


class ASR(Stage):
    name = "asr"
    channels = ("user/word", "turn/script")

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.utt: dict[str, Utterance] = {}
        self.on("user.word", self.word)

    def forget(self, session: str) -> None:
        self.utt.pop(session, None)

    async def word(self, env: Envelope) -> None:
        arrived = now_ns()
        u = self.utt.get(env.session)
        if u is None or u.turn != env.turn:
            u = Utterance(turn=env.turn)
            script = self.script_of(env)
            u.complete_at_pauses = list(script.complete_at_pauses) if script else []
            self.utt[env.session] = u
        # each word is heard after the one before it (and its silence), however late its message came
        u.queue.append((env, arrived))
        if u.wake is not None:
            if not u.wake.done():
                u.wake.set_result(None)
        elif not u.listening:
            u.listening = True
            self.spawn(env.session, ("listen", env.turn), self._listen(u), turn=env.turn)

    async def _listen(self, u: Utterance) -> None:
        """Hear the utterance's words in arrival order, waiting for the next one until its last word is
        heard: one task per utterance, not one per word."""
        try:
            while True:
                if not u.queue:
                    u.wake = asyncio.get_running_loop().create_future()
                    try:
                        await u.wake
                    finally:
                        u.wake = None
                env, arrived = u.queue.popleft()
                await self._hear(env, u, arrived)
                if env.payload.last_word and not u.queue:
                    return
        finally:
            u.listening = False

    async def _hear(self, env: Envelope, u: Utterance, arrived: int) -> None:
        """One word on media time: its audio, then the silence after it (``gap_after_ns``), decide whether
        that silence ends the turn. Timing follows arrival (a late word is heard late: tax); the decisions
        follow the media timeline alone (a late word never turns a pause into an endpoint)."""
        p: UserWord = env.payload  # type: ignore[assignment]
        if u.finalised:
            # the user kept talking after we endpointed: that endpoint was premature
            await self.publish(
                self.reply(env, Cancel(segment=u.segment, reason=CancelReason.USER_RESUMED), [])
            )
            u.segment += 1
            u.finalised = False
        if p.pause_before:
            u.pauses_seen += 1
        if u.partials < len(u.words):  # the previous word ended just as this one began
            await self._partial(env, u)
        u.words.append(p.text)
        u.last = env
        annotated = self._annotation(u, env)
        # the silence clock starts when this word's audio ends, not when it began arriving (heard from its
        # arrival, or from when the word before it ends, if that is later: the scheduled end, so a listener
        # that wakes late does not push every later word back; lateness stays tax, never accumulates)
        speech_end = max(arrived, u.heard_until) + p.dur_ns
        u.heard_until = speech_end
        await self._endpoint(
            env, u, speech_end, annotated, NEVER if p.gap_after_ns is None else p.gap_after_ns
        )

    def _annotation(self, u: Utterance, env: Envelope) -> bool | None:
        """Scenario's smart-turn label for a pause after this word (True at the utterance's last word)."""
        if env.payload.last_word:
            return True
        if u.pauses_seen < len(u.complete_at_pauses):
            return u.complete_at_pauses[u.pauses_seen]
        return False

    async def _partial(self, env: Envelope, u: Utterance) -> None:
        u.partials = len(u.words)
        if not self.wanted("asr/partial"):
            return  # nobody could receive it (in-memory bus, no subscriber): not built, not sent
        payload = Partial(text=" ".join(u.words), words=len(u.words), segment=u.segment)
        await self.publish(self.reply(env, payload, []), qos=0)

    async def _endpoint(
        self, env: Envelope, u: Utterance, speech_end: int, annotated: bool | None, gap: int
    ) -> None:
        cfg = self.cfg.asr
        # what the silence after this word will decide (the words cannot change meanwhile: this listener
        # alone hears them)
        text = " ".join(u.words)
        n_words = len(u.words)
        pre = self.cfg.router.preemptive
        wait_ms, infer_ms = endpoint_wait_ms(cfg, text, annotated)
        wait, infer = round(wait_ms * 1e6), round(infer_ms * 1e6)
        stable = round(pre.stable_ms * 1e6)
        eager = pre.enabled and stable < wait + infer and gap >= stable
        if gap < wait + infer and not eager and not (u.partials < n_words and self.wanted("asr/partial")):
            # the word is recognised when its audio ends, but nobody would hear of it and the user speaks
            # again before the silence decides anything: no sleep to wait it out (one timer less per word)
            u.partials = n_words
            return
        await sleep_until_ns(speech_end)
        if u.partials < n_words:
            await self._partial(env, u)  # the word is recognised once its audio has ended
        if eager:
            # eager end of turn: the transcript has been stable (silence) for stable_ms
            await sleep_until_ns(speech_end + stable)
            if self.wanted("asr/partial"):
                payload = Partial(text=text, words=n_words, segment=u.segment, eager=True)
                await self.publish(self.reply(env, payload, []), qos=0)
        if gap < wait + infer:
            return  # the user speaks again before the silence ends the turn: no spans built, no draw made
        t = speech_end + wait + infer
        await sleep_until_ns(t)
        # endpointed: from here a new word means the user was not done
        u.finalised = True
        spans = [*env.spans, Span(stage="asr", what="endpoint wait", start_ns=speech_end, dur_ns=wait)]
        if infer:
            spans.append(Span(stage="asr", what="turn detector", start_ns=speech_end + wait, dur_ns=infer))
        rng = rng_for(self.cfg.seed, env.session, env.turn, u.segment, "asr")
        fin = round(cfg.finalize_ms.sample_ms(rng) * 1e6)
        if gap < wait + infer + fin:
            return  # the user resumed while the transcript was being finalised: it is never sent
        spans.append(Span(stage="asr", what="finalise", start_ns=t, dur_ns=fin))
        await sleep_until_ns(t + fin)
        await self.publish(self.reply(env, Final(text=text, words=n_words, segment=u.segment), spans))
