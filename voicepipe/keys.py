"""A run's secrets: the shared token, the key of one run *instance*, and the MACs made with them.

Contract.

* **Token** (``VOICEPIPE_RUN_TOKEN``, else 32 random bytes): shared by the run and the ``voicepipe stage``
  processes that serve it. It never travels, is never printed and has no repr. It signs nothing on the bus
  but the run's announcement (:func:`announce_key`); message keys are derived from it.
* **Instance**: each start of a run draws a fresh 128-bit nonce and announces it (:mod:`voicepipe.bus.instance`).
  Its key is keyed BLAKE2b used as a KDF (RFC 7693's keyed mode is a PRF): ``BLAKE2b-256(key=token,
  "voicepipe instance\\0" run "\\0" nonce)``. Two runs with the same run id and token — one after the other or
  at once — have different keys, so nothing one of them signed verifies in the other: a recorded run cannot
  be replayed into a later one. The announcement key (``"voicepipe announce\\0" run``) is per run id only,
  since a stage must verify the announcement before it knows the nonce; announcements carry a wall-clock
  time, so an old one replayed is stale (:mod:`voicepipe.bus.instance`).
* **Messages** (:func:`seal`, :func:`body_verified`): the MAC is keyed BLAKE2b-128 over the *whole wire body*
  — routing facts, spans, ``sent_ns`` and payload — with the ``auth`` value set to 32 zeros while hashing,
  then written into the body. The sender serialises once (the bytes it MACs are the bytes it sends, with the
  MAC spliced in); a receiver hashes the raw bytes it got (zeroing the same 32 characters) and never
  serialises again. ``"auth":"`` occurs once in a body a key holder made: a JSON string cannot hold an
  unescaped quote, and no payload or span model has an ``auth`` field; the value found must also equal the
  parsed ``auth``. Cost (timeit, loaded shared 2-core box): hashing a 1.8 KB ``tts.audio`` body ~3.1 µs
  against ~0.6 µs for the facts alone, plus a ~1 µs search for the ``auth`` slot; against a live pipeline
  message's ~600-700 µs (bench/msgcost.py --against the previous code, 2 interleaved rounds:
  bench/results/msgcost-instance-keys.json) the difference is inside the run-to-run noise.
* **Records** (:func:`seal_record`, :func:`open_record`): liveness markers, heartbeats and announcements are
  ``MAC SP JSON`` with the MAC over the topic and the JSON, so a record is valid on its own topic only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

from voicepipe.errors import UserError

TOKEN_ENV = "VOICEPIPE_RUN_TOKEN"
MAC_HEX = 32  # 128-bit MACs, hex
_ZEROS = b"0" * MAC_HEX
_PLACEHOLDER = "0" * MAC_HEX
_AUTH = b'"auth":"'
# set in an envelope's __dict__ (no field: never serialised) by a bus that checked the MAC on the raw body
# it received (True/False); the guard trusts that verdict instead of serialising the envelope again
VERIFIED = "_vp_mac_ok"
_blake2b = hashlib.blake2b


def run_token() -> bytes:
    """The run's secret: ``VOICEPIPE_RUN_TOKEN`` when set (stages in other processes need the same one), else
    32 random bytes."""
    given = os.environ.get(TOKEN_ENV)
    return given.encode() if given else secrets.token_bytes(32)


def require_shared_token(where: str) -> None:
    """Stages in other processes derive their keys from the token they are given: the run and they must share one."""
    if not os.environ.get(TOKEN_ENV):
        raise UserError(
            where,
            f"stages in other processes need the run's secret: set {TOKEN_ENV} to the same value for the run "
            "and every `voicepipe stage` process (e.g. export VOICEPIPE_RUN_TOKEN=$(openssl rand -hex 32))",
        )


def _key(token: bytes) -> bytes:
    """BLAKE2b's key is at most 64 bytes: a longer token is hashed to one (same token, same key everywhere)."""
    return token if len(token) <= 64 else _blake2b(token, digest_size=64).digest()


def derive(token: bytes, label: str, *parts: bytes) -> bytes:
    """A 256-bit key for ``label`` and ``parts`` under ``token`` (keyed BLAKE2b as a KDF)."""
    return _blake2b(b"\0".join([label.encode(), *parts]), key=_key(token), digest_size=32).digest()


def announce_key(token: bytes, run: str) -> bytes:
    return derive(token, "voicepipe announce", run.encode())


