"""Council: several small agents answer the same turn; an aggregation decides what is spoken.

* ``first`` — hedged: every member starts; the first to finish its first clause wins and streams on,
  the others are cancelled (their tokens are wasted work).
* ``vote`` — the first ``k`` complete answers vote (majority); then the answer is spoken at once.
* ``judge`` — all answers (members past the deadline dropped), then a judge call with them in its
  prompt (Mixture-of-Agents shape): seconds before first audio on slow hardware.
* ``draft-refine`` — the fastest member's draft is spoken at once while a refine call (judge backend)
  improves it in the background for the next turn's context.

Quality is modelled from members' benchmark accuracies at the turn's complexity
(hardware.quality.at_complexity, then strategy.council_quality), not measured.
"""

from __future__ import annotations

import asyncio
import contextlib

from voicepipe.backends.base import Backend, EndpointError, LLMRequest, tokens_by, writes_own_text
from voicepipe.clock import now_ns, rng_for
from voicepipe.hardware.quality import at_complexity
from voicepipe.messages import Cancel, CancelReason, Envelope, Path, Route, Span, Target, TurnMeta, TurnScript
from voicepipe.stages.agent import (
    Generation,
    fail_turn,
    prompt_tokens,
    request_cost,
    request_messages,
    stream_reply,
)
from voicepipe.stages.base import Stage
from voicepipe.strategy import council_quality
from voicepipe.text import count_tokens, first_clause_end, tokens_of


def first_clause_token(tokens: list[str], min_words: int) -> int:
    """Index of the token that completes the reply's first speakable clause (the race in ``first``)."""
    words: list[str] = []
    for n, tok in enumerate(tokens):
        if tok.startswith(" ") or not words:
            words.append(tok.strip())
        else:
            words[-1] += tok
        if first_clause_end(words, min_words) is not None:
            return n
    return max(0, len(tokens) - 1)


