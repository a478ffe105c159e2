"""The in-memory bus: the MQTT bus's contract inside one process, for runs on virtual time.

:class:`MemoryBroker` is one run's broker; :class:`MemoryBus` is a stage's connection to it. Same topics
(``voicepipe/{run}/{session}/{channel}``, a stage subscribes per channel for every session), same
:class:`~voicepipe.messages.Envelope` objects, QoS-1 delivery as the MQTT bus gives it on one broker: every
subscriber (the publisher too) gets every message exactly once, in publish order per publisher. The
envelope object itself is passed — no JSON round trip (the payloads were validated when they were built).
A broker made for one virtual run (``trusted=True``, as :func:`voicepipe.runner.simulate` makes it) is
reachable by nothing but that run's own stages, so messages on it are neither signed nor authenticated
(:attr:`voicepipe.bus.base.Bus.trusted`; the guard's other checks stay). Unlike a broker, it knows who listens: :meth:`MemoryBus.wanted` tells a stage that a message on a channel no
one subscribes to (and no tap watches) would reach nobody, so it need not be built at all.

A stage's receive loop (:meth:`MemoryBus.serve`) has no queue and no task per message: a delivery puts the
envelope on the subscriber's backlog and, once per batch, schedules one callback that hands the backlog to
the stage's ``receive`` in order — as a task reading a queue would, one scheduling hop after the publish.
A ``receive`` that completes without waiting (the common case: handlers publish and spawn tasks) costs a
call; one that waits continues as a task, and the subscriber's next messages wait until it is done, so a
stage still handles its messages one at a time, in arrival order.

A hop costs ``hop_ns`` of (virtual) time: 0 by default, so a run's timing is its modelled spans alone; a
modelled hop delays delivery: each subscriber's messages wait in a FIFO drained by one timer, so the order
stays the publish order (asyncio's timer heap does not keep the order of equal deadlines).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from typing import Any

from voicepipe.bus.base import Bus
from voicepipe.clock import now_ns
from voicepipe.keys import sign
from voicepipe.messages import Envelope, channel_of


class MemoryBroker:
    """One run's subscriptions: channel -> the buses subscribed to it (in subscription order)."""

    def __init__(
        self,
        run: str,
        hop_ns: int = 0,
        tap: Callable[[str, Envelope], None] | None = None,
        *,
        trusted: bool = False,
    ) -> None:
        self.run = run
        self.hop_ns = hop_ns
        self.trusted = trusted  # only this run's stages hold a connection: no MACs (Bus.trusted)
        self.tap = tap  # sees every published message (an observer, like a tool subscribed to voicepipe/#)
        self.subs: dict[str, list[MemoryBus]] = {}
        self.delivered = 0

    def connect(self, name: str) -> MemoryBus:
        return MemoryBus(self, name)

    def deliver(self, channel: str, env: Envelope) -> None:
        if self.tap is not None:
            self.tap(channel, env)
        subs = self.subs.get(channel)
        if not subs:
            return
        self.delivered += len(subs)
        if self.hop_ns:
            due = now_ns() + self.hop_ns
            for bus in subs:
                bus.later(due, (channel, env))
        else:
            for bus in subs:
                bus.push(channel, env)


