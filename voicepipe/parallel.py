"""Independent virtual-time runs in forked worker processes, results in input order.

A virtual run (``capacity``'s load levels, ``compare --predict``'s configurations) is pure CPU and shares
nothing with the next one: each builds its own stages, bus, clock and backends from its arguments and
draws every random number from ``clock.rng_for(seed, ...)``. Running several in worker processes therefore
gives the same results as running them one after another, in less wall time on a machine with more than
one core. Items are handed out heaviest first (``weights``) so the longest run starts at once.

Workers are forked (POSIX ``fork``: no re-import, nothing pickled on the way in) when :class:`ForkPool` is
entered, before the caller starts any thread of its own (a progress bar's refresh thread): enter the pool
first. Results, and an item's exception as :class:`ItemFailed`, come back pickled. Progress: the function
gets a ``report(n)`` callable; in a worker it sends counts over a pipe, drained while waiting. With one
worker, one item, or no ``fork`` on this platform, everything runs here, in order.

Executors. :class:`Executor` is the one interface the sweeps use: ``start(fn, items, weights)`` gives a batch
(a context manager with ``results(report)``), and ``map(fn, items, weights, progress)`` is the two in one.
:class:`LocalExecutor` is the fork pool above; ``voicepipe.parallel_ray.RayExecutor`` sends the same items to
a Ray cluster (imported only when asked for: ``--executor ray`` or ``ray://HOST:PORT``, the ``ray`` extra).
Every executor returns results in item order and raises the first failure in item order as
:class:`ItemFailed`, so the choice changes where the work runs, never what comes back. :func:`voicepipe.executors.executor_for`
turns the ``--executor`` text into one.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

I = TypeVar("I")  # noqa: E741
R = TypeVar("R")

Report = Callable[[int], None]
REPORT_EVERY = 25  # a worker sends progress in batches of this many

# what the forked workers read (set just before they are forked, so they inherit it)
_work: tuple[Callable[[Any, Report], Any], Sequence[Any], Any] | None = None


class ItemFailed(Exception):
    """Item ``index`` raised ``error`` (in a worker or here)."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(f"item {index}: {error}")
        self.index = index
        self.error = error


def earliest_failure_known(failed: Mapping[int, BaseException], pending: Iterable[int], n: int) -> bool:
    """Has an item failed before every item still running (so no earlier item can fail any more)?"""
    return bool(failed) and min(failed) < min(pending, default=n)


def in_item_order(done: Mapping[int, R], failed: Mapping[int, BaseException], n: int) -> list[R]:
    """The ``n`` results in item order, or the earliest failure (in item order) as :class:`ItemFailed`."""
    if failed:
        i = min(failed)
        raise ItemFailed(i, failed[i]) from failed[i]
    return [done[i] for i in range(n)]


def default_workers() -> int:
    """The CPUs this process may run on (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _in_worker(index: int) -> Any:
    assert _work is not None
    fn, items, queue = _work
    pending = [0]

    def report(n: int) -> None:
        pending[0] += n
        if pending[0] >= REPORT_EVERY:
            queue.put(pending[0])
            pending[0] = 0

    try:
        return fn(items[index], report)
    finally:
        if pending[0]:
            queue.put(pending[0])


class ForkPool(Generic[I, R]):
    """``fn(item, report)`` for every item, in up to ``workers`` forked processes (see the module doc)."""

    def __init__(
        self,
        fn: Callable[[I, Report], R],
        items: Sequence[I],
        *,
        workers: int,
        weights: Sequence[float] | None = None,
    ) -> None:
        self.fn, self.items = fn, list(items)
        self.workers = min(workers, len(self.items))
        if "fork" not in mp.get_all_start_methods():
            self.workers = 1
        order = range(len(self.items))
        self.order = sorted(order, key=lambda i: -weights[i]) if weights is not None else list(order)
        self.pool: cf.ProcessPoolExecutor | None = None
        self.futures: dict[cf.Future[R], int] = {}
        self.queue: Any = None

    def __enter__(self) -> ForkPool[I, R]:
        global _work
        if self.workers > 1:
            ctx = mp.get_context("fork")
            self.queue = ctx.SimpleQueue()
            _work = (self.fn, self.items, self.queue)
            try:
                # with fork, the first submit forks every worker at once (before any thread we start later)
                self.pool = cf.ProcessPoolExecutor(self.workers, mp_context=ctx)
                self.futures = {self.pool.submit(_in_worker, i): i for i in self.order}
            finally:
                _work = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=exc[0] is None, cancel_futures=True)
            self.queue.close()

    def results(self, report: Report | None = None) -> list[R]:
        """Every item's result, in item order; the first failure (in item order) as :class:`ItemFailed`."""
        tell = report or (lambda _n: None)
        if self.pool is None:
            out: list[R] = []
            for i, item in enumerate(self.items):
                try:
                    out.append(self.fn(item, tell))
                except Exception as exc:
                    raise ItemFailed(i, exc) from exc
            return out
        done: dict[int, R] = {}
        failed: dict[int, BaseException] = {}
        pending = set(self.futures)
        while pending:
            finished, pending = cf.wait(pending, timeout=0.2, return_when=cf.FIRST_COMPLETED)
            while not self.queue.empty():
                tell(self.queue.get())
            for f in finished:
                i = self.futures[f]
                err = f.exception()
                if err is None:
                    done[i] = f.result()
                else:
                    failed[i] = err
            if earliest_failure_known(failed, (self.futures[f] for f in pending), len(self.items)):
                break  # no earlier item can fail any more: report this one now
        return in_item_order(done, failed, len(self.items))


class Batch(Protocol[R]):
    """Items under way on an executor: enter it, then ``results(report)`` (item order; :class:`ItemFailed`)."""

    def __enter__(self) -> Batch[R]: ...

    def __exit__(self, *exc: object) -> None: ...

    def results(self, report: Report | None = None) -> list[R]: ...


class Executor:
    """Where independent items run. ``start`` before any thread of the caller's own (the local pool forks
    then); ``map`` when there is nothing to start in between."""

    name = "executor"

    def start(
        self, fn: Callable[[I, Report], R], items: Sequence[I], weights: Sequence[float] | None = None
    ) -> Batch[R]:
        raise NotImplementedError

    def map(
        self,
        fn: Callable[[I, Report], R],
        items: Sequence[I],
        weights: Sequence[float] | None = None,
        progress: Report | None = None,
    ) -> list[R]:
        """``fn(item, report)`` for every item, results in item order; ``progress`` gets the counts."""
        with self.start(fn, items, weights) as batch:
            return batch.results(progress)

    def close(self) -> None:
        """Let go of what the executor holds (a Ray connection it made); the local one holds nothing."""


class LocalExecutor(Executor):
    """Forked processes on this machine (:class:`ForkPool`), ``workers`` of them (default: the CPUs)."""

    name = "local"

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers

    def start(
        self, fn: Callable[[I, Report], R], items: Sequence[I], weights: Sequence[float] | None = None
    ) -> ForkPool[I, R]:
        return ForkPool(fn, items, workers=self.workers or default_workers(), weights=weights)
