"""What every stage shares: one bus client, a receive loop that never dies, per-session tasks and state.

A stage subscribes once per channel for the whole run and serves every session through that
subscription. Work longer than a handler (sleeping out a modelled duration, streaming) runs in tasks
registered under (session, key); ``session.end`` cancels them and drops the session's state, so nothing
is left behind when a conversation ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog
from pydantic import BaseModel

from voicepipe.backends import BackendPool
from voicepipe.bus import Bus
from voicepipe.config import PipelineConfig
from voicepipe.messages import CancelReason, Envelope, Span, TurnScript

log = structlog.get_logger("voicepipe.stage")

Handler = Callable[[Envelope], Awaitable[None]]


@dataclass
class RunContext:
    run: str
    cfg: PipelineConfig
    backends: BackendPool = field(default_factory=BackendPool)


class Stage:
    name: ClassVar[str] = "stage"
    channels: ClassVar[tuple[str, ...]] = ()

    def __init__(self, bus: Bus, ctx: RunContext) -> None:
        self.bus = bus
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.tasks: dict[str, dict[Any, asyncio.Task[None]]] = {}
        self.errors = 0
        self.first_error: str | None = None  # the first handler/task failure, for runs that must not hide it
        self.ready = asyncio.Event()
        self.handlers: dict[str, Handler] = {}
        # the scripted turns (turn.script: reference reply, hints) of stages that subscribe to them
        # per session (so ending one session never scans the others): turn -> script
        self.scripts: dict[str, dict[int, TurnScript]] = {}
        if "turn/script" in self.channels:
            self.on("turn.script", self._script)
        # segments the ASR withdrew (the user resumed after a premature endpoint), and effects on the
        # conversation (history, learned answers) that wait for the turn to be over
        self.dropped: dict[str, set[tuple[int, int]]] = {}  # session -> (turn, segment)
        self.pending: dict[str, dict[tuple[int, int], list[Callable[[], None]]]] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    async def run(self) -> None:
        await self.bus.subscribe(*self.channels, "session/end")
        self.ready.set()
        await self.bus.serve(self.receive)

    async def receive(self, env: Envelope) -> None:
        """One received message (the bus hands them over one at a time, in arrival order)."""
        if env.type == "session.end":
            self.end_session(env.session)
            return
        if env.type == "control.cancel" and env.payload.reason == CancelReason.USER_RESUMED:
            key = (env.turn, env.payload.segment or 0)
            self.dropped.setdefault(env.session, set()).add(key)
            self.pending.get(env.session, {}).pop(key, None)
        handler = self.handlers.get(env.type)
        if handler is None:
            return
        try:
            await handler(env)
        except Exception as exc:  # a bad message never kills the stage
            self._failed(exc)
            log.warning("handler failed", stage=self.name, type=env.type, error=repr(exc))
            await self.bus.deadletter(f"{env.session}/{env.type}", f"handler error: {exc!r}", b"")

    def on(self, type_: str, handler: Handler) -> None:
        self.handlers[type_] = handler

    # -- per-session tasks -----------------------------------------------------------------------
    def spawn(self, session: str, key: Any, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` for a session under ``key``, replacing (cancelling) an older task with that key."""
        bucket = self.tasks.setdefault(session, {})
        old = bucket.pop(key, None)
        if old:
            old.cancel()
        task = asyncio.create_task(self._guard(coro))
        bucket[key] = task

        def _done(t: asyncio.Task[None], session: str = session, key: Any = key) -> None:
            b = self.tasks.get(session)
            if b is not None and b.get(key) is t:
                del b[key]
                if not b:
                    del self.tasks[session]

        task.add_done_callback(_done)
        return task

    async def _guard(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(exc)
            log.warning("task failed", stage=self.name, error=repr(exc))

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = f"{self.name}: {exc}"

    def cancel(self, session: str, match: Callable[[Any], bool]) -> int:
        n = 0
        for key, task in list(self.tasks.get(session, {}).items()):
            if match(key):
                task.cancel()
                n += 1
        return n

    def end_session(self, session: str) -> None:
        for task in self.tasks.pop(session, {}).values():
            task.cancel()
        for d in (self.scripts, self.pending, self.dropped):
            d.pop(session, None)
        self.forget(session)

    async def _script(self, env: Envelope) -> None:
        scripts = self.scripts.setdefault(env.session, {})
        scripts.pop(env.turn - 2, None)  # keep this turn and the one before
        scripts[env.turn] = env.payload
        pending = self.pending.get(env.session, {})
        for key in [k for k in pending if k[0] < env.turn]:
            for effect in pending.pop(key):
                effect()  # the earlier turn is over: what it taught the conversation now counts
        dropped = self.dropped.get(env.session)
        if dropped:
            self.dropped[env.session] = {k for k in dropped if k[0] >= env.turn - 1}
        await self.on_script(env)

    def is_dropped(self, env: Envelope) -> bool:
        """Is this message about a segment the ASR withdrew (premature endpoint)?"""
        dropped = self.dropped.get(env.session)
        return bool(dropped) and (env.turn, env.payload.segment) in dropped

    def after_turn(self, env: Envelope, effect: Callable[[], None]) -> None:
        """Apply ``effect`` once the turn is over (next turn's script), unless its segment is withdrawn."""
        if not self.is_dropped(env):
            key = (env.turn, env.payload.segment)
            self.pending.setdefault(env.session, {}).setdefault(key, []).append(effect)

    async def on_script(self, env: Envelope) -> None:
        """A new scripted turn arrived (stages that need more than ``self.scripts`` override)."""

    def script_of(self, env: Envelope) -> TurnScript | None:
        return self.scripts.get(env.session, {}).get(env.turn)

    def forget(self, session: str) -> None:
        """Drop per-session state (stages with state override)."""

    def open_tasks(self) -> int:
        return sum(len(b) for b in self.tasks.values())

    async def shutdown(self) -> None:
        for s in list(self.tasks):
            self.end_session(s)
        await asyncio.sleep(0)

    # -- helpers -----------------------------------------------------------------------------------
    def reply(self, env: Envelope, payload: BaseModel, spans: list[Span]) -> Envelope:
        """A new envelope for the same session/turn carrying the causal chain forward."""
        return Envelope.of(payload, env.run, env.session, env.turn, spans)


async def cancel_quietly(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
