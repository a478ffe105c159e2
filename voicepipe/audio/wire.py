"""Frames in and out of a stage's MQTT connection, beside its JSON messages.

:class:`AudioPort` publishes signed frames (:mod:`voicepipe.audio.frames`) at QoS 0 on the session's
``audio/up`` or ``audio/down`` topic through the process's :class:`~voicepipe.bus.mqtt.link.MqttLink`, and hands the
frames of one direction to a callback as they arrive (the link's raw tap: no JSON parsing, no envelope).
A frame that fails its MAC or its sequence check is dropped and counted; the callback runs in the receive
path and must be quick (stages queue the frame and return). Real audio needs a live run: the in-memory bus
of ``predict`` carries no audio. A replica's port (its bus a :class:`~voicepipe.bus.partition.PartitionedBus`)
hands over only the frames of the sessions its replica owns, dropping the others by topic before their MAC
is checked (counted in ``skipped``), as the replica's bus does with its messages.
"""

from __future__ import annotations

from collections.abc import Callable

from voicepipe.audio.frames import CHANNELS, BadFrame, Frame, FrameGate, decode, encode
from voicepipe.bus import Bus
from voicepipe.bus.mqtt import MqttBus
from voicepipe.bus.partition import PartitionedBus
from voicepipe.clock import now_ns
from voicepipe.errors import UserError
from voicepipe.messages import topic


class AudioPort:
    def __init__(self, bus: Bus, run: str, token: bytes) -> None:
        self.replica = bus if isinstance(bus, PartitionedBus) and not bus.shadow else None
        if isinstance(bus, PartitionedBus):
            bus = bus.inner
        if not isinstance(bus, MqttBus):
            raise UserError("--audio", "real audio needs a live run over MQTT (`voicepipe run`), not predict")
        self.link = bus.link
        self.run = run
        self._token = token
        self.gate = FrameGate()
        self.sent = 0
        self.received = 0
        self.bad = 0
        self.skipped = 0  # frames of sessions another replica owns

    def send(self, session: str, frame: Frame) -> None:
        body = encode(frame, self.run, session, self._token)
        self.link.publish(topic(self.run, session, CHANNELS[frame.direction]), body, 0, now_ns())
        self.sent += 1

    async def listen(self, direction: int, on_frame: Callable[[str, Frame, int], None]) -> None:
        """Call ``on_frame(session, frame, arrived_ns)`` for every admitted frame of ``direction``."""
        run, token, gate, replica = self.run, self._token, self.gate, self.replica

        def see(session: str, _channel: str, body: bytes) -> None:
            got = now_ns()
            if replica is not None and not replica.owns(session):
                self.skipped += 1
                return
            try:
                frame = decode(body, run, session, token)
            except BadFrame:
                self.bad += 1
                return
            if frame.direction != direction or not gate.admit(session, frame):
                self.bad += 1
                return
            self.received += 1
            on_frame(session, frame, got)

        await self.link.tap((CHANNELS[direction],), see)
