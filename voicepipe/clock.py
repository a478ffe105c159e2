"""The one clock every stage reads: CLOCK_MONOTONIC in ns (shared by all processes on a host)."""

from __future__ import annotations

import asyncio
import time
import zlib

import numpy as np

now_ns = time.monotonic_ns


async def sleep_until_ns(deadline_ns: int) -> None:
    """Sleep until an absolute monotonic deadline (never a chain of relative sleeps that drifts)."""
    delay = (deadline_ns - time.monotonic_ns()) / 1e9
    if delay > 0:
        await asyncio.sleep(delay)


def rng_for(seed: int, *keys: object) -> np.random.Generator:
    """A reproducible generator for one (seed, session, turn, stage...) — independent of arrival order."""
    words = [seed & 0xFFFFFFFF] + [zlib.crc32(str(k).encode()) for k in keys]
    return np.random.default_rng(words)
