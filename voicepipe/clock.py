"""The one clock every stage reads, and the one place that sleeps: real or virtual.

Real: CLOCK_MONOTONIC in ns (shared by all processes on a host). Virtual: :class:`VirtualLoop`, an asyncio
event loop with no I/O whose time is a counter — when no callback is ready it jumps straight to the
earliest timer instead of waiting, so modelled seconds cost only the CPU of the code that runs. Code on it
is unchanged: :func:`now_ns` and :func:`sleep_until_ns` follow the running loop, and asyncio's own timers
(``asyncio.sleep``, ``wait_for``, ``call_later``) run on its time. A virtual run in which every task waits
and no timer is left is a deadlock: it raises :class:`VirtualDeadlock` instead of hanging.

Real-time sleeps: modelled durations are realised by sleeping until absolute deadlines. asyncio's own timers wake up to
~1 ms late (epoll takes whole milliseconds), which on a chain of six sleeps would add ~6 ms of fake
"pipeline tax". So one timer task per event loop serves every deadline: it sleeps coarsely to ~1 ms
before the earliest deadline, then yields to the loop until the deadline passes. Only that task ever
spins, whatever the number of sessions, and I/O keeps flowing while it does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import heapq
import itertools
import time
import weakref
import zlib
from asyncio import events
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np

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


class VirtualDeadlock(RuntimeError):
    """Every task of a virtual run waits on something no timer or message will ever bring."""


class _JumpingSelector:
    """The selector of a loop without I/O: ``select(timeout)`` moves virtual time instead of blocking."""

    def __init__(self, loop: VirtualLoop) -> None:
        self.loop = loop

    def select(self, timeout: float | None) -> list[Any]:
        if timeout is None:
            raise VirtualDeadlock(
                "virtual clock: every task is waiting and no timer is scheduled (a deadlock in the pipeline)"
            )
        if timeout > 0:
            # the loop dropped cancelled timers from the head of its heap before computing the timeout
            when = self.loop._scheduled[0]._when
            self.loop.now = max(self.loop.now, round(when * 1e9))
        return []

    def close(self) -> None:
        pass


class VirtualLoop(asyncio.BaseEventLoop):
    """An asyncio loop on virtual time (ns counter starting at ``start_ns``); no sockets, no subprocesses."""

    def __init__(self, start_ns: int = 0) -> None:
        super().__init__()
        self.now = start_ns
        self._selector = _JumpingSelector(self)
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.now / 1e9

    def _process_events(self, event_list: list[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        pass  # nothing runs in other threads: no wake-up needed


T = TypeVar("T")


def run_virtual(coro: Coroutine[Any, Any, T], start_ns: int = 0) -> T:
    """Run ``coro`` to completion on a fresh :class:`VirtualLoop`; blocks the caller (in a helper thread
    when the caller's thread already runs an event loop)."""

    def go() -> T:
        # not asyncio.Runner: it swaps the SIGINT handler, and repr()s the old one on the way (slow with a
        # big pipeline in it); a virtual run has nothing to interrupt but the CPU work itself
        loop = VirtualLoop(start_ns)
        try:
            return loop.run_until_complete(coro)
        finally:
            left = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in left:
                t.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    if events._get_running_loop() is None:
        return go()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="voicepipe-virtual") as pool:
        return pool.submit(go).result()


# Test hook (issue 10: measurement must not need the stages' clocks to agree): code running in a context where
# this is set reads a real clock offset by that many ns, as a stage on another host would. Tasks inherit it
# from the task that created them, so setting it at the top of a stage's receive loop moves that whole stage.
_offset_ns: contextvars.ContextVar[int] = contextvars.ContextVar("voicepipe_clock_offset_ns", default=0)


def set_clock_offset_ns(offset_ns: int) -> None:
    """Offset the real clock by ``offset_ns`` for the current task and the tasks it starts (tests only)."""
    _offset_ns.set(offset_ns)


def now_ns() -> int:
    """Monotonic ns: the running virtual loop's time, else the host's CLOCK_MONOTONIC (plus a test offset)."""
    loop = events._get_running_loop()
    if loop.__class__ is VirtualLoop:
        return loop.now  # type: ignore[attr-defined]
    return time.monotonic_ns() + _offset_ns.get()


def is_virtual() -> bool:
    return events._get_running_loop().__class__ is VirtualLoop


async def _sleep_virtual(loop: VirtualLoop, deadline_ns: int) -> None:
    # a timer may pop up to the loop's 1 ns resolution early: sleep again until the deadline is reached
    while loop.now < deadline_ns:
        fut = loop.create_future()
        handle = loop.call_at(deadline_ns / 1e9, _resolve, fut)
        try:
            await fut
        finally:
            handle.cancel()


async def sleep_until_ns(deadline_ns: int) -> None:
    """Sleep until an absolute monotonic deadline (never a chain of relative sleeps that drifts)."""
    loop = asyncio.get_running_loop()
    if loop.__class__ is VirtualLoop:
        if deadline_ns <= loop.now:  # type: ignore[attr-defined]
            await asyncio.sleep(0)
        else:
            await _sleep_virtual(loop, deadline_ns)  # type: ignore[arg-type]
        return
    deadline_ns -= _offset_ns.get()  # to the host's clock
    if deadline_ns <= time.monotonic_ns():
        await asyncio.sleep(0)
        return
    timer = _timers.get(loop)
    if timer is None:
        timer = _timers[loop] = _DeadlineTimer(loop)
    await timer.add(deadline_ns)


def rng_for(seed: int, *keys: object) -> np.random.Generator:
    """A reproducible generator for one (seed, session, turn, stage...) — independent of arrival order."""
    words = [seed & 0xFFFFFFFF] + [zlib.crc32(str(k).encode()) for k in keys]
    return np.random.default_rng(words)
