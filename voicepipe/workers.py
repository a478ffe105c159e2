"""Stages served in processes of their own: ``voicepipe stage`` and ``--workers``.

:func:`serve_stages` runs some stages of a run in this process until cancelled (announcing them with a
:class:`~voicepipe.bus.liveness.Presence`); :class:`Workers` spawns ``--workers`` processes, each running
:func:`worker_entry`; :func:`until_signalled` stops a server cleanly on a signal; :func:`run_live_loop` runs a
live coroutine on the fastest event loop installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import structlog

from voicepipe.bus import Bus
from voicepipe.bus.brokers import quiet_amqtt
from voicepipe.bus.instance import Follower
from voicepipe.bus.liveness import Presence, Watch
from voicepipe.bus.mqtt import check_run_topics, negotiate_protocol
from voicepipe.bus.partition import SHADOWED, Membership, PartitionedBus, kind_of, replica_id
from voicepipe.clock.gc import during_run, tune_for_runs
from voicepipe.config import PipelineConfig, broker_address
from voicepipe.errors import check_run_id
from voicepipe.keys import Instance
from voicepipe.stages.base import RunContext, Stage
from voicepipe.stages.guard import require_shared_token
from voicepipe.stageset import build_stages, mqtt_connector, start_stages, stop_stages

log = structlog.get_logger("voicepipe.run")
T = TypeVar("T")


def process_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


async def serve_stages(
    cfg: PipelineConfig,
    names: list[str],
    run: str,
    *,
    process: str | None = None,
    replicas: list[str] | None = None,
    planned: list[str] | None = None,
    on_stages: Callable[[list[Stage]], None] | None = None,
    token: bytes | None = None,
    instance: Instance | None = None,
) -> None:
    """Run some stages of run ``run`` in this process until cancelled (``voicepipe stage``, a worker).

    ``replicas``: the replica ids served here (default ``{name}.0`` each); ``planned``: every replica of the
    run (default: these). A kind with several planned replicas serves only the sessions its replica owns
    (:mod:`voicepipe.bus.partition`). The process announces itself with a :class:`~voicepipe.bus.liveness.Presence`.
    ``on_stages`` sees the stages once built (an observer, for tests). ``token``: the run's secret (a
    ``voicepipe stage`` reads ``VOICEPIPE_RUN_TOKEN``) from which the key of the instance it joins is derived:
    the run's announcement names it (:mod:`voicepipe.bus.instance`), and serving ends when that instance is over.
    ``instance``: the instance to serve (a ``--workers`` process gets it from its parent, no token).
    """
    quiet_amqtt()
    check_run_id(run)  # part of every topic: a "/" or "+" would make every turn time out silently
    if not cfg.broker.url:
        raise ValueError("broker.url: stages in separate processes need a broker (--broker URL)")
    if token is None and instance is None:
        require_shared_token("voicepipe stage")
    addr = broker_address(cfg.broker)
    ctx = RunContext(run=run, cfg=cfg, instance=instance)
    if token is not None:
        ctx.token = token
    protocol = await negotiate_protocol(addr, cfg.broker.protocol)
    await check_run_topics(addr, run)
    base = mqtt_connector(addr, ctx, protocol)
    mine = replicas or [replica_id(n, 0) for n in names]
    process = process or process_name()
    members = Membership(planned or mine)
    by_kind = {kind_of(r): r for r in mine}
    shared = {k for k, rs in members.live.items() if len(rs) > 1}

    def connect(name: str) -> Bus:
        if name not in shared:
            return base(name)
        r = by_kind[name]  # several replicas: a client id of its own, and only the sessions it owns
        return PartitionedBus(base(r), r, members, shadow=name in SHADOWED)  # (a shadow: every session)

    def peer_died(_process: str, replicas: list[str], _why: str) -> None:
        members.remove(replicas)  # the sessions it owned move to the replicas left

    async with contextlib.AsyncExitStack() as stack:
        stack.enter_context(during_run())  # collector pauses would show as tax (if the program opted in)
        follower = None
        if ctx.instance is None:  # join the instance the run announces (verified with the token)
            follower = await stack.enter_async_context(Follower(addr, run, ctx.token))
            ctx.instance = await follower.instance()
            log.info("joined run instance", run=run, instance=ctx.instance.id)
        inst, grace = ctx.instance, cfg.broker.stage_grace_s
        if shared:  # replicas must learn of a dead peer to take over its sessions
            await stack.enter_async_context(Watch(addr, run, peer_died, who=process, instance=inst, grace_s=grace))
        stages = build_stages(connect, ctx, [kind_of(r) for r in mine])
        for s in stages:  # a replica may take over a dead peer's sessions mid-stream (Guard.adopt); a shadow
            s.guard.adopt = isinstance(s.bus, PartitionedBus) and not s.bus.shadow  # saw them from the start
        if on_stages is not None:
            on_stages(stages)

        def counters() -> tuple[int, int, int]:
            skipped = sum(s.bus.skipped for s in stages if isinstance(s.bus, PartitionedBus))
            return sum(s.bus.published for s in stages), sum(s.bus.received for s in stages), skipped

        tasks: list[asyncio.Task[None]] = []
        try:
            tasks = await start_stages(stack, stages)
            srcs = [s.src for s in stages]  # the hello: the client accepts replies from these senders only
            async with Presence(addr, run, process, mine, counters, instance=inst, srcs=srcs, grace_s=grace):
                over = [asyncio.create_task(follower.over(inst), name="instance-over")] if follower else []
                done, _ = await asyncio.wait([*tasks, *over], return_when=asyncio.FIRST_COMPLETED)
                for o in over:
                    if o in done:
                        log.info("run instance over", run=run, instance=inst.id, why=o.result())
                    o.cancel()
                for t in tasks:
                    if t in done:
                        t.result()  # a loop that fails ends the serving with its exception
        finally:
            await stop_stages(stages, tasks)  # logs every loop that had failed


def worker_entry() -> None:
    """A ``--workers`` process (``python -c 'from voicepipe.workers import worker_entry; worker_entry()'``):
    reads its pickled job from stdin — (config, run, process, replicas, planned) — and serves the replicas
    until SIGTERM, then clears its marker and exits cleanly."""
    cfg, run, process, replicas, planned, instance = pickle.load(sys.stdin.buffer)
    tune_for_runs()  # a worker is a process of the CLI's run, not a library caller's: tuned like the CLI
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle

    parent = os.getppid()

    async def orphaned(task: asyncio.Task[None]) -> None:
        while os.getppid() == parent:  # the run process died without stopping us: stop too
            await asyncio.sleep(1.0)
        task.cancel()

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        guard = asyncio.create_task(orphaned(task))
        kinds = [kind_of(r) for r in replicas]
        await until_signalled(
            serve_stages(cfg, kinds, run, process=process, replicas=replicas, planned=planned, instance=instance),
            (signal.SIGTERM,),
        )
        guard.cancel()

    run_live_loop(main())


async def until_signalled(
    coro: Awaitable[None], signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
) -> None:
    """Await ``coro`` (a server: stages until cancelled) and stop it cleanly on any of ``signals``, or on
    a cancel of this task. The handlers are installed here, on the loop, not inherited: a process started
    with SIGINT ignored (``nohup``, some supervisors and test runners) still stops on Ctrl-C or SIGTERM.
    The server runs as its own task and is cancelled until it ends: a cancel that lands where the server
    absorbs it (a shutdown step, a reconnect) is sent again, so a signal always stops the process."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    inner = asyncio.ensure_future(coro)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        with contextlib.suppress(asyncio.CancelledError):  # a cancel of this task: stop the server too
            await asyncio.wait({inner, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        while not inner.done():
            inner.cancel()
            await asyncio.wait({inner}, timeout=1.0)
        for sig in signals:
            loop.remove_signal_handler(sig)
    failed = None if inner.cancelled() else inner.exception()
    if failed is not None:
        raise failed


class Workers:
    """``--workers N``: N stage processes spawned for one run (see :func:`~voicepipe.bus.partition.plan_workers`)."""

    def __init__(self, cfg: PipelineConfig, run: str, plan: list[list[str]], instance: Instance) -> None:
        self.cfg, self.run, self.plan, self.instance = cfg, run, plan, instance
        self.planned = [r for p in plan for r in p]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        code = "from voicepipe.workers import worker_entry; worker_entry()"
        for i, reps in enumerate(self.plan):
            p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
            assert p.stdin is not None
            # the instance's key goes through the pipe, never argv or the environment (ps would show it)
            p.stdin.write(pickle.dumps((self.cfg, self.run, f"w{i}", reps, self.planned, self.instance)))
            p.stdin.close()
            self.procs.append(p)

    def failed(self) -> str | None:
        """A worker that exited before the run was ready (its exit code)."""
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                return f"worker w{i} exited with code {p.returncode} before it was ready"
        return None

    def stop(self, timeout_s: float = 5.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout_s)


def run_live_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run a live coroutine on uvloop where installed (``pip install voicepipe[fast]``), else asyncio's
    loop: the event loop is a share of every bus message's CPU cost (bench/msgcost.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
