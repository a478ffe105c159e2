"""Stage replicas with session affinity: which replica serves which session, and a bus that keeps to it.

Model. ``voicepipe run --workers N`` runs N worker processes. The stages whose state is per session
(:data:`REPLICATED`: ASR, router, agent, TTS) get one replica per worker; the stages whose state spans
sessions (:data:`SINGLE`: the council shares one simulated device per backend, the cache its learned
answers) stay one instance each, placed on the workers in turn: splitting them would change what is
simulated, not only who computes it.

The agent is replicated although its hardware backends model one shared device (a
:class:`~voicepipe.hardware.serving.DeviceServer`: a queue and a batch that every session's requests share).
Its replicas are **shadows** of each other (:data:`SHADOWED`): every agent replica receives every session's
agent messages (no filtering by owner), feeds every request to its own copy of the device model, and
publishes only for the sessions it owns; for the others it runs the same generation muted (nothing sent,
no turn failed). So each replica's device holds the whole run's load — the queueing and batching a
session meets are those of the one device, as with a single agent — and a replica that takes over a dead
peer's sessions already holds their conversation history and the device's state. The copies agree up to
when each process received a message (arrival times differ by the broker's fan-out, well under a
millisecond on one host). Why not the alternatives: splitting the device into per-replica shares would
model N smaller devices (other batching, other queueing: other numbers for the same config); keeping the
device in one process behind stateless fronts would leave that process the single point of failure and
add a bus round trip per request. The price: each agent replica does the agent's work for every session
(N times the agent's CPU in all). A backend that is a real server (``kind == "endpoint"``) is not
shadowed — the server is the device, and a shadow would send it every request N times —: for it the
replicas are stateless fronts that ignore the sessions they do not own (a moved session starts with no
modelled history there).

Affinity: every replica of a kind subscribes to the kind's channels as usual (plain subscriptions) and acts
only on the sessions it owns; the owner of a session is the highest rendezvous hash (HRW) of
``(kind, session, replica)`` over the kind's live replicas (:func:`owner`). Every process computes the same
answer from the same membership, with no coordination and no broker feature. When a replica dies, only its
sessions move (to the replica with the next-highest hash); the others keep their owner.

Why not the alternatives: MQTT 5 shared subscriptions (``$share/group/...``) spread messages per message, not
per session — mosquitto round-robins them (no sticky or hashed strategy), so a session's words would reach
several ASR replicas — and amqtt delivers nothing to ``$share`` topics. Partitioned topics
(``voicepipe/{run}/p{k}/...``) would cut the fan-out but fix the partition count in the topic layout and
need a rebalancing protocol when a replica dies. Carrying all state in the messages would make every stage
stateless but every message larger. The price of HRW on plain subscriptions is fan-out: a replicated kind
receives each of its messages once per replica and drops the ones it does not own (``bench/scale.py`` shows
what that costs).

:class:`Membership` is the live replica set (planned at start, shrunk when :mod:`voicepipe.bus.liveness` reports
a death; a dead replica never comes back within a run). :class:`PartitionedBus` wraps a stage's bus and
yields only the messages of sessions its replica owns (plus ``session.end``, which every replica obeys);
with ``shadow`` it yields every message and answers :meth:`PartitionedBus.owns` for the stage to decide.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterable, Sequence

from voicepipe.bus.base import Bus
from voicepipe.messages import Envelope

REPLICATED = ("asr", "router", "agent", "tts")  # safe to split by session (the agent: as shadows)
SINGLE = ("council", "cache")  # state across sessions (shared simulated device, learned cache)
SHADOWED = ("agent",)  # replicas that see every session and act (muted) on those they do not own


def replica_id(kind: str, index: int) -> str:
    return f"{kind}.{index}"


def kind_of(replica: str) -> str:
    return replica.split(".", 1)[0]


def plan_workers(names: Sequence[str], workers: int) -> list[list[str]]:
    """Replica ids per worker process: one replica of each replicated stage on every worker, the single
    stages spread over the workers in turn. ``names`` are the stage kinds the run needs (no client)."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    plan: list[list[str]] = [[] for _ in range(workers)]
    singles = 0
    for kind in names:
        if kind == "client":
            continue
        if kind in REPLICATED:
            for w in range(workers):
                plan[w].append(replica_id(kind, w))
        else:
            plan[singles % workers].append(replica_id(kind, 0))
            singles += 1
    return plan


