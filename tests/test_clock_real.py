"""Real-time deadlines (clock.sleep_until_ns on a real loop): never early, in deadline order, on both the
Linux timerfd path and the portable yield path. Lateness is a benchmark's business (bench/tax.py), not a test's."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from voicepipe import clock
from voicepipe.clock import realtime


async def _sleepers(n: int, tries: int = 5) -> list[tuple[int, int, int, bool]]:
    """n concurrent sleepers with shuffled deadlines 200-205 ms ahead: (deadline, woke, order of waking,
    whether it started waiting before its deadline). On a stalled box a sleeper may start after its own
    deadline; it then returns at once, so it is not one of the sleepers whose order is checked. A round in
    which most sleepers started late (the process stalled for 200 ms) is checked for earliness and run again."""
    for _ in range(tries - 1):
        woke = await _round(n)
        if sum(w[3] for w in woke) >= n // 2:
            return woke
        assert all(t >= d for d, t, _, _ in woke), "a deadline sleeper woke before its deadline"
    return await _round(n)


async def _round(n: int) -> list[tuple[int, int, int, bool]]:
    base = time.monotonic_ns() + 200_000_000
    woke: list[tuple[int, int, int, bool]] = []

    async def one(k: int) -> None:
        deadline = base + ((k * 7919) % n) * 5_000_000 // n
        waited = time.monotonic_ns() < deadline - 1_000_000  # with a margin: it surely goes to the heap
        await clock.sleep_until_ns(deadline)
        woke.append((deadline, time.monotonic_ns(), len(woke), waited))

    await asyncio.gather(*(one(k) for k in range(n)))
    return woke


def _check(woke: list[tuple[int, int, int, bool]]) -> None:
    assert all(t >= d for d, t, _, _ in woke), "a deadline sleeper woke before its deadline"
    waited = [w for w in woke if w[3]]
    assert len(waited) >= len(woke) // 2  # the order below is checked on most of them, not on none
    by_order = [d for d, _, _, _ in sorted(waited, key=lambda w: w[2])]
    assert by_order == sorted(by_order), "sleepers woke out of deadline order"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux-only")
async def test_timerfd_path_wakes_every_sleeper_never_early_and_in_order() -> None:
    woke = await _sleepers(300)
    assert realtime._timers[asyncio.get_running_loop()].fd is not None  # the timerfd path was taken
    _check(woke)
    # a deadline already past returns at once, a cancelled sleeper leaves the others undisturbed
    await clock.sleep_until_ns(time.monotonic_ns() - 1)
    t = asyncio.create_task(clock.sleep_until_ns(time.monotonic_ns() + 2_000_000))
    await asyncio.sleep(0)
    t.cancel()
    _check(await _sleepers(20))


async def test_portable_path_wakes_every_sleeper_never_early_and_in_order(monkeypatch) -> None:
    monkeypatch.setattr(realtime, "_timerfd_or_none", lambda: None)
    woke = await _sleepers(300)
    assert realtime._timers[asyncio.get_running_loop()].fd is None
    _check(woke)


def test_timerfd_path_on_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")
    if not sys.platform.startswith("linux"):
        pytest.skip("timerfd is Linux-only")
    _check(uvloop.run(_sleepers(200)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/fd")
def test_closed_loops_release_their_timerfd() -> None:
    """Each loop's deadline timer holds a timerfd; a closed loop's is released when the next loop makes its
    own (a test session runs hundreds of loops: they must not run the process out of descriptors)."""
    import os

    async def one() -> None:
        await clock.sleep_until_ns(time.monotonic_ns() + 100_000)

    asyncio.run(one())
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(100):
        asyncio.run(one())
    assert len(os.listdir("/proc/self/fd")) - before <= 2
    assert sum(1 for lp in realtime._timers if lp.is_closed()) <= 1
