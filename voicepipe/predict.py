"""The analytic answer: every turn's modelled latency and breakdown, without running anything.

The predictor lays out, on a virtual clock that starts at the end of the user's speech, the same chain
of modelled spans the live stages produce — same word timings, endpointing rule, random draws (keyed by
seed, session, turn, segment and stage through :func:`voicepipe.clock.rng_for`), routes, backend timings,
chunking and clause aggregation — with zero bus hops, and measures it with the same
:func:`voicepipe.measure.measure`. So a live run's ``predicted_ms`` equals ``predict``'s for the same turn
and seed wherever the chain is sequential (the agent and cache paths, councils, one session per device);
with preemptive generation the LLM's spans overlap the ASR's and bus hops shift the overlap, so there
the two agree only to within the hops. What it cannot see: queueing between sessions on a shared device,
and work for premature segments that the live run cancels at a timing-dependent moment.

:func:`predict_grid` evaluates many configurations over the same turns with numpy: the config-independent
parts (words, pauses, draws, token counts) are planned once per turn, the per-config sums are array
arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from voicepipe.backends import BackendPool
from voicepipe.backends.base import Backend, LLMRequest, ScheduledStream
from voicepipe.clock import rng_for
from voicepipe.config import Z90, Dist, PipelineConfig
from voicepipe.measure import measure
from voicepipe.messages import Span
from voicepipe.records import BreakdownPart, TurnRecord
from voicepipe.scenario import Scenario, Turn, session_id
from voicepipe.stages.agent import chunk_ends, prompt_tokens, request_cost
from voicepipe.stages.asr import endpoint_wait_ms
from voicepipe.stages.council import first_clause_token
from voicepipe.stages.router import decide
from voicepipe.stages.tts import first_audio_chunk
from voicepipe.strategy import LRU, best_match, council_quality
from voicepipe.text import count_tokens, normalise, plain, speak, tokens_of

MS = 1_000_000  # ns per ms


@dataclass
class TurnPrediction:
    scenario: str
    session: str
    turn: int
    user_text: str
    path: str
    route: str
    backend: str
    predicted_ms: float
    budget_ms: float
    breakdown: list[BreakdownPart]
    cost_usd: float = 0.0
    quality: float | None = None
    premature_endpoint: bool = False
    exact: bool = True  # False where live timing can differ by bus hops (overlapping spans)

    @property
    def within_budget(self) -> bool:
        return self.predicted_ms <= self.budget_ms

    def as_record(self, label: str = "") -> TurnRecord:
        """A turn record whose latency is the prediction (``measured_ms`` = ``predicted_ms``, tax 0), so the
        summaries and tables that read records can show predictions; never written as a measurement."""
        return TurnRecord(
            run="predict", label=label, scenario=self.scenario, session=self.session, turn=self.turn,
            user_text=self.user_text, backend=self.backend, measured_ms=self.predicted_ms,
            predicted_ms=self.predicted_ms, tax_ms=0.0, budget_ms=self.budget_ms, within_budget=self.within_budget,
            breakdown=self.breakdown, path=self.path, route=self.route, cost_usd=self.cost_usd, quality=self.quality,
            premature_endpoint=self.premature_endpoint,
        )  # fmt: skip

    def to_json(self) -> dict:
        return {
            "scenario": self.scenario, "session": self.session, "turn": self.turn, "user_text": self.user_text,
            "predicted_ms": self.predicted_ms, "budget_ms": self.budget_ms, "within_budget": self.within_budget,
            "breakdown": [p.model_dump() for p in self.breakdown], "backend": self.backend, "path": self.path,
            "route": self.route, "cost_usd": self.cost_usd, "quality": self.quality,
            "premature_endpoint": self.premature_endpoint, "exact": self.exact, "modelled": True,
        }  # fmt: skip


@dataclass
class Utterance:
    """Config-light facts of a spoken turn: word timings and where the ASR will endpoint."""

    text: str
    segment: int  # index of the final segment (= number of premature endpoints)
    early_final: bool  # a premature segment's final transcript was published (the router saw it)
    eager_words: list[int]  # word indices after which an eager end-of-turn fires (preemptive)
    last_end_ms: float  # end of speech, from the utterance's start
    word_ends_ms: list[float]
    final_wait_ms: float
    final_infer_ms: float


def utterance(cfg: PipelineConfig, turn: Turn, session: str = "", k: int = 0) -> Utterance:
    """Replays the ASR's endpointing over the scripted word timings (mirrors stages/asr.py).

    A pause longer than the endpoint wait ends a segment early (premature); the router only hears of it
    if the pause also outlasts that segment's finalisation, when the ASR publishes its final.
    """
    words = speak(turn.user, turn.words_per_minute or cfg.client.words_per_minute)
    texts = [w.text for w in words]
    pauses_seen = 0
    segment = 0
    early_final = False
    eager: list[int] = []
    prev_end = 0.0
    pre = cfg.router.preemptive
    wait = infer = 0.0
    for i, w in enumerate(words):
        if w.start_ms - prev_end > 1.0:
            pauses_seen += 1
        prev_end = w.end_ms
        last = i == len(words) - 1
        if last:
            annotated: bool | None = True
        elif pauses_seen < len(turn.complete_at_pauses):
            annotated = turn.complete_at_pauses[pauses_seen]
        else:
            annotated = False
        text = " ".join(texts[: i + 1])
        wait, infer = endpoint_wait_ms(cfg.asr, text, annotated)
        gap = math.inf if last else words[i + 1].start_ms - w.end_ms
        if pre.enabled and pre.stable_ms < wait + infer and gap > pre.stable_ms:
            eager.append(i)
        if gap > wait + infer and not last:
            fin = cfg.asr.finalize_ms.sample_ms(rng_for(cfg.seed, session, k, segment, "asr"))
            early_final = early_final or gap > wait + infer + fin
            segment += 1
    return Utterance(
        text=" ".join(texts),
        segment=segment,
        early_final=early_final,
        eager_words=eager,
        last_end_ms=words[-1].end_ms,
        word_ends_ms=[w.end_ms for w in words],
        final_wait_ms=wait,
        final_infer_ms=infer,
    )


@dataclass
class _SessionState:
    agent_history: int = 0
    council_history: int = 0
    learned: LRU[str, str] = field(default_factory=lambda: LRU(0))


class Predictor:
    """Predicts the turns of scenarios under one config (backends built once, shared across turns)."""

    def __init__(self, cfg: PipelineConfig, pool: BackendPool | None = None) -> None:
        self.cfg = cfg
        self.pool = pool or BackendPool()
        self.agents = {n: self.pool.get(spec) for n, spec in cfg.agent.backends().items()}
        self.members = [self.pool.get(spec) for spec in cfg.council.members]
        judge = cfg.council.judge
        self.judge = (
            self.pool.get(judge) if judge is not None else (self.members[0] if self.members else None)
        )

    def scenario(self, scenario: Scenario, session_index: int = 0) -> list[TurnPrediction]:
        cfg = self.cfg
        sid = session_id(scenario, session_index)
        st = _SessionState(learned=LRU(cfg.cache.capacity))
        fixed = {normalise(q): e.get("answer", "") for e in cfg.cache.entries for q in e.get("questions", [])}
        for e in scenario.cache:
            fixed.update({normalise(q): e.answer for q in e.questions})
        return [self._turn(scenario, sid, k, t, st, fixed) for k, t in enumerate(scenario.turns)]

    # -- one turn ------------------------------------------------------------------------------------
    def _turn(
        self, sc: Scenario, sid: str, k: int, turn: Turn, st: _SessionState, fixed: dict[str, str]
    ) -> TurnPrediction:
        cfg = self.cfg
        u = utterance(cfg, turn, sid, k)
        seed = cfg.seed
        up, down = round(cfg.transport.uplink_ms * MS), round(cfg.transport.downlink_ms * MS)
        spans = [Span(stage="transport", what="uplink", start_ns=0, dur_ns=up)]
        t = up
        wait, infer = round(u.final_wait_ms * MS), round(u.final_infer_ms * MS)
        spans.append(Span(stage="asr", what="endpoint wait", start_ns=t, dur_ns=wait))
        t += wait
        if infer:
            spans.append(Span(stage="asr", what="turn detector", start_ns=t, dur_ns=infer))
            t += infer
        fin = round(cfg.asr.finalize_ms.sample_ms(rng_for(seed, sid, k, u.segment, "asr")) * 1e6)
        spans.append(Span(stage="asr", what="finalise", start_ns=t, dur_ns=fin))
        t += fin
        text = u.text
        script = {"intent": turn.intent, "complexity": turn.complexity}
        out = TurnPrediction(
            scenario=sc.name, session=sid, turn=k, user_text=plain(turn.user), path="agent", route="single",
            backend=cfg.backend_label(), predicted_ms=0.0, budget_ms=cfg.budget_ms, breakdown=[],
            premature_endpoint=u.segment > 0,
        )  # fmt: skip
        reply_tokens = tokens_of(turn.reply)
        committed = self._preemptive_commit(u)
        if committed:
            eager_ns = round((u.word_ends_ms[u.eager_words[-1]] - u.last_end_ms) * MS) + up
            eager_ns += round(cfg.router.preemptive.stable_ms * MS)
            out.path, out.route, out.exact = "preemptive", "preemptive", False
            t = self._agent(
                out, spans, sid, k, u, cfg.main_agent, reply_tokens, st, start=eager_ns, release=t
            )
            return self._finish(out, spans, t, sid, k, u, down)
        if cfg.router.policy == "classifier" and cfg.router.classifier_ms > 0:
            d = round(cfg.router.classifier_ms * MS)
            spans.append(Span(stage="router", what="classifier", start_ns=t, dur_ns=d))
            t += d
        dest, out.route = decide(cfg.router, text, script, cfg.main_agent)
        fallback = dest if not dest.startswith("cache") else cfg.router.default
        if dest == "cache" or (cfg.router.cache_first and cfg.cache.enabled):
            if fallback == "cache":
                fallback = f"agent:{cfg.main_agent}"
            served = self._cache(out, spans, t, sid, k, u, turn, st, fixed)
            if served is not None:
                return self._finish(out, spans, served, sid, k, u, down, tts_done=True)
            t += round(cfg.cache.lookup_ms * MS)
            out.route += " (cache miss)"
            dest = fallback
        if dest == "council":
            out.path = "council"
            t = self._council(out, spans, t, sid, k, u, reply_tokens, st)
        else:
            name = dest.split(":", 1)[1] if ":" in dest else cfg.agent.name
            t = self._agent(out, spans, sid, k, u, name, reply_tokens, st, start=t, release=t)
        return self._finish(out, spans, t, sid, k, u, down)

    def _preemptive_commit(self, u: Utterance) -> bool:
        """Mirrors the router: the last eager end of turn is on the full utterance, within max tries,
        and no premature final ended preemption for the turn."""
        pre = self.cfg.router.preemptive
        if not pre.enabled or u.early_final or not u.eager_words:
            return False
        n = len(u.word_ends_ms)
        return u.eager_words[-1] == n - 1 and len(u.eager_words) <= pre.max_tries

    def _first_audio_token(self, tokens: list[str]) -> int:
        return self._first_audio_token_of(tokens, self.cfg)

    @staticmethod
    def _first_audio_token_of(tokens: list[str], cfg: PipelineConfig) -> int:
        """The token whose chunk completes TTS's first clause: the LLM time on the first-audio path."""
        ends = chunk_ends(tokens, cfg.agent.chunk_tokens)
        chunks, start = [], 0
        for e in ends:
            chunks.append("".join(tokens[start : e + 1]))
            start = e + 1
        return ends[first_audio_chunk(chunks, cfg.tts)]

    def _agent(
        self, out: TurnPrediction, spans: list[Span], sid: str, k: int, u: Utterance, name: str,
        tokens: list[str], st: _SessionState, *, start: int, release: int,
    ) -> int:  # fmt: skip
        """Agent spans from ``start``; text is released (committed) no earlier than ``release``."""
        cfg = self.cfg
        backend = self.agents[name]
        prompt, cached = prompt_tokens(cfg.agent.prompt_tokens, st.agent_history, u.text)
        timing = backend.predict(
            LLMRequest(sid, k, prompt, len(tokens), cached),
            rng_for(cfg.seed, sid, k, u.segment, "agent", name),
        )
        c = self._first_audio_token(tokens)
        stream = ScheduledStream(timing, start)
        spans.extend(stream.spans(c))
        st.agent_history += count_tokens(u.text) + len(tokens)
        self._learn(st, u, tokens)
        out.backend, out.quality = backend.name, backend.quality
        out.cost_usd = request_cost(backend, prompt, cached, len(tokens))
        return max(stream.at_ns(c), release)

    def _learn(self, st: _SessionState, u: Utterance, tokens: list[str]) -> None:
        """Generated answers become cache entries (when the cache learns), as stages/cache.py does."""
        if self.cfg.cache.learn:
            st.learned.put(normalise(u.text), "".join(tokens).strip())

    def _council(
        self, out: TurnPrediction, spans: list[Span], t0: int, sid: str, k: int, u: Utterance,
        tokens: list[str], st: _SessionState,
    ) -> int:  # fmt: skip
        cfg, c = self.cfg, self.cfg.council
        prompt, cached = prompt_tokens(cfg.agent.prompt_tokens, st.council_history, u.text)
        timings = [
            b.predict(LLMRequest(sid, k, prompt, len(tokens), cached), rng_for(cfg.seed, sid, k, u.segment, "council", i))
            for i, b in enumerate(self.members)
        ]  # fmt: skip
        deadline = c.deadline_ms / 1e3
        n = len(tokens)
        cost = 0.0
        if c.aggregation in ("first", "draft-refine"):
            race = first_clause_token(tokens, cfg.tts.min_clause_words)
            done = sorted(
                (tm.token_s(race), i) for i, tm in enumerate(timings) if tm.token_s(race) <= deadline
            )
            kk = 1
            order = [i for _, i in done[:1]]
        else:
            done = sorted(
                (tm.token_s(n - 1), i) for i, tm in enumerate(timings) if tm.token_s(n - 1) <= deadline
            )
            kk = c.k if c.aggregation == "vote" else len(timings)
            order = [i for _, i in done[:kk]]
        if not order:
            raise ValueError("no council member answers before the deadline")
        chosen = order[-1]
        c_tok = self._first_audio_token(tokens)
        end = t0
        if c.aggregation == "judge" and self.judge is not None:
            tj = t0 + round(timings[chosen].token_s(n - 1) * 1e9)
            answers = n * len(order)
            jt = self.judge.predict(
                LLMRequest(sid, k, prompt + answers, n, cached),
                rng_for(cfg.seed, sid, k, u.segment, "council", 99),
            )
            spans.append(Span(stage="council", what="judge wait", start_ns=t0, dur_ns=tj - t0))
            stream = ScheduledStream(jt, tj)
            spans.extend(stream.spans(c_tok))
            end = stream.at_ns(c_tok)
            cost += request_cost(self.judge, prompt + answers, cached, n)
        else:
            stream = ScheduledStream(timings[chosen], t0)
            if c.aggregation == "vote":
                vote_end = stream.at_ns(n - 1)
                spans.append(Span(stage="council", what="vote wait", start_ns=t0, dur_ns=vote_end - t0))
                end = vote_end
            spans.extend(stream.spans(c_tok))
            end = max(end, stream.at_ns(c_tok))
        # as the live council bills: answers that counted in full, the others for what they had made when
        # the council stopped waiting (the race decided, the vote complete, or the deadline)
        decided_s = done[kk - 1][0] if len(order) == kk else deadline
        counted = set(order) if c.aggregation in ("vote", "judge") else {chosen}
        for i, (b, tm) in enumerate(zip(self.members, timings, strict=True)):
            made = n if i in counted else sum(1 for j in range(n) if tm.token_s(j) <= decided_s)
            cost += request_cost(b, prompt, cached, made)
        if c.aggregation == "draft-refine" and self.judge is not None:
            cost += request_cost(self.judge, prompt + n, cached, n)
        st.council_history += count_tokens(u.text) + n
        self._learn(st, u, tokens)
        out.backend = f"council:{c.aggregation}"
        out.quality = council_quality(c.aggregation, [self.members[i].quality for i in order], c.judge_gain)
        out.cost_usd = cost
        return end

    def _cache(
        self, out: TurnPrediction, spans: list[Span], t0: int, sid: str, k: int, u: Utterance, turn: Turn,
        st: _SessionState, fixed: dict[str, str],
    ) -> int | None:  # fmt: skip
        """Cache lookup from ``t0``; returns when its audio is ready, or None on a miss."""
        cfg = self.cfg
        pairs = [(q, (a, True)) for q, a in fixed.items()] + [(q, (a, False)) for q, a in st.learned.items()]
        lookup = round(cfg.cache.lookup_ms * MS)
        spans.append(Span(stage="cache", what="lookup", start_ns=t0, dur_ns=lookup))
        score, hit = best_match(u.text, pairs)
        if hit is None or score < cfg.cache.threshold:
            return None
        answer, prerendered = hit
        ready = t0 + lookup
        if not prerendered:
            render = round(cfg.tts.ttfb_ms.sample_ms(rng_for(cfg.seed, sid, k, "cache-render")) * 1e6)
            spec = self._speculation(u, pairs, render)
            out.exact = False if spec is not None else out.exact
            if spec is not None and spec[0] == answer:
                if spec[1] > ready:
                    spans.append(
                        Span(
                            stage="cache", what="render (speculative)", start_ns=ready, dur_ns=spec[1] - ready
                        )
                    )
                    ready = spec[1]
            else:
                spans.append(Span(stage="tts", what="time to first audio", start_ns=ready, dur_ns=render))
                ready += render
        out.path, out.backend, out.cost_usd = "cache", "cache", 0.0
        out.quality = 1.0 if normalise(answer) == normalise(turn.reply) else 0.0
        return ready

    def _speculation(self, u: Utterance, pairs: list, render: int) -> tuple[str, int] | None:
        """The cache's speculative render on partials (mirrors stages/cache.py, zero hops)."""
        cur: tuple[str, int] | None = None
        words = u.text.split()
        up = round(self.cfg.transport.uplink_ms * MS)
        for i, end in enumerate(u.word_ends_ms):
            score, hit = best_match(" ".join(words[: i + 1]), pairs)
            if hit is None or hit[1] or score < self.cfg.cache.partial_threshold:
                continue
            if cur is None or cur[0] != hit[0]:
                cur = (hit[0], round((end - u.last_end_ms) * MS) + up + render)
        return cur

    def _finish(
        self, out: TurnPrediction, spans: list[Span], t: int, sid: str, k: int, u: Utterance, down: int,
        tts_done: bool = False,
    ) -> TurnPrediction:  # fmt: skip
        if not tts_done:
            ttfb = round(
                self.cfg.tts.ttfb_ms.sample_ms(rng_for(self.cfg.seed, sid, k, u.segment, "tts")) * 1e6
            )
            spans.append(Span(stage="tts", what="time to first audio", start_ns=t, dur_ns=ttfb))
            t += ttfb
        spans.append(Span(stage="transport", what="downlink", start_ns=t, dur_ns=down))
        m = measure(spans, 0, t + down)
        out.predicted_ms = m.predicted_ns / 1e6
        out.breakdown = m.parts
        return out


