"""Virtual time: :class:`VirtualLoop`, an asyncio event loop with no I/O whose time is a counter.

When no callback is ready it jumps straight to the earliest timer instead of waiting, so modelled seconds
cost only the CPU of the code that runs. Code on it is unchanged: :func:`voicepipe.clock.now_ns` and
:func:`voicepipe.clock.sleep_until_ns` follow the running loop, and asyncio's own timers (``asyncio.sleep``,
``wait_for``, ``call_later``) run on its time. A virtual run in which every task waits and no timer is left
is a deadlock: it raises :class:`VirtualDeadlock` instead of hanging.

The loop is a minimal ``AbstractEventLoop`` (not ``BaseEventLoop``: no selector, no debug paths, no
per-iteration timeout arithmetic): a deque of ready handles and one heap of ``(ns, sequence, item)``
timers, where a virtual sleep's item is its future itself (no handle, nothing to cancel). Equal deadlines
run in the order they were scheduled. asyncio's C Futures and Tasks run on it unchanged.

:func:`run_virtual` leaves the process's garbage collector alone unless the program opted in with
:func:`voicepipe.clock.gc.tune_for_runs` (see :mod:`voicepipe.clock.gc`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import heapq
import itertools
import logging
import sys
import threading
import weakref
from asyncio import events
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from contextvars import Context
from typing import Any, TypeVar

from voicepipe.clock.gc import during_run

log = logging.getLogger("voicepipe.clock")
T = TypeVar("T")


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
    _when_ns: int

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

    def call_soon(  # type: ignore[override]  # a lean handle, not asyncio.Handle: the methods callers use
        self, callback: Callable[..., object], *args: Any, context: Context | None = None
    ) -> _Handle:
        h = _Handle(callback, args, context)
        self._ready.append(h)
        return h

    call_soon_threadsafe = call_soon  # type: ignore[assignment]  # nothing runs in other threads

    def call_at(  # type: ignore[override]  # a lean timer handle, not asyncio.TimerHandle
        self, when: float, callback: Callable[..., object], *args: Any, context: Context | None = None
    ) -> _Timer:
        h = _Timer(callback, args, context)
        h._when_ns = round(when * 1e9)
        heapq.heappush(self._heap, (h._when_ns, next(self._seq), h))
        return h

    def call_later(  # type: ignore[override]  # (see call_at)
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

    def run_until_complete(self, future: Awaitable[T]) -> T:  # type: ignore[override]  # no generator-based coroutines
        fut: asyncio.Future[T] = asyncio.ensure_future(future, loop=self)
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


def run_virtual(coro: Coroutine[Any, Any, T], start_ns: int = 0) -> T:
    """Run ``coro`` to completion on a fresh :class:`VirtualLoop`; blocks the caller (in a helper thread
    when the caller's thread already runs an event loop)."""

    def go() -> T:
        # not asyncio.Runner: it swaps the SIGINT handler, and repr()s the old one on the way (slow with a
        # big pipeline in it); a virtual run has nothing to interrupt but the CPU work itself
        loop = VirtualLoop(start_ns)  # type: ignore[abstract]  # the I/O methods it lacks raise NotImplementedError
        try:
            with during_run(virtual=True):
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


class _Here(threading.local):
    """The :class:`VirtualLoop` running in this thread, if any (set and cleared by its ``run_forever``).

    The same answer as ``asyncio._get_running_loop()`` for a virtual loop, without its cost: CPython 3.11
    checks the process id on every call (``getpid()``, a system call: ~2 % of a virtual run's CPU)."""

    virtual: VirtualLoop | None = None


_here = _Here()
