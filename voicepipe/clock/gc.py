"""Garbage-collector settings for runs, applied only in a program that asked for them.

Contract: importing voicepipe, or running anything in it (a virtual prediction, a capacity level, a live
run), leaves the process's collector exactly as the program set it, unless the program called
:func:`tune_for_runs` first. The voicepipe CLI does, once, at start-up (its forked capacity workers inherit
the choice); a program using voicepipe as a library may, or may wrap its own code in :func:`lean_gc`.

Why the CLI tunes: a run allocates futures, handles, tasks and messages by the hundred per turn; with the
default collector settings ~10 % of a virtual run's CPU went to collections, most of it re-walking the
long-lived heap (configs, model tables, imports), and a live run of 500 sessions stalled its event loop for
17 ms (gen 0/1) to 150 ms (gen 2) at a time: measured as pipeline tax (its p90/p99). During a run, virtual
or live: what exists before it is frozen (never walked) and the youngest generation is collected every
20,000 allocations instead of 700. While only virtual runs are in progress the collector is off
altogether: a virtual run's state is mostly alive until it ends (every session's tasks, futures and
timers), so even lean collections kept re-walking it: 8 % of the CPU of a 1,000-session level, 11 % of a
2,000-session one (gc.callbacks timing). It leaves cyclic garbage behind (measured: 2 to 39 objects per
turn, by configuration), freed by one collection of the youngest generation when the last run ends (~3 %
of a level's CPU). Handing the survivors to the oldest generation instead was cheaper but leaked: on
Python 3.11 that generation is collected only after enough promotions, which back-to-back virtual runs
never make (a reviewer measured +1.35 MB per run over 40 runs in one process).
Timing only: nothing is leaked, the settings are restored when the last concurrent run ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager

GC_THRESHOLD = (20_000, 20, 100)
_lock = threading.Lock()
_runs = 0  # runs in progress under lean_gc, virtual or live
_live = 0  # of which live
_saved: tuple[int, int, int] = (700, 10, 10)
_was_enabled = True
_tune_runs = False  # the program's choice: tune_for_runs()


def tune_for_runs(enabled: bool = True) -> None:
    """Let every later run in this process (and in processes it forks) apply :func:`lean_gc`.

    The CLI calls this once before it dispatches a command; nothing in the library calls it."""
    global _tune_runs
    _tune_runs = enabled


def tuning_for_runs() -> bool:
    """Whether :func:`tune_for_runs` is in effect."""
    return _tune_runs


def _apply() -> None:
    if _live == 0:
        gc.disable()
    else:
        gc.enable()


@contextlib.contextmanager
def lean_gc(virtual: bool = False) -> Iterator[None]:
    """Collector settings for one run (see the module doc), always applied: ``virtual`` runs switch the
    collector off while no live run is in progress; a collector the program disabled stays disabled."""
    global _runs, _live, _saved, _was_enabled
    with _lock:
        if _runs == 0:
            _saved = gc.get_threshold()
            _was_enabled = gc.isenabled()
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLD)
        _runs += 1
        _live += not virtual
        if _was_enabled:
            _apply()
    try:
        yield
    finally:
        with _lock:
            _runs -= 1
            _live -= not virtual
            if _runs == 0:
                gc.set_threshold(*_saved)
                gc.unfreeze()
                if _was_enabled:
                    gc.enable()
                    if virtual:
                        gc.collect(0)  # the run's objects never left the youngest generation
            elif _was_enabled:
                _apply()


def during_run(virtual: bool = False) -> AbstractContextManager[None]:
    """What a run enters: :func:`lean_gc` if the program called :func:`tune_for_runs`, else nothing."""
    return lean_gc(virtual) if _tune_runs else contextlib.nullcontext()