def predict(cfg: PipelineConfig, scenarios: Sequence[Scenario], sessions: int = 1) -> list[TurnPrediction]:
    p = Predictor(cfg)
    return [tp for sc in scenarios for i in range(sessions) for tp in p.scenario(sc, i)]


# -- many configurations at once ---------------------------------------------------------------------
@cache
def _z(seed: int, *keys: object) -> float:
    """The first standard normal a stage draws for ``keys`` (what Dist.sample_ms and profiles use)."""
    return float(rng_for(seed, *keys).standard_normal())


def _dist_ms(d: Dist, z: np.ndarray) -> np.ndarray:
    if d.median == 0 or d.p90 == d.median:
        return np.full_like(z, d.median)
    return d.median * np.exp(np.log(d.p90 / d.median) / Z90 * z)


def predict_grid(configs: Sequence[PipelineConfig], scenario: Scenario) -> np.ndarray:
    """Predicted ms, shape (configs, turns), vectorised over turns.

    What does not depend on the varied fields is computed once and reused across the grid: token counts
    and history, the endpointing replay per ASR setting, the first-audio token per chunking/TTS setting,
    draws per key, and LLM timings per (backend, turn, prompt). Each config then costs a few array
    operations. Single-agent configs take this path; configs that need the full chain (cache, council,
    preemptive, classifier or rules routes) fall back to :class:`Predictor` (same numbers, slower).
    """
    pool = BackendPool()
    out = np.empty((len(configs), len(scenario.turns)))
    sid = session_id(scenario, 0)
    turns = scenario.turns
    texts = [plain(t.user) for t in turns]
    tokens = [tokens_of(t.reply) for t in turns]
    user_tok = [count_tokens(x) for x in texts]
    history = np.concatenate([[0], np.cumsum([u + len(r) for u, r in zip(user_tok, tokens, strict=True)])])[
        :-1
    ]
    utt_cache: dict[str, list[Utterance]] = {}
    first_cache: dict[str, list[int]] = {}
    timing_cache: dict[tuple, float] = {}
    for ci, cfg in enumerate(configs):
        simple = (
            cfg.router.policy == "single" and not cfg.router.cache_first and not cfg.router.preemptive.enabled
        )
        if not simple:
            out[ci] = [tp.predicted_ms for tp in Predictor(cfg, pool).scenario(scenario)]
            continue
        ukey = cfg.asr.model_dump_json() + cfg.client.model_dump_json() + str(cfg.seed)
        if ukey not in utt_cache:
            utt_cache[ukey] = [utterance(cfg, t, sid, k) for k, t in enumerate(turns)]
        utts = utt_cache[ukey]
        fkey = cfg.tts.model_dump_json(include={"aggregate", "min_clause_words"}) + str(
            cfg.agent.chunk_tokens
        )
        if fkey not in first_cache:
            first_cache[fkey] = [Predictor._first_audio_token_of(toks, cfg) for toks in tokens]
        first = first_cache[fkey]
        segs = [u.segment for u in utts]
        z_asr = np.array([_z(cfg.seed, sid, k, s, "asr") for k, s in enumerate(segs)])
        z_tts = np.array([_z(cfg.seed, sid, k, s, "tts") for k, s in enumerate(segs)])
        wait = np.array([u.final_wait_ms + u.final_infer_ms for u in utts])
        name = cfg.main_agent
        backend: Backend = pool.get(cfg.agent.backends()[name])
        llm = np.empty(len(utts))
        for k, seg in enumerate(segs):
            prompt = cfg.agent.prompt_tokens + int(history[k]) + user_tok[k]
            cached = cfg.agent.prompt_tokens + int(history[k])
            key = (backend.name, cfg.seed, k, seg, name, prompt, cached, len(tokens[k]), first[k])
            if key not in timing_cache:
                tm = backend.predict(
                    LLMRequest(sid, k, prompt, len(tokens[k]), cached),
                    rng_for(cfg.seed, sid, k, seg, "agent", name),
                )
                timing_cache[key] = tm.token_s(first[k]) * 1e3
            llm[k] = timing_cache[key]
        out[ci] = (
            cfg.transport.uplink_ms + wait + _dist_ms(cfg.asr.finalize_ms, z_asr) + llm
            + _dist_ms(cfg.tts.ttfb_ms, z_tts) + cfg.transport.downlink_ms
        )  # fmt: skip
    return out
