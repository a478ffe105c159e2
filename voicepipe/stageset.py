"""The stages of one run: which the config needs, their classes, their buses, and starting and stopping them.

:func:`needed_stages` picks the diagram's boxes a config uses; :func:`build_stages` makes one per name on a bus
from ``connect`` (live: :func:`mqtt_connector`, every stage of a process on one MQTT connection; virtual: the
in-memory broker); :func:`start_stages` / :func:`stop_stages` run and end their receive loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable

from voicepipe.audio.asr import RealASR
from voicepipe.audio.caller import Caller
from voicepipe.audio.tone import ToneTTS
from voicepipe.audio.tts import RealTTS
from voicepipe.audio.vad_asr import VadASR
from voicepipe.bus import BrokerHealth, Bus
from voicepipe.bus.mqtt import BrokerAddress, MqttBus, MqttLink
from voicepipe.config import PipelineConfig
from voicepipe.stages.agent import Agent
from voicepipe.stages.asr import ASR
from voicepipe.stages.base import NOTED_PER_REASON, RunContext, Stage, cancel_and_wait
from voicepipe.stages.cache import Cache
from voicepipe.stages.client import Client
from voicepipe.stages.council import Council
from voicepipe.stages.router import Router
from voicepipe.stages.tts import TTS


def refused_so_far(stages: list[Stage]) -> int:
    """Deliveries this process's stages refused so far: dead-lettered by a guard or by the bus (malformed),
    or dropped by the bus as a duplicate id (a running count, read by the lag probe)."""
    n = 0
    for s in stages:
        noted = sum(min(k, NOTED_PER_REASON) for k in s.noted.values())
        n += sum(s.guard.counters.dead.values()) + getattr(s.bus, "duplicates", 0) + s.bus.deadletters - noted
    return n


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
    """One stage per name, each with its own bus ``connect(name)`` (not yet connected; live buses of one process
    share its MQTT connection, :func:`mqtt_connector`)."""
    return [stage_class(n, ctx.cfg)(connect(n), ctx, **(client_kw if n == "client" else {})) for n in names]


def stage_class(name: str, cfg: PipelineConfig) -> type[Stage]:
    """The stage that plays ``name`` under ``cfg``, each speech stage on its own (issue 25,
    :mod:`voicepipe.speech_mix`): the audio caller for an audio ``client.voice``, the real ASR and TTS for
    real engines; a modelled TTS answering an audio caller plays its reply as frames (:class:`ToneTTS`)."""
    real = cfg.real_stages
    if name == "client" and "client" in real:
        return Caller
    if name == "asr" and "vad" in real:
        return RealASR if "asr" in real else VadASR
    if name == "tts":
        return RealTTS if "tts" in real else ToneTTS if "client" in real else STAGES["tts"]
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