class MemoryBus(Bus):
    """A stage's connection to a :class:`MemoryBroker`."""

    def __init__(self, broker: MemoryBroker, name: str) -> None:
        super().__init__(broker.run, name)
        self.broker = broker
        self.trusted = broker.trusted
        self.inbox: asyncio.Queue[tuple[str, Envelope]] = asyncio.Queue()
        self.channels: set[str] = set()
        self.in_flight: deque[tuple[int, tuple[str, Envelope]]] = deque()
        # set by serve(): a stage's receive is an ``async def``, its coroutine is stepped here directly
        self.receive: Callable[[Envelope], Coroutine[Any, Any, None]] | None = None
        self.backlog: deque[Envelope] = deque()
        self.draining = False  # a drain is scheduled or running
        self.busy: asyncio.Task[None] | None = None  # a receive that had to wait, continuing as a task
        self.served: asyncio.Future[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # serve()'s loop: deliveries come on it

    def push(self, channel: str, env: Envelope) -> None:
        if self.receive is None:
            self.inbox.put_nowait((channel, env))
            return
        self.backlog.append(env)
        if not self.draining and self.busy is None:
            self.draining = True
            self.loop.call_soon(self._drain)  # type: ignore[union-attr]  # set with receive, by serve()

    def _drain(self) -> None:
        backlog, receive = self.backlog, self.receive
        try:
            while backlog and self.busy is None and receive is not None:
                self.received += 1
                coro = receive(backlog.popleft())
                try:
                    waits_on = coro.send(None)
                except StopIteration:
                    continue
                self.busy = self.loop.create_task(_finish(coro, waits_on))  # type: ignore[union-attr]
                self.busy.add_done_callback(self._resumed)
        except BaseException as exc:  # receive itself failed (not a handler): the stage's loop ends with it
            if self.served is not None and not self.served.done():
                self.served.set_exception(exc)
        finally:
            self.draining = False

    def _resumed(self, task: asyncio.Task[None]) -> None:
        self.busy = None
        if not task.cancelled() and task.exception() is not None:
            if self.served is not None and not self.served.done():
                self.served.set_exception(task.exception())  # type: ignore[arg-type]
            return
        if self.backlog and not self.draining:
            self.draining = True
            self._drain()

    def later(self, due_ns: int, item: tuple[str, Envelope]) -> None:
        """Deliver ``item`` at ``due_ns`` (dues arrive in non-decreasing order: one hop for all)."""
        self.in_flight.append((due_ns, item))
        if len(self.in_flight) == 1:
            asyncio.get_running_loop().call_at(due_ns / 1e9, self._land)

    def _land(self) -> None:
        now = now_ns()
        q = self.in_flight
        while q and q[0][0] <= now + 1:  # the loop's timers have 1 ns resolution
            self.push(*q.popleft()[1])
        if q:
            asyncio.get_running_loop().call_at(q[0][0] / 1e9, self._land)

    def wanted(self, channel: str) -> bool:
        """Would a message on ``channel`` reach anyone (a subscriber, or the tap that sees everything)?"""
        return self.broker.tap is not None or bool(self.broker.subs.get(channel))

    async def subscribe(self, *channels: str) -> None:
        for ch in channels:
            if ch not in self.channels:
                self.channels.add(ch)
                self.broker.subs.setdefault(ch, []).append(self)

    async def publish(self, env: Envelope, *, qos: int | None = None) -> None:
        self.post(env)

    def post(self, env: Envelope) -> None:
        """:meth:`publish` without a coroutine: delivery never waits (a stage calls this directly)."""
        d = env.__dict__  # plain field reads and writes (every field is set when it is built)
        if d["run"] != self.run:
            raise ValueError(f"envelope of run {d['run']!r} published on run {self.run!r}")
        d["sent_ns"] = now_ns()
        if self.key is not None:  # an untrusted in-memory bus (tests): signed like a body on the wire
            sign(env, self.key)
        self.published += 1
        self.broker.deliver(channel_of(d["type"]), env)

    async def messages(self) -> AsyncIterator[tuple[str, Envelope]]:
        inbox = self.inbox
        while True:
            item = await inbox.get()
            self.received += 1
            yield item

    async def serve(self, receive: Callable[[Envelope], Awaitable[None]]) -> None:
        self.loop = asyncio.get_running_loop()
        self.receive = receive  # type: ignore[assignment]  # an async def (see __init__)
        while not self.inbox.empty():  # delivered before serve() began
            self.backlog.append(self.inbox.get_nowait()[1])
        self.served = asyncio.get_running_loop().create_future()
        if self.backlog and not self.draining:
            self.draining = True
            asyncio.get_running_loop().call_soon(self._drain)
        try:
            await self.served
        finally:
            self.receive = None
            if self.busy is not None:
                self.busy.cancel()


class _Rest:
    """The rest of a coroutine that has already run up to its first wait on ``first`` (for a task)."""

    __slots__ = ("coro", "first")

    def __init__(self, coro: Coroutine[Any, Any, None], first: Any) -> None:
        self.coro, self.first = coro, first

    def __await__(self) -> Generator[Any, Any, None]:
        coro, waits_on = self.coro, self.first
        while True:
            try:
                sent = yield waits_on
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:
                try:
                    waits_on = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    waits_on = coro.send(sent)
                except StopIteration:
                    return


async def _finish(coro: Coroutine[Any, Any, None], first: Any) -> None:
    await _Rest(coro, first)
