"""Audio frames on the bus: 20 ms of 16 kHz mono s16le PCM behind a small signed binary header.

A frame travels as a binary MQTT payload on its session's audio topic, next to the JSON messages:
``voicepipe/{run}/{session}/audio/up`` (caller -> ASR) and ``.../audio/down`` (TTS -> caller). Layout
(big-endian header, then the MAC, then the samples)::

    magic  b"VPA1"   4 bytes
    dir    u8        0 up, 1 down
    flags  u8        bit 0: the last frame of an utterance or a reply
    turn   i32       the turn the audio belongs to
    seq    u32       the sender's frame number in this session and direction (rises by one)
    seg    u16       the turn's segment (a reply to a segment the ASR withdrew is not this turn's reply)
    media  u64       ns: where the frame's first sample lies on the sender's media timeline of the turn
    mac    16 bytes  keyed BLAKE2b of (run, session, header, samples) under the run's token
    pcm    640 bytes exactly one 20 ms frame (a shorter last frame is padded with silence)

The MAC covers the samples and the run and session named by the topic (which are not repeated in the body),
so a frame cannot be altered, moved to another session or direction, or forged without the token. Unlike the
JSON envelope's MAC it covers the body: a frame is small and hashing 660 bytes costs well under a
microsecond. :class:`FrameGate` admits a verified frame only when its sequence number is past the last
one seen for its (session, direction), counting the gaps (frames the broker dropped: audio travels at
QoS 0, a lost frame is a glitch, not a failed turn).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field

from voicepipe.audio import FRAME_BYTES

MAGIC = b"VPA1"
UP, DOWN = 0, 1
CHANNELS = {UP: "audio/up", DOWN: "audio/down"}
LAST = 1
_HEAD = struct.Struct(">4sBBiIHQ")
MAC_BYTES = 16
SIZE = _HEAD.size + MAC_BYTES + FRAME_BYTES


class BadFrame(ValueError):
    """A body that is not a valid frame for this run and session (one-line reason)."""


@dataclass(frozen=True, slots=True)
class Frame:
    direction: int
    turn: int
    seq: int
    media_ns: int
    pcm: bytes
    last: bool = False
    segment: int = 0


def _mac(token: bytes, run: str, session: str, head: bytes, pcm: bytes) -> bytes:
    key = token if len(token) <= 64 else hashlib.blake2b(token, digest_size=64).digest()
    h = hashlib.blake2b(key=key, digest_size=MAC_BYTES, person=b"vp-audio")
    h.update(f"{run}\0{session}\0".encode())
    h.update(head)
    h.update(pcm)
    return h.digest()


def encode(frame: Frame, run: str, session: str, token: bytes) -> bytes:
    """The wire bytes of ``frame`` for (run, session), signed with ``token``."""
    pcm = frame.pcm
    if len(pcm) > FRAME_BYTES or len(pcm) % 2:
        raise ValueError(f"a frame holds at most {FRAME_BYTES} bytes of s16le samples, not {len(pcm)}")
    if len(pcm) < FRAME_BYTES:
        pcm = pcm + bytes(FRAME_BYTES - len(pcm))
    if frame.direction not in CHANNELS:
        raise ValueError(f"direction must be {UP} (up) or {DOWN} (down)")
    flags = LAST if frame.last else 0
    head = _HEAD.pack(MAGIC, frame.direction, flags, frame.turn, frame.seq, frame.segment, frame.media_ns)
    return head + _mac(token, run, session, head, pcm) + pcm


def decode(body: bytes, run: str, session: str, token: bytes) -> Frame:
    """The frame in ``body`` if it is well formed and signed for (run, session) under ``token``; else
    :class:`BadFrame` with the reason."""
    if len(body) != SIZE:
        raise BadFrame(f"a frame is {SIZE} bytes, not {len(body)}")
    head = body[: _HEAD.size]
    magic, direction, flags, turn, seq, segment, media = _HEAD.unpack(head)
    if magic != MAGIC:
        raise BadFrame("not an audio frame (bad magic)")
    if direction not in CHANNELS:
        raise BadFrame(f"unknown direction {direction}")
    if flags & ~LAST:
        raise BadFrame(f"unknown flags {flags:#x}")
    got = body[_HEAD.size : _HEAD.size + MAC_BYTES]
    pcm = body[_HEAD.size + MAC_BYTES :]
    if not hmac.compare_digest(got, _mac(token, run, session, head, pcm)):
        raise BadFrame("unauthenticated (bad MAC)")
    return Frame(direction, turn, seq, media, bytes(pcm), bool(flags & LAST), segment)


@dataclass
class FrameGate:
    """Sequence checks per (session, direction): a repeat or a step back is refused, a jump is counted."""

    last: dict[tuple[str, int], int] = field(default_factory=dict)
    lost: int = 0
    refused: int = 0

    def admit(self, session: str, frame: Frame) -> bool:
        key = (session, frame.direction)
        prev = self.last.get(key, -1)
        if frame.seq <= prev:
            self.refused += 1
            return False
        self.lost += frame.seq - prev - 1
        self.last[key] = frame.seq
        return True

    def end(self, session: str) -> None:
        for d in CHANNELS:
            self.last.pop((session, d), None)
