"""Real-time deadlines: one deadline timer per event loop, and the real clock's test offset.

Modelled durations are realised by sleeping until absolute deadlines. asyncio's own timers wake up to
~1 ms late (epoll and libuv take whole milliseconds), which on a chain of six sleeps would add ~6 ms of fake
"pipeline tax". So one deadline timer per event loop serves every deadline, on Linux through a kernel
``timerfd`` armed at the earliest deadline (absolute CLOCK_MONOTONIC, ns resolution, timer slack set to
1 µs for the loop's thread) and watched by the loop like any socket: the loop sleeps in epoll until the
deadline or I/O, whichever comes first, and burns no CPU waiting. Elsewhere (no timerfd) the timer sleeps
coarsely to ~1 ms before the earliest deadline, then yields to the loop until it passes (a spin that costs
a core while deadlines are near: measured at ~43 % of a live run's CPU on the rapid-fire scenario).

Contract: :func:`sleep_until_real_ns` never returns before its deadline (on the host's clock plus this
context's test offset); sleepers wake in deadline order. Nothing here knows about virtual time
(:mod:`voicepipe.clock.now` chooses between the two).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import heapq
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable

SPIN_NS = 1_200_000  # finish the last stretch by yielding, not by an epoll timeout
log = logging.getLogger("voicepipe.clock")


class _TimerFd:
    """A Linux timerfd on CLOCK_MONOTONIC (``os.timerfd_*`` from Python 3.13, else libc through ctypes)."""

    def __init__(self) -> None:
        flags = os.O_NONBLOCK | os.O_CLOEXEC  # TFD_NONBLOCK / TFD_CLOEXEC have these values on Linux
        self.fd: int
        self._set: Callable[[int], object]
        if sys.version_info >= (3, 13):  # (os.timerfd_* exist on Linux from 3.13; only Linux builds this)
            self.fd = os.timerfd_create(time.CLOCK_MONOTONIC, flags=flags)
            self._set = lambda ns: os.timerfd_settime_ns(self.fd, flags=os.TFD_TIMER_ABSTIME, initial=ns)
        else:
            libc = _libc()
            fd = libc.timerfd_create(time.CLOCK_MONOTONIC, flags)
            if fd < 0:
                raise OSError(ctypes.get_errno(), "timerfd_create failed")
            self.fd = fd
            spec = _ITimerSpec()

            def settime(ns: int) -> None:
                spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(ns, 1_000_000_000)
                if libc.timerfd_settime(self.fd, 1, ctypes.byref(spec), None) != 0:  # 1: TFD_TIMER_ABSTIME
                    raise OSError(ctypes.get_errno(), "timerfd_settime failed")

            self._set = settime
        _tighten_timer_slack()

    def arm(self, deadline_ns: int) -> None:
        self._set(max(deadline_ns, 1))  # 0 would disarm it

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            os.read(self.fd, 8)

    def close(self) -> None:
        """Close once (a closed fd number may be reused by the next file: never close it twice)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


class _TimeSpec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("it_interval", _TimeSpec), ("it_value", _TimeSpec)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return libc


def _tighten_timer_slack() -> None:
    """The kernel delays a thread's timer wake-ups by its slack (default 50 µs): 1 µs for this thread."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, ns


def _timerfd_or_none() -> _TimerFd | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return _TimerFd()
    except (OSError, AttributeError) as exc:
        log.debug("no timerfd (%s): deadlines are met by yielding to the loop", exc)
        return None


class _DeadlineTimer:
    """Every real-time deadline of one event loop: a heap of futures, woken by a timerfd (or a short spin)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.fd = _timerfd_or_none()
        if self.fd is not None:
            try:
                loop.add_reader(self.fd.fd, self._fire)
            except (NotImplementedError, RuntimeError):  # a loop without readers (e.g. Windows proactor)
                self.fd.close()
                self.fd = None
        self.armed_ns = 0
        self.loop = loop
        self.heap: list[tuple[int, int, asyncio.Future[None]]] = []
        self.seq = itertools.count()
        self.task: asyncio.Task[None] | None = None
        self.wake: asyncio.Future[None] | None = None

    def close(self) -> None:
        """The loop is closed: release the timerfd (the loop already dropped its reader)."""
        if self.fd is not None:
            self.fd.close()
        self.heap.clear()

    def add(self, deadline_ns: int) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self.loop.create_future()
        heapq.heappush(self.heap, (deadline_ns, next(self.seq), fut))
        if self.fd is not None:
            if self.heap[0][2] is fut or not self.armed_ns:
                self.armed_ns = self.heap[0][0]
                self.fd.arm(self.armed_ns)
            return fut
        if self.task is None or self.task.done():
            self.task = self.loop.create_task(self._run(), name="voicepipe-deadline-timer")
        elif self.heap[0][2] is fut and self.wake is not None and not self.wake.done():
            self.wake.set_result(None)  # a new earliest deadline: re-plan the coarse sleep
        return fut

    def _fire(self) -> None:
        """The timerfd is readable: resolve every due deadline, re-arm for the next one."""
        assert self.fd is not None
        self.fd.drain()
        heap = self.heap
        now = time.monotonic_ns()
        while heap and (heap[0][0] <= now or heap[0][2].done()):
            _, _, fut = heapq.heappop(heap)
            if not fut.done():
                fut.set_result(None)
        self.armed_ns = heap[0][0] if heap else 0
        if heap:
            self.fd.arm(self.armed_ns)

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


# one deadline timer per event loop; a timer refers to its loop, so entries are dropped explicitly (when the
# next loop makes its timer, every closed loop's timer closes its timerfd): tests run hundreds of loops
_timers: dict[asyncio.AbstractEventLoop, _DeadlineTimer] = {}


def _timer_of(loop: asyncio.AbstractEventLoop) -> _DeadlineTimer:
    timer = _timers.get(loop)
    if timer is None:
        for old in [lp for lp in list(_timers) if lp.is_closed()]:
            stale = _timers.pop(old, None)  # (another thread's loop may purge the same entry)
            if stale is not None:
                stale.close()
        timer = _timers[loop] = _DeadlineTimer(loop)
    return timer


# Test hook (issue 10: measurement must not need the stages' clocks to agree): code running in a context where
# this is set reads a real clock offset by that many ns, as a stage on another host would. Tasks inherit it
# from the task that created them, so setting it at the top of a stage's receive loop moves that whole stage.
_offset_ns: contextvars.ContextVar[int] = contextvars.ContextVar("voicepipe_clock_offset_ns", default=0)


def set_clock_offset_ns(offset_ns: int) -> None:
    """Offset the real clock by ``offset_ns`` for the current task and the tasks it starts (tests only)."""
    _offset_ns.set(offset_ns)


async def sleep_until_real_ns(deadline_ns: int) -> None:
    """Sleep on the running (real) loop until ``deadline_ns`` on this context's offset clock."""
    loop = asyncio.get_running_loop()
    deadline_ns -= _offset_ns.get()  # to the host's clock
    if deadline_ns <= time.monotonic_ns():
        await asyncio.sleep(0)
        return
    await _timer_of(loop).add(deadline_ns)
