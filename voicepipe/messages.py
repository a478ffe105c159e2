"""Bus messages: one envelope, typed payloads, topic helpers.

Every body on the bus is JSON of :class:`Envelope`. A stage that receives something it cannot parse
(bad JSON, wrong schema version, unknown type, payload that fails validation) hands the raw bytes to the
dead-letter path instead of crashing.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = 1
ROOT = "voicepipe"


class Span(BaseModel):
    """One stretch of work a stage did for a turn, on the shared monotonic clock (ns).

    ``modelled`` spans are durations the models prescribed (the stage then slept until
    ``start_ns + dur_ns``); measured spans are what the stage observed.
    """

    model_config = ConfigDict(frozen=True)

    stage: str
    what: str
    start_ns: int
    dur_ns: int
    modelled: bool = True
    # a measured span's duration as a calibrated model predicted it (real endpoints with a profile):
    # counts towards the turn's predicted time instead of the measured duration
    predicted_ns: int | None = None

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.dur_ns


MessageType = Literal[
    "turn.script",  # client -> stages: the scripted turn (reference reply, hints): the simulation's oracle
    "user.word",  # client -> asr: one spoken word reached the ASR (after the uplink)
    "user.speech_start",  # client -> all: the user started speaking (barge-in detection)
    "asr.partial",  # asr -> router/cache: interim transcript
    "asr.final",  # asr -> router: final transcript of an endpointed segment
    "route",  # router -> agent/council/cache: who serves this turn
    "reply.text",  # agent/council -> tts: a chunk of reply text
    "tts.audio",  # tts/cache -> client: a chunk of reply audio
    "control.cancel",  # anyone -> all: drop work for (session, turn, segment)
    "session.end",  # client -> all: forget this session
    "turn.record",  # client -> anyone: the finished turn's measurement
]


class Envelope(BaseModel):
    model_config = ConfigDict(extra="forbid")

    v: Literal[1] = SCHEMA_VERSION
    type: MessageType
    run: str
    session: str
    turn: int = -1
    id: str = Field(default_factory=lambda: next_id())
    sent_ns: int = Field(default_factory=time.monotonic_ns)
    spans: list[Span] = Field(default_factory=list)
    payload: dict[str, Any] = Field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


_ids = itertools.count()
_pid = os.getpid()


def next_id() -> str:
    return f"{_pid:x}-{next(_ids):x}"


class BadMessage(ValueError):
    """A body that is not a valid envelope; carries a one-line reason."""


def parse(body: bytes | bytearray | str) -> Envelope:
    try:
        return Envelope.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise BadMessage(f"{where}: {err['msg']}") from None


def topic(run: str, session: str, channel: str) -> str:
    return f"{ROOT}/{run}/{session}/{channel}"


def deadletter_topic(run: str) -> str:
    return f"{ROOT}/{run}/deadletter"


def split_topic(t: str) -> tuple[str, str, str]:
    """``voicepipe/{run}/{session}/{channel...}`` -> (run, session, channel)."""
    parts = t.split("/", 3)
    if len(parts) < 4 or parts[0] != ROOT:
        raise BadMessage(f"topic {t!r} is not voicepipe/run/session/channel")
    return parts[1], parts[2], parts[3]
