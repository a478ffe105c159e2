"""Elementwise helpers the step physics is written in: one formula for two callers.

The fit and the sweeps call the physics on arrays (a column of candidate constants against a row of
points); the serving engine calls it on one step shape at a time, Python numbers, hundreds of thousands
of times a run, where numpy's fixed cost per call (a 0-d array for every operation) was most of the
time. These helpers keep numpy's semantics for arrays and do the same IEEE double operation on plain
numbers (a Python ``float`` out, which mixes with numpy as a float64 does). The engine's results are the
ones it computed before this path: its numbers were numpy scalars, and a power of numpy scalars is the C
library's, as a Python float's is. Against the array path (the same formula on one-element arrays) they
agree to the last bit or so: numpy's vectorised power may round a last bit differently on some CPUs
(tests/test_num_scalar_path.py). NaN, ±inf and −0.0 are not handled as numpy does; no step produces them.
A numpy scalar that is not a Python float subclass (an ``int64``, a ``bool_``) takes the numpy path.

Typed as numpy arrays for the callers' sake: a float where every input is a number, an array otherwise.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

FArray = NDArray[np.float64]
_NUM = (int, float)  # bool is an int; np.float64 is a float


def arr(x: ArrayLike) -> FArray:
    """``np.asarray(x, dtype=float)``; a number stays a float."""
    if isinstance(x, _NUM):
        return float(x)
    return np.asarray(x, dtype=float)


def where(cond: Any, a: ArrayLike, b: ArrayLike) -> FArray:
    """``np.where(cond, a, b)`` as floats; numbers (and a Python bool) stay numbers."""
    if isinstance(cond, bool) and isinstance(a, _NUM) and isinstance(b, _NUM):
        return float(a if cond else b)
    return np.where(cond, np.asarray(a, dtype=float), np.asarray(b, dtype=float))


def maximum(a: ArrayLike, b: ArrayLike) -> FArray:
    """``np.maximum(a, b)``; two numbers give a float."""
    if isinstance(a, _NUM) and isinstance(b, _NUM):
        return float(a if a >= b else b)
    return np.maximum(a, b)


def minimum(a: ArrayLike, b: ArrayLike) -> FArray:
    """``np.minimum(a, b)``; two numbers give a float."""
    if isinstance(a, _NUM) and isinstance(b, _NUM):
        return float(a if a <= b else b)
    return np.minimum(a, b)


def ceil(x: ArrayLike) -> FArray:
    """``np.ceil(x)``; a number gives a float."""
    if isinstance(x, _NUM):
        return float(math.ceil(x))
    return np.ceil(x)
