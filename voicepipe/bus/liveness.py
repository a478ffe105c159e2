"""Liveness: stage processes say they are alive, the run notices when one is not, and no turn waits forever.

Contract.

* A stage process (``voicepipe stage``, or a ``run --workers`` worker) holds a :class:`Presence`: its own MQTT
  client that publishes a retained marker ``voicepipe/{run}/_alive/{process}`` — the replicas it serves and
  its stages' sender ids: its *hello* to the run instance — and registers a last will that marks it off, so
  a crashed process leaves no live marker for the next run with the same id; a clean exit marks it off too.
  It also publishes a heartbeat ``voicepipe/{run}/_hb/{process}`` every :data:`HEARTBEAT_S` (QoS 0, with its
  CPU seconds and message counters) from a thread, so an overloaded event loop does not pass for a dead
  process.
* **Signed** (issue 27): markers, their clearing ("off", the will included) and heartbeats are records
  sealed with the run instance's key (:func:`voicepipe.keys.seal_record`, the MAC over topic and record) and
  numbered per process; the :class:`Watch` ignores and counts (:attr:`Watch.invalid`) an unsigned, forged,
  other-instance or replayed (number not above the last) one. An empty retained publish only deletes a
  record: it clears nothing (the watcher deletes an "off" record it has read, so none is left retained).
* The run holds a :class:`Watch`: a process is ready when its marker is present *and* a heartbeat arrived
  (a retained marker alone may be stale: amqtt, for one, never fires a hung client's will). It is dead when
  it marks itself off (will or exit): a SIGKILLed process is seen at once. A silent one (no heartbeat for
  :data:`DEAD_AFTER_S`) is *paused*: its sessions stay with it, and if it beats again within the grace
  (``broker.stage_grace_s``, default :data:`PAUSE_GRACE_S`) it resumes them (SIGSTOP then SIGCONT); past the
  grace it is dead and its sessions move to the replicas left (:mod:`voicepipe.bus.partition`). While the
  watching process's own loop runs late, silence is not held against a peer (its beats may be waiting
  unread): overload delays a verdict instead of faking a death.
* A turn's deadline is :func:`turn_deadline_ns`: the scenario's end of speech for that turn plus
  ``client.turn_timeout_s``. :class:`Progress` follows each session's last step on the bus (script, final
  transcript, route, reply text), so a turn past its deadline is failed naming the stage that held it
  (:func:`holder`) — a paused stage's turns included.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import paho.mqtt.client as mqtt
import structlog
from paho.mqtt.enums import CallbackAPIVersion
from pydantic import BaseModel, ConfigDict, ValidationError

from voicepipe.bus.base import stop_task
from voicepipe.bus.mqtt.address import BrokerAddress
from voicepipe.bus.mqtt.link import MqttLink
from voicepipe.keys import Instance, open_record, seal_record
from voicepipe.messages import BadMessage, split_topic, topic

log = structlog.get_logger("voicepipe.bus.liveness")

HEARTBEAT_S = 0.5  # a beat every half second ...
DEAD_AFTER_S = 1.5  # ... and three missed beats mean paused (not yet dead: see PAUSE_GRACE_S)
# How long a paused (silent) process keeps its sessions before it is dead. The default is the broker's own
# verdict on a silent client: MQTT 3.1.1 §3.1.2.10 (MQTT 5 §3.1.2.10 alike) has the server drop a client that
# sent nothing for 1.5 x its keep-alive and then publish its will; Presence's keep-alive is 5 s, so a stopped
# process's will ("off") arrives at 7.5 s regardless. Waiting longer would gain nothing, and a shorter grace
# would move the sessions of a process the broker still holds connected. A configured grace sets the
# keep-alive to match (grace / 1.5), so both verdicts keep agreeing.
PAUSE_GRACE_S = 7.5
CHECK_S = 0.1
LAG_S = 0.25  # a check that runs this much late means the watching loop itself is overloaded
FINAL = 2**53  # the number of a will: nothing a process sent before it can follow it


def alive_topic(run: str, process: str) -> str:
    return f"voicepipe/{run}/_alive/{process}"


def heartbeat_topic(run: str, process: str) -> str:
    return f"voicepipe/{run}/_hb/{process}"


def keepalive_for(grace_s: float) -> int:
    """The MQTT keep-alive whose will-on-silence (1.5 x keep-alive) comes at ``grace_s`` or just after it (so
    the heartbeat verdict, "paused past its grace", is the one that counts)."""
    return max(1, math.ceil(grace_s / 1.5))


class Marker(BaseModel):
    """The retained online marker of a stage process: the replicas it serves (``asr.0``, ``agent.0``...) and
    the sender ids of its stages (the hello: the client accepts replies from these only)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    replicas: list[str]
    srcs: list[str] = []
    state: Literal["on", "off"] = "on"
    n: int = 0


