"""Agent: an LLM on a backend streams the turn's reply text in chunks, on the backend's timing.

The simulated model "writes" the scenario's reference reply: the words are scripted, the timing is the
backend's (empirical profile or hardware model, possibly shared with other sessions). Text leaves in
chunks — at clause ends or every ``chunk_tokens`` tokens — never a message per token. Each chunk carries
the causal chain plus the backend's modelled spans (queue, ttft, decode) up to its last token.

A preemptive request (``hold``) generates at once but publishes nothing until the router commits it;
a cancelled one counts its generated tokens (and prompt) as wasted work. So does the reply to a segment
the ASR withdraws (the user resumed after a premature endpoint), whether it was still being generated or
had already been written in full: everything it made is thrown away. The waste rides on the turn's next
reply (``TurnMeta.wasted_tokens``).

Replicas (``--workers``) are shadows (:data:`voicepipe.bus.partition.SHADOWED`): a replica runs every
session's requests on its copy of the backend's device, and for a session it does not own when the request
starts the generation is *muted* — it occupies the modelled device and grows the history as the owner's
does, but publishes nothing and fails no turn. A muted generation stays muted if its session moves here
mid-turn (the dead owner's turn in flight is failed by the run, not resumed halfway); the session's next
request is this replica's own. A real server's requests are never shadowed (one per turn, by the owner).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from voicepipe.backends.base import (
    Backend,
    EndpointError,
    LLMRequest,
    TokenStream,
    tokens_by,
    writes_own_text,
)
from voicepipe.clock import now_ns, rng_for
from voicepipe.hardware.quality import at_complexity
from voicepipe.messages import (
    Cancel,
    CancelReason,
    Envelope,
    Route,
    Span,
    Target,
    TurnMeta,
    TurnScript,
    reply_text,
)
from voicepipe.records import EndpointMetrics
from voicepipe.stages.base import Stage
from voicepipe.text import CLAUSE_END, count_tokens, tokens_of

CACHED_INPUT_PRICE = 0.1  # cached prompt tokens billed at 10% (Anthropic/OpenAI prompt-caching docs)


def chunk_ends(tokens: list[str], max_tokens: int) -> list[int]:
    """Indices of the last token of each chunk: clause ends, or the first word boundary once a chunk has
    ``max_tokens`` tokens (a chunk never splits a word, so TTS sees whole words)."""
    ends: list[int] = []
    start = 0
    for i, tok in enumerate(tokens):
        last = i == len(tokens) - 1
        at_boundary = last or tokens[i + 1].startswith(" ")
        if last or (at_boundary and (CLAUSE_END.search(tok) or i - start + 1 >= max_tokens)):
            ends.append(i)
            start = i + 1
    return ends


@functools.lru_cache(maxsize=4096)
def scripted_chunk_ends(tokens: tuple[str, ...], max_tokens: int) -> tuple[int, ...]:
    """:func:`chunk_ends` of a scripted reply, memoised (every session of a run gives the same replies)."""
    return tuple(chunk_ends(list(tokens), max_tokens))


def prompt_tokens(base: int, history: int, user_text: str) -> tuple[int, int]:
    """(prompt tokens, of which cached) for a turn: base prompt + history are a stable prefix."""
    return base + history + count_tokens(user_text), base + history


def request_cost(backend: Backend, prompt: int, cached: int, output: int) -> float:
    return backend.prices.cost(prompt - cached, output) + backend.prices.cost(cached, 0) * CACHED_INPUT_PRICE


@dataclass
class Generation:
    """One request in flight: its stream, how far it got, and (for preemptive) the commit gate."""

    stream: TokenStream
    tokens: list[str]
    prompt: int
    cached: int
    backend: Backend
    produced: int = 0
    commit: asyncio.Event = field(default_factory=asyncio.Event)
    commit_env: Envelope[Route] | None = None
    complexity: str | None = None  # the turn's scripted difficulty: modelled quality depends on it
    wasted: bool = False  # its work has been counted as thrown away (once)
    muted: bool = False  # a shadow replica's copy of another replica's request: runs, publishes nothing

    def billed(self) -> tuple[int, int, int]:
        """(prompt, cached prompt, output) tokens: a real model's usage as its server reported it, else
        the modelled prompt and the scripted reply's length."""
        if writes_own_text(self.stream):
            return (*self.stream.usage()[:1], 0, self.stream.usage()[1])
        return self.prompt, self.cached, len(self.tokens)


async def reply_chunks(gen: Generation, chunk_tokens: int) -> AsyncIterator[tuple[int, bool]]:
    """(last token, final) of each chunk once it exists: the script's chunks on the stream's timing, or
    chunks of the text a real model writes, cut by the same rule as it arrives."""
    if writes_own_text(gen.stream):
        async for end, final in gen.stream.chunks(lambda toks: chunk_ends(toks, chunk_tokens)):
            yield end, final
        return
    for end in scripted_chunk_ends(tuple(gen.tokens), chunk_tokens):
        await gen.stream.token_time(end)
        yield end, end == len(gen.tokens) - 1


