"""Runs scenarios through the pipeline: a bus, the stages (live: one MQTT connection per process), sessions.

:func:`run_pipeline` runs live: real time, an MQTT broker (embedded amqtt, or the configured one).
:func:`simulate` runs the same stages on the in-memory bus and the virtual clock (``predict``, ``capacity``):
modelled time only, as fast as the CPU goes. Both play sessions through :func:`play_sessions`.

Live runs can spread stages over processes: ``external`` stages served by ``voicepipe stage``
(:func:`serve_stages`), or ``workers`` processes this run spawns (:class:`Workers`, replicas with session
affinity per :mod:`voicepipe.bus.partition`). Stage processes announce themselves and are watched per
:mod:`voicepipe.bus.liveness`; :class:`Failer` turns a death or a missed deadline into failed turns with a reason,
so every expected turn is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from voicepipe.audio.asr import RealASR
from voicepipe.audio.caller import Caller
from voicepipe.audio.tts import RealTTS
from voicepipe.bus import BrokerHealth, BrokerOutage, Bus
from voicepipe.bus.brokers import EmbeddedBroker, quiet_amqtt
from voicepipe.bus.instance import Announcer, Follower, refuse_if_running
from voicepipe.bus.liveness import Presence, Progress, Watch, turn_deadline_ns
from voicepipe.bus.memory import MemoryBroker
from voicepipe.bus.mqtt import (
    BrokerAddress,
    MqttBus,
    MqttLink,
    check_run_topics,
    negotiate_protocol,
    probe_round_trip,
)
from voicepipe.bus.partition import SHADOWED, Membership, PartitionedBus, kind_of, plan_workers, replica_id
from voicepipe.clock import is_virtual, now_ns, run_virtual
from voicepipe.clock.gc import during_run, tune_for_runs
from voicepipe.config import PipelineConfig, broker_address, check_speech
from voicepipe.errors import UserError, check_run_id
from voicepipe.exitcodes import signal_name
from voicepipe.incidents import Incidents, spans_ms
from voicepipe.keys import Instance
from voicepipe.measure import (
    BURST_REFUSED,
    LAG_TRUST_P99_MS,
    TAX_OUTLIER_MS,
    TURN_LAG_TRUST_MS,
    LagProbe,
    LoopLag,
)
from voicepipe.messages import Cancel, CancelReason, Envelope
from voicepipe.modelled import on_virtual_time
from voicepipe.records import Accounting, TurnRecord, account
from voicepipe.scenario import Scenario, session_id
from voicepipe.stages.agent import Agent
from voicepipe.stages.asr import ASR
from voicepipe.stages.base import NOTED_PER_REASON, RunContext, Stage, cancel_and_wait
from voicepipe.stages.cache import Cache
from voicepipe.stages.client import Client
from voicepipe.stages.council import Council
from voicepipe.stages.guard import Counters, require_shared_token
from voicepipe.stages.router import Router
from voicepipe.stages.tts import TTS
from voicepipe.stopping import Interrupted
from voicepipe.stopping import current as current_stop

log = structlog.get_logger("voicepipe.run")
T = TypeVar("T")

NAGLE_FIX = (
    "the broker stalls small messages (Nagle's algorithm on its sockets): add `set_tcp_nodelay true` "
    "to mosquitto.conf (and keep TCP_NODELAY on clients) — otherwise every hop can wait ~40 ms and the "
    "measured tax is the broker's, not your pipeline's"
)


@dataclass
class RunResult:
    run: str
    broker: str
    records: list[TurnRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    probe_ms: float | None = None
    deadletters: int = 0
    stage_errors: int = 0
    first_error: str | None = None
    open_tasks_after: int = 0
    duplicates: int = 0  # redelivered bus messages dropped by envelope id (after reconnects)
    outage: str | None = None  # the run ended early: the broker stayed away longer than the window
    signalled: int | None = None  # the run ended early: this signal stopped it (voicepipe.stopping)
    ended: str | None = None  # the run ended early for another reason (an internal error)
    # the broker's absences this process's clients saw, (start, end) monotonic ns, and their reconnects
    broker_outages: list[tuple[int, int]] = field(default_factory=list)
    broker_stalls: list[tuple[int, int]] = field(default_factory=list)
    reconnects: int = 0
    # what the stages did with what they received (received, dead-lettered by reason, late, lost in
    # transit, handler errors), the turns the run was asked to play, and its own event-loop lag (live only)
    counters: Counters = field(default_factory=Counters)
    expected_turns: int = 0
    lag: LoopLag | None = None

    def task_failed(self, name: str, exc: BaseException) -> None:
        """A task of the run (a stage's receive loop, the deadline watch) had ended with ``exc``: counted
        with the stage errors, and the run's first error if it has none yet."""
        self.stage_errors += 1
        if self.first_error is None:
            self.first_error = f"{name}: {exc!r}"

    def accounting(self) -> Accounting:
        return account(self.records, self.expected_turns, self.counters.lost)

    def incidents(self) -> Incidents:
        """Outages, stalls, stage deaths and what ended the run early (:mod:`voicepipe.incidents`)."""
        ended = f"broker outage: {self.outage}" if self.outage else self.ended
        if self.signalled is not None:
            ended = signal_name(self.signalled)
        return Incidents(
            outages_ms=spans_ms(self.broker_outages), stalls_ms=spans_ms(self.broker_stalls),
            reconnects=self.reconnects, deaths=list(self.deaths), ended_by=ended,
        ).add_turns(self.records)  # fmt: skip

    def summary_json(self) -> dict[str, object]:
        """The run's counters as one JSON object (the last line of ``--json``); never the run's token."""
        c = self.counters
        return {
            "type": "run.summary",
            "run": self.run,
            "turns": self.accounting().model_dump(),
            "incidents": self.incidents().to_json(),
            "bus": {
                "received": c.received,
                "dead_lettered": dict(c.dead),
                "duplicates": c.duplicates,
                # every message refused, by reason (dead letters and the bus's duplicate drops), per delivery
                "refused": refused_by_reason(c),
                "late": c.late,
                "lost_in_transit": c.lost,
                "handler_errors": c.handler_errors,
            },
            "loop_lag": None
            if self.lag is None
            else {"p99_ms": self.lag.p99_ms, "max_ms": self.lag.max_ms, "samples": self.lag.samples,
                  "overloaded": self.lag.overloaded, "trust_p99_ms": LAG_TRUST_P99_MS},
            "trust": untrusted_turns(self.records),
        }  # fmt: skip

    workers: int = 0
    deaths: list[str] = field(default_factory=list)  # stage processes that died: "process (replicas): why"
    death_ns: list[int] = field(default_factory=list)  # when the run noticed each (monotonic ns)
    worker_pids: list[int] = field(default_factory=list)
    # bus counters: this process's stages, and (from their last heartbeats) the stage processes'
    local_published: int = 0
    local_received: int = 0
    remote_cpu_s: float = 0.0
    remote_published: int = 0
    remote_received: int = 0
    remote_skipped: int = 0  # messages a replica received for a session another replica owns


def refused_by_reason(c: Counters) -> dict[str, int]:
    """Every refused delivery by reason: the dead letters' reasons, and the bus's drops of an envelope id it
    had already seen (``duplicate envelope id``: redelivered, replayed or tampered copies keeping the id)."""
    out = dict(c.dead)
    if c.duplicates:
        out["duplicate envelope id"] = out.get("duplicate envelope id", 0) + c.duplicates
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def distrust_reasons(records: list[TurnRecord]) -> dict[str, int]:
    """The measured turns whose numbers this process's load may have made (``TurnRecord.trusted``), by kind
    of reason (the text before its first colon); a turn with two reasons counts under both."""
    why: dict[str, int] = {}
    for r in records:
        if not r.trusted:
            for part in r.distrust.split("; "):
                head = part.split(":", 1)[0]
                why[head] = why.get(head, 0) + 1
    return why


def untrusted_turns(records: list[TurnRecord]) -> dict[str, object]:
    """The summary's ``trust``: untrusted turns, their reasons, and the bounds they were judged by."""
    return {
        "untrusted_turns": sum(not r.trusted for r in records),
        "reasons": distrust_reasons(records),
        "tax_outlier_ms": TAX_OUTLIER_MS,
        "turn_lag_trust_ms": TURN_LAG_TRUST_MS,
        "burst_refused": BURST_REFUSED,
    }


def refused_so_far(stages: list[Stage]) -> int:
    """Deliveries this process's stages refused so far: dead-lettered by a guard or by the bus (malformed),
    or dropped by the bus as a duplicate id (a running count, read by the lag probe)."""
    n = 0
    for s in stages:
        noted = sum(min(k, NOTED_PER_REASON) for k in s.noted.values())
        n += sum(s.guard.counters.dead.values()) + getattr(s.bus, "duplicates", 0) + s.bus.deadletters - noted
    return n


class RunAborted(BrokerOutage):
    """The broker stayed away past ``broker.outage_window_s``; ``result`` holds what was measured."""

    def __init__(self, msg: str, result: RunResult) -> None:
        super().__init__(msg)
        self.result = result


Slot = tuple[float, list[tuple[Scenario, str]]]  # start offset (s), conversations played back to back


async def _slot(client: Client, start_s: float, conversations: list[tuple[Scenario, str]]) -> None:
    await asyncio.sleep(start_s)
    for sc, sid in conversations:
        await client.play(sc, sid)


def spread_slots(cfg: PipelineConfig, scenarios: list[Scenario], sessions: int) -> list[Slot]:
    """Every (scenario, session) once, started ``client.start_spread_ms`` apart in all (the live default)."""
    pairs = session_ids(scenarios, sessions)
    spread = cfg.client.start_spread_ms / 1e3 / max(1, len(pairs))
    return [(i * spread, [pair]) for i, pair in enumerate(pairs)]


def session_ids(scenarios: list[Scenario], sessions: int) -> list[tuple[Scenario, str]]:
    pairs = [(sc, session_id(sc, i)) for sc in scenarios for i in range(sessions)]
    if len({sid for _, sid in pairs}) != len(pairs):
        raise ValueError("scenario names must differ: two scenarios would share session ids")
    return pairs


STAGES: dict[str, type[Stage]] = {
    "asr": ASR, "router": Router, "agent": Agent, "cache": Cache, "council": Council, "tts": TTS, "client": Client,
}  # fmt: skip


REAL_STAGES: dict[str, type[Stage]] = {"asr": RealASR, "tts": RealTTS, "client": Caller}


def needed_stages(cfg: PipelineConfig) -> list[str]:
    """The diagram's boxes this config uses; the cache and the council only when configured."""
    ctx = RunContext(run="", cfg=cfg)
    names = ["asr", "router", "agent"]
    if cfg.cache.enabled or cfg.router.cache_first or _routes_to(ctx, "cache"):
        names.append("cache")
    if cfg.council.members:
        names.append("council")
    return [*names, "tts", "client"]


def build_stages(
    connect: Callable[[str], Bus], ctx: RunContext, names: list[str], **client_kw: object
) -> list[Stage]:
    """One stage per name, each with its own bus ``connect(name)`` (not yet connected; live buses of one process
    share its MQTT connection, :func:`mqtt_connector`)."""
    return [stage_class(n, ctx.cfg)(connect(n), ctx, **(client_kw if n == "client" else {})) for n in names]


def stage_class(name: str, cfg: PipelineConfig) -> type[Stage]:
    """The stage that plays ``name`` under ``cfg``: the real-audio caller, ASR and TTS when its speech
    engines are real (issue 25), else the modelled ones."""
    if cfg.real_audio:
        return REAL_STAGES.get(name, STAGES[name])
    return STAGES[name]


def process_link(
    addr: BrokerAddress, ctx: RunContext, protocol: str = "3.1.1", health: BrokerHealth | None = None
) -> MqttLink:
    """This process's one MQTT connection for run ``ctx.run`` (its stages and its progress tap share it)."""
    b = ctx.cfg.broker
    return MqttLink(
        addr, ctx.run, f"p{secrets.token_hex(3)}", b.qos, protocol=protocol,
        outage_window_s=b.outage_window_s, health=health or BrokerHealth(),
    )  # fmt: skip


def mqtt_connector(
    addr: BrokerAddress,
    ctx: RunContext,
    protocol: str = "3.1.1",
    health: BrokerHealth | None = None,
    link: MqttLink | None = None,
) -> Callable[[str], Bus]:
    """Buses for the stages of this process, all on one MQTT connection (:class:`~voicepipe.bus.mqtt.link.MqttLink`:
    a message several of them subscribe to crosses the wire once; one ``send`` per event-loop batch)."""
    shared = link or process_link(addr, ctx, protocol, health)
    return lambda name: MqttBus(addr, ctx.run, name, qos=ctx.cfg.broker.qos, link=shared)


async def start_stages(stack: contextlib.AsyncExitStack, stages: list[Stage]) -> list[asyncio.Task[None]]:
    """Connect every stage's client, start its receive loop, and wait until all are subscribed."""
    for s in stages:
        await stack.enter_async_context(s.bus)
    tasks = [asyncio.create_task(s.run(), name=f"stage-{s.name}") for s in stages]
    await asyncio.wait_for(asyncio.gather(*(s.ready.wait() for s in stages)), 10)
    return tasks


async def stop_stages(
    stages: list[Stage], tasks: list[asyncio.Task[None]]
) -> list[tuple[str, BaseException]]:
    """Shut every stage down, then cancel its receive loop and wait for it to end. A loop that had already
    ended with an exception (or raised one while it stopped) is logged at error and returned as (task name,
    exception) for the run's failure channel, never swallowed; only the cancellation itself is expected."""
    for s in stages:
        await s.shutdown()
    return await cancel_and_wait(*tasks)


def _routes_to(ctx: RunContext, dest: str) -> bool:
    r = ctx.cfg.router
    if r.policy == "rules":
        return dest in [r.default, *(rule.to for rule in r.rules)]
    if r.policy == "classifier":
        return dest in (r.classifier_low, r.default)
    return False


class StagesMissing(RuntimeError):
    """Stages the run expects in other processes never reported ready."""


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
    """A ``--workers`` process (``python -c 'from voicepipe.runner import worker_entry; worker_entry()'``):
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
    with SIGINT ignored (``nohup``, some supervisors and test runners) still stops on Ctrl-C or SIGTERM."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, task.cancel)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await coro
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


class Workers:
    """``--workers N``: N stage processes spawned for one run (see :func:`~voicepipe.bus.partition.plan_workers`)."""

    def __init__(self, cfg: PipelineConfig, run: str, plan: list[list[str]], instance: Instance) -> None:
        self.cfg, self.run, self.plan, self.instance = cfg, run, plan, instance
        self.planned = [r for p in plan for r in p]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        code = "from voicepipe.runner import worker_entry; worker_entry()"
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


def run_live_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run a live coroutine on uvloop where installed (``pip install voicepipe[fast]``), else asyncio's
    loop: the event loop is a share of every bus message's CPU cost (bench/msgcost.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def _stop_task(task: asyncio.Task[None], result: RunResult) -> None:
    """Stop a helper task of the run; one that had failed is reported in ``result`` (and logged)."""
    for name, exc in await cancel_and_wait(task):
        result.task_failed(name, exc)


WORKERS_NEED_BROKER = (
    "worker processes need a broker URL (--broker mqtt://HOST:PORT, e.g. a mosquitto with "
    "`set_tcp_nodelay true`): the embedded amqtt broker serves one process only"
)


async def play_sessions(
    stack: contextlib.AsyncExitStack,
    stages: list[Stage],
    slots: list[Slot],
    result: RunResult,
    *,
    before: Callable[[], Awaitable[None]] | None = None,
    probe: LagProbe | None = None,
) -> None:
    """Start the stages, play every slot's conversations, stop the stages. Every scenario is first checked
    against the run's config (:func:`voicepipe.config.check_speech`: a UserError), on every path in.
    ``probe``: the run's own lag probe (a live run's default: a new one; a virtual run has none)."""
    tasks: list[asyncio.Task[None]] = []
    raised: BaseException | None = None  # a stage loop's failure this raises (not counted twice)
    if stages:
        played = {id(sc): sc for _, convs in slots for sc, _ in convs}
        check_speech(stages[0].cfg, list(played.values()))
    result.expected_turns = sum(len(sc.turns) for _, convs in slots for sc, _ in convs)
    probe = None if is_virtual() else probe or LagProbe()
    probing = asyncio.create_task(probe.run()) if probe else None
    stop = current_stop()  # a live run under voicepipe.stopping: a signal stops the sessions, not the run
    stopping: asyncio.Task[bool] | None = None
    try:
        tasks = await start_stages(stack, stages)
        if before is not None:
            await before()
        client = next(s for s in stages if isinstance(s, Client))
        play = asyncio.ensure_future(asyncio.gather(*(_slot(client, at, convs) for at, convs in slots)))
        # a stage's receive loop ends only when its bus gave up (the broker away past the outage window)
        waiting: list[asyncio.Future[Any]] = [play, *tasks]
        if stop is not None:
            stopping = asyncio.create_task(stop.event.wait(), name="stop-on-signal")
            waiting.append(stopping)
            stop.watch()
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if stop is not None and stop.signum is not None and not play.done():  # the turns in flight stay unrecorded
            for name, exc in await cancel_and_wait(play, what="the sessions"):
                result.task_failed(name, exc)
            return
        if not play.done():
            for name, exc in await cancel_and_wait(play, what="the sessions"):
                result.task_failed(name, exc)
            dead = next(t for t in tasks if t.done())
            raised = None if dead.cancelled() else dead.exception()
            raise raised or RuntimeError(f"{dead.get_name()} stopped during the run")
        await play
        await asyncio.sleep(0.05)  # let session.end reach every stage
        result.open_tasks_after = sum(s.open_tasks() for s in stages)
    finally:
        if stopping is not None:
            stopping.cancel()
        if probing is not None:
            probing.cancel()
            result.lag = probe.result() if probe else None
        stopped = await stop_stages(stages, tasks)
        result.deadletters = sum(s.bus.deadletters for s in stages)
        result.stage_errors += sum(s.errors for s in stages)
        result.first_error = result.first_error or next((s.first_error for s in stages if s.first_error), None)
        for name, exc in stopped:  # a stage loop that failed is a failure of the run, whenever it happened
            if exc is not raised:
                result.task_failed(name, exc)
        for s in stages:
            result.counters.add(s.guard.counters)
        result.counters.received = sum(s.bus.received for s in stages)
        result.counters.duplicates = sum(getattr(s.bus, "duplicates", 0) for s in stages)
        malformed = result.deadletters - sum(
            min(n, NOTED_PER_REASON) for s in stages for n in s.noted.values()
        )
        if malformed > 0:  # refused by the bus before any stage saw them (not JSON, wrong schema...)
            result.counters.dead["malformed"] += malformed


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
