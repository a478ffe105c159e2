"""The one clock every stage reads, and the one place that sleeps: real or virtual.

Real: CLOCK_MONOTONIC in ns (shared by all processes on a host). Virtual: :class:`VirtualLoop`, an asyncio
event loop with no I/O whose time is a counter — when no callback is ready it jumps straight to the
earliest timer instead of waiting, so modelled seconds cost only the CPU of the code that runs. Code on it
is unchanged: :func:`now_ns` and :func:`sleep_until_ns` follow the running loop, and asyncio's own timers
(``asyncio.sleep``, ``wait_for``, ``call_later``) run on its time. A virtual run in which every task waits
and no timer is left is a deadlock: it raises :class:`VirtualDeadlock` instead of hanging.

The virtual loop is a minimal ``AbstractEventLoop`` (not ``BaseEventLoop``: no selector, no debug paths,
no per-iteration timeout arithmetic): a deque of ready handles and one heap of ``(ns, sequence, item)``
timers, where a virtual sleep's item is its future itself (no handle, nothing to cancel). Equal deadlines
run in the order they were scheduled. asyncio's C Futures and Tasks run on it unchanged.

Real-time sleeps: modelled durations are realised by sleeping until absolute deadlines. asyncio's own timers wake up to
~1 ms late (epoll and libuv take whole milliseconds), which on a chain of six sleeps would add ~6 ms of fake
"pipeline tax". So one deadline timer per event loop serves every deadline, on Linux through a kernel
``timerfd`` armed at the earliest deadline (absolute CLOCK_MONOTONIC, ns resolution, timer slack set to
1 µs for the loop's thread) and watched by the loop like any socket: the loop sleeps in epoll until the
deadline or I/O, whichever comes first, and burns no CPU waiting. Elsewhere (no timerfd) the timer sleeps
coarsely to ~1 ms before the earliest deadline, then yields to the loop until it passes (a spin that costs
a core while deadlines are near: measured at ~43 % of a live run's CPU on the rapid-fire scenario).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import ctypes
import gc
import heapq
import itertools
import logging
import os
import sys
import threading
import time
import weakref
import zlib
from asyncio import events
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from contextvars import Context
from typing import Any, TypeVar

import numpy as np

SPIN_NS = 1_200_000  # finish the last stretch by yielding, not by an epoll timeout
log = logging.getLogger("voicepipe.clock")


class _TimerFd:
    """A Linux timerfd on CLOCK_MONOTONIC (``os.timerfd_*`` from Python 3.13, else libc through ctypes)."""

    def __init__(self) -> None:
        flags = os.O_NONBLOCK | os.O_CLOEXEC  # TFD_NONBLOCK / TFD_CLOEXEC have these values on Linux
        if hasattr(os, "timerfd_create"):
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


class VirtualDeadlock(RuntimeError):
    """Every task of a virtual run waits on something no timer or message will ever bring."""


class _Handle:
    """A ready callback (what ``call_soon`` returns): run once by the loop unless cancelled first."""

    __slots__ = ("_args", "_callback", "_cancelled", "_context")

    def __init__(
        self, callback: Callable[..., object], args: tuple[Any, ...], context: Context | None
    ) -> None:
        self._callback = callback
        self._args = args
        self._context = context if context is not None else contextvars.copy_context()
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:  # the timer heap's test for a dead entry (a sleep's future answers the same)
        return self._cancelled


class _Timer(_Handle):
    """A callback due at a virtual instant (what ``call_at``/``call_later`` return)."""

    __slots__ = ("_when_ns",)

    def when(self) -> float:
        return self._when_ns / 1e9


class VirtualLoop(asyncio.AbstractEventLoop):
    """An asyncio loop on virtual time (ns counter starting at ``start_ns``); no I/O, threads or subprocesses.

    Ready callbacks run in FIFO order; timers sit in one heap of ``(due ns, sequence, handle or future)``
    (equal deadlines keep their scheduling order). When nothing is ready, time jumps to the earliest live
    timer; when nothing is ready and no timer is left, the run is a :class:`VirtualDeadlock`. Virtual
    sleeps (:func:`sleep_until_ns`) put their future straight into the heap: no handle, no cancel.
    asyncio's own Futures and Tasks, ``asyncio.sleep``, ``wait_for``, ``timeout``, queues and events run
    on it unchanged; executors, sockets, signals and subprocesses are not available.
    """

    def __init__(self, start_ns: int = 0) -> None:
        self.now = start_ns
        self._ready: deque[_Handle] = deque()
        self._heap: list[tuple[int, int, Any]] = []
        self._seq = itertools.count()
        self._stopping = False
        self._closed = False
        self._running = False
        self._exception_handler: Callable[..., object] | None = None
        self._task_factory: Any = None
        self._asyncgens: weakref.WeakSet[Any] = weakref.WeakSet()

    # -- time and scheduling ---------------------------------------------------------------------
    def time(self) -> float:
        return self.now / 1e9

    def call_soon(
        self, callback: Callable[..., object], *args: Any, context: Context | None = None
    ) -> _Handle:
        h = _Handle(callback, args, context)
        self._ready.append(h)
        return h

    call_soon_threadsafe = call_soon  # nothing runs in other threads

    def call_at(
        self, when: float, callback: Callable[..., object], *args: Any, context: Context | None = None
    ) -> _Timer:
        h = _Timer(callback, args, context)
        h._when_ns = round(when * 1e9)
        heapq.heappush(self._heap, (h._when_ns, next(self._seq), h))
        return h

    def call_later(
        self, delay: float, callback: Callable[..., object], *args: Any, context: Context | None = None
    ) -> _Timer:
        return self.call_at(self.now / 1e9 + delay, callback, *args, context=context)

    def wake_at(self, when_ns: int) -> asyncio.Future[None]:
        """A future resolved when virtual time reaches ``when_ns`` (cancel it to drop the wake-up)."""
        fut = self.create_future()
        heapq.heappush(self._heap, (when_ns, next(self._seq), fut))
        return fut

    def create_future(self) -> asyncio.Future[Any]:
        return asyncio.Future(loop=self)

    def create_task(self, coro: Any, *, name: str | None = None, context: Context | None = None) -> Any:
        if self._task_factory is not None:
            task = (
                self._task_factory(self, coro)
                if context is None
                else self._task_factory(self, coro, context=context)
            )
            if name is not None:
                task.set_name(name)
            return task
        return asyncio.Task(coro, loop=self, name=name, context=context)

    def set_task_factory(self, factory: Any) -> None:
        self._task_factory = factory

    def get_task_factory(self) -> Any:
        return self._task_factory

    # -- running ---------------------------------------------------------------------------------
    def _run(self) -> None:
        ready, heap, pop = self._ready, self._heap, heapq.heappop
        while True:
            if not ready:
                while heap and heap[0][2].done():
                    pop(heap)
                if not heap:
                    if self._stopping:
                        return
                    raise VirtualDeadlock(
                        "virtual clock: every task is waiting and no timer is scheduled (a deadlock in the pipeline)"
                    )
                if heap[0][0] > self.now:
                    self.now = heap[0][0]
            now = self.now
            while heap and heap[0][0] <= now:
                item = pop(heap)[2]
                if item.__class__ is _Timer:
                    if not item._cancelled:
                        ready.append(item)
                elif not item.done():
                    item.set_result(None)
            for _ in range(len(ready)):
                h = ready.popleft()
                if h._cancelled:
                    continue
                try:
                    h._context.run(h._callback, *h._args)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:
                    self.call_exception_handler(
                        {"message": f"Exception in callback {h._callback!r}", "exception": exc, "handle": h}
                    )
            if self._stopping:
                return

    def run_forever(self) -> None:
        if self._running:
            raise RuntimeError("This event loop is already running")
        if events._get_running_loop() is not None:
            raise RuntimeError("Cannot run the event loop while another loop is running")
        old_hooks = sys.get_asyncgen_hooks()
        sys.set_asyncgen_hooks(firstiter=self._asyncgens.add, finalizer=self._finalize_asyncgen)
        self._running = True
        events._set_running_loop(self)
        _here.virtual = self
        try:
            self._run()
        finally:
            self._stopping = False
            self._running = False
            _here.virtual = None
            events._set_running_loop(None)
            sys.set_asyncgen_hooks(*old_hooks)

    def run_until_complete(self, future: Any) -> Any:
        fut = asyncio.ensure_future(future, loop=self)
        fut.add_done_callback(self._stop_when_done)
        try:
            self.run_forever()
        finally:
            fut.remove_done_callback(self._stop_when_done)
        if not fut.done():
            raise RuntimeError("Event loop stopped before Future completed.")
        return fut.result()

    def _stop_when_done(self, fut: asyncio.Future[Any]) -> None:
        self._stopping = True

    def stop(self) -> None:
        self._stopping = True

    def is_running(self) -> bool:
        return self._running

    def is_closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._running:
            raise RuntimeError("Cannot close a running event loop")
        self._closed = True
        self._ready.clear()
        self._heap.clear()

    def get_debug(self) -> bool:
        return False

    def set_debug(self, enabled: bool) -> None:
        pass

    # -- async generators, errors ----------------------------------------------------------------
    def _finalize_asyncgen(self, agen: Any) -> None:
        self._asyncgens.discard(agen)
        if not self._closed:
            self.create_task(agen.aclose())

    async def shutdown_asyncgens(self) -> None:
        gens = list(self._asyncgens)
        self._asyncgens.clear()
        if gens:
            await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)

    async def shutdown_default_executor(self, timeout: float | None = None) -> None:
        pass

    def set_exception_handler(self, handler: Callable[..., object] | None) -> None:
        self._exception_handler = handler

    def get_exception_handler(self) -> Callable[..., object] | None:
        return self._exception_handler

    def default_exception_handler(self, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        log.error(context.get("message", "Unhandled exception in the virtual loop"), exc_info=exc)

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        if self._exception_handler is None:
            self.default_exception_handler(context)
        else:
            self._exception_handler(self, context)


T = TypeVar("T")

# A run allocates futures, handles, tasks and messages by the hundred per turn; with the default collector
# settings ~10 % of a virtual run's CPU went to collections, most of it re-walking the long-lived heap
# (configs, model tables, imports), and a live run of 500 sessions stalled its event loop for 17 ms (gen 0/1)
# to 150 ms (gen 2) at a time: measured as pipeline tax (its p90/p99). During a run, virtual or live: what
# exists before it is frozen (never walked) and the youngest generation is collected every 20,000
# allocations instead of 700. While only virtual runs are in progress the collector is off altogether: a
# virtual run's state is mostly alive until it ends (every session's tasks, futures and timers), so even
# lean collections kept re-walking it: 8 % of the CPU of a 1,000-session level, 11 % of a 2,000-session one
# (gc.callbacks timing). It leaves cyclic garbage behind (measured: 2 to 39 objects per turn, by
# configuration), freed by one collection of the youngest generation when the last run ends (~3 % of a
# level's CPU). Handing the survivors to the oldest generation instead was cheaper but leaked: on Python
# 3.11 that generation is collected only after enough promotions, which back-to-back virtual runs never make
# (a reviewer measured +1.35 MB per run over 40 runs in one process).
# Timing only: nothing is leaked, the settings are restored when the last concurrent run ends.
GC_THRESHOLD = (20_000, 20, 100)
_gc_lock = threading.Lock()
_gc_runs = 0  # runs in progress, virtual or live
_gc_live = 0  # of which live
_gc_saved: tuple[int, int, int] = gc.get_threshold()
_gc_was_enabled = True


def _gc_apply() -> None:
    if _gc_live == 0:
        gc.disable()
    else:
        gc.enable()


@contextlib.contextmanager
def lean_gc(virtual: bool = False) -> Iterator[None]:
    """Collector settings for one run (see above); ``virtual`` runs switch it off while no live run runs."""
    global _gc_runs, _gc_live, _gc_saved, _gc_was_enabled
    with _gc_lock:
        if _gc_runs == 0:
            _gc_saved = gc.get_threshold()
            _gc_was_enabled = gc.isenabled()
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLD)
        _gc_runs += 1
        _gc_live += not virtual
        if _gc_was_enabled:
            _gc_apply()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_runs -= 1
            _gc_live -= not virtual
            if _gc_runs == 0:
                gc.set_threshold(*_gc_saved)
                gc.unfreeze()
                if _gc_was_enabled:
                    gc.enable()
                    if virtual:
                        gc.collect(0)  # the run's objects never left the youngest generation
            elif _gc_was_enabled:
                _gc_apply()


def run_virtual(coro: Coroutine[Any, Any, T], start_ns: int = 0) -> T:
    """Run ``coro`` to completion on a fresh :class:`VirtualLoop`; blocks the caller (in a helper thread
    when the caller's thread already runs an event loop)."""

    def go() -> T:
        # not asyncio.Runner: it swaps the SIGINT handler, and repr()s the old one on the way (slow with a
        # big pipeline in it); a virtual run has nothing to interrupt but the CPU work itself
        loop = VirtualLoop(start_ns)
        try:
            with lean_gc(virtual=True):
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


class _Here(threading.local):
    """The :class:`VirtualLoop` running in this thread, if any (set and cleared by its ``run_forever``).

    The same answer as ``asyncio._get_running_loop()`` for a virtual loop, without its cost: CPython 3.11
    checks the process id on every call (``getpid()``, a system call: ~2 % of a virtual run's CPU)."""

    virtual: VirtualLoop | None = None


_here = _Here()


def now_ns() -> int:
    """Monotonic ns: the running virtual loop's time, else the host's CLOCK_MONOTONIC (plus a test offset)."""
    loop = _here.virtual
    if loop is not None:
        return loop.now
    return time.monotonic_ns() + _offset_ns.get()


def is_virtual() -> bool:
    return _here.virtual is not None


def running_loop() -> asyncio.AbstractEventLoop:
    """``asyncio.get_running_loop()`` (a running virtual loop without asyncio's system call)."""
    return _here.virtual or asyncio.get_running_loop()


async def sleep_until_ns(deadline_ns: int) -> None:
    """Sleep until an absolute monotonic deadline (never a chain of relative sleeps that drifts)."""
    vloop = _here.virtual
    if vloop is not None:
        if deadline_ns <= vloop.now:
            await asyncio.sleep(0)
        else:
            # a cancelled sleep's future is cancelled with its task: a dead heap entry the loop skips
            await vloop.wake_at(deadline_ns)
        return
    loop = asyncio.get_running_loop()
    deadline_ns -= _offset_ns.get()  # to the host's clock
    if deadline_ns <= time.monotonic_ns():
        await asyncio.sleep(0)
        return
    await _timer_of(loop).add(deadline_ns)


def rng_for(seed: int, *keys: object) -> np.random.Generator:
    """A reproducible generator for one (seed, session, turn, stage...) — independent of arrival order.

    PCG64 seeded by a SeedSequence over the 32-bit words [seed, crc32(str(key))...]: the generator
    ``np.random.default_rng(words)`` makes, built from a uint32 array (a list of Python ints is coerced
    word by word under ``np.errstate``: ~3x the cost, same entropy, same stream)."""
    words = np.array([seed & 0xFFFFFFFF, *[zlib.crc32(str(k).encode()) for k in keys]], dtype=np.uint32)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))