class Beat(BaseModel):
    """A heartbeat: the process's CPU seconds so far and its stages' bus counters."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    cpu_s: float
    published: int
    received: int
    skipped: int = 0  # messages of sessions another replica owns
    n: int = 0


Counters = Callable[[], tuple[int, int, int]]  # published, received, skipped


class Presence:
    """A stage process's signed marker, last will and heartbeat (an async context manager).

    Its client is paho's own, with its network thread, and the beats come from a thread of their own: a
    process whose event loop is busy (overload) keeps beating — it is slow, not dead; one that is stopped
    or killed does not. A stage stuck inside a busy loop is caught by the turn deadlines instead.
    """

    def __init__(
        self,
        addr: BrokerAddress,
        run: str,
        process: str,
        replicas: list[str],
        counters: Counters,
        *,
        instance: Instance,
        srcs: list[str] | None = None,
        grace_s: float = PAUSE_GRACE_S,
    ):
        self.run, self.process, self.replicas, self.counters = run, process, replicas, counters
        self.srcs = srcs or []
        self.addr = addr
        self._key = instance.key
        self._n = itertools.count(1)
        self.topic = alive_topic(run, process)
        self.hb_topic = heartbeat_topic(run, process)
        self.keepalive = keepalive_for(grace_s)
        # client ids are unique per broker: the instance in it keeps two starts of one run id apart
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"vp-{run}-{instance.id}-{process}-alive")
        self.client.will_set(self.topic, payload=self._marker("off", FINAL), qos=1, retain=True)
        if addr.username:
            self.client.username_pw_set(addr.username, addr.password)
        tls = addr.ssl_context()
        if tls is not None:
            self.client.tls_set_context(tls)
        self._stop = threading.Event()
        self._marked = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:  # never the key
        return f"Presence({self.run}/{self.process})"

    def _marker(self, state: Literal["on", "off"], n: int | None = None) -> bytes:
        m = Marker(replicas=self.replicas, srcs=self.srcs, state=state, n=next(self._n) if n is None else n)
        return seal_record(self._key, self.topic, m.model_dump())

    def beat(self) -> Beat:
        published, received, skipped = self.counters()
        return Beat(cpu_s=time.process_time(), published=published, received=received, skipped=skipped,
                    n=next(self._n))  # fmt: skip

    def _beat_body(self) -> bytes:
        return seal_record(self._key, self.hb_topic, self.beat().model_dump())

    def _on_connect(
        self, client: mqtt.Client, _userdata: object, _flags: object, rc: object, _p: object
    ) -> None:
        # on every (re)connect: paho reconnects by itself, and a restarted broker has lost the retained marker
        if not getattr(rc, "is_failure", False):
            client.publish(self.topic, self._marker("on"), qos=1, retain=True)
            self._marked.set()

    def _connect(self) -> None:
        self.client.on_connect = self._on_connect
        self.client.connect(self.addr.host, self.addr.port, keepalive=self.keepalive)
        self.client.loop_start()
        if not self._marked.wait(10):
            raise TimeoutError(f"{self.process}: the broker did not accept the liveness client within 10 s")

    def _beats(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.client.publish(self.hb_topic, self._beat_body(), qos=0)

    async def __aenter__(self) -> Presence:
        await asyncio.to_thread(self._connect)
        self.client.publish(self.hb_topic, self._beat_body(), qos=0)
        self._thread = threading.Thread(target=self._beats, name=f"heartbeat-{self.process}", daemon=True)
        self._thread.start()
        return self

    def _close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        with contextlib.suppress(Exception):
            # final counters, then the signed "off", then delete the retained record (no stale marker left)
            self.client.publish(self.hb_topic, self._beat_body(), qos=1).wait_for_publish(2)
            self.client.publish(self.topic, self._marker("off"), qos=1, retain=True).wait_for_publish(2)
            self.client.publish(self.topic, b"", qos=1, retain=True).wait_for_publish(2)
        self.client.disconnect()  # a clean disconnect: the will is not sent (the marker is already off)
        self.client.loop_stop()

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self._close)


@dataclass
class Peer:
    """What the run knows of one stage process."""

    replicas: list[str] = field(default_factory=list)
    marked: bool = False
    last_beat: float | None = None  # monotonic seconds
    beat: Beat | None = None
    first: Beat | None = None  # the first heartbeat (CPU spent starting up is before it)
    dead: str = ""  # why, once dead
    n: int = 0  # the number of the last signed record taken from it (replays repeat an earlier one)
    paused_at: float | None = None  # monotonic seconds: silent since, while within its grace


OnDead = Callable[[str, list[str], str], None]  # process, its replicas, why
OnHello = Callable[[list[str]], None]  # the sender ids a verified marker names


class Watch:
    """The run's view of its stage processes: ready when marked and beating, paused when silent, dead on a
    signed "off" (will or exit) or when paused past the grace."""

    def __init__(
        self,
        addr: BrokerAddress,
        run: str,
        on_dead: OnDead,
        *,
        instance: Instance,
        who: str = "run",
        dead_after_s: float = DEAD_AFTER_S,
        grace_s: float = PAUSE_GRACE_S,
        on_hello: OnHello | None = None,
    ):
        self.run = run
        self.on_dead = on_dead
        self.on_hello = on_hello
        self.dead_after_s = dead_after_s
        self.grace_s = max(grace_s, dead_after_s)
        self._key = instance.key
        self.peers: dict[str, Peer] = {}
        self.changed = asyncio.Event()
        self.lagged_at = 0.0  # when this process's own loop last ran late (beats may wait unread)
        self.invalid = 0  # liveness records ignored: unsigned, forged, of another instance, or replayed
        self.pauses = 0  # silences a process came back from within its grace
        self.client = addr.client(identifier=f"vp-{run}-{instance.id}-watch-{who}")  # unique per broker
        self._tasks: list[asyncio.Task[None]] = []

    def __repr__(self) -> str:  # never the key
        return f"Watch({self.run}, peers={len(self.peers)})"
    async def __aenter__(self) -> Watch:
        await self.client.__aenter__()
        await self.client.subscribe(alive_topic(self.run, "+"), qos=1)
        await self.client.subscribe(heartbeat_topic(self.run, "+"), qos=0)
        self._tasks = [asyncio.create_task(self._read(), name="read"), asyncio.create_task(self._check(), name="check")]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            await stop_task(t, f"liveness-watch-{t.get_name()}")
        with contextlib.suppress(Exception):
            await self.client.__aexit__(None, None, None)

    def _die(self, process: str, peer: Peer, why: str) -> None:
        if peer.dead:
            return
        peer.dead = why
        self.on_dead(process, list(peer.replicas), why)
        self.changed.set()

    async def _read(self) -> None:
        async for m in self.client.messages:
            parts = str(m.topic).split("/")
            if len(parts) != 4:
                continue
            what, process = parts[2], parts[3]
            body = m.payload if isinstance(m.payload, bytes | bytearray) else b""
            peer = self.peers.get(process)
            if not body:  # a deletion: ours of an "off" record, or a forged clear; it clears nothing
                if peer is not None and peer.marked and not peer.dead:
                    self.invalid += 1
                    log.warning("unsigned liveness clear ignored", topic=str(m.topic))
                continue
            rec = open_record(self._key, str(m.topic), body)
            try:
                got = None if rec is None else (Marker if what == "_alive" else Beat).model_validate(rec)
            except ValidationError:
                got = None
            if got is None or (peer is not None and got.n <= peer.n) or what not in ("_alive", "_hb"):
                if peer is None or not peer.dead:  # (what follows a dead process's will changes nothing)
                    self.invalid += 1  # unsigned, forged, another instance's, or a replay of an earlier one
                continue
            if peer is None:
                peer = self.peers[process] = Peer()
            peer.n = got.n
            if isinstance(got, Marker):
                if got.state == "on":
                    peer.replicas = got.replicas
                    peer.marked = True
                    if self.on_hello is not None:
                        self.on_hello(got.srcs)
                else:
                    if peer.marked or peer.last_beat is not None:
                        self._die(process, peer, "it marked itself off (last will or exit)")
                    with contextlib.suppress(Exception):  # leave no retained "off" behind for the next run
                        await self.client.publish(str(m.topic), b"", qos=1, retain=True)
            else:
                peer.beat = got
                peer.first = peer.first or got
                peer.last_beat = time.monotonic()
                if peer.paused_at is not None and not peer.dead:
                    log.warning("stage process resumed within its grace", process=process,
                                silent_s=round(peer.last_beat - peer.paused_at + self.dead_after_s, 2))  # fmt: skip
                    peer.paused_at = None
                    self.pauses += 1
            self.changed.set()

    async def _check(self) -> None:
        prev = time.monotonic()
        while True:
            await asyncio.sleep(CHECK_S)
            now = time.monotonic()
            if now - prev > CHECK_S + LAG_S or self._tasks[0].done():
                # our loop ran late, or our own connection is gone: silence may be beats we cannot read
                self.lagged_at = now
            prev = now
            for process, peer in list(self.peers.items()):
                beating = peer.marked and peer.last_beat is not None and not peer.dead
                heard = max(peer.last_beat or 0.0, self.lagged_at)
                if not beating or now - heard <= self.dead_after_s:
                    continue
                if peer.paused_at is None:
                    peer.paused_at = now
                    log.warning("stage process silent: paused until its grace runs out", process=process,
                                grace_s=self.grace_s)  # fmt: skip
                if now - heard > self.grace_s:
                    self._die(process, peer, f"no heartbeat for {self.grace_s:g} s (paused past its grace)")

    def live_replicas(self) -> set[str]:
        fresh = time.monotonic() - self.dead_after_s
        return {
            r
            for p in self.peers.values()
            if p.marked and not p.dead and p.last_beat is not None and p.last_beat >= fresh
            for r in p.replicas
        }

    async def wait_ready(self, wanted: Callable[[set[str]], bool], timeout_s: float) -> bool:
        """Wait until ``wanted(live replica ids)`` holds; False after ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not wanted(self.live_replicas()):
                    self.changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.changed.wait(), 0.2)
                return True
        return False

    def totals(self) -> Beat:
        """The summed last heartbeats of every process seen: message counters, and CPU seconds since each
        process's first beat (start-up — imports, connecting — excluded)."""
        peers = [p for p in self.peers.values() if p.beat is not None and p.first is not None]
        beats = [p.beat for p in peers if p.beat is not None]
        return Beat(
            cpu_s=sum(b.cpu_s - f.cpu_s for p in peers if (b := p.beat) is not None and (f := p.first) is not None),
            published=sum(b.published for b in beats),
            received=sum(b.received for b in beats),
            skipped=sum(b.skipped for b in beats),
        )


