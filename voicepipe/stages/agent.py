"""Agent: an LLM on a backend streams the turn's reply text in chunks, on the backend's timing.

The simulated model "writes" the scenario's reference reply: the words are scripted, the timing is the
backend's (empirical profile or hardware model, possibly shared with other sessions). Text leaves in
chunks — at clause ends or every ``chunk_tokens`` tokens — never a message per token. Each chunk carries
the causal chain plus the backend's modelled spans (queue, ttft, decode) up to its last token.
"""

from __future__ import annotations

from dataclasses import dataclass

from voicepipe.backends.base import Backend, LLMRequest
from voicepipe.clock import now_ns, rng_for
from voicepipe.messages import Envelope
from voicepipe.stages.base import Stage
from voicepipe.text import CLAUSE_END, count_tokens, tokens_of


def chunk_ends(tokens: list[str], max_tokens: int) -> list[int]:
    """Indices of the last token of each chunk: clause ends, or every ``max_tokens`` tokens."""
    ends: list[int] = []
    start = 0
    for i, tok in enumerate(tokens):
        if CLAUSE_END.search(tok) or i - start + 1 >= max_tokens or i == len(tokens) - 1:
            ends.append(i)
            start = i + 1
    return ends


@dataclass
class History:
    tokens: int = 0  # conversation so far (user + assistant), on top of the base prompt


def prompt_tokens(base: int, history: int, user_text: str) -> tuple[int, int]:
    """(prompt tokens, of which cached) for a turn: base prompt + history are a stable prefix."""
    return base + history + count_tokens(user_text), base + history


class Agent(Stage):
    name = "agent"
    channels = ("turn/script", "route", "control/cancel")

    def __init__(self, *a, agent_name: str = "main", backend: Backend | None = None, **kw) -> None:
        super().__init__(*a, **kw)
        self.agent_name = agent_name
        self.backend = backend or self.ctx.backends.get(self.cfg.agent.backend)
        self.scripts: dict[tuple[str, int], dict] = {}
        self.history: dict[str, History] = {}
        self.on("turn.script", self.script)
        self.on("route", self.route)
        self.on("control.cancel", self.cancelled)

    def forget(self, session: str) -> None:
        self.history.pop(session, None)
        for k in [k for k in self.scripts if k[0] == session]:
            del self.scripts[k]

    async def script(self, env: Envelope) -> None:
        self.scripts.pop((env.session, env.turn - 2), None)
        self.scripts[(env.session, env.turn)] = env.payload

    async def cancelled(self, env: Envelope) -> None:
        seg = env.payload.get("segment")
        self.cancel(env.session, lambda k: k[0] == env.turn and (seg is None or k[1] == seg))

    async def route(self, env: Envelope) -> None:
        p = env.payload
        if p.get("target") != "agent" or p.get("agent") != self.agent_name:
            return
        script = self.scripts.get((env.session, env.turn))
        if script is None:
            raise ValueError(f"no script for turn {env.turn} of session {env.session}")
        self.spawn(env.session, (env.turn, p.get("segment", 0)), self._generate(env, script))

    async def _generate(self, env: Envelope, script: dict) -> None:
        t0 = now_ns()
        reply = str(script["reply"])
        tokens = tokens_of(reply)
        hist = self.history.setdefault(env.session, History())
        prompt, cached = prompt_tokens(self.cfg.agent.prompt_tokens, hist.tokens, env.payload.get("text", ""))
        req = LLMRequest(env.session, env.turn, prompt, len(tokens), cached)
        seg = env.payload.get("segment", 0)
        rng = rng_for(self.cfg.seed, env.session, env.turn, seg, "agent", self.agent_name)
        stream = self.backend.start(req, t0, rng)
        meta = {
            "backend": self.backend.name,
            "path": env.payload.get("path", "agent"),
            "route": env.payload.get("route", "single"),
            "input_tokens": prompt,
            "output_tokens": len(tokens),
            "cost_usd": self.backend.prices.cost(prompt - cached, len(tokens))
            + self.backend.prices.cost(cached, 0) * 0.1,
            "quality": self.backend.quality,
        }
        try:
            start = 0
            ends = chunk_ends(tokens, self.cfg.agent.chunk_tokens)
            for seq, end in enumerate(ends):
                await stream.token_time(end)
                payload = {
                    "text": "".join(tokens[start : end + 1]),
                    "seq": seq,
                    "final": end == len(tokens) - 1,
                    "words": env.payload.get("words", 0),
                    "segment": seg,
                    "meta": meta,
                }
                spans = [*env.spans, *stream.spans(end)]
                await self.bus.publish(self.reply(env, "reply.text", payload, spans))
                start = end + 1
            hist.tokens += count_tokens(env.payload.get("text", "")) + len(tokens)
        finally:
            stream.cancel()