@dataclass(frozen=True)
class Instance:
    """One start of a run: its nonce (announced) and the key everything in it is signed with (never shown)."""

    run: str
    nonce: str  # 32 hex digits
    key: bytes = field(repr=False)

    @property
    def id(self) -> str:
        """Short enough for client ids and logs, long enough to tell concurrent starts apart."""
        return self.nonce[:12]

    @classmethod
    def new(cls, token: bytes, run: str) -> Instance:
        return cls.of(token, run, secrets.token_hex(16))

    @classmethod
    def of(cls, token: bytes, run: str, nonce: str) -> Instance:
        return cls(run, nonce, derive(token, "voicepipe instance", run.encode(), nonce.encode()))


# -- message MACs ------------------------------------------------------------------------------------
_keyed: dict[bytes, Any] = {}  # key -> BLAKE2b state after its key block (only the body is hashed per message)


def _state(key: bytes) -> Any:
    keyed = _keyed.get(key)
    if keyed is None:
        if len(_keyed) >= 64:  # one key per run instance: a long-lived process running many runs keeps a few
            _keyed.clear()
        keyed = _keyed[key] = _blake2b(key=_key(key), digest_size=MAC_HEX // 2)
    return keyed.copy()


def seal(env: Any, key: bytes) -> bytes:
    """``env``'s wire body with its MAC under ``key`` in ``auth`` (also set on ``env``): one serialisation."""
    d = env.__dict__
    d["auth"] = _PLACEHOLDER
    body = env.to_bytes()
    i = body.find(_AUTH) + len(_AUTH)
    h = _state(key)
    h.update(body)
    tag = h.hexdigest()
    d["auth"] = tag
    return body[:i] + tag.encode() + body[i + MAC_HEX :]


def sign(env: Any, key: bytes) -> None:
    """Set ``env.auth`` to its MAC under ``key`` (the body as :meth:`Envelope.to_bytes` writes it)."""
    seal(env, key)


def mac(env: Any, key: bytes) -> str:
    """The MAC ``env`` would carry under ``key`` (its body serialised with ``auth`` zeroed)."""
    d = env.__dict__
    had = d["auth"]
    d["auth"] = _PLACEHOLDER
    try:
        body = env.to_bytes()
    finally:
        d["auth"] = had
    h = _state(key)
    h.update(body)
    return str(h.hexdigest())


def body_verified(body: bytes | bytearray, auth: str, key: bytes) -> bool:
    """Does the raw ``body`` (whose parsed ``auth`` is ``auth``) carry a valid MAC under ``key``?"""
    if len(auth) != MAC_HEX or not auth.isascii():
        return False
    i = body.find(_AUTH)
    if i < 0:
        return False
    i += len(_AUTH)
    j = i + MAC_HEX
    if body[i:j] != auth.encode() or body[j : j + 1] != b'"':
        return False
    mv = memoryview(body)
    h = _state(key)
    h.update(mv[:i])
    h.update(_ZEROS)
    h.update(mv[j:])
    return hmac.compare_digest(h.hexdigest(), auth)


def verified(env: Any, key: bytes) -> bool:
    """Is ``env``'s MAC valid under ``key``? A bus that checked the raw body says so on the envelope
    (:data:`VERIFIED`); an envelope without that verdict (in-process, tests) is serialised to check."""
    d = env.__dict__
    ok = d.get(VERIFIED)
    if ok is not None:
        return bool(ok)
    a = d["auth"]  # any string up to 64 characters: compare_digest raises on non-ASCII str, so refuse it first
    return bool(a) and a.isascii() and hmac.compare_digest(mac(env, key), a)


# -- signed records (liveness, announcements) ----------------------------------------------------------
def seal_record(key: bytes, topic: str, record: dict[str, Any]) -> bytes:
    """``MAC SP JSON``: ``record`` as JSON, its MAC over the topic and the JSON."""
    text = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
    h = _state(key)
    h.update(topic.encode() + b"\0" + text)
    return h.hexdigest().encode() + b" " + text


MAX_RECORD = 16384  # a liveness record or announcement is a few hundred bytes


def open_record(key: bytes, topic: str, body: bytes | bytearray) -> dict[str, Any] | None:
    """The record in ``body`` if its MAC under ``key`` on ``topic`` is valid (and it is a JSON object), else None."""
    if len(body) > MAX_RECORD or body[MAC_HEX : MAC_HEX + 1] != b" ":
        return None
    tag, text = bytes(body[:MAC_HEX]), bytes(body[MAC_HEX + 1 :])
    h = _state(key)
    h.update(topic.encode() + b"\0" + text)
    if not hmac.compare_digest(h.hexdigest().encode(), tag):
        return None
    try:
        got = json.loads(text)
    except ValueError:
        return None
    return got if isinstance(got, dict) else None
