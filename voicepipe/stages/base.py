"""What every stage shares: one bus client, a receive loop that never dies, per-session tasks and state.

A stage subscribes once per channel for the whole run and serves every session through that
subscription. Work longer than a handler (sleeping out a modelled duration, streaming) runs in tasks
registered under (session, key); ``session.end`` cancels them and drops the session's state, so nothing
is left behind when a conversation ends.

The receive loop distrusts the bus (:mod:`voicepipe.stages.guard`): a message is acted on only when it is
authenticated by the run's token, comes from the stage that owns its channel, is next in its sender's
sequence and fits the session's current turn; anything else is dead-lettered with a reason and counted.
A handler or task that raises fails that turn (a ``control.cancel`` with reason ``failed`` and the error,
which the client records), never the run. Every message a stage publishes goes through :meth:`Stage.publish`,
which names the sender and numbers it; its bus signs it as it serialises it.

Clock-free chains (issue 10): each received message's spans are moved onto the receiving stage's clock as if
the message had arrived the instant it was sent (shifted by arrival − ``sent_ns``, so any offset between the
two clocks cancels). Along a turn's chain each stage's spans keep their durations and their positions within
that stage, the hops are squeezed out, and at the client the chain ends at the instant the reply audio
arrived on the client's clock: [end of speech, heard] is then covered by the stages' own spans, and what they
do not cover is the bus — measured without any two clocks agreeing.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog

from voicepipe.backends import BackendPool
from voicepipe.bus import Bus
from voicepipe.clock import now_ns, running_loop, set_clock_offset_ns
from voicepipe.config import PipelineConfig
from voicepipe.keys import Instance, run_token
from voicepipe.messages import (
    Cancel,
    CancelReason,
    Envelope,
    Q,
    Segmented,
    Span,
    TurnScript,
    carries,
    copied,
    message_type,
)
from voicepipe.spans import shifted
from voicepipe.stages.guard import ADMITTED, Guard, Verdict

log = structlog.get_logger("voicepipe.stage")

NOTED_PER_REASON = 20  # dead letters per stage and reason logged and copied to the dead-letter topic

# a handler of one message type, registered with that type's payload class (Stage.on): the envelope's type
# names exactly one payload class (Envelope's validator), so the table holds handlers of every payload type
Handler = Callable[[Envelope[Any]], Awaitable[None]]


@dataclass
class RunContext:
    run: str
    cfg: PipelineConfig
    backends: BackendPool = field(default_factory=BackendPool)
    token: bytes = field(default_factory=run_token, repr=False)  # never printed: the run's shared secret
    # this start of the run (voicepipe.keys.Instance): its key signs every message; None (virtual runs,
    # tests of one stage): the token itself is the key
    instance: Instance | None = None

    @property
    def key(self) -> bytes:
        return self.token if self.instance is None else self.instance.key


class Stage:
    name: ClassVar[str] = "stage"
    channels: ClassVar[tuple[str, ...]] = ()
    clock_offset_ns: ClassVar[int] = 0  # tests: the stage reads a clock offset by that much (clock.py hook)

    def __init__(self, bus: Bus, ctx: RunContext) -> None:
        self.bus = bus
        self._wanted: Callable[[str], bool] | None = getattr(bus, "wanted", None)  # see wanted()
        # a bus whose publish never waits (the in-memory bus) takes a message without a coroutine
        self._post: Callable[[Envelope], None] | None = getattr(bus, "post", None)
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
            self.on(TurnScript, self._script)
        # segments the ASR withdrew (the user resumed after a premature endpoint), and effects on the
        # conversation (history, learned answers) that wait for the turn to be over
        self.dropped: dict[str, set[tuple[int, int]]] = {}  # session -> (turn, segment)
        self.pending: dict[str, dict[tuple[int, int], list[Callable[[], None]]]] = {}
        if not bus.trusted:  # a bus no one else can reach needs no MACs (Bus.trusted)
            # the bus signs each body as it serialises it (voicepipe.keys.seal): a view of another bus (a
            # replica's PartitionedBus) and the bus it wraps alike
            layer: Bus | None = bus
            while layer is not None:
                layer.key = ctx.key
                layer = getattr(layer, "inner", None)
        self.guard = Guard(ctx.key, client_side=self.name == "client", trusted=bus.trusted)
        self.src = f"{self.name}/{secrets.token_hex(3)}"  # sender instance: kind/replica
        self.seqs: dict[str, dict[str, int]] = {}  # session -> type -> last sequence number sent
        self.noted: dict[str, int] = {}  # dead letters per reason copied to the dead-letter topic
        self.failed_turns: dict[str, set[int]] = {}  # session -> turns this stage already failed (once each)

    # -- lifecycle -------------------------------------------------------------------------------
    async def run(self) -> None:
        if self.clock_offset_ns:
            set_clock_offset_ns(self.clock_offset_ns)  # this task and every task it starts
        await self.bus.subscribe(*self.channels_for(self.cfg), "session/end")
        self.ready.set()
        await self.bus.serve(self.receive)

    @classmethod
    def channels_for(cls, cfg: PipelineConfig) -> tuple[str, ...]:
        """The channels this stage acts on in ``cfg`` (it subscribes to these and ``session/end``): by
        default all of :attr:`channels`; a stage that would ignore one under ``cfg`` leaves it out, so no
        message is delivered, authenticated and checked only to be dropped."""
        return cls.channels

    async def receive(self, env: Envelope) -> None:
        """One received message (the bus hands them over one at a time, in arrival order): admitted by the
        guard, then handled; nothing a message does may kill the stage. (One coroutine per message: this
        is every message's path.)"""
        try:
            got = self.guard.admit(env)
            if got is not ADMITTED:
                if got.verdict is Verdict.DEAD:
                    await self._deadletter(env, got.reason)
                    return
                if got.verdict is Verdict.LATE:
                    return
            type_ = env.type
            env = rebase(env, now_ns())
            if type_ == "session.end":
                self.guard.end(env.session)
                self.end_session(env.session)
                return
            if got.lost:
                await self.fail_turn(env.session, env.turn, got.lost, lost=True)
            if carries(env, Cancel) and env.payload.reason == CancelReason.USER_RESUMED:
                key = (env.turn, env.payload.segment or 0)
                self.dropped.setdefault(env.session, set()).add(key)
                self.pending.get(env.session, {}).pop(key, None)
            handler = self.handlers.get(type_)
            if handler is not None:
                await handler(env)
        except Exception as exc:
            self._failed(exc)
            self.guard.counters.handler_errors += 1
            log.warning("handler failed", stage=self.name, type=env.type, error=repr(exc))
            await self.fail_turn(env.session, env.turn, f"{self.name} failed on {env.type}: {exc!r}")

    async def reject(self, env: Envelope, reason: str) -> None:
        """A handler found ``env`` impossible in the session's state: dead-letter and count it."""
        self.guard.counters.dead[reason.split(":", 1)[0]] += 1
        await self._deadletter(env, reason)

    async def _deadletter(self, env: Envelope, reason: str) -> None:
        head = reason.split(":", 1)[0]
        n = self.noted[head] = self.noted.get(head, 0) + 1
        if n <= NOTED_PER_REASON:  # the first few of each reason are logged and copied; all are counted
            body = env.model_dump_json(exclude={"auth"}).encode()[:512]
            await self.bus.deadletter(f"{env.session}/{env.type}", reason, body)

    async def publish(self, env: Envelope, *, qos: int | None = None) -> None:
        """Send ``env`` as this stage: sender, next sequence number for its session and channel, signature."""
        d = env.__dict__  # plain field writes: every field of an envelope is set when it is built
        seqs = self.seqs.get(d["session"])
        if seqs is None:
            seqs = self.seqs[d["session"]] = {}
        seq = seqs[d["type"]] = seqs.get(d["type"], -1) + 1
        d["src"] = self.src
        d["seq"] = seq
        post = self._post
        if post is not None:
            post(env)
        else:
            await self.bus.publish(env, qos=qos)

    def wanted(self, channel: str) -> bool:
        """Could anyone receive a message on ``channel``? Always on a bus that cannot tell (MQTT: any client
        may subscribe); the in-memory bus knows its subscribers (and its tap), so a stage may skip building
        a message no one would see (``MemoryBus.wanted``)."""
        wanted = self._wanted
        return True if wanted is None else wanted(channel)

    async def fail_turn(self, session: str, turn: int, reason: str, *, lost: bool = False) -> None:
        """Fail (or, for dropped messages, lose) ``turn`` of ``session`` once, with ``reason``: everyone drops
        its work and the client records it."""
        failed = self.failed_turns.setdefault(session, set())
        if turn < 0 or turn in failed or session in self.guard.ended:
            return
        failed.add(turn)
        why = CancelReason.LOST if lost else CancelReason.FAILED
        try:
            await self.publish(
                Envelope.of(Cancel(reason=why, error=reason[:2000]), self.ctx.run, session, turn)
            )
        except Exception as exc:  # a bus that cannot take it leaves the turn to its deadline
            log.warning("could not publish a failed turn", stage=self.name, session=session, turn=turn,
                        error=repr(exc))  # fmt: skip

    def on(self, payload: type[Q], handler: Callable[[Envelope[Q]], Awaitable[None]]) -> None:
        """Handle messages whose payload is ``payload`` (one of ``messages.PAYLOADS``) with ``handler``."""
        self.handlers[message_type(payload)] = handler

    # -- per-session tasks -----------------------------------------------------------------------
    def spawn(
        self, session: str, key: Any, coro: Coroutine[Any, Any, None], turn: int | None = None
    ) -> asyncio.Task[None]:
        """Run ``coro`` for a session under ``key``, replacing (cancelling) an older task with that key. If it
        raises, its turn fails (``turn``, else the key's first element when that is a turn number)."""
        bucket = self.tasks.setdefault(session, {})
        old = bucket.pop(key, None)
        if old:
            old.cancel()
        if turn is None and isinstance(key, tuple) and key and type(key[0]) is int:
            turn = key[0]
        task = running_loop().create_task(self._guard(coro, session, turn))
        bucket[key] = task

        def _done(t: asyncio.Task[None], session: str = session, key: Any = key) -> None:
            if t.cancelled():
                coro.close()  # cancelled before it started: never awaited, so close it (no RuntimeWarning)
            b = self.tasks.get(session)
            if b is not None and b.get(key) is t:
                del b[key]
                if not b:
                    del self.tasks[session]

        task.add_done_callback(_done)
        return task

    async def _guard(self, coro: Coroutine[Any, Any, None], session: str, turn: int | None) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(exc)
            self.guard.counters.handler_errors += 1
            log.warning("task failed", stage=self.name, error=repr(exc))
            if turn is not None:
                await self.fail_turn(session, turn, f"{self.name} failed: {exc!r}")

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
        self.seqs.pop(session, None)
        self.failed_turns.pop(session, None)
        self.forget(session)

    async def _script(self, env: Envelope[TurnScript]) -> None:
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

    def is_dropped(self, env: Envelope[Segmented]) -> bool:
        """Is this message about a segment the ASR withdrew (premature endpoint)?"""
        dropped = self.dropped.get(env.session)
        return dropped is not None and (env.turn, env.payload.segment) in dropped

    def after_turn(self, env: Envelope[Segmented], effect: Callable[[], None]) -> None:
        """Apply ``effect`` once the turn is over (next turn's script), unless its segment is withdrawn."""
        if not self.is_dropped(env):
            key = (env.turn, env.payload.segment)
            self.pending.setdefault(env.session, {}).setdefault(key, []).append(effect)

    async def on_script(self, env: Envelope[TurnScript]) -> None:
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
    def reply(self, env: Envelope, payload: Q, spans: list[Span]) -> Envelope[Q]:
        """A new envelope for the same session/turn carrying the causal chain forward."""
        return Envelope.of(payload, env.run, env.session, env.turn, spans)


def rebase(env: Envelope[Q], arrived_ns: int) -> Envelope[Q]:
    """``env`` with its spans moved onto the receiver's clock as if it had arrived when it was sent (the
    hop squeezed out; any offset between sender's and receiver's clocks cancels). A new envelope with new
    spans (the received one may be shared by other subscribers); the fields are copied as they are: they
    were validated when the message came in, and shifting a time keeps it an int."""
    shift = arrived_ns - env.sent_ns
    if not shift or not env.spans:
        return env
    d = env.__dict__.copy()
    d["spans"] = shifted(env.spans, shift)
    d["sent_ns"] = arrived_ns
    return copied(env, d)


async def cancel_and_wait(*tasks: asyncio.Future[Any], what: str = "task") -> list[tuple[str, BaseException]]:
    """Cancel ``tasks`` and wait until every one has ended. Their cancellation is what was asked for and is
    dropped; an exception one of them ended with (before the cancel, or while it was being cancelled) is
    never swallowed: each is logged at error and returned as (name, exception) for the caller's failure
    channel. A cancel of the caller itself propagates (the tasks are cancelled all the same). ``what`` names
    a future that is not a task (a gather)."""
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks)
    failed: list[tuple[str, BaseException]] = []
    for t in tasks:
        if t.cancelled():
            continue
        exc = t.exception()
        # a cancelled gather is not cancelled() itself: it ends with its children's CancelledError
        if exc is not None and not isinstance(exc, asyncio.CancelledError):
            name = t.get_name() if isinstance(t, asyncio.Task) else what
            log.error("task had failed when it was stopped", task=name, error=repr(exc))
            failed.append((name, exc))
    return failed
