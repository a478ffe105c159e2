"""Waiting for something with a time limit, without asyncio's extra task: :func:`wait_within` and :class:`Latch`.

:func:`wait_within` is ``asyncio.wait_for`` for a future that is already there (no task wraps it): the
caller resumes when the future is done (its result or exception) or raises ``TimeoutError`` once
``timeout_s`` of the running loop's time has passed (virtual or real). On a timeout, or when the waiting
task is cancelled, the future is cancelled too (``cancel=True``, as ``wait_for`` does) or left alone.
:class:`Latch` is ``asyncio.Event``'s ``set``/``is_set`` with a future to wait on, so a timed wait on it
is one future and one timer instead of ``wait_for(event.wait())``'s task, waiter and callbacks (on a
virtual run every turn's client waits like this: fewer scheduled callbacks per turn).
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from voicepipe.clock.now import running_loop

T = TypeVar("T")


async def wait_within(fut: asyncio.Future[T], timeout_s: float, *, cancel: bool = True) -> T:
    """``fut``'s result (or its exception) once it is done; ``TimeoutError`` after ``timeout_s`` seconds."""
    if fut.done():
        return fut.result()
    loop = running_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def release(_: Any = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    fut.add_done_callback(release)
    timer = loop.call_later(timeout_s, release)
    try:
        await waiter
    except asyncio.CancelledError:
        fut.remove_done_callback(release)
        if cancel:
            fut.cancel()
        raise
    finally:
        timer.cancel()
    if fut.done():
        return fut.result()
    fut.remove_done_callback(release)
    if cancel:
        fut.cancel()
    raise TimeoutError


class Latch:
    """Set once, never cleared: ``set()``, ``is_set()``, and :meth:`future` to wait on (done once set).
    Made and waited on inside a running loop (the future belongs to it)."""

    __slots__ = ("_fut", "_set")

    def __init__(self) -> None:
        self._set = False
        self._fut: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._set = True
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    def is_set(self) -> bool:
        return self._set

    def future(self) -> asyncio.Future[None]:
        """A future done once the latch is set (the same one each time; never cancel it yourself)."""
        fut = self._fut
        if fut is None:
            fut = self._fut = running_loop().create_future()
            if self._set:
                fut.set_result(None)
        return fut
