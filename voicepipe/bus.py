"""The bus: the interface every stage talks through, and its MQTT implementation.

:class:`Bus` is what a stage sees: subscribe to channels (for every session of the run), publish
envelopes, iterate over received ones, dead-letter what cannot be used. Two implementations share that
contract — topics ``voicepipe/{run}/{session}/{channel}``, one :class:`~voicepipe.messages.Envelope` per
message, QoS 1 (every subscriber gets each message, in publish order per publisher, the publisher too when
subscribed): :class:`MqttBus` (here: the stages of one process share one MQTT connection, an
:class:`MqttLink`) and :class:`voicepipe.membus.MemoryBus` (in-process, for virtual time). Stages do not know
which one they run on.

MQTT: every client sets TCP_NODELAY (small QoS 1 messages otherwise wait on delayed ACKs). A link subscribes
to ``voicepipe/{run}/+/{channel}`` once per channel its stages want and serves every session of every stage
through it: a message several stages of the process subscribe to crosses the wire once.

The message path is lean (:class:`LeanClient`: no future, task or timer per message, one socket write per
event-loop batch for every stage of the process; bench/msgcost.py measures it) and survives the broker going
away (:class:`MqttLink`: reconnect with backoff and jitter, persistent session, QoS 1 resend, resubscribe,
replay after a restart; :class:`MqttBus`: duplicates dropped by envelope id; :class:`BrokerHealth` records outages and stalls for the turns they
hit; past ``outage_window_s`` :class:`BrokerOutage` ends the run). Validation happens here, where bytes
enter from the network (:func:`voicepipe.messages.parse`); the in-memory bus passes validated objects.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import math
import random
import socket
import ssl
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import aiomqtt
import structlog
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.client import MQTT_CLEAN_START_FIRST_ONLY
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from voicepipe.clock import now_ns
from voicepipe.errors import UserError, redact_url
from voicepipe.messages import BadMessage, Envelope, channel_of, deadletter_topic, parse, split_topic, topic

if TYPE_CHECKING:
    from voicepipe.config import BrokerConfig

log = structlog.get_logger("voicepipe.bus")

NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
LEAN_MAX_PACKET = 256 * 1024  # larger packets are read by paho (linear); messages here are far smaller
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
        # the file guard: no FIFO or device reaches ssl (it would block)
        from voicepipe.files import check_file
        from voicepipe.limits import MAX_PEM_BYTES

        for name in ("ca_file", "cert_file", "key_file"):
            if getattr(self, name):
                check_file(getattr(self, name), MAX_PEM_BYTES, field=f"broker.{name}")
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

    def client(
        self,
        identifier: str | None = None,
        *,
        lean: bool = False,
        protocol: str = "3.1.1",
        session_expiry_s: float | None = None,
        **kw: Any,
    ) -> aiomqtt.Client:
        """An aiomqtt client for this address (TCP_NODELAY, TLS as configured). ``lean``: a
        :class:`LeanClient` on a persistent session (resumed after a reconnect); ``protocol`` "5" speaks
        MQTT 5 (clean start on the first connect only, session expiry ``session_expiry_s``)."""
        if protocol == "5":
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = math.ceil(session_expiry_s or 0) + 5 if lean else 0
            kw.update(
                protocol=aiomqtt.ProtocolVersion.V5, clean_start=MQTT_CLEAN_START_FIRST_ONLY, properties=props
            )
        elif lean:
            kw["clean_session"] = False
        return (LeanClient if lean else aiomqtt.Client)(
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
    # no one but this run's own stages can reach it (the in-process bus of a virtual run): senders do not
    # sign, receivers do not authenticate (voicepipe.stages.guard, check 1); every other check stays
    trusted: bool = False

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


class _BufferedSocket:
    """paho's socket seen through two buffers, so one syscall serves many packets.

    paho reads a packet in several ``recv`` calls (command byte, each length byte, body) and writes each
    packet with its own ``send``. Here reads take up to 64 KiB from the kernel at once and serve paho from
    memory; writes only collect, and :meth:`flush` sends them in one call once the event loop has run the
    current batch of callbacks (every PUBLISH and PUBACK of that batch together).
    """

    __slots__ = ("rbuf", "rpos", "sock", "wbuf")

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.rbuf = b""
        self.rpos = 0
        self.wbuf: list[bytes] = []

    def recv(self, n: int) -> bytes:
        if self.rpos >= len(self.rbuf):
            data = self.sock.recv(65536)  # BlockingIOError and TLS want-read pass through to paho
            if not data:
                return b""
            self.rbuf, self.rpos = data, 0
        start = self.rpos
        self.rpos = min(start + n, len(self.rbuf))
        return self.rbuf[start : self.rpos]

    def fill(self) -> int:
        """Append what the kernel has to the unread rest: 1 read some, 0 nothing now, -1 end of stream."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return 0
        if not data:
            return -1
        rest = self.rbuf[self.rpos :]
        self.rbuf, self.rpos = (rest + data if rest else data), 0
        return 1

    def buffered(self) -> int:
        pend = getattr(self.sock, "pending", None)  # TLS: decrypted bytes the SSL object still holds
        return len(self.rbuf) - self.rpos + (pend() if pend else 0)

    def send(self, buf: bytes | bytearray | memoryview) -> int:
        self.wbuf.append(bytes(buf))
        return len(buf)

    def flush(self) -> bool:
        """Send what paho wrote; False when the kernel took only part (the rest waits for writability)."""
        if not self.wbuf:
            return True
        data = self.wbuf[0] if len(self.wbuf) == 1 else b"".join(self.wbuf)
        self.wbuf.clear()
        try:
            n = self.sock.send(data)
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            n = 0
        if n < len(data):
            self.wbuf.append(data[n:])
            return False
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class LeanClient(aiomqtt.Client):
    """aiomqtt's client with a lean per-message path (aiomqtt >= 2.5, paho 2.x).

    aiomqtt, per message: an ``asyncio.Event``, a ``wait_for`` task and its timeout timer for every QoS 1
    publish; a thread-safe wake-up (a self-pipe write) to register the socket for writing; a task and an
    ``asyncio.wait`` for every received message. Here instead: :meth:`publish_nowait` hands the message to
    paho (which keeps QoS 1 messages until acknowledged and sends them again after a reconnect); writes
    are flushed once per event-loop batch through :class:`_BufferedSocket`; received messages go into a
    deque that :meth:`wait` drains, one future per empty-to-non-empty transition. Connecting, TLS,
    subscribing and MQTT 5 stay aiomqtt's and paho's.
    """

    def __init__(self, *a: Any, socket_options: Any = (), **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._opts = tuple(socket_options)
        self._thread = threading.get_ident()
        self._sockw: _BufferedSocket | None = None
        self._flush_due = False
        self._writer = False
        self._waiter: asyncio.Future[None] | None = None
        self.inbox: deque[tuple[str, bytes]] = deque()
        # MqttLink: every received message goes to ``sink`` (not the inbox); ``wakers`` hear of a lost link
        self.sink: Callable[[str, bytes], None] | None = None
        self.wakers: list[Callable[[], None]] = []
        self.unacked: dict[int, int] = {}  # QoS 1 mid -> when it was handed over (stall detection)
        self.bad_topics = 0  # PUBLISHes whose topic is not UTF-8 (a broker that forwards them): dropped
        self._client.disable_logger()  # paho formats a debug line per packet otherwise (errors still raise)

    # -- connection life --------------------------------------------------------------------------
    @property
    def lost(self) -> bool:
        return self._disconnected.done()

    def prepare_reconnect(self) -> None:
        """After a lost connection: let ``__aenter__`` connect again (aiomqtt's documented reuse)."""
        if self._connected.done():
            self._connected = asyncio.Future()
        if self._client.protocol == 5:
            # resume the session: paho's connect() would treat every call as the first (clean start)
            self._clean_start = False
        self._wake()

    def _lose(self, exc: BaseException) -> None:
        if not self._disconnected.done():
            self._disconnected.set_exception(exc)
            self._disconnected.exception()  # retrieved: a lost connection is handled, not an unawaited error
        self._wake()

    def _on_disconnect(self, *a: Any, **kw: Any) -> None:
        super()._on_disconnect(*a, **kw)
        d = self._disconnected
        if d.done() and not d.cancelled():
            d.exception()  # retrieved: MqttBus reconnects; nobody else awaits it
        self._wake()

    # -- socket hooks (paho's external-loop API) ---------------------------------------------------
    def _on_socket_open(self, client: Any, userdata: Any, sock: Any) -> None:
        raw = sock
        for opt in self._opts:
            with contextlib.suppress(OSError):
                raw.setsockopt(*opt)
        w = _BufferedSocket(raw)
        client._sock = w  # paho reads and writes through the buffers from here on
        self._sockw = w

        def readable() -> None:
            took = False
            reads = 0
            try:
                while client._sock is w:
                    if client._in_packet["command"] == 0:  # paho is not in the middle of a packet
                        got = self._take(w)
                        if got:
                            took = True
                            continue
                        if got is None:  # the next packet is not all here yet
                            if reads and (reads > 1 or w.rpos >= len(w.rbuf)):
                                # one kernel read per callback (and one more to complete its last packet):
                                # the stages run before the next, so a busy link cannot starve them
                                break
                            reads += 1
                            more = w.fill()
                            if more > 0:
                                continue
                            if more == 0:
                                break
                    # paho's own packets (CONNACK, SUBACK, PINGRESP, QoS 2...), and the end of the stream
                    if client.loop_read() != 0 or client._sock is not w or not w.buffered():
                        break
            except Exception as exc:  # a broken connection: reconnect, as aiomqtt would disconnect
                self._lose(exc)
            if took:
                client._last_bytes_received = time.monotonic()  # paho's keep-alive clock (time_func)
            self._flush_soon()

        def misc() -> None:
            self._misc_task = self._loop.create_task(self._misc_loop())

        self._loop.call_soon_threadsafe(self._loop.add_reader, raw.fileno(), readable)
        self._loop.call_soon_threadsafe(misc)

    def _take(self, w: _BufferedSocket) -> bool | None:
        """Handle the packet at the head of the read buffer if it is a PUBLISH (QoS 0 or 1) or a PUBACK
        (success): True. False: one for paho (anything else, or anything unusual: it decodes and reports
        it). None: the packet is not complete yet.

        paho decodes every packet into objects (an MQTTMessage, MQTT 5 Properties and a ReasonCode, a
        callback lookup by topic) and queues each PUBACK through its locks; the two packets of every bus
        message are read here from the buffer instead. The QoS 1 state stays paho's: a PUBACK completes the
        message through paho (``_do_on_publish``: its out-message table, in-flight count and callback), a
        received QoS 1 PUBLISH is acknowledged at once, as paho does without manual acks.
        """
        buf, pos = w.rbuf, w.rpos
        end = len(buf)
        if end - pos < 2:
            return None
        cmd = buf[pos]
        kind = cmd & 0xF0
        if kind != 0x30 and kind != 0x40:
            return False
        n, i, mul = 0, pos + 1, 1
        while True:  # remaining length: up to 4 bytes, 7 bits each
            if i >= end:
                return None
            b = buf[i]
            n += (b & 127) * mul
            i += 1
            if b < 128:
                break
            mul <<= 7
            if mul > 1 << 21:
                return False
        if n > LEAN_MAX_PACKET:
            return False  # paho reads a large packet into one growing buffer; here each read would copy it
        stop = i + n
        if stop > end:
            return None
        c = self._client
        if kind == 0x40:  # PUBACK: mid, then (MQTT 5) a reason code, omitted when it is success
            code = buf[i + 2] if n > 2 else 0
            # a success code (0; 16: no subscriber matched) without properties; errors are paho's
            if cmd != 0x40 or n < 2 or n > 4 or code not in (0, 16) or (n == 4 and buf[i + 3]):
                return False
            if n != 2 and c._protocol != 5:  # MQTT 3.1.1: a PUBACK is exactly its packet id
                return False
            w.rpos = stop
            mid = (buf[i] << 8) | buf[i + 1]
            with c._out_message_mutex:
                if mid in c._out_messages:
                    c._do_on_publish(mid, *_puback(code))
            return True
        qos = (cmd >> 1) & 3
        if qos >= 2 or n < 2:  # QoS 2 is paho's; 3 is malformed: paho reports it
            return False
        j = i + 2 + ((buf[i] << 8) | buf[i + 1])
        if j == i + 2 or j + (2 if qos else 0) > stop:  # a topic alias, or malformed: paho's to judge
            return False
        t: str | None
        try:
            t = buf[i + 2 : j].decode()
        except UnicodeDecodeError:
            t = None  # paho would raise on it at every read, wedging the connection: acknowledged, dropped
        mid = 0
        if qos:
            mid = (buf[j] << 8) | buf[j + 1]
            j += 2
        if c._protocol == 5:  # skip the properties (their length is a variable byte integer)
            plen, mul = 0, 1
            while True:
                if j >= stop:
                    return False
                b = buf[j]
                plen += (b & 127) * mul
                j += 1
                if b < 128:
                    break
                mul <<= 7
            j += plen
            if j > stop:
                return False
        w.rpos = stop
        body = buf[j:stop]
        if qos:
            w.wbuf.append(bytes((0x40, 2, mid >> 8, mid & 255)))  # PUBACK (MQTT 5: success, no properties)
        if t is None:
            self.bad_topics += 1
            log.warning("dropped a message whose topic is not UTF-8", count=self.bad_topics)
            return True
        if self.sink is not None:
            self.sink(t, body)
        else:
            self.inbox.append((t, body))
            self._wake()
        return True

    def _on_socket_close(self, client: Any, userdata: Any, sock: Any) -> None:
        if self._writer:
            with contextlib.suppress(Exception):
                self._loop.remove_writer(sock.fileno())
            self._writer = False
        self._sockw = None
        super()._on_socket_close(client, userdata, sock)

    def _on_socket_register_write(self, client: Any, userdata: Any, sock: Any) -> None:
        self._flush_soon()

    def _on_socket_unregister_write(self, client: Any, userdata: Any, sock: Any) -> None:
        pass  # writes only ever wait in _BufferedSocket; its own writer callback is managed in _flush

    def _flush_soon(self) -> None:
        if self._flush_due:
            return
        self._flush_due = True
        if threading.get_ident() == self._thread:
            self._loop.call_soon(self._flush)
        else:  # paho connects in an executor thread
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        try:
            self._client.loop_write()  # paho's queued packets into the write buffer
            w = self._sockw
            if w is None:
                return
            if w.flush():
                if self._writer:
                    self._loop.remove_writer(w.fileno())
                    self._writer = False
            elif not self._writer:
                self._loop.add_writer(w.fileno(), self._flush)
                self._writer = True
        except Exception as exc:
            self._lose(exc)

    # -- messages ------------------------------------------------------------------------------------
    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        try:
            t = message.topic
        except UnicodeDecodeError:  # raised here, paho would read the same packet again forever
            self.bad_topics += 1
            log.warning("dropped a message whose topic is not UTF-8", count=self.bad_topics)
            return
        if self.sink is not None:
            self.sink(t, message.payload)
            return
        self.inbox.append((t, message.payload))
        self._wake()

    def _on_publish(self, client: Any, userdata: Any, mid: int, *a: Any) -> None:
        self.unacked.pop(mid, None)
        if self._pending_publishes:  # someone awaits aiomqtt's own publish (retained markers)
            super()._on_publish(client, userdata, mid, *a)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, properties: Any = None) -> None:
        # QoS 1 messages in flight: as many as the broker takes (MQTT 5 Receive Maximum, which paho does not
        # apply itself; stock mosquitto says 20); unlimited on 3.1.1 (paho's default 20 would hold a busy
        # stage's sends back, and its limit check scans every unacknowledged message on each PUBACK)
        most = getattr(properties, "ReceiveMaximum", 0) if properties is not None else 0
        client._max_inflight_messages = 0 if not most or most >= 65535 else most  # its setter refuses now
        super()._on_connect(client, userdata, flags, rc, properties)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        for wake in self.wakers:
            wake()

    async def wait(self) -> None:
        """Until a message is in :attr:`inbox` or the connection is lost."""
        if self.inbox or self._disconnected.done():
            return
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def publish_nowait(self, topic: str, payload: bytes, qos: int, retain: bool = False) -> int:
        """Hand a message to paho; paho's result code (``MQTT_ERR_NO_CONN``: queued until reconnected for
        QoS 1, dropped for QoS 0)."""
        info = self._client.publish(topic, payload, qos, retain)
        if qos and info.rc in (0, MQTT_ERR_NO_CONN):
            self.unacked[info.mid] = now_ns()
        return int(info.rc)


