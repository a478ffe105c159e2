"""The one clock every stage reads, and the one place that sleeps: the running virtual loop's, else real.

:func:`now_ns` is monotonic ns: a running :class:`~voicepipe.clock.virtual.VirtualLoop`'s counter, else the
host's CLOCK_MONOTONIC (shared by all processes on a host) plus this context's test offset.
:func:`sleep_until_ns` sleeps until an absolute deadline on that same clock (virtual: a heap entry of the
loop; real: :func:`~voicepipe.clock.realtime.sleep_until_real_ns`, never early).
"""

from __future__ import annotations

import asyncio
import time

from voicepipe.clock.realtime import _offset_ns, sleep_until_real_ns
from voicepipe.clock.virtual import _here


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
    await sleep_until_real_ns(deadline_ns)