class Council(Stage):
    name = "council"
    channels = ("turn/script", "route", "control/cancel")

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        c = self.cfg.council
        self.members = [self.ctx.backends.get(spec) for spec in c.members]
        self.judge = self.ctx.backends.get(c.judge) if c.judge is not None else self.members[0]
        self.history: dict[str, int] = {}
        self.on(Route, self.route)
        self.on(Cancel, self.cancelled)

    def forget(self, session: str) -> None:
        self.history.pop(session, None)

    async def cancelled(self, env: Envelope[Cancel]) -> None:
        p = env.payload
        if p.attempt is not None or p.reason == CancelReason.HEARD:
            return  # preemption is the agent's; "heard" stops only the audio
        seg = p.segment
        self.cancel(env.session, lambda k: k[0] == env.turn and (seg is None or k[1] == seg))

    async def route(self, env: Envelope[Route]) -> None:
        p = env.payload
        if p.target != Target.COUNCIL or self.is_dropped(env):
            return
        script = self.script_of(env)
        if not script:
            raise ValueError(f"no script for turn {env.turn} of session {env.session}")
        self.spawn(env.session, (env.turn, p.segment), self._convene(env, script))

    def _gen(
        self, env: Envelope[Route], backend: Backend, tokens: list[str], extra_prompt: int, i: int, t0: int
    ) -> Generation:
        p = env.payload
        prompt, cached = prompt_tokens(self.cfg.agent.prompt_tokens, self.history.get(env.session, 0), p.text)
        prompt += extra_prompt
        req = LLMRequest(env.session, env.turn, prompt, len(tokens), cached, request_messages(p.text))
        rng = rng_for(self.cfg.seed, env.session, env.turn, p.segment, "council", i)
        stream = backend.start(req, t0, rng)
        tokens = stream.pieces if writes_own_text(stream) else tokens  # a real model's own words
        return Generation(stream, tokens, prompt, cached, backend)

    async def _convene(self, env: Envelope[Route], script: TurnScript) -> None:
        c = self.cfg.council
        t0 = now_ns()
        tokens = tokens_of(script.reply)
        gens = [self._gen(env, b, tokens, 0, i, t0) for i, b in enumerate(self.members)]
        deadline = c.deadline_ms / 1e3
        first_clause = first_clause_token(tokens, self.cfg.tts.min_clause_words)
        cost = 0.0
        wasted = 0
        n = len(tokens)
        grow = count_tokens(env.payload.text) + n
        self.after_turn(
            env, lambda: self.history.__setitem__(env.session, self.history.get(env.session, 0) + grow)
        )
        try:
            if c.aggregation in ("first", "draft-refine"):
                race = first_clause
                order = await self._finish_order(gens, race, t0, deadline, k=1)
                win = order[0]
                chosen, members_q = gens[win], [at_complexity(self.members[win].quality, script.complexity)]  # what the user hears
                spoken = chosen
            else:
                k = c.k if c.aggregation == "vote" else len(gens)
                race = len(tokens) - 1
                order = await self._finish_order(gens, race, t0, deadline, k=k)
                members_q = [at_complexity(self.members[i].quality, script.complexity) for i in order]
                chosen = gens[order[-1]]  # the answer that completed the vote / the last the judge waited for
                spoken = chosen
                if c.aggregation == "judge":
                    answers = sum(len(gens[i].tokens) for i in order)
                    tj = chosen.stream.spans(len(tokens) - 1)[-1].end_ns  # modelled: the last answer done
                    spoken = self._gen(env, self.judge, tokens, answers, 99, tj)
                    cost += request_cost(self.judge, spoken.prompt, spoken.cached, len(tokens))
            # members whose answers counted are billed in full; the rest for what they made before
            # they were dropped (wasted work)
            counted = {id(gens[i]) for i in order} if c.aggregation in ("vote", "judge") else {id(chosen)}
            # the decision instant is modelled (the last counted answer's token), never the moment this
            # task got to run: billing must not depend on scheduling or bus timing
            decided = gens[order[-1]].stream.spans(race)[-1].end_ns
            for g in gens:
                if id(g) in counted:
                    cost += request_cost(g.backend, *g.billed())
                    continue
                made = tokens_by(g.stream, len(g.tokens), decided)
                g.stream.cancel()
                wasted += made
                cost += request_cost(g.backend, g.prompt, g.cached, made)
            quality = council_quality(c.aggregation, members_q, c.judge_gain)
            if c.aggregation == "draft-refine":
                cost += request_cost(self.judge, chosen.prompt + n, chosen.cached, n)
            meta = TurnMeta(
                backend=f"council:{c.aggregation}",
                path=Path.COUNCIL,
                route=env.payload.route,
                input_tokens=sum(g.prompt for g in gens),
                output_tokens=len(tokens),
                cost_usd=cost,
                wasted_tokens=wasted,
                quality=quality,
                members=[b.name for b in self.members],
            )
            chain = list(env.spans)
            if spoken is not chosen:  # judge: the wait for the members' answers is council time
                chain.append(Span(stage="council", what=f"{c.aggregation} wait", start_ns=t0,
                                  dur_ns=spoken.stream.spans(0)[0].start_ns - t0))  # fmt: skip
            elif c.aggregation == "vote":
                end = chosen.stream.spans(len(tokens) - 1)[-1].end_ns
                chain.append(Span(stage="council", what="vote wait", start_ns=t0, dur_ns=end - t0))
            spoken.commit.set()
            try:
                await stream_reply(self, env, spoken, lambda _h: meta, self.cfg.agent.chunk_tokens, chain)
            except EndpointError as exc:  # the spoken answer's real model failed: the turn fails
                await fail_turn(self, env, str(exc))
                return
            if c.aggregation == "draft-refine":
                # the draft has been spoken; the refine call (draft in its prompt) runs on the judge's
                # backend, sharing its device with everyone else; its answer is the one the history
                # keeps (same length as the draft: the text is scripted)
                drafted = spoken.stream.spans(n - 1)[-1].end_ns  # modelled: the draft's last token
                refine = self._gen(env, self.judge, tokens, n, 98, drafted)
                self.spawn(env.session, (env.turn, "refine"), self._refine(refine))
        finally:
            for g in gens:
                g.stream.cancel()

    @staticmethod
    async def _refine(gen: Generation) -> None:
        try:
            await gen.stream.token_time(len(gen.tokens) - 1)
        finally:
            gen.stream.cancel()

    async def _finish_order(
        self, gens: list[Generation], token: int, t0: int, deadline_s: float, k: int
    ) -> list[int]:
        """Indices of the first ``k`` members to produce ``token`` within the deadline, by the token's modelled
        instant (never by which task woke first: real-time wake-ups jitter by a millisecond)."""

        async def one(i: int) -> int:
            await gens[i].stream.token_time(token)
            return i

        tasks = [asyncio.create_task(one(i)) for i in range(len(gens))]
        woke = 0
        try:
            for fut in asyncio.as_completed(tasks, timeout=deadline_s):
                with contextlib.suppress(TimeoutError, EndpointError):  # a failed member never finishes
                    await fut
                    woke += 1
                if woke >= k:
                    break
        except TimeoutError:
            pass
        finally:
            for t in tasks:
                t.cancel()
        now = now_ns()
        limit = min(now, t0 + round(deadline_s * 1e9))
        done = sorted(
            (at, i) for i, g in enumerate(gens) if (at := g.stream.spans(token)[-1].end_ns) <= limit
        )[:k]
        if not done:
            raise TimeoutError("no council member answered before the deadline")
        for _, i in done:
            gens[i].produced = token + 1
        return [i for _, i in done]
