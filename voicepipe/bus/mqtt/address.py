"""Where the MQTT broker is and how to reach it: :class:`BrokerAddress` (``mqtt://`` / ``mqtts://`` URLs,
credentials, TLS files), parsed and checked once at start so a bad URL or certificate is one line naming the
field, never a traceback at connect time.

Every client made here sets TCP_NODELAY (small QoS 1 messages otherwise wait on delayed ACKs). aiomqtt warns on
every publish once more than 10 are in flight — normal with hundreds of sessions on one client: its logger
(``voicepipe.mqtt``) keeps errors only. An acknowledgement for a subscribe or unsubscribe whose caller has
already gone (cancelled at shutdown, or timed out) is logged by aiomqtt as an exception with a traceback;
it is one line at warning here (:class:`LateAck`).

Every client is a :class:`Client`: aiomqtt's, with a connect that a cancel cannot leave half done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
from dataclasses import dataclass, field
from typing import Any, Self
from urllib.parse import unquote, urlparse

import aiomqtt
from paho.mqtt.client import MQTT_CLEAN_START_FIRST_ONLY
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from voicepipe.errors import UserError, redact_url
from voicepipe.files import check_file
from voicepipe.limits import MAX_PEM_BYTES

NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


class LateAck(logging.Filter):
    """aiomqtt's 'Unexpected message ID "N" in on_subscribe callback' (and on_unsubscribe): the broker's
    acknowledgement of a call nobody waits for any more. Expected after a cancel, so one line at warning, not
    an error with a KeyError traceback on a user's terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Unexpected message ID"):
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


MQTT_LOG = logging.getLogger("voicepipe.mqtt")
MQTT_LOG.setLevel(logging.ERROR)
MQTT_LOG.addFilter(LateAck())

UNWIND_S = 5.0  # how long a cancelled connect may take to finish and disconnect before it is left to itself


class Client(aiomqtt.Client):
    """aiomqtt's client whose connect survives a cancel (a signal at start-up, a shutdown mid-connect).

    aiomqtt connects in an executor thread and, once the socket opens, starts its keep-alive task from that
    thread. A cancel that lands meanwhile ends ``__aenter__`` but not the connect: the connection stays open
    with nobody to close it, and a keep-alive task started after the loop cancelled its tasks is destroyed
    pending when the loop closes. Here the connect runs shielded; on a cancel an unwinding task of its own
    waits for the connect to end (aiomqtt bounds it), disconnects if it succeeded, however late, and is not
    stopped by further cancels; the cancelled caller waits for it up to :data:`UNWIND_S`, then the cancel goes on.
    """

    async def __aenter__(self) -> Self:
        entering = asyncio.ensure_future(super().__aenter__())
        try:
            await asyncio.shield(entering)
        except asyncio.CancelledError as cancel:
            unwind = asyncio.ensure_future(_unwind(self, entering))
            _UNWINDING.add(unwind)  # a strong reference until it ends
            unwind.add_done_callback(_UNWINDING.discard)
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):  # a second cancel: stop waiting only
                await asyncio.wait_for(asyncio.shield(unwind), UNWIND_S)
            raise cancel
        return self


_UNWINDING: set[asyncio.Future[None]] = set()


async def _unwind(client: aiomqtt.Client, entering: asyncio.Future[Any]) -> None:
    """After a cancelled connect: wait for it to end, then disconnect if it connected."""
    try:
        await entering
    except BaseException:  # it failed or was cancelled: nothing is open
        return
    with contextlib.suppress(asyncio.CancelledError, TimeoutError, aiomqtt.MqttError, OSError):
        await asyncio.wait_for(client.__aexit__(None, None, None), UNWIND_S)


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

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for ``mqtts://`` (None for plain ``mqtt://``); bad files raise UserError."""
        if not self.tls:
            return None
        # the file guard: no FIFO or device reaches ssl (it would block)
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
        factory: type[Client] = Client,
        persistent: bool = False,
        protocol: str = "3.1.1",
        session_expiry_s: float | None = None,
        **kw: Any,
    ) -> Client:
        """A ``factory`` client (:class:`Client` or a subclass) for this address: TCP_NODELAY, TLS as configured.
        ``persistent``: a session the broker keeps across a reconnect; ``protocol`` "5" speaks MQTT 5 (clean
        start on the first connect only, session expiry ``session_expiry_s`` when persistent)."""
        if protocol == "5":
            props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            props.SessionExpiryInterval = math.ceil(session_expiry_s or 0) + 5 if persistent else 0
            kw.update(
                protocol=aiomqtt.ProtocolVersion.V5, clean_start=MQTT_CLEAN_START_FIRST_ONLY, properties=props
            )
        elif persistent:
            kw["clean_session"] = False
        return factory(
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
