"""Runs scenarios through the pipeline: a bus, the stages (one bus connection each), sessions, records.

:func:`run_pipeline` runs live: real time, an MQTT broker (embedded amqtt, or the configured one).
:func:`simulate` runs the same stages on the in-memory bus and the virtual clock (``predict``, ``capacity``):
modelled time only, as fast as the CPU goes. Both play sessions through :func:`play_sessions`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from voicepipe.brokers import EmbeddedBroker, quiet_amqtt
from voicepipe.bus import (
    BrokerAddress,
    BrokerHealth,
    BrokerOutage,
    Bus,
    MqttBus,
    negotiate_protocol,
    probe_round_trip,
)
from voicepipe.clock import is_virtual, run_virtual
from voicepipe.config import PipelineConfig
from voicepipe.measure import LAG_TRUST_P99_MS, LagProbe, LoopLag
from voicepipe.membus import MemoryBroker
from voicepipe.messages import Envelope
from voicepipe.records import Accounting, TurnRecord, account
from voicepipe.scenario import Scenario, session_id
from voicepipe.stages.agent import Agent
from voicepipe.stages.asr import ASR
from voicepipe.stages.base import NOTED_PER_REASON, RunContext, Stage, cancel_quietly
from voicepipe.stages.cache import Cache
from voicepipe.stages.client import Client
from voicepipe.stages.council import Council
from voicepipe.stages.guard import Counters, require_shared_token
from voicepipe.stages.router import Router
from voicepipe.stages.tts import TTS

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
    # what the stages did with what they received (received, dead-lettered by reason, late, lost in
    # transit, handler errors), the turns the run was asked to play, and its own event-loop lag (live only)
    counters: Counters = field(default_factory=Counters)
    expected_turns: int = 0
    lag: LoopLag | None = None

    def accounting(self) -> Accounting:
        return account(self.records, self.expected_turns, self.counters.lost)

    def summary_json(self) -> dict[str, object]:
        """The run's counters as one JSON object (the last line of ``--json``); never the run's token."""
        c = self.counters
        return {
            "type": "run.summary",
            "run": self.run,
            "turns": self.accounting().model_dump(),
            "bus": {
                "received": c.received,
                "dead_lettered": dict(c.dead),
                "late": c.late,
                "lost_in_transit": c.lost,
                "handler_errors": c.handler_errors,
            },
            "loop_lag": None
            if self.lag is None
            else {"p99_ms": self.lag.p99_ms, "max_ms": self.lag.max_ms, "samples": self.lag.samples,
                  "overloaded": self.lag.overloaded, "trust_p99_ms": LAG_TRUST_P99_MS},
        }  # fmt: skip


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
    """One stage per name, each with its own bus connection ``connect(name)`` (not yet connected)."""
    return [STAGES[n](connect(n), ctx, **(client_kw if n == "client" else {})) for n in names]


def mqtt_connector(
    addr: BrokerAddress, ctx: RunContext, protocol: str = "3.1.1", health: BrokerHealth | None = None
) -> Callable[[str], Bus]:
    b = ctx.cfg.broker
    shared = health or BrokerHealth()
    return lambda name: MqttBus(
        addr, ctx.run, name, qos=b.qos, protocol=protocol, outage_window_s=b.outage_window_s, health=shared
    )


async def start_stages(stack: contextlib.AsyncExitStack, stages: list[Stage]) -> list[asyncio.Task[None]]:
    """Connect every stage's client, start its receive loop, and wait until all are subscribed."""
    for s in stages:
        await stack.enter_async_context(s.bus)
    tasks = [asyncio.create_task(s.run(), name=f"stage-{s.name}") for s in stages]
    await asyncio.wait_for(asyncio.gather(*(s.ready.wait() for s in stages)), 10)
    return tasks


async def stop_stages(stages: list[Stage], tasks: list[asyncio.Task[None]]) -> None:
    for s in stages:
        await s.shutdown()
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


def ready_topic(run: str, name: str) -> str:
    """Retained marker a stage running in another process publishes once it is subscribed."""
    return f"voicepipe/{run}/_ready/{name}"


def _routes_to(ctx: RunContext, dest: str) -> bool:
    r = ctx.cfg.router
    if r.policy == "rules":
        return dest in [r.default, *(rule.to for rule in r.rules)]
    if r.policy == "classifier":
        return dest in (r.classifier_low, r.default)
    return False


class StagesMissing(RuntimeError):
    """Stages the run expects in other processes never reported ready."""


async def _wait_for_external(addr: BrokerAddress, run: str, names: set[str], timeout_s: float = 30.0) -> None:
    seen: set[str] = set()
    async with addr.client(identifier=f"vp-{run}-wait") as c:
        await c.subscribe(ready_topic(run, "+"), qos=1)
        try:
            async with asyncio.timeout(timeout_s):
                async for m in c.messages:
                    if m.payload:
                        seen.add(str(m.topic).rsplit("/", 1)[-1])
                    if names <= seen:
                        return
        except TimeoutError:
            missing = ", ".join(sorted(names - seen))
            raise StagesMissing(
                f"stages {missing} of run {run} not ready after {timeout_s:.0f} s "
                f"(start them with `voicepipe stage {missing.replace(',', '')} --run {run} --broker URL`)"
            ) from None