def _score(kind: str, session: str, replica: str) -> int:
    h = hashlib.blake2b(f"{kind}\0{session}\0{replica}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def owner(kind: str, session: str, replicas: Iterable[str]) -> str | None:
    """The replica of ``kind`` that serves ``session``: highest rendezvous hash; None if none is live."""
    return max(replicas, key=lambda r: _score(kind, session, r), default=None)


class Membership:
    """The live replicas of each stage kind of a run."""

    def __init__(self, replicas: Iterable[str]) -> None:
        self.live: dict[str, list[str]] = {}
        for r in replicas:
            self.live.setdefault(kind_of(r), []).append(r)
        self.dead: set[str] = set()

    def owner(self, kind: str, session: str) -> str | None:
        return owner(kind, session, self.live.get(kind, ()))

    def remove(self, replicas: Iterable[str]) -> list[str]:
        """Mark ``replicas`` dead; returns those that were live."""
        gone = []
        for r in replicas:
            group = self.live.get(kind_of(r), [])
            if r in group:
                group.remove(r)
                self.dead.add(r)
                gone.append(r)
        return gone

    def kinds_without_replica(self) -> list[str]:
        return sorted(k for k, rs in self.live.items() if not rs)


class PartitionedBus(Bus):
    """A replica's view of its stage's bus: only the sessions it owns (and every ``session.end``)."""

    def __init__(self, inner: Bus, replica: str, members: Membership, *, shadow: bool = False) -> None:
        super().__init__(inner.run, inner.name)
        self.inner = inner
        self.trusted = inner.trusted  # a view of the same bus: its peers sign (or not) as the inner bus's do
        self.replica = replica
        self.kind = kind_of(replica)
        self.members = members
        self.shadow = shadow  # yield every session's messages: the stage mutes those it does not own
        self.served: set[str] = set()  # sessions this replica acted on (as their owner)
        self.skipped = 0  # messages of sessions another replica owns (not counted for a shadow)
        if hasattr(inner, "accept") and not shadow:  # the MQTT bus drops them by topic, before parsing their bodies
            inner.accept = self._accept

    def _accept(self, session: str, channel: str) -> bool:
        if channel == "session/end" or self.members.owner(self.kind, session) == self.replica:
            return True
        self.skipped += 1
        return False

    def owns(self, session: str) -> bool:
        """Is this replica the owner of ``session`` now (its live replicas' highest hash)?"""
        return self.members.owner(self.kind, session) == self.replica

    @property
    def client(self):  # type: ignore[no-untyped-def]  # the MQTT client, where the inner bus has one
        return self.inner.client  # type: ignore[attr-defined]

    async def __aenter__(self) -> PartitionedBus:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.inner.__aexit__(*exc)

    async def subscribe(self, *channels: str) -> None:
        await self.inner.subscribe(*channels)

    async def publish(self, env: Envelope, *, qos: int | None = None) -> None:
        await self.inner.publish(env, qos=qos)
        self.published = self.inner.published

    async def deadletter(self, where: str, reason: str, body: bytes) -> None:
        await self.inner.deadletter(where, reason, body)
        self.deadletters = self.inner.deadletters

    async def messages(self) -> AsyncIterator[tuple[str, Envelope]]:
        async for channel, env in self.inner.messages():
            self.received = self.inner.received
            self.deadletters = self.inner.deadletters
            if env.type != "session.end":
                if self.members.owner(self.kind, env.session) == self.replica:
                    self.served.add(env.session)
                elif not self.shadow:
                    self.skipped += 1
                    continue
            yield channel, env
