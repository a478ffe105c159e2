"""The lean MQTT client: aiomqtt's connection handling with voicepipe's own per-message path.

aiomqtt, per message: an ``asyncio.Event``, a ``wait_for`` task and its timeout timer for every QoS 1
publish; a thread-safe wake-up (a self-pipe write) to register the socket for writing; a task and an
``asyncio.wait`` for every received message. :class:`LeanClient` instead: :meth:`~LeanClient.publish_nowait`
hands the message to paho (which keeps QoS 1 messages until acknowledged and sends them again after a
reconnect); writes are flushed once per event-loop batch through :class:`_BufferedSocket`; PUBLISH and PUBACK
packets are read straight from the buffer (:meth:`~LeanClient._take`), everything else is paho's. Connecting,
TLS, subscribing and MQTT 5 stay aiomqtt's and paho's. bench/msgcost.py measures it.

Its every reach into either library's internals goes through :mod:`._private`, which pins the versions they
were written for; elsewhere :func:`._private.lean_allowed` decides whether this client is used at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from voicepipe.bus.mqtt import _private
from voicepipe.bus.mqtt.address import Client
from voicepipe.clock import now_ns

log = structlog.get_logger("voicepipe.bus")

LEAN_MAX_PACKET = 256 * 1024  # larger packets are read by paho (linear); messages here are far smaller
MQTT_ERR_NO_CONN = 4  # paho.mqtt.enums.MQTTErrorCode.MQTT_ERR_NO_CONN


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


class LeanClient(Client):
    """aiomqtt's client with a lean per-message path (see the module docstring)."""

    def __init__(self, *a: Any, socket_options: Any = (), **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._opts = tuple(socket_options)
        self._thread = threading.get_ident()
        self._paho = _private.paho_of(self)
        self.loop = _private.loop_of(self)
        self._v5 = _private.is_v5(self._paho)
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
        self._aio = {n: _private.aiomqtt_handler(self, n) for n in ("connect", "disconnect", "publish")}
        self._aio["socket_close"] = _private.aiomqtt_handler(self, "socket_close")
        p = self._paho
        p.disable_logger()  # paho formats a debug line per packet otherwise (errors still raise)
        # paho's public callback slots, taken over from aiomqtt (which set them in its __init__)
        p.on_connect = self._hook_connect
        p.on_disconnect = self._hook_disconnect
        p.on_message = self._hook_message
        p.on_publish = self._hook_publish
        p.on_socket_open = self._hook_socket_open
        p.on_socket_close = self._hook_socket_close
        p.on_socket_register_write = self._hook_register_write
        p.on_socket_unregister_write = self._hook_unregister_write

    # -- connection life --------------------------------------------------------------------------
    @property
    def lost(self) -> bool:
        return _private.disconnected(self).done()

    def prepare_reconnect(self) -> None:
        """After a lost connection: let ``__aenter__`` connect again (aiomqtt's documented reuse)."""
        # MQTT 5: resume the session (paho's connect() would treat every call as the first: clean start)
        _private.prepare_reconnect(self, resume_v5=self._v5)
        self.wake()

    async def close(self) -> None:
        """The link is done: disconnect (QoS 1 messages still unacknowledged stay with paho, unsent)."""
        await self.__aexit__(None, None, None)

    def _lose(self, exc: BaseException) -> None:
        _private.lose(self, exc)
        self.wake()

    def _hook_disconnect(self, *a: Any, **kw: Any) -> None:
        self._aio["disconnect"](*a, **kw)
        d = _private.disconnected(self)
        if d.done() and not d.cancelled():
            d.exception()  # retrieved: MqttBus reconnects; nobody else awaits it
        self.wake()

    # -- socket hooks (paho's external-loop API) ---------------------------------------------------
    def _hook_socket_open(self, client: Any, userdata: Any, sock: Any) -> None:
        raw = sock
        for opt in self._opts:
            with contextlib.suppress(OSError):
                raw.setsockopt(*opt)
        w = _BufferedSocket(raw)
        _private.set_sock(client, w)  # paho reads and writes through the buffers from here on
        self._sockw = w
        sock_of, idle = _private.sock, _private.between_packets

        def readable() -> None:
            took = False
            reads = 0
            try:
                while sock_of(client) is w:
                    if idle(client):  # paho is not in the middle of a packet
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
                    if client.loop_read() != 0 or sock_of(client) is not w or not w.buffered():
                        break
            except Exception as exc:  # a broken connection: reconnect, as aiomqtt would disconnect
                self._lose(exc)
            if took:
                _private.heard_from_broker(client, time.monotonic())  # paho's keep-alive clock (time_func)
            self.flush_soon()

        self.loop.call_soon_threadsafe(self.loop.add_reader, raw.fileno(), readable)
        self.loop.call_soon_threadsafe(_private.start_misc, self)

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
        if kind == 0x40:  # PUBACK: mid, then (MQTT 5) a reason code, omitted when it is success
            code = buf[i + 2] if n > 2 else 0
            # a success code (0; 16: no subscriber matched) without properties; errors are paho's
            if cmd != 0x40 or n < 2 or n > 4 or code not in (0, 16) or (n == 4 and buf[i + 3]):
                return False
            if n != 2 and not self._v5:  # MQTT 3.1.1: a PUBACK is exactly its packet id
                return False
            w.rpos = stop
            _private.complete_publish(self._paho, (buf[i] << 8) | buf[i + 1], *_puback(code))
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
        if self._v5:  # skip the properties (their length is a variable byte integer)
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
            self.wake()
        return True

    def _hook_socket_close(self, client: Any, userdata: Any, sock: Any) -> None:
        if self._writer:
            with contextlib.suppress(Exception):
                self.loop.remove_writer(sock.fileno())
            self._writer = False
        self._sockw = None
        self._aio["socket_close"](client, userdata, sock)

    def _hook_register_write(self, client: Any, userdata: Any, sock: Any) -> None:
        self.flush_soon()

    def _hook_unregister_write(self, client: Any, userdata: Any, sock: Any) -> None:
        pass  # writes only ever wait in _BufferedSocket; its own writer callback is managed in _flush

    def flush_soon(self) -> None:
        if self._flush_due:
            return
        self._flush_due = True
        if threading.get_ident() == self._thread:
            self.loop.call_soon(self._flush)
        else:  # paho connects in an executor thread
            self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        try:
            self._paho.loop_write()  # paho's queued packets into the write buffer
            w = self._sockw
            if w is None:
                return
            if w.flush():
                if self._writer:
                    self.loop.remove_writer(w.fileno())
                    self._writer = False
            elif not self._writer:
                self.loop.add_writer(w.fileno(), self._flush)
                self._writer = True
        except Exception as exc:
            self._lose(exc)

    # -- messages ------------------------------------------------------------------------------------
    def _hook_message(self, client: Any, userdata: Any, message: Any) -> None:
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
        self.wake()

    def _hook_publish(self, client: Any, userdata: Any, mid: int, *a: Any) -> None:
        self.unacked.pop(mid, None)
        if _private.awaited_publishes(self):  # someone awaits aiomqtt's own publish (retained markers)
            self._aio["publish"](client, userdata, mid, *a)

    def _hook_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, properties: Any = None) -> None:
        # QoS 1 messages in flight: as many as the broker takes (MQTT 5 Receive Maximum, which paho does not
        # apply itself; stock mosquitto says 20); unlimited on 3.1.1 (paho's default 20 would hold a busy
        # stage's sends back, and its limit check scans every unacknowledged message on each PUBACK)
        most = getattr(properties, "ReceiveMaximum", 0) if properties is not None else 0
        _private.set_max_inflight(client, 0 if not most or most >= 65535 else most)  # its setter refuses now
        self._aio["connect"](client, userdata, flags, rc, properties)

    def wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        for wake in self.wakers:
            wake()

    async def wait(self) -> None:
        """Until a message is in :attr:`inbox` or the connection is lost."""
        if self.inbox or self.lost:
            return
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def publish_nowait(self, topic: str, payload: bytes, qos: int, retain: bool = False) -> int:
        """Hand a message to paho; paho's result code (``MQTT_ERR_NO_CONN``: queued until reconnected for
        QoS 1, dropped for QoS 0)."""
        info = self._paho.publish(topic, payload, qos, retain)
        if qos and info.rc in (0, MQTT_ERR_NO_CONN):
            self.unacked[info.mid] = now_ns()
        return int(info.rc)


_PUBACKS: dict[int, tuple[ReasonCode, Properties]] = {}


def _puback(code: int) -> tuple[ReasonCode, Properties]:
    """(reason code, properties) of a PUBACK without properties, as paho hands them to ``on_publish``: made
    once per code."""
    got = _PUBACKS.get(code)
    if got is None:
        got = _PUBACKS[code] = (
            ReasonCode(PacketTypes.PUBACK, identifier=code),
            Properties(PacketTypes.PUBACK),  # type: ignore[no-untyped-call]
        )
    return got
