"""The Ray executor: the same independent items as :class:`voicepipe.parallel.LocalExecutor`, on a Ray cluster.

Imported only by :func:`voicepipe.executors.executor_for` once ``ray`` imports (the ``ray`` extra). Each item
is one Ray task (one CPU): ``fn`` and the item travel by cloudpickle, the task returns the result, or the
item's exception, with the count ``fn`` reported, so a failure comes back as
:class:`~voicepipe.parallel.ItemFailed` exactly as from the fork pool, and results are in item order.
Items are submitted heaviest first (``weights``). Progress is per finished item: its whole count arrives
when it is done. Results equal the local run's because each item is pure and seeded (see
:mod:`voicepipe.parallel`); the driver ships its own ``voicepipe`` package to the workers
(``runtime_env.py_modules``), so a cluster runs this code, not whatever version it has installed. The
workers still need voicepipe's dependencies (pydantic, numpy, ...).

Connecting: ``address`` None is ``ray.init()`` (RAY_ADDRESS, or the cluster ``ray start`` left on this
machine, else a new local one); ``ray://HOST:PORT`` is Ray client. A Ray this starts listens on loopback
only, and Ray's usage-stats reporting is off unless the environment says otherwise (both are
``os.environ.setdefault``, so the user's own settings win). If ``ray.init`` is already done (a caller's own
session), that session is used and left open. A Ray client whose server on the cluster fails to start
("Initialization failure from server": its client server accepts before the cluster can start one) is tried
again, ``CLIENT_TRIES`` times in all; an address that does not answer is one line at once. A failed
``ray.init`` leaves the signal handlers as it found them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

import ray
import structlog

from voicepipe.errors import UserError
from voicepipe.parallel import Executor, Report, earliest_failure_known, in_item_order

I = TypeVar("I")  # noqa: E741
R = TypeVar("R")

_PACKAGE = Path(__file__).resolve().parent  # this voicepipe, shipped to the workers


def _call(fn: Callable[[Any, Report], Any], item: Any) -> tuple[bool, Any, int]:
    """In the Ray worker: ``(ok, result or exception, reported count)``."""
    count = [0]

    def report(n: int) -> None:
        count[0] += n

    try:
        return True, fn(item, report), count[0]
    except Exception as exc:
        try:
            pickle.dumps(exc)
        except Exception:  # an exception that cannot travel comes back as its text
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        return False, exc, count[0]


_remote_call = ray.remote(num_cpus=1, max_retries=0)(_call)


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# a Ray client (ray://) that fails to start its server on the cluster is tried this many times in all, the
# n-th retry after n x CLIENT_RETRY_S
CLIENT_TRIES = 3
CLIENT_RETRY_S = 2.0
CLIENT_INIT_FAILED = "Initialization failure from server"  # ray/util/client/worker.py, Ray 2.x
_log = structlog.get_logger("voicepipe.ray")


def connect(address: str | None) -> dict[signal.Signals, Any] | None:
    """``ray.init`` for ``address`` unless a session is already open. Returns the signal handlers ray.init
    replaces (for :meth:`RayExecutor.close` to put back) when this call opened the session, else None."""
    if ray.is_initialized():
        return None
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kw: dict[str, Any] = {}
    if address is None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # node address = loopback
        kw["include_dashboard"] = False
    env = {"py_modules": [str(_PACKAGE)], "excludes": ["__pycache__", "*.pyc"]}
    tries = CLIENT_TRIES if address is not None and address.startswith("ray://") else 1
    for attempt in range(1, tries + 1):
        try:
            ray.init(
                address=address, runtime_env=env, logging_level=logging.WARNING, log_to_driver=False, **kw
            )
            break
        except (ConnectionError, TimeoutError, RuntimeError, ValueError) as exc:
            for sig, handler in handlers.items():  # a failed ray.init may have installed its own already
                signal.signal(sig, handler)
            # a Ray client server that accepts before the cluster behind it can start this driver's server
            # answers "Initialization failure from server" (seen about once in five on a fresh loopback head):
            # that one is tried again; an address nobody answers (a connection timeout, ~30 s) is not
            if attempt == tries or not (isinstance(exc, ConnectionError) and str(exc).startswith(CLIENT_INIT_FAILED)):
                _refuse(address, exc)
            _log.debug("ray client could not start; trying again", address=address, error=str(exc)[:500])
            time.sleep(CLIENT_RETRY_S * attempt)
    return handlers


def _refuse(address: str | None, exc: Exception) -> NoReturn:
    """The one-line user error for a Ray that could not be started or reached."""
    where = address or "a local Ray"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    raise UserError("--executor", f"cannot start or reach {where}: {first}") from None


class RayBatch(Generic[I, R]):
    """Items submitted as Ray tasks (see the module doc)."""

    def __init__(
        self, fn: Callable[[I, Report], R], items: Sequence[I], weights: Sequence[float] | None
    ) -> None:
        self.fn, self.items = fn, list(items)
        order = range(len(self.items))
        self.order = sorted(order, key=lambda i: -weights[i]) if weights is not None else list(order)
        self.refs: dict[Any, int] = {}

    def __enter__(self) -> RayBatch[I, R]:
        self.refs = {_remote_call.remote(self.fn, self.items[i]): i for i in self.order}
        return self

    def __exit__(self, *exc: object) -> None:
        for ref in self.refs:  # what is still running (after a failure or Ctrl-C) is not waited for
            with contextlib.suppress(Exception):  # already finished or gone
                ray.cancel(ref, force=True)
        self.refs = {}

    def results(self, report: Report | None = None) -> list[R]:
        """Every item's result, in item order; the first failure (in item order) as :class:`ItemFailed`."""
        tell = report or (lambda _n: None)
        done: dict[int, R] = {}
        failed: dict[int, BaseException] = {}
        pending = list(self.refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                i = self.refs.pop(ref)
                try:
                    ok, value, n = ray.get(ref)
                except ray.exceptions.RayError as exc:  # the task itself died (worker lost, cancelled)
                    ok, value, n = False, exc, 0
                if n:
                    tell(n)
                if ok:
                    done[i] = value
                else:
                    failed[i] = value
            if earliest_failure_known(failed, (self.refs[r] for r in pending), len(self.items)):
                break  # no earlier item can fail any more: report this one now
        return in_item_order(done, failed, len(self.items))


class RayExecutor(Executor):
    """Items as Ray tasks on the cluster at ``address`` (None: a local Ray); connects when made."""

    name = "ray"

    def __init__(self, address: str | None) -> None:
        self.address = address
        self.opened = connect(address)  # the handlers to restore when this executor opened the session

    def start(
        self, fn: Callable[[I, Report], R], items: Sequence[I], weights: Sequence[float] | None = None
    ) -> RayBatch[I, R]:
        return RayBatch(fn, items, weights)

    def close(self) -> None:
        """Shut the session down if this executor opened it, and put back the signal handlers it replaced."""
        if self.opened is None:
            return
        if ray.is_initialized():
            ray.shutdown()
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self.opened.items():
                signal.signal(sig, handler)
        self.opened = None