_PUBACKS: dict[int, tuple[Any, Any]] = {}


def _puback(code: int) -> tuple[Any, Any]:
    """(reason code, properties) of a PUBACK without properties, as paho hands them to ``on_publish``: made
    once per code."""
    got = _PUBACKS.get(code)
    if got is None:
        from paho.mqtt.reasoncodes import ReasonCode

        got = _PUBACKS[code] = (
            ReasonCode(PacketTypes.PUBACK, identifier=code),
            Properties(PacketTypes.PUBACK),
        )
    return got


MQTT_ERR_NO_CONN = 4  # paho.mqtt.enums.MQTTErrorCode.MQTT_ERR_NO_CONN
REPLAY_NS = 2_000_000_000  # published this long before a lost connection: sent again after reconnecting
SEEN_IDS = 16384  # ids remembered per client for deduplication (QoS 1 redelivers after reconnects)


class MqttLink:
    """One MQTT connection shared by the stages of a process: the lean message path, reconnect and resume.

    Every :class:`MqttBus` of a process that shares a link (``runner.mqtt_connector``) publishes through the
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
    ) -> None:
        self.addr = addr
        self.run = run
        self.name = name
        self.qos = qos
        self.window_ns = round(outage_window_s * 1e9)
        self.health = health or BrokerHealth()
        self.client: LeanClient = addr.client(
            identifier=f"vp-{run}-{name}",
            lean=True,
            protocol=protocol,
            session_expiry_s=outage_window_s,
        )  # type: ignore[assignment]
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
            for t in (self._watch, self._reconnecting):
                if t is not None:
                    t.cancel()
                    with contextlib.suppress(BaseException):
                        await t
            with contextlib.suppress(Exception):
                await self.client.__aexit__(None, None, None)

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
        must be quick and must not raise): a diagnostic observer (:class:`~voicepipe.liveness.Progress`)
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
                bus._wake()

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
                c._wake()
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
            c._flush_soon()
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
    ) -> None:
        super().__init__(run, name)
        self.addr = addr
        self.qos = qos
        self.link = link or MqttLink(
            addr, run, name, qos, protocol=protocol, outage_window_s=outage_window_s, health=health
        )
        self.client = self.link.client
        self.health = self.link.health
        self.duplicates = 0
        # (session, channel) -> act on it? Checked on the topic, before the body is parsed or the stage
        # woken: a replica (voicepipe.partition) drops other replicas' sessions without paying for them
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
        rc = self.link.publish(
            topic(self.run, env.session, channel_of(env.type)), env.to_bytes(), q, env.sent_ns
        )
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

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def messages(self) -> AsyncIterator[tuple[str, Envelope]]:
        """Parsed envelopes with their channel; malformed ones go to the dead-letter topic, duplicates
        (same envelope id again, after a redelivery) are dropped."""
        link, c = self.link, self.client
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
                if self._duplicate(env.id):
                    self.duplicates += 1
                    continue
                yield channel, env
            if link.fatal is not None:
                raise link.fatal
            if c.lost:
                await link.wait_reconnected()
                continue
            self._waiter = c._loop.create_future()
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
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
