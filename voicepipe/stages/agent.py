"""Agent: an LLM on a backend streams the turn's reply text in chunks, on the backend's timing.

The simulated model "writes" the scenario's reference reply: the words are scripted, the timing is the
backend's (empirical profile or hardware model, possibly shared with other sessions). Text leaves in
chunks — at clause ends or every ``chunk_tokens`` tokens — never a message per token. Each chunk carries
the causal chain plus the backend's modelled spans (queue, ttft, decode) up to its last token.

A preemptive request (``hold``) generates at once but publishes nothing until the router commits it;
a cancelled one counts its generated tokens (and prompt) as wasted work.
"""

from __future__ import annotations

import asyncio
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
from voicepipe.messages import Envelope, Span
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
    commit_env: Envelope | None = None

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
    for end in chunk_ends(gen.tokens, chunk_tokens):
        await gen.stream.token_time(end)
        yield end, end == len(gen.tokens) - 1


def request_messages(user_text: str) -> tuple[tuple[str, str], ...]:
    """What a real model is asked: the user's words (history is modelled by token counts only)."""
    return (("user", user_text),)


async def stream_reply(
    stage: Stage,
    env: Envelope,
    gen: Generation,
    meta_of: Callable[[Envelope], dict[str, Any]],
    chunk_tokens: int,
    chain: list[Span],
) -> None:
    """Publish ``gen``'s text as reply.text chunks on its timing; held until ``gen.commit`` is set.

    ``meta_of(head)`` builds the usage/cost metadata once the envelope that released the reply (the
    route, or the router's commit) is known.
    """
    start = 0
    meta: dict[str, Any] | None = None
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
                meta = {**meta, "endpoint": gen.stream.metrics()}
        payload = {
            "text": "".join(gen.tokens[start : end + 1]),
            "seq": seq,
            "final": final,
            "words": head.payload.get("words", 0),
            "segment": head.payload.get("segment", 0),
            "meta": meta,
        }
        spans = [*chain, *(head.spans if head is not env else []), *gen.stream.spans(end)]
        await stage.bus.publish(stage.reply(head, "reply.text", payload, spans))
        start = end + 1


async def fail_turn(stage: Stage, env: Envelope, reason: str) -> None:
    """Tell everyone (the client records it) that this turn's reply failed, and why."""
    payload = {"segment": env.payload.get("segment", 0), "reason": "failed", "error": reason}
    await stage.bus.publish(stage.reply(env, "control.cancel", payload, []))


class Agent(Stage):
    name = "agent"
    channels = ("turn/script", "route", "control/cancel")

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.backends = {n: self.ctx.backends.get(spec) for n, spec in self.cfg.agent.backends().items()}
        self.history: dict[str, int] = {}
        self.running: dict[tuple[str, Any], Generation] = {}  # (session, task key)
        self.wasted: dict[tuple[str, int], tuple[int, float]] = {}  # tokens, USD
        self.on("route", self.route)
        self.on("control.cancel", self.cancelled)

    def forget(self, session: str) -> None:
        self.history.pop(session, None)
        for d in (self.running, self.wasted):
            for k in [k for k in d if k[0] == session]:
                del d[k]

    async def on_script(self, env: Envelope) -> None:
        self.wasted.pop((env.session, env.turn - 2), None)

    async def cancelled(self, env: Envelope) -> None:
        """Stop generating: a preemptive attempt that did not match, a withdrawn segment, a barge-in.

        ("heard" only stops the audio: the reply is still the assistant's turn in the conversation.)
        """
        p = env.payload
        if p.get("reason") == "heard":
            return
        if "attempt" in p:
            match = lambda k: k == (env.turn, "pre", p["attempt"])  # noqa: E731
        else:
            seg = p.get("segment")
            match = lambda k: k[0] == env.turn and (seg is None or k[1] == seg)  # noqa: E731
        for (session, key), gen in list(self.running.items()):
            if session == env.session and match(key):
                self._waste(session, env.turn, gen)
                del self.running[(session, key)]
        self.cancel(env.session, match)

    def _waste(self, session: str, turn: int, gen: Generation) -> None:
        """Count what a cancelled request had already cost: its prompt and the tokens made by now."""
        made = tokens_by(gen.stream, len(gen.tokens), now_ns())
        gen.stream.cancel()
        tokens, usd = self.wasted.get((session, turn), (0, 0.0))
        self.wasted[(session, turn)] = (
            tokens + made,
            usd + request_cost(gen.backend, gen.prompt, gen.cached, made),
        )

    def _remember(self, env: Envelope, gen: Generation) -> None:
        """Once the turn is over, its question and (scripted) answer are conversation history."""
        grow = count_tokens(env.payload.get("text", "")) + len(gen.tokens)
        self.after_turn(
            env, lambda: self.history.__setitem__(env.session, self.history.get(env.session, 0) + grow)
        )

    async def route(self, env: Envelope) -> None:
        p = env.payload
        if self.is_dropped(env):
            return
        if p.get("target") == "commit":
            gen = self.running.get((env.session, (env.turn, "pre", p.get("attempt"))))
            if gen is not None and not gen.commit.is_set():
                gen.commit_env = env
                gen.commit.set()
                self._remember(env, gen)
            return
        if p.get("target") != "agent" or p.get("agent") not in self.backends:
            return
        script = self.script_of(env)
        if not script:
            raise ValueError(f"no script for turn {env.turn} of session {env.session}")
        key = (env.turn, "pre", p["attempt"]) if p.get("hold") else (env.turn, p.get("segment", 0))
        gen = self._start(env, script, p["agent"])
        if not p.get("hold"):
            gen.commit.set()
            self._remember(env, gen)
        self.running[(env.session, key)] = gen
        self.spawn(env.session, key, self._run(env, gen, key))

    def _start(self, env: Envelope, script: dict, agent: str) -> Generation:
        backend = self.backends[agent]
        tokens = tokens_of(str(script["reply"]))
        prompt, cached = prompt_tokens(
            self.cfg.agent.prompt_tokens, self.history.get(env.session, 0), env.payload.get("text", "")
        )
        user = str(env.payload.get("text", ""))
        req = LLMRequest(env.session, env.turn, prompt, len(tokens), cached, request_messages(user))
        # a preemptive attempt is the same request made earlier: same draw as the segment's own
        rng = rng_for(self.cfg.seed, env.session, env.turn, env.payload.get("segment", 0), "agent", agent)
        stream = backend.start(req, now_ns(), rng)
        tokens = stream.pieces if writes_own_text(stream) else tokens  # a real model's own words
        return Generation(stream, tokens, prompt, cached, backend)

    async def _run(self, env: Envelope, gen: Generation, key: Any) -> None:
        def meta_of(head: Envelope) -> dict[str, Any]:
            wasted_tokens, wasted_usd = self.wasted.get((env.session, env.turn), (0, 0.0))
            prompt, cached, output = gen.billed()
            return {
                "backend": gen.backend.name,
                "path": head.payload.get("path", "agent"),
                "route": env.payload.get("route", "single"),
                "input_tokens": prompt,
                "output_tokens": output,
                "cost_usd": request_cost(gen.backend, prompt, cached, output) + wasted_usd,
                "wasted_tokens": wasted_tokens,
                "quality": gen.backend.quality,
            }

        try:
            await stream_reply(self, env, gen, meta_of, self.cfg.agent.chunk_tokens, list(env.spans))
        except EndpointError as exc:  # a real model failed: the turn fails with the reason, the run goes on
            await fail_turn(self, env, str(exc))
        finally:
            if self.running.get((env.session, key)) is gen:
                del self.running[(env.session, key)]
            gen.stream.cancel()
