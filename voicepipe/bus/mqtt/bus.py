"""A stage's bus on MQTT (:class:`MqttBus`): typed envelopes in and out through the process's
:class:`~voicepipe.bus.mqtt.link.MqttLink`.

Validation happens here, where bytes enter from the network (:func:`voicepipe.messages.parse`): a malformed
body, or one whose type or run/session does not match its topic, is dead-lettered; each body's MAC is checked on the
raw bytes under the run instance's key (:func:`voicepipe.keys.body_verified`; the verdict goes to the guard
on the envelope), and an authenticated envelope id seen again (QoS 1 redelivers after a reconnect) is
dropped — an unauthenticated copy never takes a genuine message's id. A replica's ``accept`` filter is checked on the topic before
the body is parsed. :class:`~voicepipe.bus.base.BrokerOutage` from the link ends the stage's iteration.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Callable

from voicepipe.bus.base import BrokerHealth, BrokerOutage, Bus
from voicepipe.bus.mqtt.address import BrokerAddress
from voicepipe.bus.mqtt.lean import MQTT_ERR_NO_CONN
from voicepipe.bus.mqtt.link import MqttLink
from voicepipe.clock import now_ns
from voicepipe.keys import VERIFIED, body_verified, seal
from voicepipe.messages import BadMessage, Envelope, channel_of, deadletter_topic, parse, split_topic, topic

SEEN_IDS = 16384  # ids remembered per client for deduplication (QoS 1 redelivers after reconnects)


class MqttBus(Bus):
    """A stage's bus on an :class:`MqttLink` (its own, or one its process shares): typed envelopes in and
    out, malformed ones dead-lettered, redelivered ones dropped by id."""

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
        link: MqttLink | None = None,
        lean: bool | None = None,
    ) -> None:
        super().__init__(run, name)
        self.addr = addr
        self.qos = qos
        self.link = link or MqttLink(
            addr, run, name, qos, protocol=protocol, outage_window_s=outage_window_s, health=health, lean=lean
        )
        self.client = self.link.client
        self.health = self.link.health
        self.duplicates = 0
        # (session, channel) -> act on it? Checked on the topic, before the body is parsed or the stage
        # woken: a replica (voicepipe.bus.partition) drops other replicas' sessions without paying for them
        self.accept: Callable[[str, str], bool] | None = None
        self.dropped_qos0 = 0
        self.inbox: deque[tuple[str, bytes]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._seen: set[str] = set()
        self._seen_order: deque[str] = deque()

    @property
    def fatal(self) -> BrokerOutage | None:
        return self.link.fatal

    @property
    def replayed(self) -> int:
        return self.link.replayed

    async def __aenter__(self) -> MqttBus:
        await self.link.enter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.link.exit()

    async def subscribe(self, *channels: str) -> None:
        for ch in channels:
            await self.link.subscribe(self, ch)

    async def publish(self, env: Envelope, *, qos: int | None = None) -> None:
        env.sent_ns = now_ns()
        q = self.qos if qos is None else qos
        key = self.key
        body = env.to_bytes() if key is None else seal(env, key)  # one serialisation, MAC spliced in
        rc = self.link.publish(topic(self.run, env.session, channel_of(env.type)), body, q, env.sent_ns)
        if rc == MQTT_ERR_NO_CONN and not q:
            self.dropped_qos0 += 1
        self.published += 1

    async def deadletter(self, where: str, reason: str, body: bytes) -> None:
        await super().deadletter(where, reason, body)
        note = {
            "stage": self.name,
            "topic": where,
            "reason": reason,
            "body": body[:512].decode("utf-8", errors="replace"),
        }
        self.client.publish_nowait(deadletter_topic(self.run), json.dumps(note).encode(), 0)

    def wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def messages(self) -> AsyncIterator[tuple[str, Envelope]]:
        """Parsed envelopes with their channel; malformed ones go to the dead-letter topic, duplicates
        (same envelope id again, after a redelivery) are dropped."""
        link, c = self.link, self.client
        loop = asyncio.get_running_loop()
        inbox = self.inbox
        while True:
            while inbox:
                t, body = inbox.popleft()
                try:
                    _, session, channel = split_topic(t)
                    env = parse(body)
                    if channel_of(env.type) != channel:
                        raise BadMessage(f"type {env.type!r} does not belong on channel {channel!r}")
                    if env.session != session or env.run != self.run:
                        raise BadMessage("run/session in body do not match the topic")
                except BadMessage as exc:
                    await self.deadletter(t, str(exc), bytes(body))
                    continue
                key = self.key
                if key is not None:  # the guard reads this verdict (check 1): the raw bytes, hashed once
                    d = env.__dict__
                    ok = d[VERIFIED] = body_verified(body, d["auth"], key)
                    if not ok:  # the guard dead-letters it; its id must not shadow the genuine message's
                        yield channel, env
                        continue
                if self._duplicate(env.id):
                    self.duplicates += 1
                    continue
                yield channel, env
            if link.fatal is not None:
                raise link.fatal
            if c.lost:
                await link.wait_reconnected()
                continue
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _duplicate(self, id_: str) -> bool:
        seen = self._seen
        if id_ in seen:
            return True
        seen.add(id_)
        order = self._seen_order
        order.append(id_)
        if len(order) > SEEN_IDS:
            seen.discard(order.popleft())
        return False

    def disruption_ms(self, start_ns: int, end_ns: int) -> float:
        return self.health.overlap_ns(start_ns, end_ns) / 1e6
