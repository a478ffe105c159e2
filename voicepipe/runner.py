"""Runs scenarios through the pipeline: a bus, the stages (live: one MQTT connection per process), sessions.

:func:`run_pipeline` runs live: real time, an MQTT broker (embedded amqtt, or the configured one).
:func:`simulate` runs the same stages on the in-memory bus and the virtual clock (``predict``, ``capacity``):
modelled time only, as fast as the CPU goes. Both play sessions through :func:`voicepipe.sessions.play_sessions`
on the stages of :mod:`voicepipe.stageset`; what they measured is a :class:`voicepipe.runresult.RunResult`.

Live runs can spread stages over processes: ``external`` stages served by ``voicepipe stage``
(:func:`voicepipe.workers.serve_stages`), or ``workers`` processes this run spawns
(:class:`voicepipe.workers.Workers`, replicas with session affinity per :mod:`voicepipe.bus.partition`). Stage
processes announce themselves and are watched per :mod:`voicepipe.bus.liveness`; :class:`Failer` turns a death
or a missed deadline into failed turns with a reason, so every expected turn is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable
from typing import Any

from voicepipe.bus import BrokerHealth, BrokerOutage
from voicepipe.bus.brokers import EmbeddedBroker, quiet_amqtt
from voicepipe.bus.instance import Announcer, refuse_if_running
from voicepipe.bus.liveness import Progress, Watch, turn_deadline_ns
from voicepipe.bus.memory import MemoryBroker
from voicepipe.bus.mqtt import BrokerAddress, check_run_topics, negotiate_protocol, probe_round_trip
from voicepipe.bus.partition import Membership, kind_of, plan_workers, replica_id
from voicepipe.clock import now_ns, run_virtual
from voicepipe.clock.gc import during_run
from voicepipe.config import PipelineConfig, broker_address
from voicepipe.errors import UserError, check_run_id
from voicepipe.keys import Instance
from voicepipe.measure import TAX_OUTLIER_MS, LagProbe
from voicepipe.messages import Cancel, CancelReason, Envelope
from voicepipe.modelled import on_virtual_time
from voicepipe.records import TurnRecord
from voicepipe.runresult import RunAborted, RunResult
from voicepipe.scenario import Scenario
from voicepipe.sessions import Slot, play_sessions, spread_slots
from voicepipe.stages.base import RunContext, cancel_and_wait
from voicepipe.stages.client import Client
from voicepipe.stages.guard import require_shared_token
from voicepipe.stageset import build_stages, mqtt_connector, needed_stages, process_link, refused_so_far
from voicepipe.stopping import Interrupted
from voicepipe.stopping import current as current_stop
from voicepipe.workers import Workers

NAGLE_FIX = (
    "the broker stalls small messages (Nagle's algorithm on its sockets): add `set_tcp_nodelay true` "
    "to mosquitto.conf (and keep TCP_NODELAY on clients) — otherwise every hop can wait ~40 ms and the "
    "measured tax is the broker's, not your pipeline's"
)


class StagesMissing(RuntimeError):
    """Stages the run expects in other processes never reported ready."""


class Failer:
    """Fails in-flight turns with a reason (a ``control.cancel`` with reason ``failed``, sent by the client
    stage): those held by a stage process that died, and those past their deadline, naming the holder."""

    def __init__(self, client: Client, members: Membership, result: RunResult, progress: Progress | None):
        self.client = client
        self.members = members
        self.result = result
        self.progress = progress
        self.failed: set[tuple[str, int]] = set()
        self.closing = False

    def fail(self, session: str, turn: int, why: str) -> None:
        if (session, turn) in self.failed:
            return
        self.failed.add((session, turn))
        env = Envelope.of(Cancel(reason=CancelReason.FAILED, error=why), self.client.ctx.run, session, turn)
        task = asyncio.create_task(self.client.publish(env))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def in_flight(self) -> list[tuple[str, int, int]]:
        """(session, turn, end of speech ns) of every turn not heard yet."""
        return [
            (s, lis.turn, lis.end_of_speech_ns)
            for s, lis in self.client.listening.items()
            if not lis.first.done()
        ]

    def on_dead(self, process: str, replicas: list[str], why: str) -> None:
        if self.closing:
            return
        before = {(r, s): self.members.owner(kind_of(r), s) for r in replicas for s, _, _ in self.in_flight()}
        gone = self.members.remove(replicas)
        self.result.deaths.append(f"{process} ({', '.join(replicas)}): {why}")
        self.result.death_ns.append(now_ns())
        for session, turn, _ in self.in_flight():
            for r in gone:
                if before.get((r, session)) == r:
                    self.fail(session, turn, f"stage {kind_of(r)} died")

    async def watch_deadlines(self) -> None:
        timeout_s = self.client.cfg.client.turn_timeout_s
        while True:
            await asyncio.sleep(0.25)
            orphaned = self.members.kinds_without_replica()
            now = now_ns()
            for session, turn, eos in self.in_flight():
                if orphaned:  # no replica of a kind left: no later turn can be served either
                    self.fail(session, turn, f"stage {orphaned[0]} died")
                elif now > turn_deadline_ns(eos, timeout_s):
                    held = self.progress.held_by(session, turn) if self.progress else "unknown"
                    self.fail(
                        session, turn,
                        f"timeout: stage {held} held the turn past its deadline (end of speech + {timeout_s:g} s)",
                    )  # fmt: skip


async def run_pipeline(
    cfg: PipelineConfig,
    scenarios: list[Scenario],
    sessions: int = 1,
    *,
    run_id: str | None = None,
    on_record: Callable[[TurnRecord], None] | None = None,
    on_ready: Callable[[RunResult], None] | None = None,
    external: frozenset[str] = frozenset(),
    workers: int = 0,
    plan: list[list[str]] | None = None,
    ready_timeout_s: float = 30.0,
) -> RunResult:
    """Play the scenarios and collect their turn records. Stages named in ``external`` run in other
    processes (``voicepipe stage``) against the same broker, run id and config; the run waits for them.
    ``workers`` > 0 spawns that many stage processes (replicas, :mod:`voicepipe.bus.partition`); only the client
    stays here. ``plan`` (replica ids per process, e.g. from :func:`~voicepipe.bus.partition.plan_workers`) says
    which replicas other processes serve when they are started by someone else (``serve_stages``). Either way a :class:`~voicepipe.bus.liveness.Watch` fails the turns of a stage process that dies,
    and every turn not heard by its deadline fails naming the stage that held it."""
    quiet_amqtt()
    if external:
        require_shared_token("--external")
    run = check_run_id(run_id) if run_id is not None else secrets.token_hex(4)
    if workers and not cfg.broker.url:
        raise UserError("--workers", WORKERS_NEED_BROKER)
    needed = needed_stages(cfg)
    spawn = plan_workers([n for n in needed if n != "client"], workers) if workers else []
    remote = [r for p in (spawn or plan or []) for r in p] or [
        replica_id(n, 0) for n in needed if n in external
    ]
    served_elsewhere = {kind_of(r) for r in remote}
    async with contextlib.AsyncExitStack() as stack:
        stack.enter_context(during_run())  # collector pauses would show as tax (if the program opted in)
        if cfg.broker.url:
            addr = broker_address(cfg.broker)
            protocol = await negotiate_protocol(addr, cfg.broker.protocol)
            await check_run_topics(addr, run)  # an ACL that refuses them would only show as timeouts
            shown = f"{addr.host}:{addr.port} (MQTT {protocol})"
        else:
            emb = await stack.enter_async_context(EmbeddedBroker())
            addr = BrokerAddress.parse(emb.url)
            protocol = "3.1.1"
            shown = f"embedded amqtt {addr.host}:{addr.port}"
        result = RunResult(run=run, broker=shown, workers=workers)
        ctx = RunContext(run=run, cfg=cfg)
        ctx.instance = Instance.new(ctx.token, run)  # this start's key (voicepipe.keys), announced for stages
        if cfg.broker.url or remote:
            if cfg.broker.url:  # one live start per run id and broker (voicepipe.bus.instance)
                await refuse_if_running(addr, run, ctx.token)
            await stack.enter_async_context(Announcer(addr, ctx.instance, ctx.token))
        procs = Workers(cfg, run, spawn, ctx.instance) if spawn else None
        if procs:
            procs.start()
            result.worker_pids = [p.pid for p in procs.procs]
            stack.callback(procs.stop)
        if cfg.broker.probe:
            result.probe_ms = await probe_round_trip(addr, qos=cfg.broker.qos)
            if result.probe_ms > cfg.broker.probe_warn_ms:
                result.warnings.append(
                    f"broker round trip {result.probe_ms:.0f} ms (expected ~1 ms): {NAGLE_FIX}"
                )

        def record(r: TurnRecord) -> None:
            eos, heard = r.end_of_speech_ns, r.first_audio_ns
            if r.tax_ms is not None and r.tax_ms > TAX_OUTLIER_MS and eos is not None and heard is not None:
                why = probe.distrust(eos, heard)  # judged now, before the record is written
                if why:  # a tax outlier that coincides with a stall or a burst: the tool's, as likely as not
                    r.trusted, r.distrust = False, f"{why} (tax {r.tax_ms:.0f} ms, over {TAX_OUTLIER_MS:g} ms)"
            result.records.append(r)
            if on_record:
                on_record(r)

        local = [n for n in needed if n not in served_elsewhere]
        health = BrokerHealth()
        link = process_link(addr, ctx, protocol, health)
        stages = build_stages(mqtt_connector(addr, ctx, link=link), ctx, local, on_record=record)
        client = next(s for s in stages if isinstance(s, Client))
        probe = LagProbe(refused=lambda: refused_so_far(stages))
        progress = await stack.enter_async_context(Progress(addr, run, link))
        members = Membership(remote)
        failer = Failer(client, members, result, progress)
        client.guard.joined = {s.src for s in stages}  # and each remote stage whose signed hello arrives
        watch = (
            await stack.enter_async_context(
                Watch(addr, run, failer.on_dead, instance=ctx.instance, grace_s=cfg.broker.stage_grace_s,
                      on_hello=client.guard.joined.update)
            ) if remote else None
        )  # fmt: skip

        async def wait_remote() -> None:
            if watch is not None:
                kinds = {kind_of(r) for r in remote}

                def ready(live: set[str]) -> bool:
                    if procs and (why := procs.failed()):
                        raise StagesMissing(why)
                    return set(remote) <= live if procs or plan else kinds <= {kind_of(r) for r in live}

                if not await watch.wait_ready(ready, ready_timeout_s):
                    missing = ", ".join(sorted(kinds - {kind_of(r) for r in watch.live_replicas()}))
                    raise StagesMissing(
                        f"stages {missing or 'replicas'} of run {run} not ready after {ready_timeout_s:.0f} s"
                        + ("" if procs else f" (start them with `voicepipe stage {missing.replace(',', '')} "
                           f"--run-id {run} --broker URL`)")
                    )  # fmt: skip
            deadlines = asyncio.create_task(failer.watch_deadlines(), name="turn-deadlines")
            stack.push_async_callback(_stop_task, deadlines, result)
            if on_ready:
                on_ready(result)

        try:
            await play_sessions(
                stack, stages, spread_slots(cfg, scenarios, sessions), result, before=wait_remote, probe=probe
            )
        except BrokerOutage as exc:
            result.outage = str(exc)
        finally:
            result.warnings += health.summary()
            result.broker_outages, result.broker_stalls = list(health.outages), list(health.stalls)
            result.reconnects = health.reconnects
            result.duplicates = sum(getattr(s.bus, "duplicates", 0) for s in stages)
            failer.closing = True
            if procs:
                await asyncio.to_thread(procs.stop)
                await asyncio.sleep(0.2)  # the workers' last heartbeats carry their final counters
            if watch is not None:
                totals = watch.totals()
                result.remote_cpu_s = totals.cpu_s
                result.remote_published = totals.published
                result.remote_received = totals.received
                result.remote_skipped = totals.skipped
                if watch.invalid:  # unsigned, forged or replayed liveness records: ignored, counted here
                    result.counters.dead["liveness unsigned or invalid"] += watch.invalid
                if watch.pauses:
                    result.warnings.append(f"{watch.pauses} stage process pause(s) resumed within the grace "
                                           f"(broker.stage_grace_s={cfg.broker.stage_grace_s:g})")  # fmt: skip
        result.local_published = sum(s.bus.published for s in stages)
        result.local_received = sum(s.bus.received for s in stages)
    stop = current_stop()
    if stop is not None and stop.signum is not None:  # a signal ended the run (or came as it finished)
        result.signalled = stop.signum
        raise Interrupted(stop.signum, result)
    if result.outage:
        raise RunAborted(result.outage, result)
    return result


async def _stop_task(task: asyncio.Task[None], result: RunResult) -> None:
    """Stop a helper task of the run; one that had failed is reported in ``result`` (and logged)."""
    for name, exc in await cancel_and_wait(task):
        result.task_failed(name, exc)


WORKERS_NEED_BROKER = (
    "worker processes need a broker URL (--broker mqtt://HOST:PORT, e.g. a mosquitto with "
    "`set_tcp_nodelay true`): the embedded amqtt broker serves one process only"
)


async def simulate_async(
    cfg: PipelineConfig,
    scenarios: list[Scenario],
    sessions: int = 1,
    *,
    run_id: str = "virtual",
    slots: list[Slot] | None = None,
    hop_ns: int = 0,
    on_record: Callable[[TurnRecord], None] | None = None,
    tap: Callable[[str, Envelope], None] | None = None,
) -> RunResult:
    """The live stages on the in-memory bus (call on a :class:`~voicepipe.clock.VirtualLoop`). ``slots``
    replaces the live default (each session once, spread as configured); ``tap`` sees every message.
    A real endpoint runs as its calibrated profile, or is refused (:func:`voicepipe.modelled.on_virtual_time`)."""
    cfg = on_virtual_time(cfg)
    ctx = RunContext(run=run_id, cfg=cfg)
    broker = MemoryBroker(ctx.run, hop_ns, tap=tap, trusted=True)  # in this process only: no MACs
    result = RunResult(run=ctx.run, broker=f"in-memory ({hop_ns / 1e6:g} ms hops, virtual time)")

    def record(r: TurnRecord) -> None:
        result.records.append(r)
        if on_record:
            on_record(r)

    stages = build_stages(broker.connect, ctx, needed_stages(cfg), on_record=record)
    async with contextlib.AsyncExitStack() as stack:
        await play_sessions(stack, stages, slots or spread_slots(cfg, scenarios, sessions), result)
    return result


def simulate(cfg: PipelineConfig, scenarios: list[Scenario], sessions: int = 1, **kw: Any) -> RunResult:
    """:func:`simulate_async` on a fresh virtual clock: modelled time only, as fast as the CPU allows."""
    return run_virtual(simulate_async(cfg, scenarios, sessions, **kw))
