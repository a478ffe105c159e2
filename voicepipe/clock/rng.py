"""Reproducible random streams keyed by (seed, session, turn, stage...), independent of arrival order."""

from __future__ import annotations

import zlib

import numpy as np


def rng_for(seed: int, *keys: object) -> np.random.Generator:
    """A reproducible generator for one (seed, session, turn, stage...) — independent of arrival order.

    PCG64 seeded by a SeedSequence over the 32-bit words [seed, crc32(str(key))...]: the generator
    ``np.random.default_rng(words)`` makes, built from a uint32 array (a list of Python ints is coerced
    word by word under ``np.errstate``: ~3x the cost, same entropy, same stream)."""
    words = np.array([seed & 0xFFFFFFFF, *[zlib.crc32(str(k).encode()) for k in keys]], dtype=np.uint32)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))
