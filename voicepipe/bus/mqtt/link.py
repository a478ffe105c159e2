"""One MQTT connection shared by the stages of a process (:class:`MqttLink`): delivery to every bus of the
process, reconnect with backoff, session resume, resend and replay, and the stall watchdog.

The link's client is the lean one (:class:`~voicepipe.bus.mqtt.lean.LeanClient`) when
:func:`~voicepipe.bus.mqtt._private.lean_allowed` says so (the pinned aiomqtt and paho-mqtt, and
``VOICEPIPE_LEAN`` not 0), else aiomqtt's public API (:class:`~voicepipe.bus.mqtt.plain.PlainClient`); both
offer :class:`LinkClient`, so nothing above the link knows which.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import aiomqtt
import structlog

from voicepipe.bus.base import BrokerHealth, BrokerOutage, stop_task
from voicepipe.bus.mqtt import _private
from voicepipe.bus.mqtt.address import BrokerAddress
from voicepipe.bus.mqtt.lean import MQTT_ERR_NO_CONN, LeanClient
from voicepipe.bus.mqtt.plain import PlainClient
from voicepipe.clock import now_ns
from voicepipe.messages import topic

if TYPE_CHECKING:
    from voicepipe.bus.mqtt.bus import MqttBus

log = structlog.get_logger("voicepipe.bus")


class LinkClient(Protocol):
    """What :class:`MqttLink` needs of its client, lean or plain."""

    sink: Callable[[str, bytes], None] | None
    wakers: list[Callable[[], None]]
    unacked: dict[int, int]  # QoS 1 publishes not yet acknowledged -> when handed over (ns)
    bad_topics: int

    @property
    def lost(self) -> bool: ...
    def prepare_reconnect(self) -> None: ...
    def publish_nowait(self, topic: str, payload: bytes, qos: int, retain: bool = False) -> int: ...
    def flush_soon(self) -> None: ...
    def wake(self) -> None: ...
    async def subscribe(self, topic: str, qos: int) -> Any: ...
    async def __aenter__(self) -> Any: ...
    async def __aexit__(self, *exc: Any) -> None: ...
    async def close(self) -> None: ...


REPLAY_NS = 2_000_000_000  # published this long before a lost connection: sent again after reconnecting


class MqttLink:
    """One MQTT connection shared by the stages of a process: the lean message path, reconnect and resume.

    Every :class:`MqttBus` of a process that shares a link (``stageset.mqtt_connector``) publishes through the
    same client and receives through it: a channel several of its stages subscribe to (``turn/script``,
    ``control/cancel``, ``session/end``) crosses the wire once and is handed to each of them; the PUBACKs
    and PUBLISHes of all its stages in one event-loop batch leave in one ``send``. Every bus still parses its
    own copy of the body (stages never share a message object). A bus made without a link gets one of its own.

    Lost connection: reconnect with exponential backoff and jitter (aiomqtt's documented pattern: enter
    the same client again), on a persistent session (MQTT 5: clean start on the first connect only and a
    session expiry of ``outage_window_s``; MQTT 3.1.1: ``clean_session`` false), then subscribe again.
    QoS 1 publishes not yet acknowledged stay with paho and are sent again (DUP); what the broker
    redelivers twice is dropped by envelope id (per bus). A connection lost for longer than
    ``outage_window_s`` raises :class:`BrokerOutage` from every bus's :meth:`MqttBus.messages` and
    :meth:`MqttBus.publish`.
    """

    BACKOFF_S = (0.05, 2.0)  # first retry after ~50 ms, doubling up to 2 s; each times uniform(0.5, 1)

    def __init__(
        self,
        addr: BrokerAddress,
        run: str,
        name: str,
        qos: int = 1,
        *,
        protocol: str = "3.1.1",
        outage_window_s: float = 30.0,
        health: BrokerHealth | None = None,
        lean: bool | None = None,
    ) -> None:
        self.addr = addr
        self.run = run
        self.name = name
        self.qos = qos
        self.window_ns = round(outage_window_s * 1e9)
        self.health = health or BrokerHealth()
        self.lean = _private.lean_allowed() if lean is None else lean
        made = addr.client(
            identifier=f"vp-{run}-{name}",
            factory=LeanClient if self.lean else PlainClient,
            persistent=True,
            protocol=protocol,
            session_expiry_s=outage_window_s,
        )
        assert isinstance(made, LeanClient | PlainClient)
        self.client: LinkClient = made
        self.client.sink = self._deliver
        self.client.wakers.append(self._wake_all)
        self.subs: dict[str, list[MqttBus]] = {}  # channel -> the buses subscribed to it
        self.taps: dict[str, list[Callable[[str, str, bytes], None]]] = {}  # channel -> raw observers
        self.wire: dict[str, int] = {}  # topic filter -> QoS subscribed with on the broker (acknowledged)
        self._subscribing: dict[str, asyncio.Future[None]] = {}  # filters whose SUBSCRIBE awaits its SUBACK
        self.delivered = 0  # messages that came over the wire (each to every bus and tap on its channel)
        self.users = 0
        self._entering = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
        self._reconnecting: asyncio.Task[None] | None = None
        self.fatal: BrokerOutage | None = None
        self._recent: deque[tuple[int, str, bytes]] = deque()  # (sent_ns, topic, body) of the last REPLAY_NS
        self.replayed = 0

    async def enter(self) -> None:
        """A bus starts using the link: the first one connects it."""
        async with self._entering:
            if not self.users:
                await self.client.__aenter__()
                self._watch = asyncio.create_task(self._watchdog(), name=f"bus-watch-{self.name}")
            self.users += 1

    async def exit(self) -> None:
        """A bus is done with the link: the last one disconnects it."""
        async with self._entering:
            self.users -= 1
            if self.users > 0:
                return
            await stop_task(self._watch, f"bus-watch-{self.name}")
            await stop_task(self._reconnecting, f"bus-reconnect-{self.name}", quiet=(BrokerOutage,))
            with contextlib.suppress(Exception):  # a connection already lost: nothing to close cleanly
                await self.client.close()

    async def _want(self, channel: str, qos: int) -> None:
        t = topic(self.run, "+", channel)
        while self.wire.get(t, -1) < qos:  # a new filter, or one a stage now needs at a higher QoS than a tap
            pending = self._subscribing.get(t)
            if pending is not None:  # another stage of this process is subscribing it: wait for its SUBACK
                await asyncio.shield(pending)
                continue
            done = self._subscribing[t] = asyncio.get_running_loop().create_future()
            try:
                await self.client.subscribe(t, qos=qos)
                self.wire[t] = max(qos, self.wire.get(t, -1))  # only once the broker acknowledged it
            finally:
                del self._subscribing[t]
                done.set_result(None)

    async def subscribe(self, bus: MqttBus, channel: str) -> None:
        await self._want(channel, self.qos)
        buses = self.subs.setdefault(channel, [])
        if bus not in buses:
            buses.append(bus)

    async def tap(self, channels: tuple[str, ...], see: Callable[[str, str, bytes], None]) -> None:
        """Call ``see(session, channel, body)`` for every message on ``channels``, in the receive callback (it
        must be quick and must not raise): a diagnostic observer (:class:`~voicepipe.bus.liveness.Progress`)
        without a connection of its own. Channels no stage of the link subscribes to are taken at QoS 0."""
        for ch in channels:
            await self._want(ch, 0)
            self.taps.setdefault(ch, []).append(see)

    def _deliver(self, t: str, body: bytes) -> None:
        """paho's on_message: hand the message to every bus subscribed to its channel (a replica's filter
        first: a foreign session's message never wakes its stage) and to the taps on it."""
        parts = t.split("/", 3)  # voicepipe/{run}/{session}/{channel}: what the subscriptions let through
        if len(parts) < 4:
            return
        self.delivered += 1
        if self.taps:
            for see in self.taps.get(parts[3], ()):
                see(parts[2], parts[3], body)
        for bus in self.subs.get(parts[3], ()):
            bus.received += 1
            if bus.accept is not None and not bus.accept(parts[2], parts[3]):
                continue
            bus.inbox.append((t, body))
            w = bus._waiter
            if w is not None and not w.done():
                w.set_result(None)

    def _wake_all(self) -> None:
        for buses in self.subs.values():
            for bus in buses:
                bus.wake()

    def publish(self, t: str, body: bytes, qos: int, sent_ns: int) -> int:
        """Hand a message to paho; paho's result code (``MQTT_ERR_NO_CONN`` also starts a reconnect)."""
        if self.fatal is not None:
            raise self.fatal
        rc = self.client.publish_nowait(t, body, qos)
        if qos:  # kept a moment, to publish again after a broker restart that lost it
            recent = self._recent
            recent.append((sent_ns, t, body))
            if not self.health.down_since:
                cut = sent_ns - REPLAY_NS
                while recent[0][0] < cut:
                    recent.popleft()
        if rc == MQTT_ERR_NO_CONN:
            self._lost()
        elif rc:
            raise aiomqtt.MqttCodeError(rc, "Could not publish message")
        return rc

    # -- reconnect -----------------------------------------------------------------------------------
    def _lost(self) -> None:
        """The connection is gone: start reconnecting (once)."""
        if self.fatal is not None:
            raise self.fatal
        if self._reconnecting is None or self._reconnecting.done():
            self.health.down_since.setdefault(self.name, now_ns())
            log.warning("broker connection lost; reconnecting", link=self.name)
            self._reconnecting = asyncio.create_task(self._reconnect(), name=f"bus-reconnect-{self.name}")

    async def wait_reconnected(self) -> None:
        self._lost()
        await asyncio.shield(self._reconnecting)  # type: ignore[arg-type]

    async def _reconnect(self) -> None:
        c = self.client
        since = self.health.down_since.setdefault(self.name, now_ns())
        lo, hi = self.BACKOFF_S
        attempt = 0
        while True:
            left = (since + self.window_ns - now_ns()) / 1e9
            if left <= 0:
                self.fatal = BrokerOutage(
                    f"broker {self.addr.host}:{self.addr.port} unreachable for more than "
                    f"{self.window_ns / 1e9:g} s (broker.outage_window_s)"
                )
                c.wake()
                raise self.fatal
            await asyncio.sleep(min(left, min(hi, lo * 2**attempt) * random.uniform(0.5, 1.0)))
            attempt += 1
            with contextlib.suppress(Exception):
                await c.__aexit__(None, None, None)  # releases aiomqtt's reuse lock after a lost connection
            c.prepare_reconnect()
            try:
                async with asyncio.timeout(max(0.1, min(left, 5.0))):
                    await c.__aenter__()
                    for t, q in list(self.wire.items()):  # a persistent session keeps them; a lost broker not
                        await c.subscribe(t, qos=q)
            except (aiomqtt.MqttError, OSError, TimeoutError) as exc:
                log.debug("reconnect failed", link=self.name, attempt=attempt, error=str(exc))
                continue
            self.health.down_since.pop(self.name, None)
            self.health.outages.append((since, now_ns()))
            self.health.reconnects += 1
            log.warning("broker reconnected", link=self.name, after_s=round((now_ns() - since) / 1e9, 2))
            # a restarted broker may have lost what it held (sessions, queued messages: mosquitto keeps MQTT 5
            # sessions only in memory across a crash): once every link of this process is subscribed again,
            # publish the recent messages again; receivers drop the ones they had by id
            while self.health.down_since and now_ns() < since + self.window_ns:
                await asyncio.sleep(0.02)
            again = [(t, body) for ts, t, body in self._recent if ts >= since - REPLAY_NS]
            for t, body in again:
                c.publish_nowait(t, body, self.qos)
            self.replayed += len(again)
            c.flush_soon()
            return

    async def _watchdog(self) -> None:
        """Notice a stalled broker: QoS 1 publishes unacknowledged for ``health.stall_ns``."""
        c = self.client
        stall_from: int | None = None
        while True:
            await asyncio.sleep(0.25)
            if c.lost:
                if self.fatal is None:
                    self._lost()
                stall_from = None
                continue
            oldest = next(iter(c.unacked.values()), None)
            now = now_ns()
            if oldest is not None and now - oldest >= self.health.stall_ns:
                if stall_from is None:
                    stall_from = oldest
                    log.warning(
                        "broker stalled: no acknowledgement", link=self.name, for_ms=(now - oldest) / 1e6
                    )
            elif stall_from is not None:
                self.health.stalls.append((stall_from, now))
                stall_from = None
