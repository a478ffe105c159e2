"""The one clock every stage reads, and the one place that sleeps: real or virtual.

Modules: :mod:`~voicepipe.clock.now` (``now_ns``, ``sleep_until_ns``: the running virtual loop's time, else
CLOCK_MONOTONIC), :mod:`~voicepipe.clock.virtual` (the virtual event loop and ``run_virtual``),
:mod:`~voicepipe.clock.realtime` (real-time deadlines through a timerfd), :mod:`~voicepipe.clock.gc`
(collector settings for runs, only when the program asks), :mod:`~voicepipe.clock.rng` (reproducible
random streams), :mod:`~voicepipe.clock.wait` (timed waits on a future, without a task). This package re-exports the names callers use.
"""

from __future__ import annotations

from voicepipe.clock.now import is_virtual, now_ns, running_loop, sleep_until_ns
from voicepipe.clock.realtime import set_clock_offset_ns
from voicepipe.clock.rng import rng_for
from voicepipe.clock.virtual import VirtualDeadlock, VirtualLoop, run_virtual
from voicepipe.clock.wait import Latch, wait_within

__all__ = [
    "Latch",
    "VirtualDeadlock",
    "VirtualLoop",
    "is_virtual",
    "now_ns",
    "rng_for",
    "run_virtual",
    "running_loop",
    "set_clock_offset_ns",
    "sleep_until_ns",
    "wait_within",
]
