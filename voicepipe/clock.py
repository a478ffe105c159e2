"""The one clock every stage reads: CLOCK_MONOTONIC in ns (shared by all processes on a host).

Modelled durations are realised by sleeping until absolute deadlines. asyncio's own timers wake up to
~1 ms late (epoll takes whole milliseconds), which on a chain of six sleeps would add ~6 ms of fake
"pipeline tax". So one timer task per event loop serves every deadline: it sleeps coarsely to ~1 ms
before the earliest deadline, then yields to the loop until the deadline passes. Only that task ever
spins, whatever the number of sessions, and I/O keeps flowing while it does.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
import weakref
import zlib

import numpy as np

now_ns = time.monotonic_ns
SPIN_NS = 1_200_000  # finish the last stretch by yielding, not by an epoll timeout


class _DeadlineTimer:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.heap: list[tuple[int, int, asyncio.Future[None]]] = []
        self.seq = itertools.count()
        self.task: asyncio.Task[None] | None = None
        self.wake: asyncio.Future[None] | None = None

    def add(self, deadline_ns: int) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self.loop.create_future()
        heapq.heappush(self.heap, (deadline_ns, next(self.seq), fut))
        if self.task is None or self.task.done():
            self.task = self.loop.create_task(self._run(), name="voicepipe-deadline-timer")
        elif self.heap[0][2] is fut and self.wake is not None and not self.wake.done():
            self.wake.set_result(None)  # a new earliest deadline: re-plan the coarse sleep
        return fut

    async def _run(self) -> None:
        heap = self.heap
        while heap:
            now = time.monotonic_ns()
            while heap and (heap[0][0] <= now or heap[0][2].done()):
                _, _, fut = heapq.heappop(heap)
                if not fut.done():
                    fut.set_result(None)
            if not heap:
                break
            remaining = heap[0][0] - now
            if remaining > SPIN_NS:
                self.wake = self.loop.create_future()
                handle = self.loop.call_later((remaining - SPIN_NS) / 1e9, _resolve, self.wake)
                try:
                    await self.wake
                finally:
                    handle.cancel()
            else:
                await asyncio.sleep(0)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


_timers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _DeadlineTimer] = weakref.WeakKeyDictionary()


async def sleep_until_ns(deadline_ns: int) -> None:
    """Sleep until an absolute monotonic deadline (never a chain of relative sleeps that drifts)."""
    if deadline_ns <= time.monotonic_ns():
        await asyncio.sleep(0)
        return
    loop = asyncio.get_running_loop()
    timer = _timers.get(loop)
    if timer is None:
        timer = _timers[loop] = _DeadlineTimer(loop)
    await timer.add(deadline_ns)


def rng_for(seed: int, *keys: object) -> np.random.Generator:
    """A reproducible generator for one (seed, session, turn, stage...) — independent of arrival order."""
    words = [seed & 0xFFFFFFFF] + [zlib.crc32(str(k).encode()) for k in keys]
    return np.random.default_rng(words)