# -- turn deadlines and who held a late turn ----------------------------------------------------------
PROGRESS_CHANNELS = ("turn/script", "asr/final", "route", "reply/text")
_TURN = re.compile(rb'"turn":(-?\d{1,9})[,}]')  # the envelope's turn comes before its payload and spans
_TARGET = re.compile(rb'"target":"(\w{1,20})"')
_NEXT = {"turn/script": "asr", "asr/final": "router", "reply/text": "tts"}


def holder(channel: str, target: str | None = None) -> str:
    """The stage that acts next after the last step seen on ``channel`` (a route: its target)."""
    if channel == "route":
        return "agent" if target in (None, "commit") else target
    return _NEXT.get(channel, "asr")


def turn_deadline_ns(end_of_speech_ns: int, turn_timeout_s: float) -> int:
    """When a turn that has not been heard yet fails: the scenario's end of speech + the configured wait."""
    return end_of_speech_ns + round(turn_timeout_s * 1e9)


class Progress:
    """Each session's last step on the bus, from a tap on :data:`PROGRESS_CHANNELS` (a few messages a turn)."""

    def __init__(self, addr: BrokerAddress, run: str, link: MqttLink | None = None) -> None:
        self.run = run
        self.last: dict[str, tuple[int, str, str | None]] = {}  # session -> (turn, channel, route target)
        self.link = link  # the process's shared connection: a tap on it, no client of its own
        self.client = None if link else addr.client(identifier=f"vp-{run}-progress")
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Progress:
        if self.link is not None:
            await self.link.enter()
            await self.link.tap(PROGRESS_CHANNELS, self.see)
            return self
        assert self.client is not None
        await self.client.__aenter__()
        for ch in PROGRESS_CHANNELS:
            await self.client.subscribe(topic(self.run, "+", ch), qos=0)
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.link is not None:
            await self.link.exit()
            return
        await stop_task(self._task, "liveness-progress")
        with contextlib.suppress(Exception):
            await self.client.__aexit__(None, None, None)  # type: ignore[union-attr]

    def see(self, session: str, channel: str, body: bytes) -> None:
        # a diagnostic, not a stage: it reads the envelope's turn (and a route's target) off the raw JSON
        # instead of validating every reply chunk again — a forged message can at worst misname a holder
        turn = _TURN.search(body, 0, 4096)
        if turn is None:
            return
        target = _TARGET.search(body) if channel == "route" else None
        self.last[session] = (int(turn[1]), channel, target[1].decode() if target else None)

    async def _read(self) -> None:
        assert self.client is not None
        async for m in self.client.messages:
            body = bytes(m.payload) if isinstance(m.payload, bytes | bytearray) else b""
            try:
                _, session, channel = split_topic(str(m.topic))
            except BadMessage:
                continue
            self.see(session, channel, body)

    def held_by(self, session: str, turn: int) -> str:
        last = self.last.get(session)
        if last is None or last[0] != turn:
            return "asr"  # nothing of this turn came past the words: the ASR holds it
        return holder(last[1], last[2])