async def serve_stages(cfg: PipelineConfig, names: list[str], run: str) -> None:
    """Run some stages of run ``run`` in this process until cancelled (``voicepipe stage``)."""
    quiet_amqtt()
    if not cfg.broker.url:
        raise ValueError("broker.url: stages in separate processes need a broker (--broker URL)")
    require_shared_token("voicepipe stage")
    addr = BrokerAddress.from_config(cfg.broker)
    ctx = RunContext(run=run, cfg=cfg)
    protocol = await negotiate_protocol(addr, cfg.broker.protocol)
    async with contextlib.AsyncExitStack() as stack:
        stages = build_stages(mqtt_connector(addr, ctx, protocol), ctx, names)
        tasks: list[asyncio.Task[None]] = []
        try:
            tasks = await start_stages(stack, stages)
            for s in stages:
                await s.bus.client.publish(ready_topic(run, s.name), b"ready", qos=1, retain=True)  # type: ignore[attr-defined]
            await asyncio.gather(*tasks)
        finally:
            for s in stages:
                with contextlib.suppress(Exception):
                    await s.bus.client.publish(ready_topic(run, s.name), b"", qos=1, retain=True)  # type: ignore[attr-defined]
            await stop_stages(stages, tasks)


async def run_pipeline(
    cfg: PipelineConfig,
    scenarios: list[Scenario],
    sessions: int = 1,
    *,
    run_id: str | None = None,
    on_record: Callable[[TurnRecord], None] | None = None,
    on_ready: Callable[[RunResult], None] | None = None,
    external: frozenset[str] = frozenset(),
) -> RunResult:
    """Play the scenarios and collect their turn records. Stages named in ``external`` run in other
    processes (``voicepipe stage``) against the same broker, run id and config; the run waits for them."""
    quiet_amqtt()
    if external:
        require_shared_token("--external")
    run = run_id or secrets.token_hex(4)
    async with contextlib.AsyncExitStack() as stack:
        if cfg.broker.url:
            addr = BrokerAddress.from_config(cfg.broker)
            protocol = await negotiate_protocol(addr, cfg.broker.protocol)
            shown = f"{addr.host}:{addr.port} (MQTT {protocol})"
        else:
            emb = await stack.enter_async_context(EmbeddedBroker())
            addr = BrokerAddress.parse(emb.url)
            protocol = "3.1.1"
            shown = f"embedded amqtt {addr.host}:{addr.port}"
        result = RunResult(run=run, broker=shown)
        if cfg.broker.probe:
            result.probe_ms = await probe_round_trip(addr, qos=cfg.broker.qos)
            if result.probe_ms > cfg.broker.probe_warn_ms:
                result.warnings.append(
                    f"broker round trip {result.probe_ms:.0f} ms (expected ~1 ms): {NAGLE_FIX}"
                )
        ctx = RunContext(run=run, cfg=cfg)

        def record(r: TurnRecord) -> None:
            result.records.append(r)
            if on_record:
                on_record(r)

        local = [n for n in needed_stages(cfg) if n not in external]
        health = BrokerHealth()
        stages = build_stages(mqtt_connector(addr, ctx, protocol, health), ctx, local, on_record=record)

        async def wait_external() -> None:
            if external:
                await _wait_for_external(addr, run, set(external) & set(needed_stages(cfg)))
            if on_ready:
                on_ready(result)

        try:
            await play_sessions(
                stack, stages, spread_slots(cfg, scenarios, sessions), result, before=wait_external
            )
        except BrokerOutage as exc:
            result.outage = str(exc)
        finally:
            result.warnings += health.summary()
            result.duplicates = sum(getattr(s.bus, "duplicates", 0) for s in stages)
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


async def play_sessions(
    stack: contextlib.AsyncExitStack,
    stages: list[Stage],
    slots: list[Slot],
    result: RunResult,
    *,
    before: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Start the stages, play every slot's conversations, stop the stages."""
    tasks: list[asyncio.Task[None]] = []
    result.expected_turns = sum(len(sc.turns) for _, convs in slots for sc, _ in convs)
    probe = None if is_virtual() else LagProbe()
    probing = asyncio.create_task(probe.run()) if probe else None
    try:
        tasks = await start_stages(stack, stages)
        if before is not None:
            await before()
        client = next(s for s in stages if isinstance(s, Client))
        play = asyncio.ensure_future(asyncio.gather(*(_slot(client, at, convs) for at, convs in slots)))
        # a stage's receive loop ends only when its bus gave up (the broker away past the outage window)
        await asyncio.wait([play, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if not play.done():
            await cancel_quietly(play)
            dead = next(t for t in tasks if t.done())
            exc = None if dead.cancelled() else dead.exception()
            raise exc or RuntimeError(f"{dead.get_name()} stopped during the run")
        await play
        await asyncio.sleep(0.05)  # let session.end reach every stage
        result.open_tasks_after = sum(s.open_tasks() for s in stages)
    finally:
        if probing is not None:
            probing.cancel()
            result.lag = probe.result() if probe else None
        await stop_stages(stages, tasks)
        result.deadletters = sum(s.bus.deadletters for s in stages)
        result.stage_errors = sum(s.errors for s in stages)
        result.first_error = next((s.first_error for s in stages if s.first_error), None)
        for s in stages:
            result.counters.add(s.guard.counters)
        result.counters.received = sum(s.bus.received for s in stages)
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
    replaces the live default (each session once, spread as configured); ``tap`` sees every message."""
    ctx = RunContext(run=run_id, cfg=cfg)
    broker = MemoryBroker(ctx.run, hop_ns, tap=tap)
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
