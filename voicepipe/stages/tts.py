"""TTS: aggregate reply text to the first speakable clause, then time-to-first-audio, then audio.

Text arrives in chunks. As soon as a clause is complete (punctuation after ``min_clause_words`` words,
or the reply's end) it is synthesised: the first clause after the modelled time to first audio, later
clauses streamed behind it. Audio leaves one message per clause with its duration at the speaking
rate, carrying the causal chain of the text that completed the first clause.
"""

from __future__ import annotations

import asyncio
import functools
import math
from dataclasses import dataclass, field
from typing import ClassVar

from voicepipe.clock import now_ns, rng_for, sleep_until_ns
from voicepipe.config import TTSConfig
from voicepipe.limits import MAX_SPEECH_MS
from voicepipe.messages import Cancel, CancelReason, Envelope, ReplyText, SpeechStart, audio
from voicepipe.spans import modelled_span
from voicepipe.stages.base import Stage
from voicepipe.text import audio_ms, first_clause_end


@functools.lru_cache(maxsize=64)
def longest_clause(words_per_minute: float) -> int:
    """The most words one audio chunk may hold: what the speaking rate says in MAX_SPEECH_MS (the bus
    guard's bound on a chunk, so the TTS's own audio never meets it, whatever text reaches it)."""
    n = max(1, math.floor(MAX_SPEECH_MS / 60_000.0 * words_per_minute))
    while n > 1 and n * 60_000.0 / words_per_minute > MAX_SPEECH_MS:
        n -= 1
    return n


def split_clauses(words: list[str], cfg: TTSConfig, final: bool) -> tuple[list[list[str]], list[str]]:
    """Complete clauses in ``words`` and the rest still waiting for more text (flushed when final). A
    run of words with no clause end is cut at :func:`longest_clause` (as a TTS engine caps its input)."""
    out: list[list[str]] = []
    rest = list(words)
    cap = longest_clause(cfg.words_per_minute)
    while rest:
        end = first_clause_end(rest, cfg.min_clause_words, sentence=cfg.aggregate == "sentence")
        if end is None or end > cap:
            if end is None and len(rest) < cap:
                break
            end = cap
        out.append(rest[:end])
        rest = rest[end:]
    if final and rest:
        out.append(rest)
        rest = []
    return out, rest


def first_audio_chunk(chunks: list[str], cfg: TTSConfig) -> int:
    """Index of the text chunk whose arrival completes the first speakable clause (the last at worst)."""
    words: list[str] = []
    for j, text in enumerate(chunks):
        words.extend(text.split())
        if split_clauses(words, cfg, final=j == len(chunks) - 1)[0]:
            return j
    return len(chunks) - 1


@dataclass
class Reply:
    pending: list[str] = field(default_factory=list)
    # (clause, the reply.text it came in, when that arrived, the reply's last clause)
    queue: asyncio.Queue[tuple[list[str], Envelope[ReplyText], int, bool]] = field(default_factory=asyncio.Queue)
    seq: int = 0


class TTS(Stage):
    name = "tts"
    # turn/script: to know the run's sessions and their turns (voicepipe.stages.guard), even on turns the
    # cache answers without any text to speak
    channels: ClassVar[tuple[str, ...]] = ("reply/text", "control/cancel", "user/speech_start", "turn/script")

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.replies: dict[str, dict[tuple[int, int], Reply]] = {}  # session -> (turn, segment) -> reply
        self.on(ReplyText, self.text)
        self.on(Cancel, self.cancelled)
        self.on(SpeechStart, self.barge_in)

    async def barge_in(self, env: Envelope[SpeechStart]) -> None:
        """The user talks over the reply: after VAD onset (modelled, or a real VAD's), stop speaking and cancel
        the turn's work."""
        self.spawn(env.session, ("barge-in", env.turn), self._stop(env))

    async def _stop(self, env: Envelope[SpeechStart]) -> None:
        if not env.payload.vad:  # a real VAD's onset (the real ASR's) was detected already
            await sleep_until_ns(now_ns() + round(self.cfg.tts.barge_in_detect_ms * 1e6))
        self.cancel(env.session, lambda k: k[0] == env.turn)
        replies = self.replies.get(env.session, {})
        for k in [k for k in replies if k[0] == env.turn]:
            del replies[k]
        await self.publish(self.reply(env, Cancel(reason=CancelReason.BARGE_IN), []))

    def forget(self, session: str) -> None:
        self.replies.pop(session, None)

    async def cancelled(self, env: Envelope[Cancel]) -> None:
        seg = env.payload.segment
        self.cancel(env.session, lambda k: k[0] == env.turn and (seg is None or k[1] == seg))
        replies = self.replies.get(env.session, {})
        for k in [k for k in replies if k[0] == env.turn]:
            if seg is None or k[1] == seg:
                del replies[k]

    async def text(self, env: Envelope[ReplyText]) -> None:
        arrived = now_ns()
        if self.is_dropped(env):
            return  # text for a segment the ASR withdrew (premature endpoint)
        p = env.payload
        seg = p.segment
        key = (env.session, env.turn, seg)
        replies = self.replies.setdefault(env.session, {})
        r = replies.get(key[1:])
        if r is None:
            if p.seq != 0:
                return  # tail of a reply we already dropped (cancelled)
            r = replies[key[1:]] = Reply()
            self.spawn(env.session, (env.turn, seg), self._speak(env, r, key))
        r.pending.extend(p.text.split())
        final = p.final
        clauses, r.pending = split_clauses(r.pending, self.cfg.tts, final)
        for i, clause in enumerate(clauses):
            r.queue.put_nowait((clause, env, arrived, final and i == len(clauses) - 1))

    async def _speak(self, first_env: Envelope[ReplyText], r: Reply, key: tuple[str, int, int]) -> None:
        cfg = self.cfg.tts
        rng = rng_for(self.cfg.seed, key[0], key[1], key[2], "tts")
        ttfb = round(cfg.ttfb_ms.sample_ms(rng) * 1e6)
        ready = 0
        try:
            while True:
                clause, env, arrived, last = await r.queue.get()
                if r.seq == 0:
                    spans = [
                        *env.spans,
                        modelled_span("tts", "time to first audio", arrived, ttfb),
                    ]
                    ready = arrived + ttfb
                else:
                    # later clauses stream behind the first; modelled as a fraction of the first latency
                    ready = max(ready, arrived) + ttfb // 4
                    spans = []
                await sleep_until_ns(ready)
                text = env.payload
                payload = audio(  # Audio(...) without validating values that are already of their types
                    seq=r.seq, text=" ".join(clause), duration_ms=audio_ms(clause, cfg.words_per_minute),
                    last=last, words=text.words, segment=key[2], meta=text.meta,
                )  # fmt: skip
                await self.publish(self.reply(env, payload, spans))
                r.seq += 1
                if last:
                    return
        finally:
            self.replies.get(key[0], {}).pop(key[1:], None)