def request_messages(user_text: str) -> tuple[tuple[str, str], ...]:
    """What a real model is asked: the user's words (history is modelled by token counts only)."""
    return (("user", user_text),)


async def stream_reply(
    stage: Stage,
    env: Envelope[Route],
    gen: Generation,
    meta_of: Callable[[Envelope[Route]], TurnMeta],
    chunk_tokens: int,
    chain: list[Span],
) -> None:
    """Publish ``gen``'s text as reply.text chunks on its timing; held until ``gen.commit`` is set.

    ``meta_of(head)`` builds the usage/cost metadata once the envelope that released the reply (the
    route, or the router's commit) is known.
    """
    start = 0
    meta: TurnMeta | None = None
    seq = -1
    async for end, final in reply_chunks(gen, chunk_tokens):
        seq += 1
        gen.produced = end + 1
        if not gen.commit.is_set():
            await gen.commit.wait()
        head = gen.commit_env if gen.commit_env is not None else env
        if meta is None or (final and writes_own_text(gen.stream)):  # usage is known at the end
            meta = meta_of(head)
            if final and writes_own_text(gen.stream):
                meta = meta.model_copy(
                    update={"endpoint": EndpointMetrics.model_validate(gen.stream.metrics())}
                )
        route = head.payload
        text = reply_text(  # ReplyText(...) without validating values that are already of their types
            text="".join(gen.tokens[start : end + 1]), seq=seq, final=final, words=route.words,
            segment=route.segment, meta=meta,
        )  # fmt: skip
        if not gen.muted:
            spans = [*chain, *(head.spans if head is not env else []), *gen.stream.spans(end)]
            await stage.publish(stage.reply(head, text, spans))
        start = end + 1


async def fail_turn(stage: Stage, env: Envelope[Route], reason: str) -> None:
    """Tell everyone (the client records it) that this turn's reply failed, and why."""
    route = env.payload
    await stage.publish(
        stage.reply(env, Cancel(segment=route.segment, reason=CancelReason.FAILED, error=reason), [])
    )


