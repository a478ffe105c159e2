"""Run instances on the broker: each start of a run announces its nonce; stages join it; a second start with
the same run id is refused.

Contract.

* Topic ``voicepipe/{run}/_instance``, retained, QoS 1. A record (:func:`voicepipe.keys.seal_record` under
  :func:`voicepipe.keys.announce_key`, i.e. the token and the run id) ``{"nonce", "at_ns", "state"}``:
  ``state`` "live" while the run plays, "ended" when it is over. ``at_ns`` is the announcer's wall clock
  (all processes of a run share one host clock: ``voicepipe stage``'s contract).
* :class:`Announcer` (the run process): publishes "live" at every (re)connect and every :data:`ANNOUNCE_S`,
  registers an "ended" record as its last will, and publishes "ended" on a clean exit. A record is *fresh*
  while live and at most :data:`STALE_S` old: a recorded announcement replayed later is stale, so it can
  neither make a stage join a finished run for long nor make a new run refuse to start.
* :func:`refuse_if_running` (a run, before it announces or spawns anything): a fresh live record of another
  nonce is a run that may still be alive; if a newer record of it arrives within :data:`STALE_S`, this start
  is refused with one line (``UserError`` on ``--run-id``, exit 2). Chosen over running side by side:
  isolation alone (the keys differ, so neither could falsify the other) would still leave two runs dead-
  lettering each other's traffic and external stages joining whichever they saw first.
* :class:`Follower` (``voicepipe stage``): waits for a fresh live record verified with the token, gives its
  :class:`~voicepipe.keys.Instance`, and says when that instance is over (ended, superseded by a newer one,
  or silent past :data:`STALE_S`: an announcer that died without its will). Unsigned or invalid records are
  ignored and counted (:attr:`Follower.invalid`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from dataclasses import dataclass

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from voicepipe.bus.base import stop_task
from voicepipe.bus.mqtt.address import BrokerAddress
from voicepipe.errors import UserError
from voicepipe.keys import Instance, announce_key, open_record, seal_record

ANNOUNCE_S = 1.0  # a live run refreshes its announcement this often ...
STALE_S = 3.0  # ... so one older than this is a replay or a run that died without its will firing
BARRIER_S = 5.0  # how long to wait for the broker to answer the read of the retained announcement


def instance_topic(run: str) -> str:
    return f"voicepipe/{run}/_instance"


@dataclass(frozen=True)
class Announcement:
    nonce: str
    at_ns: int
    state: str

    def fresh(self, now_ns: int | None = None) -> bool:
        now = time.time_ns() if now_ns is None else now_ns
        return self.state == "live" and abs(now - self.at_ns) <= STALE_S * 1e9


def read(token_key: bytes, run: str, body: bytes | bytearray) -> Announcement | None:
    """The verified announcement in ``body`` (None: empty, unsigned, forged or malformed)."""
    got = open_record(token_key, instance_topic(run), body)
    if got is None:
        return None
    nonce, at, state = got.get("nonce"), got.get("at_ns"), got.get("state")
    if not (isinstance(nonce, str) and len(nonce) == 32 and isinstance(at, int) and state in ("live", "ended")):
        return None
    return Announcement(nonce, at, state)


class Announcer:
    """The run's announcement: live while it plays, ended when it stops (will or clean exit)."""

    def __init__(self, addr: BrokerAddress, instance: Instance, token: bytes) -> None:
        self.instance = instance
        self.topic = instance_topic(instance.run)
        self._key = announce_key(token, instance.run)
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"vp-{instance.run}-{instance.id}-announce"
        )
        self.client.will_set(self.topic, payload=self._record("ended"), qos=1, retain=True)
        if addr.username:
            self.client.username_pw_set(addr.username, addr.password)
        tls = addr.ssl_context()
        if tls is not None:
            self.client.tls_set_context(tls)
        self.addr = addr
        self._stop = threading.Event()
        self._up = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"Announcer({self.instance.run}/{self.instance.id})"

    def _record(self, state: str) -> bytes:
        return seal_record(
            self._key, self.topic, {"nonce": self.instance.nonce, "at_ns": time.time_ns(), "state": state}
        )

    def _on_connect(self, client: mqtt.Client, _u: object, _f: object, rc: object, _p: object) -> None:
        if not getattr(rc, "is_failure", False):
            client.publish(self.topic, self._record("live"), qos=1, retain=True)
            self._up.set()

    def _refresh(self) -> None:
        while not self._stop.wait(ANNOUNCE_S):
            self.client.publish(self.topic, self._record("live"), qos=1, retain=True)

    def _start(self) -> None:
        self.client.on_connect = self._on_connect
        self.client.connect(self.addr.host, self.addr.port, keepalive=5)
        self.client.loop_start()
        if not self._up.wait(10):
            raise TimeoutError("the broker did not accept the run's announcement within 10 s")
        self._thread = threading.Thread(target=self._refresh, name="announce", daemon=True)
        self._thread.start()

    def _close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        with contextlib.suppress(Exception):
            self.client.publish(self.topic, self._record("ended"), qos=1, retain=True).wait_for_publish(2)
        self.client.disconnect()
        self.client.loop_stop()

    async def __aenter__(self) -> Announcer:
        await asyncio.to_thread(self._start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self._close)


