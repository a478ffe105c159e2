"""ASR: partial transcripts while the user speaks, endpointing, then the final transcript.

Receives the user's utterance once, as its first word's audio starts arriving (after the uplink): every word
with its place on the media timeline. Each word is heard at its own instant on that timeline (the message's
arrival plus the word's offset from the first), never earlier, and only where hearing it can change what
is published does hearing it cost a timer. Every word resets the endpoint timer, which starts counting silence when the word's audio ends; when it runs
out (``silence``: a fixed wait; ``smart``: short if the utterance looks complete, long if not, plus the
detector's inference time) the turn is endpointed, and the final transcript follows after the modelled
finalisation latency. A word that arrives after an endpoint means the user was not done: the segment is
cancelled downstream (a premature endpoint) and the turn continues as the next segment.

Media time (issue 10): whether a silence ends the turn is decided from the audio timeline the client stamps on
each word (``gap_after_ns``: the silence before the next word), not from whether the next word happened
to be heard in time — the message stands for audio a streaming ASR would hear in order, so an overloaded
event loop that hears a word late makes the endpoint late (tax), never premature. Words are heard
strictly in order, each after the previous word's silence has been handled.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from voicepipe.clock import now_ns, rng_for, running_loop, sleep_until_ns
from voicepipe.config import ASRConfig
from voicepipe.messages import Cancel, CancelReason, Envelope, Final, Partial, UserUtterance, UserWord
from voicepipe.spans import Span, modelled_span, shifted
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


def shortest_wait_ns(cfg: ASRConfig) -> int:
    """A lower bound (ns, rounded as :meth:`ASR._take` rounds) of every endpoint wait plus detector time
    under ``cfg``: a shorter silence ends no turn, whatever was said."""
    if cfg.endpointing == "silence":
        return round(cfg.silence_ms * 1e6)
    waits = (cfg.smart_complete_ms, cfg.smart_incomplete_ms)
    return round(min(waits) * 1e6) + round(cfg.smart_inference_ms * 1e6)


def wait_of(cfg: ASRConfig, text: str, annotated: bool | None) -> float:
    wait, infer = endpoint_wait_ms(cfg, text, annotated)
    return wait + infer


@dataclass(slots=True)
class Heard:
    """One word of an utterance message, as the ASR hears it: at ``at`` (ns), its uplink spans those of the
    message (the first word's) moved ``shift`` ns along the media timeline."""

    word: UserWord
    at: int
    base: list[Span]
    shift: int

    def spans(self) -> list[Span]:
        return shifted(self.base, self.shift)


@dataclass
class Utterance:
    turn: int
    env: Envelope[UserUtterance]  # the utterance message (session, turn: what the ASR's messages reply to)
    words: list[str] = field(default_factory=list)
    segment: int = 0
    finalised: bool = False  # the current segment has been sent as final
    partials: int = 0  # words covered by the last partial sent
    pauses_seen: int = 0
    complete_at_pauses: list[bool] = field(default_factory=list)
    # words waiting to be heard, and whether a listener is hearing them: one task per utterance hears its
    # words in order, each after the previous word's silence was handled (a word already taken when the
    # message came carries what its silence will decide)
    queue: deque[tuple[Heard, Silence | None]] = field(default_factory=deque)
    listening: bool = False
    wake: asyncio.Future[None] | None = None  # the listener waits here for the utterance's next word
    heard_until: int = 0  # when the last word heard ends (its audio's scheduled end, not when we woke)


NEVER = 2**62  # the silence after the last word: it lasts until the turn is over


@dataclass(slots=True)
class Silence:
    """What the silence after a heard word will decide (ns; computed when the word is heard)."""

    speech_end: int  # when the word's audio ends
    gap: int  # the silence before the next word (NEVER after the last)
    text: str  # the utterance so far
    words: int
    wait: int  # endpoint wait
    infer: int  # turn detector
    stable: int  # preemptive: silence after which the transcript counts as stable
    eager: bool  # an eager partial goes out after ``stable``


class ASR(Stage):
    name = "asr"
    channels = ("user/utterance", "turn/script")

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.utt: dict[str, Utterance] = {}
        self._shortest_wait = shortest_wait_ns(self.cfg.asr)
        self.on(UserUtterance, self.utterance)

    def forget(self, session: str) -> None:
        self.utt.pop(session, None)

    async def utterance(self, env: Envelope[UserUtterance]) -> None:
        """The utterance's first word is arriving: every word is heard at its own instant from here."""
        arrived = now_ns()
        u = self.utt.get(env.session)
        if u is not None and u.turn == env.turn:  # a client says a turn's words in one message, once
            await self.reject(env, f"out of range: a second utterance for turn {env.turn}")
            return
        if u is None or u.turn != env.turn:
            u = Utterance(turn=env.turn, env=env)
            script = self.script_of(env)
            u.complete_at_pauses = list(script.complete_at_pauses) if script else []
            self.utt[env.session] = u
        p = env.payload
        first = p.words[0]
        origin, origin_end = first.media_ns, first.media_ns + first.dur_ns
        for w in p.words:
            self._arrive(
                u, Heard(w, arrived + w.media_ns - origin, env.spans, w.media_ns + w.dur_ns - origin_end)
            )

    def _arrive(self, u: Utterance, h: Heard) -> None:
        # each word is heard after the one before it (and its silence)
        silence: Silence | None = None
        if not u.queue and (u.wake is not None or not u.listening) and self._quiet_start(u):
            # nothing is waiting to be heard before this word, and hearing it says nothing: take it now (no
            # one can observe the words until something is published, and that waits for its instant)
            silence = self._take(u, h)
            if silence is None:
                return  # its silence decides nothing either: no listener needs to wake for it
        u.queue.append((h, silence))
        if u.wake is not None:
            if not u.wake.done():
                u.wake.set_result(None)
        elif not u.listening:
            u.listening = True
            env = u.env
            self.spawn(env.session, ("listen", env.turn), self._listen(u), turn=env.turn)

    async def _listen(self, u: Utterance) -> None:
        """Hear the utterance's words in order, each at its instant, until its last word is heard: one task
        per utterance, not one per word."""
        try:
            while True:
                if not u.queue:
                    u.wake = running_loop().create_future()
                    try:
                        await u.wake
                    finally:
                        u.wake = None
                h, silence = u.queue.popleft()
                if silence is None and self._quiet_start(u):
                    silence = self._take(u, h)  # hearing it says nothing: no need to wait for its instant
                    if silence is not None:
                        await self._endpoint(u, h, silence)
                elif silence is None:
                    if h.at > now_ns():
                        await sleep_until_ns(h.at)
                    await self._hear(u, h)
                else:  # taken when the message came: its silence is left
                    await self._endpoint(u, h, silence)
                if h.word.last_word and not u.queue:
                    return
        finally:
            u.listening = False

    def _quiet_start(self, u: Utterance) -> bool:
        """Would hearing a next word publish nothing before its silence (no premature endpoint to withdraw,
        no partial anyone receives)? Then it is taken without waiting for its instant (:meth:`_arrive`,
        :meth:`_listen`)."""
        if u.finalised:
            return False
        if u.partials < len(u.words):
            if self.wanted("asr/partial"):
                return False
            u.partials = len(u.words)  # what _partial does when no one would receive it
        return True

    async def _hear(self, u: Utterance, h: Heard) -> None:
        """One word on media time: its audio, then the silence after it (``gap_after_ns``), decide whether
        that silence ends the turn. Timing follows arrival (a late word is heard late: tax); the decisions
        follow the media timeline alone (a late word never turns a pause into an endpoint)."""
        if u.finalised:
            # the user kept talking after we endpointed: that endpoint was premature
            await self.publish(
                self.reply(u.env, Cancel(segment=u.segment, reason=CancelReason.USER_RESUMED), [])
            )
            u.segment += 1
            u.finalised = False
        if u.partials < len(u.words):  # the previous word ended just as this one began
            await self._partial(u)
        silence = self._take(u, h)
        if silence is not None:
            await self._endpoint(u, h, silence)

    def _take(self, u: Utterance, h: Heard) -> Silence | None:
        """The word joins the utterance; what its silence will decide, or None when it decides nothing: no
        endpoint, no eager partial, no partial anyone would receive (the word is then recognised at once:
        no sleep to wait its audio out). The words cannot change meanwhile: one listener hears them."""
        p = h.word
        if p.pause_before:
            u.pauses_seen += 1
        u.words.append(p.text)
        # the silence clock starts when this word's audio ends, not when it began arriving (heard from its
        # arrival, or from when the word before it ends, if that is later: the scheduled end, so a listener
        # that wakes late does not push every later word back; lateness stays tax, never accumulates)
        speech_end = max(h.at, u.heard_until) + p.dur_ns
        u.heard_until = speech_end
        gap = NEVER if p.gap_after_ns is None else p.gap_after_ns
        n_words = len(u.words)
        pre = self.cfg.router.preemptive
        if (
            gap < self._shortest_wait
            and not (pre.enabled and gap >= round(pre.stable_ms * 1e6))
            and not (u.partials < n_words and self.wanted("asr/partial"))
        ):  # too short to end the turn or to make it stable, whatever the words say: nothing to decide
            u.partials = n_words
            return None
        text = " ".join(u.words)
        wait_ms, infer_ms = endpoint_wait_ms(self.cfg.asr, text, self._annotation(u, p))
        wait, infer = round(wait_ms * 1e6), round(infer_ms * 1e6)
        stable = round(pre.stable_ms * 1e6)
        eager = pre.enabled and stable < wait + infer and gap >= stable
        if gap < wait + infer and not eager and not (u.partials < n_words and self.wanted("asr/partial")):
            u.partials = n_words
            return None
        return Silence(speech_end, gap, text, n_words, wait, infer, stable, eager)

    def _annotation(self, u: Utterance, word: UserWord) -> bool | None:
        """Scenario's smart-turn label for a pause after this word (True at the utterance's last word)."""
        if word.last_word:
            return True
        if u.pauses_seen < len(u.complete_at_pauses):
            return u.complete_at_pauses[u.pauses_seen]
        return False

    async def _partial(self, u: Utterance) -> None:
        u.partials = len(u.words)
        if not self.wanted("asr/partial"):
            return  # nobody could receive it (in-memory bus, no subscriber): not built, not sent
        payload = Partial(text=" ".join(u.words), words=len(u.words), segment=u.segment)
        await self.publish(self.reply(u.env, payload, []), qos=0)

    async def _endpoint(self, u: Utterance, h: Heard, si: Silence) -> None:
        speech_end, gap, wait, infer = si.speech_end, si.gap, si.wait, si.infer
        await sleep_until_ns(speech_end)
        env = u.env
        if u.partials < si.words:
            await self._partial(u)  # the word is recognised once its audio has ended
        if si.eager:
            # eager end of turn: the transcript has been stable (silence) for stable_ms
            await sleep_until_ns(speech_end + si.stable)
            if self.wanted("asr/partial"):
                payload = Partial(text=si.text, words=si.words, segment=u.segment, eager=True)
                await self.publish(self.reply(env, payload, []), qos=0)
        if gap < wait + infer:
            return  # the user speaks again before the silence ends the turn: no spans built, no draw made
        t = speech_end + wait + infer
        await sleep_until_ns(t)
        # endpointed: from here a new word means the user was not done
        u.finalised = True
        spans = [*h.spans(), modelled_span("asr", "endpoint wait", speech_end, wait)]
        if infer:
            spans.append(modelled_span("asr", "turn detector", speech_end + wait, infer))
        rng = rng_for(self.cfg.seed, env.session, env.turn, u.segment, "asr")
        fin = round(self.cfg.asr.finalize_ms.sample_ms(rng) * 1e6)
        if gap < wait + infer + fin:
            return  # the user resumed while the transcript was being finalised: it is never sent
        spans.append(modelled_span("asr", "finalise", t, fin))
        await sleep_until_ns(t + fin)
        await self.publish(self.reply(env, Final(text=si.text, words=si.words, segment=u.segment), spans))