class Agent(Stage):
    name = "agent"
    channels = ("turn/script", "route", "control/cancel")

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.backends = {n: self.ctx.backends.get(spec) for n, spec in self.cfg.agent.backends().items()}
        self.history: dict[str, int] = {}
        self.running: dict[str, dict[Any, Generation]] = {}  # session -> task key -> request
        self.wasted: dict[str, dict[int, tuple[int, float]]] = {}  # session -> turn -> (tokens, USD)
        # session -> (turn, segment) -> the request whose text was released for that segment (running or
        # done), kept until the turn is over: a withdrawn segment's reply is thrown away even when complete
        self.released: dict[str, dict[tuple[int, int], Generation]] = {}
        # a shadow replica (voicepipe.bus.partition.SHADOWED) asks its bus whether it owns a session
        self._owns: Callable[[str], bool] | None = getattr(self.bus, "owns", None)
        self.shadowed = 0  # requests run muted for sessions another replica owns
        self.on(Route, self.route)
        self.on(Cancel, self.cancelled)

    def forget(self, session: str) -> None:
        self.history.pop(session, None)
        self.running.pop(session, None)
        self.wasted.pop(session, None)
        self.released.pop(session, None)

    def owns(self, session: str) -> bool:
        """Does this replica answer for ``session`` (always, unless it is one of several shadows)?"""
        return self._owns is None or self._owns(session)

    async def fail_turn(self, session: str, turn: int, reason: str, *, lost: bool = False) -> None:
        """A shadow fails no turn of a session it does not own: the owner saw (or failed) it itself."""
        if self.owns(session):
            await super().fail_turn(session, turn, reason, lost=lost)

    async def on_script(self, env: Envelope[TurnScript]) -> None:
        self.wasted.get(env.session, {}).pop(env.turn - 2, None)
        released = self.released.get(env.session)
        if released:
            for k in [k for k in released if k[0] < env.turn]:
                del released[k]

    async def cancelled(self, env: Envelope[Cancel]) -> None:
        """Stop generating: a preemptive attempt that did not match, a withdrawn segment, a barge-in.

        ("heard" only stops the audio: the reply is still the assistant's turn in the conversation.)
        """
        p = env.payload
        if p.reason == CancelReason.HEARD:
            return
        if p.attempt is not None:
            match = lambda k: k == (env.turn, "pre", p.attempt)  # noqa: E731
        else:
            seg = p.segment
            match = lambda k: k[0] == env.turn and (seg is None or k[1] == seg)  # noqa: E731
        running = self.running.get(env.session, {})
        if p.reason == CancelReason.USER_RESUMED and p.segment is not None:
            # the reply to a withdrawn segment: thrown away, running (a committed preemptive attempt
            # included) or already written in full
            gen = self.released.get(env.session, {}).pop((env.turn, p.segment), None)
            if gen is not None:
                keys = {k for k, g in running.items() if g is gen}
                for key in keys:
                    del running[key]
                self.cancel(env.session, keys.__contains__)
                self._waste(env.session, env.turn, gen)
        for key, gen in list(running.items()):
            if match(key):
                self._waste(env.session, env.turn, gen)
                del running[key]
        self.cancel(env.session, match)

    def _waste(self, session: str, turn: int, gen: Generation) -> None:
        """Count what a cancelled request had already cost: its prompt and the tokens made by now."""
        if gen.wasted:
            return
        gen.wasted = True
        made = tokens_by(gen.stream, len(gen.tokens), now_ns())
        gen.stream.cancel()
        wasted = self.wasted.setdefault(session, {})
        tokens, usd = wasted.get(turn, (0, 0.0))
        wasted[turn] = (
            tokens + made,
            usd + request_cost(gen.backend, gen.prompt, gen.cached, made),
        )

    def _remember(self, env: Envelope[Route], gen: Generation) -> None:
        """Once the turn is over, its question and (scripted) answer are conversation history."""
        grow = count_tokens(env.payload.text) + len(gen.tokens)
        self.after_turn(
            env, lambda: self.history.__setitem__(env.session, self.history.get(env.session, 0) + grow)
        )

    async def route(self, env: Envelope[Route]) -> None:
        p = env.payload
        if self.is_dropped(env):
            return
        if p.target == Target.COMMIT:
            gen = self.running.get(env.session, {}).get((env.turn, "pre", p.attempt))
            if gen is not None and not gen.commit.is_set():
                gen.commit_env = env
                gen.commit.set()
                self._remember(env, gen)
                self.released.setdefault(env.session, {})[(env.turn, p.segment)] = gen
            return
        if p.target != Target.AGENT or p.agent not in self.backends:
            return
        script = self.script_of(env)
        if not script:
            raise ValueError(f"no script for turn {env.turn} of session {env.session}")
        key = (env.turn, "pre", p.attempt) if p.hold else (env.turn, p.segment)
        muted = not self.owns(env.session)
        if muted and self.backends[p.agent].kind == "endpoint":
            return  # a real server is the device: only the owner sends it the request
        gen = self._start(env, script, p.agent)
        gen.muted = muted
        self.shadowed += muted
        if not p.hold:
            gen.commit.set()
            self._remember(env, gen)
            self.released.setdefault(env.session, {})[(env.turn, p.segment)] = gen
        self.running.setdefault(env.session, {})[key] = gen
        self.spawn(env.session, key, self._run(env, gen, key))

    def _start(self, env: Envelope[Route], script: TurnScript, agent: str) -> Generation:
        backend = self.backends[agent]
        p = env.payload
        tokens = tokens_of(script.reply)
        prompt, cached = prompt_tokens(self.cfg.agent.prompt_tokens, self.history.get(env.session, 0), p.text)
        req = LLMRequest(env.session, env.turn, prompt, len(tokens), cached, request_messages(p.text))
        # a preemptive attempt is the same request made earlier: same draw as the segment's own
        rng = rng_for(self.cfg.seed, env.session, env.turn, p.segment, "agent", agent)
        stream = backend.start(req, now_ns(), rng)
        tokens = stream.pieces if writes_own_text(stream) else tokens  # a real model's own words
        return Generation(stream, tokens, prompt, cached, backend, complexity=script.complexity)

    async def _run(self, env: Envelope[Route], gen: Generation, key: Any) -> None:
        def meta_of(head: Envelope[Route]) -> TurnMeta:
            wasted_tokens, wasted_usd = self.wasted.get(env.session, {}).get(env.turn, (0, 0.0))
            prompt, cached, output = gen.billed()
            return TurnMeta(
                backend=gen.backend.name,
                path=head.payload.path,
                route=env.payload.route,
                input_tokens=prompt,
                output_tokens=output,
                cost_usd=request_cost(gen.backend, prompt, cached, output) + wasted_usd,
                wasted_tokens=wasted_tokens,
                quality=at_complexity(gen.backend.quality, gen.complexity),
            )

        try:
            await stream_reply(self, env, gen, meta_of, self.cfg.agent.chunk_tokens, list(env.spans))
        except EndpointError as exc:  # a real model failed: the turn fails with the reason, the run goes on
            if not gen.muted:
                await fail_turn(self, env, str(exc))
        finally:
            running = self.running.get(env.session)
            if running is not None and running.get(key) is gen:
                del running[key]
            gen.stream.cancel()
