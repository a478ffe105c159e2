"""Start-up checks against the broker, each on clients of its own: which MQTT version to speak
(:func:`negotiate_protocol`), whether the run's topics come back under the broker's ACL
(:func:`check_run_topics`, :class:`RunTopicsUnreachable`), and the broker's round trip
(:func:`probe_round_trip`: a broker without TCP_NODELAY shows as ~40 ms).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import aiomqtt
from aiomqtt.exceptions import MqttConnectError

from voicepipe.bus.base import stop_task
from voicepipe.bus.mqtt.address import BrokerAddress
from voicepipe.messages import topic


async def negotiate_protocol(addr: BrokerAddress, setting: str) -> str:
    """The MQTT version the stages speak: ``setting`` unless "auto"; then 5 if the broker accepts an MQTT 5
    connection, else 3.1.1: a broker that refuses it, or (amqtt) never answers it within 3 s. Set
    ``broker.protocol`` to skip the wait."""
    if setting != "auto":
        return setting
    try:
        async with addr.client(identifier=f"vp-hello-{time.monotonic_ns():x}", protocol="5", timeout=3):
            return "5"
    except MqttConnectError as exc:
        if exc.rc in (1, 132):  # 3.1.1 "unacceptable protocol version", MQTT 5 "unsupported protocol version"
            return "3.1.1"
        raise
    except aiomqtt.MqttError as exc:
        if "timed out" in str(exc):
            return "3.1.1"
        raise


class RunTopicsUnreachable(Exception):
    """The broker accepted the connection but never delivered the run's own topics back (an ACL)."""


async def check_run_topics(addr: BrokerAddress, run: str, timeout_s: float = 5.0) -> None:
    """Publish one message under the run's topics and wait for it to come back (QoS 1, one client).

    A broker whose ACL does not let this user read and write ``voicepipe/{run}/#`` accepts the connection,
    the subscriptions and the publishes, then delivers nothing (mosquitto checks ACLs per message), so every
    turn would time out with no reason given. This turns that into one error at start, naming the run and
    the user. The topic's session part (``_reach``) and channel (a fresh tag) are ones no stage subscribes to.
    """
    tag = f"vp-reach-{time.monotonic_ns():x}"
    probe = topic(run, "_reach", tag)
    async with addr.client(identifier=tag) as c:
        await c.subscribe(probe, qos=1)
        await c.publish(probe, b"reach", qos=1)
        try:
            async with asyncio.timeout(timeout_s):
                async for _m in c.messages:
                    return
        except TimeoutError:
            who = f"user {addr.username!r}" if addr.username else "an anonymous client"
            raise RunTopicsUnreachable(
                f"broker {addr.host}:{addr.port} accepts {who} but does not deliver run {run!r}'s topics back "
                f"(published and subscribed {probe}: nothing came back in {timeout_s:g} s) — its ACL does not "
                f"let {who} read and write voicepipe/{run}/#? With docs/mosquitto-acl.conf the run id must be "
                "the user name (--run-id)"
            ) from None


async def probe_round_trip(addr: BrokerAddress, rounds: int = 8, qos: int = 1) -> float:
    """Median ms of a QoS ``qos`` ping-pong between two clients (the pipeline's message pattern).

    On a broker without TCP_NODELAY each round stalls on a delayed ACK (~40 ms on Linux); with it, a
    round is about two loopback hops (~1 ms).
    """
    tag = f"vp-probe-{time.monotonic_ns():x}"
    ping, pong = f"voicepipe-probe/{tag}/ping", f"voicepipe-probe/{tag}/pong"
    async with addr.client(identifier=f"{tag}-a") as a, addr.client(identifier=f"{tag}-b") as b:
        await a.subscribe(pong, qos=qos)
        await b.subscribe(ping, qos=qos)

        async def echo() -> None:
            async for m in b.messages:
                await b.publish(pong, m.payload, qos=qos)

        task = asyncio.create_task(echo())
        try:
            samples = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                await a.publish(ping, b"p" * 64, qos=qos)
                async for _m in a.messages:
                    break
                samples.append((time.perf_counter() - t0) * 1e3)
                await asyncio.sleep(0.002)
            return statistics.median(samples)
        finally:
            await stop_task(task, "probe-echo")
