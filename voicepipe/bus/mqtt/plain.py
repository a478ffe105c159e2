"""The plain MQTT client: the link's client built on aiomqtt's public API only.

:class:`~voicepipe.bus.mqtt.link.MqttLink` uses it instead of the lean client when
:func:`~voicepipe.bus.mqtt._private.lean_allowed` says no (aiomqtt or paho-mqtt other than the pinned
versions, or ``VOICEPIPE_LEAN=0``). It offers the same :class:`~voicepipe.bus.mqtt.link.LinkClient` surface:
:meth:`PlainClient.publish_nowait` starts one aiomqtt ``publish`` task per message (tasks run in the order
they are made, so per-publisher order holds; QoS 1 waits for its PUBACK without a timeout, paho resends it
after a reconnect), and one reader task hands every message of ``client.messages`` to ``sink``. A lost
connection is what aiomqtt reports (the message iterator or a publish failing); reconnecting enters the same
client again, aiomqtt's documented reuse.

What it does not do that the lean client does: several packets per socket write, no task per message
(bench/msgcost.py shows the difference), resuming an MQTT 5 session after a reconnect (aiomqtt asks for a
clean start each time; the link's resubscribe and replay cover the gap), and dropping a PUBLISH whose topic
is not UTF-8 (paho raises on it: the connection is lost and resumed).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import aiomqtt
import structlog

from voicepipe.bus.base import stop_task
from voicepipe.bus.mqtt.address import Client
from voicepipe.clock import now_ns

log = structlog.get_logger("voicepipe.bus")

MQTT_ERR_NO_CONN = 4  # paho.mqtt.enums.MQTTErrorCode.MQTT_ERR_NO_CONN


class PlainClient(Client):
    """aiomqtt's client, unchanged, behind the link's interface (see the module docstring)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.sink: Callable[[str, bytes], None] | None = None
        self.wakers: list[Callable[[], None]] = []
        self.unacked: dict[int, int] = {}  # publish number -> when it was handed over (QoS 1, unacknowledged)
        self.bad_topics = 0  # never counted here: paho raises on such a topic (see the module docstring)
        self._lost = True  # not connected yet
        self._reader: asyncio.Task[None] | None = None
        self._sends: set[asyncio.Task[None]] = set()
        self._count = 0

    @property
    def lost(self) -> bool:
        return self._lost

    async def __aenter__(self) -> PlainClient:
        await super().__aenter__()
        self._lost = False
        self._reader = asyncio.create_task(self._read(), name="bus-plain-reader")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        reader, self._reader = self._reader, None
        await stop_task(reader, "bus-plain-reader")
        self._lost = True
        await super().__aexit__(*exc)

    async def close(self) -> None:
        """The link is done: publishes still waiting for their PUBACK are given up, then disconnect."""
        for t in list(self._sends):
            t.cancel()
        await asyncio.gather(*self._sends, return_exceptions=True)
        await self.__aexit__(None, None, None)

    def prepare_reconnect(self) -> None:
        self.wake()

    def flush_soon(self) -> None:
        pass  # aiomqtt writes as paho asks

    def wake(self) -> None:
        for wake in self.wakers:
            wake()

    def _gone(self) -> None:
        if not self._lost:
            self._lost = True
            self.wake()

    async def _read(self) -> None:
        try:
            async for m in self.messages:
                body = m.payload if isinstance(m.payload, bytes) else bytes(str(m.payload or ""), "utf-8")
                if self.sink is not None:
                    self.sink(m.topic.value, body)
        except aiomqtt.MqttError:
            pass  # the connection is gone: the link reconnects
        self._gone()

    def publish_nowait(self, topic: str, payload: bytes, qos: int, retain: bool = False) -> int:
        """Start publishing (a task); ``MQTT_ERR_NO_CONN`` while the connection is known lost (QoS 1: paho
        keeps the message for the reconnect; QoS 0: dropped)."""
        if self._lost and not qos:
            return MQTT_ERR_NO_CONN
        self._count += 1
        key = self._count
        if qos:
            self.unacked[key] = now_ns()
        task = asyncio.get_running_loop().create_task(self._send(key, topic, payload, qos, retain))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
        return MQTT_ERR_NO_CONN if self._lost else 0

    async def _send(self, key: int, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        try:
            await self.publish(topic, payload, qos=qos, retain=retain, timeout=math.inf)
        except aiomqtt.MqttCodeError as exc:
            if exc.rc != MQTT_ERR_NO_CONN:
                log.warning("publish failed", topic=topic, error=str(exc))
            self._gone()
        except aiomqtt.MqttError as exc:
            log.debug("publish failed", topic=topic, error=str(exc))
            self._gone()
        finally:
            self.unacked.pop(key, None)
