"""The bus: the interface every stage talks through, and its MQTT implementation.

:class:`Bus` is what a stage sees: subscribe to channels (for every session of the run), publish
envelopes, iterate over received ones, dead-letter what cannot be used. Two implementations share that
contract — topics ``voicepipe/{run}/{session}/{channel}``, one :class:`~voicepipe.messages.Envelope` per
message, QoS 1 (every subscriber gets each message, in publish order per publisher, the publisher too when
subscribed): :class:`MqttBus` (one aiomqtt client per stage, here) and
:class:`voicepipe.membus.MemoryBus` (in-process, for virtual time). Stages do not know which one they run on.

MQTT: every client sets TCP_NODELAY (small QoS 1 messages otherwise wait on delayed ACKs). A stage subscribes to
``voicepipe/{run}/+/{channel}`` once and serves every session through that one subscription.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import socket
import ssl
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import aiomqtt
import structlog

from voicepipe.clock import now_ns
from voicepipe.errors import UserError, redact_url
from voicepipe.messages import BadMessage, Envelope, channel_of, deadletter_topic, parse, split_topic, topic

if TYPE_CHECKING:
    from voicepipe.config import BrokerConfig

log = structlog.get_logger("voicepipe.bus")

NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
# aiomqtt warns on every publish once more than 10 are in flight — normal with hundreds of sessions on one
# client; keep its errors, drop that per-message warning
MQTT_LOG = logging.getLogger("voicepipe.mqtt")
MQTT_LOG.setLevel(logging.ERROR)


@dataclass(frozen=True)
class BrokerAddress:
    """Where a stage connects and how: ``mqtt://`` (plain TCP, port 1883) or ``mqtts://`` (TLS, port 8883).

    TLS verifies the broker's certificate against ``ca_file`` (or the system CAs) and its host name;
    ``insecure`` turns both checks off and is never implied. ``cert_file``/``key_file`` present a client
    certificate. The password never appears in a repr or an error message.
    """

    host: str
    port: int
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False

    @classmethod
    def parse(
        cls,
        url: str,
        username: str | None = None,
        password: str | None = None,
        *,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        insecure: bool = False,
    ) -> BrokerAddress:
        shown = redact_url(url)
        try:
            u = urlparse(url if "://" in url else f"mqtt://{url}")
            port = u.port
        except ValueError:
            raise UserError("broker.url", f"{shown!r}: bad port") from None
        if u.scheme not in (*PLAIN, *TLS):
            raise UserError(
                "broker.url", f"{shown!r}: scheme must be mqtt:// or mqtts:// (got {u.scheme}://)"
            )
        if not u.hostname:
            raise UserError("broker.url", f"{shown!r}: no host")
        tls = u.scheme in TLS
        given = {"ca_file": ca_file, "cert_file": cert_file, "key_file": key_file, "insecure": insecure}
        if not tls and any(given.values()):
            opt = next(k for k, v in given.items() if v)
            raise UserError(f"broker.{opt}", f"TLS options need an mqtts:// broker URL (got {shown!r})")
        addr = cls(
            host=u.hostname,
            port=port or (8883 if tls else 1883),
            username=username or (unquote(u.username) if u.username else None),
            password=password or (unquote(u.password) if u.password else None),
            tls=tls,
            ca_file=ca_file,
            cert_file=cert_file,
            key_file=key_file,
            insecure=insecure,
        )
        addr.ssl_context()  # bad CA or certificate files: one line now, not at connect time
        return addr

    @classmethod
    def from_config(cls, broker: BrokerConfig) -> BrokerAddress:
        """The address of a validated ``broker`` config section (``url`` must be set)."""
        if not broker.url:
            raise UserError("broker.url", "no broker URL")
        return cls.parse(
            broker.url,
            broker.username,
            broker.password.get_secret_value() if broker.password is not None else None,
            ca_file=broker.ca_file,
            cert_file=broker.cert_file,
            key_file=broker.key_file,
            insecure=broker.insecure,
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for ``mqtts://`` (None for plain ``mqtt://``); bad files raise UserError."""
        if not self.tls:
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise UserError(
                "broker.ca_file", f"{self.ca_file}: not a readable PEM CA file ({_why(exc)})"
            ) from None
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file or self.key_file:
            if not self.cert_file:
                raise UserError("broker.key_file", "a client key needs its certificate (cert_file)")
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file, password=_no_key_password)
            except _EncryptedKey:
                raise UserError(
                    "broker.key_file", "the key is encrypted; give an unencrypted key file"
                ) from None
            except (OSError, ssl.SSLError) as exc:
                raise UserError(
                    "broker.cert_file",
                    f"{self.cert_file}: not a usable PEM certificate and unencrypted key ({_why(exc)})",
                ) from None
        return ctx

    def client(self, identifier: str | None = None, **kw: Any) -> aiomqtt.Client:
        return aiomqtt.Client(
            self.host,
            self.port,
            username=self.username,
            password=self.password,
            identifier=identifier,
            socket_options=NODELAY,
            keepalive=30,
            logger=MQTT_LOG,
            tls_context=self.ssl_context(),
            **kw,
        )


