"""Stopping a live run on SIGINT or SIGTERM without losing what it measured.

:func:`stop_on_signals` runs a live coroutine with handlers for the signals installed on its event loop
(not inherited: a process started with SIGINT ignored still stops). The first signal *asks* the run to
stop: once the run is playing its sessions (:meth:`Stop.watch`), it stops playing, shuts its stages down
as after a normal run and raises :class:`Interrupted` carrying its result (the turns measured so far and
the counters). A signal before that point, or a second signal, cancels the run at once (the result is
then ``None``; the turn records already handed to ``on_record`` are the caller's). Either way no
``KeyboardInterrupt`` is raised inside the loop, so nothing prints a traceback.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A signal stopped the run; ``result`` is its :class:`~voicepipe.runresult.RunResult` when the run
    could wind down, else None."""

    def __init__(self, signum: int, result: Any = None) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum
        self.result = result


class Stop:
    """The stop request of one run: set by the first signal; the run polls :attr:`event`."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.signum: int | None = None
        self.event = asyncio.Event()
        self.watched = False  # the run is in a phase that winds down on :attr:`event` by itself

    def __call__(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum
            self.event.set()
            if self.watched:
                return
        self.task.cancel()  # not yet playing, or a second signal: stop at once

    def watch(self) -> None:
        self.watched = True


CURRENT: ContextVar[Stop | None] = ContextVar("voicepipe_stop", default=None)


def current() -> Stop | None:
    """The stop request of the run this task belongs to (None outside :func:`stop_on_signals`)."""
    return CURRENT.get()


async def stop_on_signals(coro: Awaitable[T], signals: tuple[signal.Signals, ...] = SIGNALS) -> T:
    """Await ``coro`` (a live run); on one of ``signals`` let it wind down and raise :class:`Interrupted`."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    stop = Stop(task)
    token = CURRENT.set(stop)
    for sig in signals:
        loop.add_signal_handler(sig, stop, int(sig))
    try:
        got = await coro
    except asyncio.CancelledError:
        if stop.signum is None:
            raise
        task.uncancel()
        raise Interrupted(stop.signum) from None
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        CURRENT.reset(token)
    if stop.signum is not None:  # the signal came while the coroutine was already finishing
        raise Interrupted(stop.signum, got)
    return got
