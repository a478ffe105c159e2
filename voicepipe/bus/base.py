"""The bus contract, broker-agnostic: what every stage talks through, and what a broker's absence costs.

:class:`Bus` is what a stage sees: subscribe to channels (for every session of the run), publish
envelopes, iterate over received ones, dead-letter what cannot be used. Two implementations share that
contract — topics ``voicepipe/{run}/{session}/{channel}``, one :class:`~voicepipe.messages.Envelope` per
message, QoS 1 (every subscriber gets each message, in publish order per publisher, the publisher too when
subscribed): :class:`voicepipe.bus.mqtt.bus.MqttBus` (a real broker) and
:class:`voicepipe.bus.memory.MemoryBus` (in-process, for virtual time). Stages do not know which one they
run on.

:class:`BrokerHealth` records outages and stalls for the turns they hit; past ``outage_window_s``
:class:`BrokerOutage` ends the run. :func:`merged` joins overlapping intervals. Nothing here knows MQTT.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from voicepipe.clock import now_ns
from voicepipe.messages import Envelope

log = structlog.get_logger("voicepipe.bus")


class Bus(abc.ABC):
    """A stage's connection: publish envelopes, receive parsed ones, dead-letter the rest."""

    run: str
    name: str
    # no one but this run's own stages can reach it (the in-process bus of a virtual run): senders do not
    # sign, receivers do not authenticate (voicepipe.stages.guard, check 1); every other check stays
    trusted: bool = False
    # the run instance's key: set (by the stage) on every other bus, which signs each body it sends and checks
    # each it receives (voicepipe.keys.seal / body_verified)
    key: bytes | None = None

    def __init__(self, run: str, name: str) -> None:
        self.run = run
        self.name = name
        self.deadletters = 0
        self.published = 0
        self.received = 0

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:  # noqa: B027 - connection-less buses need nothing
        pass

    @abc.abstractmethod
    async def subscribe(self, *channels: str) -> None:
        """Receive ``channels`` (``user/utterance``...) of every session of the run."""

    @abc.abstractmethod
    async def publish(self, env: Envelope, *, qos: int | None = None) -> None:
        """Send ``env`` on its session's channel for its type; stamps ``sent_ns``."""

    @abc.abstractmethod
    def messages(self) -> AsyncIterator[tuple[str, Envelope]]:
        """(channel, envelope) for every message received on the subscribed channels."""

    def disruption_ms(self, start_ns: int, end_ns: int) -> float:
        """How long within [start_ns, end_ns] the broker was unreachable or stalled (0 without a broker)."""
        return 0.0

    async def serve(self, receive: Callable[[Envelope], Awaitable[None]]) -> None:
        """Hand every received envelope to ``receive``, one at a time in arrival order, until cancelled
        (a stage's receive loop; the in-memory bus calls ``receive`` without a queue in between)."""
        async for _channel, env in self.messages():
            await receive(env)

    async def deadletter(self, where: str, reason: str, body: bytes) -> None:
        self.deadletters += 1
        log.warning("deadletter", stage=self.name, topic=where, reason=reason)


class BrokerOutage(RuntimeError):
    """The broker stayed unreachable longer than ``broker.outage_window_s``: the run ends (exit code 4)."""


@dataclass
class BrokerHealth:
    """What one run's bus clients saw of the broker: disconnections and stalls, on the monotonic clock.

    An *outage* is a lost connection until the client is connected and subscribed again; a *stall* is a
    connected broker that acknowledged no QoS 1 publish for ``stall_ns`` or longer (a paused or overloaded
    broker). Every :class:`MqttBus` of a process shares one, so a turn can ask how much of its window the
    broker was away, whichever client noticed.
    """

    stall_ns: int = 1_000_000_000
    outages: list[tuple[int, int]] = field(default_factory=list)
    stalls: list[tuple[int, int]] = field(default_factory=list)
    reconnects: int = 0
    down_since: dict[str, int] = field(default_factory=dict)  # client -> when it lost the broker

    def overlap_ns(self, start_ns: int, end_ns: int) -> int:
        """How long within [start_ns, end_ns] the broker was away (outages and stalls, merged)."""
        now = now_ns()
        spans = [*self.outages, *self.stalls, *((t, now) for t in self.down_since.values())]
        cut = [(max(a, start_ns), min(b, end_ns)) for a, b in spans if b > start_ns and a < end_ns]
        return sum(b - a for a, b in merged(cut))

    def summary(self) -> list[str]:
        """Warnings for the run's summary: what the broker's absences put into the measured tax."""
        out = []
        if self.outages:  # every client notices the same outage: one per merged interval
            spans = merged(self.outages)
            worst = max(b - a for a, b in spans) / 1e9
            out.append(
                f"broker connection lost {len(spans)} time(s) (longest {worst:.1f} s, {self.reconnects} "
                "client reconnect(s)): turns during an outage include it in their latency and tax "
                "(broker_outage_ms in their records)"
            )
        if self.stalls:
            spans = merged(self.stalls)
            worst = max(b - a for a, b in spans) / 1e9
            out.append(
                f"broker stalled {len(spans)} time(s) (longest {worst:.1f} s without acknowledging a QoS 1 "
                "publish): the stall is in the measured tax of the turns it overlapped (broker_outage_ms "
                "in their records), not the pipeline's cost"
            )
        return out


def merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping (start, end) intervals joined, in order."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


# a task still running this long after its cancel is cancelled again: long enough that a cancelled task's own
# clean-up (an unsubscribe, a last publish) is not cut short on a loaded box, short beside any timeout a run has
RECANCEL_S = 5.0


async def stop_task(task: asyncio.Task[Any] | None, what: str, quiet: tuple[type[BaseException], ...] = ()) -> None:
    """Cancel ``task`` and wait for it to end. Its being cancelled is swallowed; anything else it had raised is
    logged (warning; ``quiet`` types at debug: an outcome already reported elsewhere), never dropped. If the
    task awaiting this is itself cancelled meanwhile, that cancellation goes on.

    A cancellation can be lost: on Python 3.11 ``asyncio.wait_for`` (inside aiomqtt's publish and subscribe)
    returns its result when that result and the cancel arrive together, dropping the cancel, and the task goes
    back to waiting for a message that may never come (CPython gh-86296, fixed in 3.12). So a task still
    running ``RECANCEL_S`` after its cancel is cancelled again until it ends."""
    if task is None:
        return
    task.cancel()
    while not task.done():
        await asyncio.wait({task}, timeout=RECANCEL_S)  # our own cancellation propagates from here
        if not task.done():
            log.debug("task ignored its cancel; cancelling it again", task=what)
            task.cancel()
    if task.cancelled():
        return
    exc = task.exception()
    if isinstance(exc, Exception):
        (log.debug if isinstance(exc, quiet) else log.warning)(
            "background task had failed", task=what, error=f"{type(exc).__name__}: {exc}"
        )
    elif exc is not None:
        raise exc
