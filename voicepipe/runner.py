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


def build_stages(bus_for: Callable[[str], Bus], ctx: RunContext, **client_kw) -> list[Stage]:
    """The diagram's boxes; the cache and the council only when configured."""
    stages: list[Stage] = [
        ASR(bus_for("asr"), ctx),
        Router(bus_for("router"), ctx),
        Agent(bus_for("agent"), ctx),
    ]
    if ctx.cfg.cache.enabled or ctx.cfg.router.cache_first or _routes_to(ctx, "cache"):
        stages.append(Cache(bus_for("cache"), ctx))
    if ctx.cfg.council.members:
        stages.append(Council(bus_for("council"), ctx))
    stages += [TTS(bus_for("tts"), ctx), Client(bus_for("client"), ctx, **client_kw)]
    return stages


def _routes_to(ctx: RunContext, dest: str) -> bool:
    r = ctx.cfg.router
    if r.policy == "rules":
        return dest in [r.default, *(rule.to for rule in r.rules)]
    if r.policy == "classifier":
        return dest in (r.classifier_low, r.default)
    return False


async def run_pipeline(
    cfg: PipelineConfig,
    scenarios: list[Scenario],
    sessions: int = 1,
    *,
    run_id: str | None = None,
    on_record: Callable[[TurnRecord], None] | None = None,
    on_ready: Callable[[RunResult], None] | None = None,
) -> RunResult:
    quiet_amqtt()
    run = run_id or secrets.token_hex(4)
    async with contextlib.AsyncExitStack() as stack:
        if cfg.broker.url:
            addr = BrokerAddress.parse(cfg.broker.url, cfg.broker.username, cfg.broker.password)
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
        buses: list[Bus] = []

        def bus_for(name: str) -> Bus:
            b = Bus(addr, run, name, qos=cfg.broker.qos)
            buses.append(b)
            return b

        def record(r: TurnRecord) -> None:
            result.records.append(r)
            if on_record:
                on_record(r)

        stages = build_stages(bus_for, ctx, on_record=record)
        for b in buses:
            await stack.enter_async_context(b)
        tasks = [asyncio.create_task(s.run(), name=f"stage-{s.name}") for s in stages]
        try:
            await asyncio.wait_for(asyncio.gather(*(s.ready.wait() for s in stages)), 10)
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
            for s in stages:
                await s.shutdown()
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            result.deadletters = sum(b.deadletters for b in buses)
            result.stage_errors = sum(s.errors for s in stages)
    return result
