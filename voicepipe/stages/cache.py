"""Speculative response cache: answers predicted in advance, matched on partial and final transcripts.

Entries come from the config and the scenario (question variants -> answer, with pre-rendered audio:
no TTS at all when served) plus learned ones (answers the agents generated earlier; text only, LRU with
a capacity). A partial transcript that already matches a learned entry confidently starts rendering its
audio speculatively, so it is ready when the turn ends; if the final transcript then matches something
else, that render is wasted and counted. A miss forwards the turn to the router's fallback agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from voicepipe.clock import now_ns, rng_for, sleep_until_ns
from voicepipe.messages import (
    Audio,
    CacheAnswer,
    Envelope,
    Partial,
    Path,
    Route,
    Span,
    Target,
    TurnMeta,
    TurnScript,
)
from voicepipe.stages.base import Stage
from voicepipe.stages.tts import audio_ms
from voicepipe.strategy import LRU, best_match
from voicepipe.text import normalise


@dataclass
class Entry:
    answer: str
    prerendered: bool  # audio rendered ahead of time (config/scenario entries)


def prerendered(questions: list[str], answer: str) -> dict[str, Entry]:
    """A config/scenario entry (questions, answer) as question -> pre-rendered entry."""
    return {normalise(q): Entry(answer, prerendered=True) for q in questions}


@dataclass
class Speculation:
    answer: str
    ready_ns: int
    render_ms: float


@dataclass
class Stats:
    lookups: int = 0
    hits: int = 0
    false_hits: int = 0
    speculations: int = 0
    wasted_renders: int = 0
    wasted_render_ms: float = 0.0
    hit_ms: list[float] = field(default_factory=list)


class Cache(Stage):
    name = "cache"
    channels = ("turn/script", "asr/partial", "route", "control/cancel")

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        c = self.cfg.cache
        # question -> entry. Config entries and learned ones serve every session (a shared cache);
        # a scenario's own entries serve only that scenario's sessions
        self.fixed: dict[str, Entry] = {}
        self.per_session: dict[str, dict[str, Entry]] = {}
        self.learned: LRU[str, Entry] = LRU(c.capacity)
        for e in c.entries:
            self.fixed.update(prerendered(list(e.get("questions", [])), str(e.get("answer", ""))))
        self.spec: dict[str, dict[int, Speculation]] = {}  # session -> turn -> speculative render
        self.stats = Stats()
        self.on(Partial, self.partial)
        self.on(Route, self.route)

    def forget(self, session: str) -> None:
        self.per_session.pop(session, None)
        self.spec.pop(session, None)

    def lookup(self, session: str, text: str) -> tuple[float, Entry | None]:
        own = self.per_session.get(session, {})
        pairs = [*self.fixed.items(), *own.items(), *self.learned.items()]
        return best_match(text, pairs)

    async def on_script(self, env: Envelope[TurnScript]) -> None:
        entries: list[CacheAnswer] = env.payload.cache
        for e in entries:
            self.per_session.setdefault(env.session, {}).update(prerendered(e.questions, e.answer))

    async def partial(self, env: Envelope[Partial]) -> None:
        p = env.payload
        score, entry = self.lookup(env.session, p.text)
        if entry is None or entry.prerendered or score < self.cfg.cache.partial_threshold:
            return
        cur = self.spec.get(env.session, {}).get(env.turn)
        if cur and cur.answer == entry.answer:
            return
        rng = rng_for(self.cfg.seed, env.session, env.turn, "cache-render")
        render = self.cfg.tts.ttfb_ms.sample_ms(rng)
        if cur:
            self._wasted(cur)
        self.spec.setdefault(env.session, {})[env.turn] = Speculation(
            entry.answer, now_ns() + round(render * 1e6), render
        )
        self.stats.speculations += 1

    def _wasted(self, s: Speculation) -> None:
        self.stats.wasted_renders += 1
        self.stats.wasted_render_ms += s.render_ms

    def _learn(self, env: Envelope[Route]) -> None:
        """An agent or the council answers this turn: once the turn is over (and was not withdrawn), the
        question and its (scripted) answer become a learned entry."""
        script = self.script_of(env)
        question, answer = env.payload.text, " ".join(script.reply.split()) if script else ""
        if question and answer:
            self.after_turn(
                env, lambda: self.learned.put(normalise(question), Entry(answer, prerendered=False))
            )

    async def route(self, env: Envelope[Route]) -> None:
        p = env.payload
        if self.is_dropped(env) or p.hold:
            return
        if p.target == Target.CACHE:
            self.spawn(env.session, (env.turn, "lookup"), self._serve(env, p))
        elif self.cfg.cache.learn and p.target in (Target.AGENT, Target.COUNCIL, Target.COMMIT):
            self._learn(env)

    async def _serve(self, env: Envelope[Route], p: Route) -> None:
        cfg = self.cfg.cache
        t0 = now_ns()
        text = p.text
        lookup = round(cfg.lookup_ms * 1e6)
        spans = [*env.spans, Span(stage="cache", what="lookup", start_ns=t0, dur_ns=lookup)]
        self.stats.lookups += 1
        score, entry = self.lookup(env.session, text)
        spec = self.spec.get(env.session, {}).pop(env.turn, None)
        await sleep_until_ns(t0 + lookup)
        if entry is None or score < cfg.threshold:
            if spec:
                self._wasted(spec)
            fb = p.fallback or "agent"
            council = fb == "council"
            miss = p.model_copy(update={
                "target": Target.COUNCIL if council else Target.AGENT,
                "agent": None if council else (fb.split(":", 1)[1] if ":" in fb else self.cfg.agent.name),
                "path": Path.COUNCIL if council else Path.AGENT, "route": f"{p.route} (cache miss)", "fallback": None,
            })  # fmt: skip
            await self.publish(self.reply(env, miss, spans))
            return
        ready = t0 + lookup
        if not entry.prerendered:
            if spec and spec.answer == entry.answer:  # speculated on a partial: (nearly) ready now
                if spec.ready_ns > ready:
                    spans.append(Span(stage="cache", what="render (speculative)", start_ns=ready,
                                      dur_ns=spec.ready_ns - ready))  # fmt: skip
                    ready = spec.ready_ns
            else:
                if spec:
                    self._wasted(spec)
                rng = rng_for(self.cfg.seed, env.session, env.turn, "cache-render")
                d = round(self.cfg.tts.ttfb_ms.sample_ms(rng) * 1e6)
                spans.append(Span(stage="tts", what="time to first audio", start_ns=ready, dur_ns=d))
                ready += d
        elif spec:
            self._wasted(spec)
        await sleep_until_ns(ready)
        script = self.script_of(env)
        expected = script.reply if script else None
        false_hit = expected is not None and normalise(expected) != normalise(entry.answer)
        self.stats.hits += 1
        self.stats.false_hits += int(false_hit)
        self.stats.hit_ms.append((ready - t0) / 1e6)
        words = entry.answer.split()
        meta = TurnMeta(
            backend="cache", path=Path.CACHE, route=p.route, cost_usd=0.0, quality=0.0 if false_hit else 1.0,
            false_hit=false_hit, prerendered=entry.prerendered,
        )  # fmt: skip
        audio = Audio(
            seq=0, text=entry.answer, duration_ms=audio_ms(words, self.cfg.tts.words_per_minute), last=True,
            words=p.words, segment=p.segment, meta=meta,
        )  # fmt: skip
        await self.publish(self.reply(env, audio, spans))
