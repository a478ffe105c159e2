"""The in-memory bus: the MQTT bus's contract inside one process, for runs on virtual time.

:class:`MemoryBroker` is one run's broker; :class:`MemoryBus` is a stage's connection to it. Same topics
(``voicepipe/{run}/{session}/{channel}``, a stage subscribes per channel for every session), same
:class:`~voicepipe.messages.Envelope` objects, QoS-1 delivery as the MQTT bus gives it on one broker: every
subscriber (the publisher too) gets every message exactly once, in publish order per publisher. The
envelope object itself is passed — no JSON round trip (the payloads were validated when they were built).

A hop costs ``hop_ns`` of (virtual) time: 0 by default, so a run's timing is its modelled spans alone; a
modelled hop delays delivery: each subscriber's messages wait in a FIFO drained by one timer, so the order
stays the publish order (asyncio's timer heap does not keep the order of equal deadlines).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from voicepipe.bus import Bus
from voicepipe.clock import now_ns
from voicepipe.messages import Envelope, channel_of


class MemoryBroker:
    """One run's subscriptions: channel -> the buses subscribed to it (in subscription order)."""

    def __init__(self, run: str, hop_ns: int = 0, tap: Callable[[str, Envelope], None] | None = None) -> None:
        self.run = run
        self.hop_ns = hop_ns
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
                bus.inbox.put_nowait((channel, env))


class MemoryBus(Bus):
    """A stage's connection to a :class:`MemoryBroker`."""

    def __init__(self, broker: MemoryBroker, name: str) -> None:
        super().__init__(broker.run, name)
        self.broker = broker
        self.inbox: asyncio.Queue[tuple[str, Envelope]] = asyncio.Queue()
        self.channels: set[str] = set()
        self.in_flight: deque[tuple[int, tuple[str, Envelope]]] = deque()

    def later(self, due_ns: int, item: tuple[str, Envelope]) -> None:
        """Deliver ``item`` at ``due_ns`` (dues arrive in non-decreasing order: one hop for all)."""
        self.in_flight.append((due_ns, item))
        if len(self.in_flight) == 1:
            asyncio.get_running_loop().call_at(due_ns / 1e9, self._land)

    def _land(self) -> None:
        now = now_ns()
        q = self.in_flight
        while q and q[0][0] <= now + 1:  # the loop's timers have 1 ns resolution
            self.inbox.put_nowait(q.popleft()[1])
        if q:
            asyncio.get_running_loop().call_at(q[0][0] / 1e9, self._land)

    async def subscribe(self, *channels: str) -> None:
        for ch in channels:
            if ch not in self.channels:
                self.channels.add(ch)
                self.broker.subs.setdefault(ch, []).append(self)

    async def publish(self, env: Envelope, *, qos: int | None = None) -> None:
        if env.run != self.run:
            raise ValueError(f"envelope of run {env.run!r} published on run {self.run!r}")
        env.sent_ns = now_ns()
        self.published += 1
        self.broker.deliver(channel_of(env.type), env)

    async def messages(self) -> AsyncIterator[tuple[str, Envelope]]:
        inbox = self.inbox
        while True:
            item = await inbox.get()
            self.received += 1
            yield item
