"""Every reach into aiomqtt's and paho's private internals, in one module, pinned to the versions it was
written and tested for. Nothing else in voicepipe touches an underscore name of either library.

The lean message path (:class:`voicepipe.bus.mqtt.lean.LeanClient`) reads PUBLISH and PUBACK packets out of
paho's socket itself and flushes paho's writes once per event-loop batch; for that it needs these names:

paho-mqtt ``paho.mqtt.client.Client``:

* ``_sock`` (read, write): swapped for a buffered wrapper, so paho reads and writes through it;
* ``_in_packet["command"]`` (read): 0 while paho is between packets (only then may the next one be taken);
* ``_out_message_mutex``, ``_out_messages``, ``_do_on_publish``: a PUBACK read here completes its QoS 1
  message through paho's own bookkeeping (out-message table, in-flight count, ``on_publish``);
* ``_protocol`` (read): MQTT 5 or 3.1.1 (the shape of a PUBACK, properties in a PUBLISH);
* ``_last_bytes_received`` (write): paho's keep-alive clock, which only its own reads advance;
* ``_max_inflight_messages`` (write, in ``on_connect``): the public setter refuses once connected.

aiomqtt ``aiomqtt.Client``:

* ``_client``: the paho client it wraps; ``_loop``: the event loop it was made on;
* ``_connected``, ``_disconnected``: the futures of a connection's life (reconnecting the same client,
  noticing a lost connection without a task waiting on it);
* ``_clean_start``: MQTT 5 resumes its session on a reconnect (aiomqtt would ask for a clean start);
* ``_misc_task``, ``_misc_loop``: paho's keep-alive loop, started from the socket-open hook as aiomqtt does;
* ``_pending_publishes``: whether someone awaits aiomqtt's own ``publish`` (retained markers);
* the handlers ``_on_connect``, ``_on_disconnect``, ``_on_publish``, ``_on_socket_close``: the lean
  client's paho callbacks (set through paho's public ``on_*`` attributes) hand on to them.

:func:`lean_allowed` is asked whenever a lean client would be made: with other versions installed than
:data:`PINNED` (or ``VOICEPIPE_LEAN=0``) the link uses :class:`voicepipe.bus.mqtt.plain.PlainClient`, which
uses aiomqtt's public API only, and says so once.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import structlog

log = structlog.get_logger("voicepipe.bus")

# the release series the private names above were read from (and the lean path tested on)
PINNED: dict[str, tuple[str, ...]] = {"aiomqtt": ("2.5",), "paho-mqtt": ("2.1", "2.2")}
LEAN_ENV = "VOICEPIPE_LEAN"  # "0" / "false" / "off" / "no": the plain aiomqtt path, whatever is installed

_warned = False
_warn_lock = threading.Lock()


@functools.cache
def installed() -> dict[str, str]:
    """The installed version of each pinned package ("" when it cannot be read); read once per process."""
    out = {}
    for name in PINNED:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = ""
    return out


def mismatches(have: dict[str, str] | None = None) -> list[str]:
    """``name version`` for every pinned package whose installed version is outside its series."""
    have = installed() if have is None else have
    bad = []
    for name, series in PINNED.items():
        v = have.get(name, "")
        if not any(v == s or v.startswith(s + ".") for s in series):
            bad.append(f"{name} {v or '(unknown)'}")
    return bad


def lean_allowed() -> bool:
    """May the lean client be used? No when ``VOICEPIPE_LEAN`` turns it off, or when aiomqtt or paho-mqtt are
    not the versions :data:`PINNED`; the latter is logged once per process (a warning: slower, not wrong)."""
    global _warned
    if os.environ.get(LEAN_ENV, "").strip().lower() in ("0", "false", "off", "no"):
        return False
    bad = mismatches()
    if not bad:
        return True
    with _warn_lock:
        if not _warned:
            _warned = True
            want = ", ".join(f"{n} {'/'.join(s + '.x' for s in ser)}" for n, ser in PINNED.items())
            log.warning(
                f"MQTT: {', '.join(bad)} installed, the lean message path was written for {want}: "
                "using aiomqtt's plain client (correct, more CPU per message)"
            )
    return False


# -- aiomqtt.Client ---------------------------------------------------------------------------------------
def paho_of(client: Any) -> Any:
    return client._client


def loop_of(client: Any) -> asyncio.AbstractEventLoop:
    loop: asyncio.AbstractEventLoop = client._loop
    return loop


def disconnected(client: Any) -> asyncio.Future[None]:
    fut: asyncio.Future[None] = client._disconnected
    return fut


def lose(client: Any, exc: BaseException) -> None:
    """Mark the connection lost (as aiomqtt does when a read fails), the exception retrieved: handled."""
    d = client._disconnected
    if not d.done():
        d.set_exception(exc)
        d.exception()


def prepare_reconnect(client: Any, resume_v5: bool) -> None:
    """Let ``__aenter__`` connect the same client again; MQTT 5: resume the session (no clean start)."""
    if client._connected.done():
        client._connected = asyncio.Future()
    if resume_v5:
        client._clean_start = False


def start_misc(client: Any) -> None:
    """paho's keep-alive loop, as aiomqtt's own socket-open hook starts it (call on the event loop)."""
    client._misc_task = client._loop.create_task(client._misc_loop())


def awaited_publishes(client: Any) -> bool:
    return bool(client._pending_publishes)


def aiomqtt_handler(client: Any, name: str) -> Callable[..., None]:
    """aiomqtt's own bound handler ``_on_{name}`` of ``client`` (connect, disconnect, publish, socket_close)."""
    handler: Callable[..., None] = getattr(client, f"_on_{name}")
    return handler


# -- paho.mqtt.client.Client -------------------------------------------------------------------------------
def sock(paho: Any) -> Any:
    return paho._sock


def set_sock(paho: Any, wrapped: Any) -> None:
    paho._sock = wrapped


def between_packets(paho: Any) -> bool:
    return bool(paho._in_packet["command"] == 0)


def is_v5(paho: Any) -> bool:
    return bool(paho._protocol == 5)


def heard_from_broker(paho: Any, when: float) -> None:
    paho._last_bytes_received = when


def set_max_inflight(paho: Any, most: int) -> None:
    paho._max_inflight_messages = most


def complete_publish(paho: Any, mid: int, reason: Any, props: Any) -> None:
    """A PUBACK for ``mid``: the QoS 1 message done through paho's bookkeeping (ignored if unknown)."""
    with paho._out_message_mutex:
        if mid in paho._out_messages:
            paho._do_on_publish(mid, reason, props)