PLAIN = ("mqtt", "tcp")
TLS = ("mqtts", "ssl")


class _EncryptedKey(Exception):
    pass


def _no_key_password() -> str:
    # without a callback OpenSSL would prompt on the terminal for an encrypted key's passphrase
    raise _EncryptedKey


def _why(exc: BaseException) -> str:
    return str(getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc).splitlines()[0]


class Bus(abc.ABC):
    """A stage's connection: publish envelopes, receive parsed ones, dead-letter the rest."""

    run: str
    name: str

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
        """Receive ``channels`` (``user/word``...) of every session of the run."""

    @abc.abstractmethod
    async def publish(self, env: Envelope, *, qos: int | None = None) -> None:
        """Send ``env`` on its session's channel for its type; stamps ``sent_ns``."""

    @abc.abstractmethod
    def messages(self) -> AsyncIterator[tuple[str, Envelope]]:
        """(channel, envelope) for every message received on the subscribed channels."""

    async def serve(self, receive: Callable[[Envelope], Awaitable[None]]) -> None:
        """Hand every received envelope to ``receive``, one at a time in arrival order, until cancelled
        (a stage's receive loop; the in-memory bus calls ``receive`` without a queue in between)."""
        async for _channel, env in self.messages():
            await receive(env)

    async def deadletter(self, where: str, reason: str, body: bytes) -> None:
        self.deadletters += 1
        log.warning("deadletter", stage=self.name, topic=where, reason=reason)


class MqttBus(Bus):
    """A stage's own aiomqtt client."""

    def __init__(self, addr: BrokerAddress, run: str, name: str, qos: int = 1) -> None:
        super().__init__(run, name)
        self.addr = addr
        self.qos = qos
        self.client = addr.client(identifier=f"vp-{run}-{name}")

    async def __aenter__(self) -> MqttBus:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            await self.client.__aexit__(None, None, None)

    async def subscribe(self, *channels: str) -> None:
        for ch in channels:
            await self.client.subscribe(topic(self.run, "+", ch), qos=self.qos)

    async def publish(self, env: Envelope, *, qos: int | None = None) -> None:
        env.sent_ns = now_ns()
        channel = channel_of(env.type)
        task = asyncio.current_task()
        await self.client.publish(
            topic(self.run, env.session, channel), env.to_bytes(), qos=self.qos if qos is None else qos
        )
        self.published += 1
        if task is not None and task.cancelling():
            # aiomqtt awaits its confirmation with asyncio.wait_for, which on Python < 3.12 can swallow a
            # cancel that lands as the confirmation arrives (CPython gh-86296): honour it here, so a
            # cancelled turn never goes on publishing.
            raise asyncio.CancelledError

    async def deadletter(self, where: str, reason: str, body: bytes) -> None:
        await super().deadletter(where, reason, body)
        note = {
            "stage": self.name,
            "topic": where,
            "reason": reason,
            "body": body[:512].decode("utf-8", errors="replace"),
        }
        import json

        with contextlib.suppress(Exception):
            await self.client.publish(deadletter_topic(self.run), json.dumps(note).encode(), qos=0)

    async def messages(self) -> AsyncIterator[tuple[str, Envelope]]:
        """Parsed envelopes with their channel; malformed ones go to the dead-letter topic."""
        async for msg in self.client.messages:
            self.received += 1
            t = str(msg.topic)
            body = msg.payload if isinstance(msg.payload, bytes | bytearray) else str(msg.payload).encode()
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
            yield channel, env


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
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
