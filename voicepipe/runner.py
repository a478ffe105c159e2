"""Runs scenarios through the pipeline: broker, stages (one MQTT client each), sessions, records."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from voicepipe.brokers import EmbeddedBroker, quiet_amqtt
from voicepipe.bus import BrokerAddress, Bus, probe_round_trip
from voicepipe.config import PipelineConfig
from voicepipe.records import TurnRecord
from voicepipe.scenario import Scenario, session_id
from voicepipe.stages.agent import Agent
from voicepipe.stages.asr import ASR
from voicepipe.stages.base import RunContext, Stage
from voicepipe.stages.cache import Cache
from voicepipe.stages.client import Client
from voicepipe.stages.council import Council
from voicepipe.stages.router import Router
from voicepipe.stages.tts import TTS

log = structlog.get_logger("voicepipe.run")

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
    open_tasks_after: int = 0


async def _after(delay_s: float, coro: Awaitable[list[TurnRecord]]) -> list[TurnRecord]:
    await asyncio.sleep(delay_s)
    return await coro


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


def build_stages(addr: BrokerAddress, ctx: RunContext, names: list[str], **client_kw) -> list[Stage]:
    """One stage per name, each with its own bus client (not yet connected)."""
    qos = ctx.cfg.broker.qos
    return [
        STAGES[n](Bus(addr, ctx.run, n, qos=qos), ctx, **(client_kw if n == "client" else {})) for n in names
    ]


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
    addr = BrokerAddress.from_config(cfg.broker)
    ctx = RunContext(run=run, cfg=cfg)
    async with contextlib.AsyncExitStack() as stack:
        stages = build_stages(addr, ctx, names)
        tasks: list[asyncio.Task[None]] = []
        try:
            tasks = await start_stages(stack, stages)
            for s in stages:
                await s.bus.client.publish(ready_topic(run, s.name), b"ready", qos=1, retain=True)
            await asyncio.gather(*tasks)
        finally:
            for s in stages:
                with contextlib.suppress(Exception):
                    await s.bus.client.publish(ready_topic(run, s.name), b"", qos=1, retain=True)
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
    run = run_id or secrets.token_hex(4)
    async with contextlib.AsyncExitStack() as stack:
        if cfg.broker.url:
            addr = BrokerAddress.from_config(cfg.broker)
            shown = f"{addr.host}:{addr.port}"
        else:
            emb = await stack.enter_async_context(EmbeddedBroker())
            addr = BrokerAddress.parse(emb.url)
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
        stages = build_stages(addr, ctx, local, on_record=record)
        tasks: list[asyncio.Task[None]] = []
        try:
            tasks = await start_stages(stack, stages)
            if external:
                await _wait_for_external(addr, run, set(external) & set(needed_stages(cfg)))
            if on_ready:
                on_ready(result)
            client = next(s for s in stages if isinstance(s, Client))
            pairs = session_ids(scenarios, sessions)
            spread = cfg.client.start_spread_ms / 1e3 / max(1, len(pairs))
            await asyncio.gather(
                *(_after(i * spread, client.play(sc, sid)) for i, (sc, sid) in enumerate(pairs))
            )
            await asyncio.sleep(0.05)  # let session.end reach every stage
            result.open_tasks_after = sum(s.open_tasks() for s in stages)
        finally:
            await stop_stages(stages, tasks)
            result.deadletters = sum(s.bus.deadletters for s in stages)
            result.stage_errors = sum(s.errors for s in stages)
    return result
