"""Router: picks who serves the turn — cache, one agent, or the council — and may start early.

Policies: ``single`` (every turn to one agent), ``rules`` (first matching rule on intent, complexity
hint, keywords or length), ``classifier`` (a small built-in complexity classifier whose modelled latency
is a span on the chain). ``cache_first`` tries the speculative cache before any agent route (a miss
falls through from the cache stage). Preemptive generation starts the agent on a partial transcript
that has been stable for ``stable_ms``; at the final transcript the attempt is committed if the words
match (ignoring case and punctuation), else cancelled — its tokens are wasted work.
"""

from __future__ import annotations

from dataclasses import dataclass

from voicepipe.clock import now_ns, sleep_until_ns
from voicepipe.config import PipelineConfig, RouterConfig, RuleWhen
from voicepipe.messages import (
    Cancel,
    CancelReason,
    Envelope,
    Final,
    Partial,
    Path,
    Route,
    Span,
    Target,
    TurnScript,
)
from voicepipe.stages.base import Stage
from voicepipe.strategy import same_utterance
from voicepipe.text import normalise

QUESTION_WORDS = {"why", "how", "explain", "compare", "difference", "should", "could", "would"}


def rule_matches(when: RuleWhen, text: str, script: TurnScript | None) -> bool:
    words = normalise(text).split()
    if when.intent is not None and (script.intent if script else None) not in when.intent:
        return False
    if when.complexity is not None and (script.complexity if script else None) not in when.complexity:
        return False
    if when.keywords is not None and not set(map(str.lower, when.keywords)) & set(words):
        return False
    if when.max_words is not None and len(words) > when.max_words:
        return False
    return not (when.min_words is not None and len(words) < when.min_words)


def classify(text: str) -> str:
    """Built-in complexity classifier (a text heuristic standing in for a small model): low or high."""
    words = normalise(text).split()
    if len(words) > 14 or (set(words) & QUESTION_WORDS and len(words) > 6) or text.count(",") >= 2:
        return "high"
    return "low"


def decide(cfg: RouterConfig, text: str, script: TurnScript | None, main_agent: str) -> tuple[str, str]:
    """(destination, route name) for a final transcript. Destination: cache | council | agent[:NAME]."""
    if cfg.policy == "rules":
        for i, rule in enumerate(cfg.rules):
            if rule_matches(rule.when, text, script):
                return rule.to, f"rule {i}"
        return cfg.default, "rules default"
    if cfg.policy == "classifier":
        label = classify(text)
        return (cfg.classifier_low if label == "low" else cfg.default), f"classifier:{label}"
    return f"agent:{main_agent}", "single"


@dataclass
class Attempt:
    n: int
    text: str


@dataclass
class TurnState:
    turn: int
    tries: int = 0
    attempt: Attempt | None = None
    final_seen: bool = False


class Router(Stage):
    name = "router"
    channels = ("asr/final", "asr/partial", "turn/script")

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.turns: dict[str, TurnState] = {}
        self.on(Final, self.final)
        self.on(Partial, self.partial)

    @classmethod
    def channels_for(cls, cfg: PipelineConfig) -> tuple[str, ...]:
        """Partials matter only to preemptive generation (eager ones): without it the router does not
        subscribe to them (they are most of a turn's messages; the cache, when on, still gets them)."""
        if cfg.router.preemptive.enabled:
            return cls.channels
        return tuple(ch for ch in cls.channels if ch != "asr/partial")

    def forget(self, session: str) -> None:
        self.turns.pop(session, None)

    def _state(self, env: Envelope) -> TurnState:
        st = self.turns.get(env.session)
        if st is None or st.turn != env.turn:
            st = self.turns[env.session] = TurnState(turn=env.turn)
        return st

    def _agent_name(self, dest: str) -> str:
        return dest.split(":", 1)[1] if ":" in dest else self.cfg.agent.name

    # -- preemptive generation ---------------------------------------------------------------------
    async def partial(self, env: Envelope[Partial]) -> None:
        """Start (or restart) the agent on an eager end-of-turn: a partial stable through a short silence."""
        pre = self.cfg.router.preemptive
        p = env.payload
        if not pre.enabled or not p.eager:
            return
        st = self._state(env)
        text = p.text
        if (
            st.final_seen
            or st.tries >= pre.max_tries
            or (st.attempt and same_utterance(st.attempt.text, text))
        ):
            return
        if st.attempt:
            await self._cancel_attempt(env, st)
        st.tries += 1
        st.attempt = Attempt(n=st.tries, text=text)
        payload = Route(
            target=Target.AGENT,
            agent=self.cfg.main_agent,
            path=Path.PREEMPTIVE,
            route="preemptive",
            text=text,
            words=p.words,
            segment=p.segment,
            attempt=st.attempt.n,
            hold=True,
        )
        await self.publish(self.reply(env, payload, []))

    async def _cancel_attempt(self, env: Envelope, st: TurnState) -> None:
        assert st.attempt is not None
        await self.publish(
            self.reply(env, Cancel(attempt=st.attempt.n, reason=CancelReason.PREEMPTIVE_MISMATCH), [])
        )
        st.attempt = None

    # -- the final transcript ------------------------------------------------------------------------
    async def final(self, env: Envelope[Final]) -> None:
        p = env.payload
        text = p.text
        st = self._state(env)
        st.final_seen = True
        if st.attempt is not None:
            if same_utterance(st.attempt.text, text):
                commit = Route(
                    target=Target.COMMIT, text=text, words=p.words, segment=p.segment,
                    attempt=st.attempt.n, path=Path.PREEMPTIVE, route="preemptive",
                )  # fmt: skip
                st.attempt = None
                await self.publish(self.reply(env, commit, list(env.spans)))
                return
            await self._cancel_attempt(env, st)
        # the classifier's modelled time runs in a task: the handler must not hold up other sessions
        self.spawn(env.session, (env.turn, "route", p.segment), self._route(env, p))

    async def _route(self, env: Envelope[Final], p: Final) -> None:
        cfg = self.cfg.router
        text = p.text
        spans = list(env.spans)
        t = now_ns()
        if cfg.policy == "classifier" and cfg.classifier_ms > 0:
            d = round(cfg.classifier_ms * 1e6)
            spans.append(Span(stage="router", what="classifier", start_ns=t, dur_ns=d))
            await sleep_until_ns(t + d)
        dest, route = decide(cfg, text, self.script_of(env), self.cfg.main_agent)
        agent: str | None = None
        fallback: str | None = None  # where a cache miss goes
        if dest == "cache" or (cfg.cache_first and self.cfg.cache.enabled):
            fallback = dest if not dest.startswith("cache") else cfg.default
            if fallback == "cache":
                fallback = f"agent:{self.cfg.main_agent}"
            target, path = Target.CACHE, Path.CACHE
        elif dest == "council":
            target, path = Target.COUNCIL, Path.COUNCIL
        else:
            target, path, agent = Target.AGENT, Path.AGENT, self._agent_name(dest)
        payload = Route(
            text=text, words=p.words, segment=p.segment, route=route, target=target, path=path, agent=agent,
            fallback=fallback,
        )  # fmt: skip
        await self.publish(self.reply(env, payload, spans))