class Follower:
    """A reader of a run's announcements (an async context manager): which instance is live, and when it ends."""

    def __init__(self, addr: BrokerAddress, run: str, token: bytes) -> None:
        self.run, self.token = run, token
        self._key = announce_key(token, run)
        self.client = addr.client(identifier=f"vp-{run}-follow-{secrets.token_hex(4)}")
        self.latest: Announcement | None = None
        self.invalid = 0  # unsigned or forged records seen (ignored)
        self.changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._barrier = f"voicepipe/{run}/_instance_barrier/{secrets.token_hex(4)}"
        self._synced = asyncio.Event()

    async def __aenter__(self) -> Follower:
        await self.client.__aenter__()
        await self.client.subscribe(instance_topic(self.run), qos=1)
        await self.client.subscribe(self._barrier, qos=1)
        self._task = asyncio.create_task(self._read(), name="instance-follow")
        # the broker sends retained messages on subscribe, before it handles our next publish: once this echo
        # is back, "no record" means none was retained
        await self.client.publish(self._barrier, b"", qos=1)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._synced.wait(), BARRIER_S)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await stop_task(self._task, "instance-follow", quiet=(Exception,))
        with contextlib.suppress(Exception):
            await self.client.__aexit__(None, None, None)

    async def _read(self) -> None:
        async for m in self.client.messages:
            if str(m.topic) == self._barrier:
                self._synced.set()
                continue
            body = m.payload if isinstance(m.payload, bytes | bytearray) else b""
            got = read(self._key, self.run, body)
            if got is None:
                if body:  # an empty retained publish is only a deletion
                    self.invalid += 1
                continue
            last = self.latest
            if last is not None and got.nonce == last.nonce and got.at_ns <= last.at_ns:
                continue  # an older record of the same instance (a replay): ignored
            self.latest = got
            self.changed.set()

    async def _next(self, timeout_s: float) -> None:
        self.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout_s)

    async def instance(self) -> Instance:
        """The live instance, once a fresh announcement of one has arrived."""
        while True:
            a = self.latest
            if a is not None and a.fresh():
                return Instance.of(self.token, self.run, a.nonce)
            await self._next(0.5)

    async def over(self, instance: Instance) -> str:
        """Wait until ``instance`` is over; why."""
        while True:
            a = self.latest
            if a is not None and a.nonce != instance.nonce and a.fresh():
                return f"a newer instance {a.nonce[:12]} of run {self.run} started"
            if a is not None and a.nonce == instance.nonce and a.state == "ended":
                return "the run ended"
            if a is None or not a.fresh():
                return f"the run's announcement went stale (no refresh for {STALE_S:g} s)"
            await self._next(0.5)


async def refuse_if_running(addr: BrokerAddress, run: str, token: bytes) -> None:
    """Refuse (one line, ``--run-id``) to start run ``run`` while another start of it is alive on this broker."""
    async with Follower(addr, run, token) as f:
        seen = f.latest
        if seen is None or not seen.fresh():
            return
        deadline = time.monotonic() + STALE_S
        while time.monotonic() < deadline:
            await f._next(deadline - time.monotonic())
            now = f.latest
            if now is not None and now.at_ns > seen.at_ns and now.fresh():
                age = max(0.0, (time.time_ns() - now.at_ns) / 1e9)
                raise UserError(
                    "--run-id",
                    f"run {run!r} is already running on this broker (instance {now.nonce[:12]}, announced "
                    f"{age:.1f} s ago): wait for it to end or pick another --run-id",
                )
