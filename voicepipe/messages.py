"""Bus messages: one envelope, one typed payload model per message type, topic helpers.

Every body on the bus is JSON of :class:`Envelope`. Its ``payload`` is the model that belongs to its
``type`` (:data:`PAYLOADS`), validated strictly at the boundary: no lax coercion (``true`` is not 1, ``"3"``
is not 3), no NaN or infinities, no unknown fields. Stages read typed attributes. The JSON schema of the
envelope (:meth:`Envelope.model_json_schema`) is a union discriminated on ``type``, so a tool on the bus can
validate what it sees. A stage that receives something it cannot parse (bad JSON, wrong schema version,
unknown type, payload that fails validation) hands the raw bytes to the dead-letter path instead of crashing.

``Envelope[P]`` is generic in its payload for the type checker only: at run time there is one envelope class
(and one wire variant per message type, :func:`parse`), never a class parametrised per payload, so building
and parsing cost what they did. What ties the static payload type to the message is a runtime fact the
envelope's validator enforces (``type`` names exactly one payload class): :func:`carries` narrows an envelope
by that fact, and a stage's handlers are registered per payload class (``Stage.on``).
"""

from __future__ import annotations

import builtins
import itertools
import math
import os
import secrets
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeAlias, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic.json_schema import DEFAULT_REF_TEMPLATE, GenerateJsonSchema, JsonSchemaMode
from typing_extensions import TypeIs, TypeVar

from voicepipe import clock
from voicepipe.construct import built, copied
from voicepipe.records import EndpointMetrics, TurnRecord
from voicepipe.spans import Span

SCHEMA_VERSION: Literal[2] = 2  # 2: one user.utterance per turn replaced a user.word per spoken word
ROOT = "voicepipe"

__all__ = ["PAYLOADS", "Envelope", "Span", "built", "carries", "copied", "message_type", "parse", "topic"]


class CancelReason(StrEnum):
    USER_RESUMED = "user resumed"  # the ASR withdrew a segment: its endpoint was premature
    PREEMPTIVE_MISMATCH = "preemptive mismatch"  # the final transcript differs from the eager partial
    HEARD = "heard"  # the user heard the reply start: stop the audio only (playout=first_audio)
    BARGE_IN = "barge-in"  # the user talked over the reply: stop speaking and drop the turn's work
    FAILED = "failed"  # the reply's LLM request failed (a real endpoint): the turn fails with ``error``
    LOST = "lost"  # a stage saw the broker drop this turn's messages (a sequence gap): lost with ``error``


class Target(StrEnum):
    """Who a route message is for."""

    AGENT = "agent"
    COUNCIL = "council"
    CACHE = "cache"
    COMMIT = "commit"  # release a held preemptive attempt


class Path(StrEnum):
    """How a turn was answered (TurnRecord.path)."""

    AGENT = "agent"
    CACHE = "cache"
    COUNCIL = "council"
    PREEMPTIVE = "preemptive"


class Payload(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    TYPE: ClassVar[str]


Count = Annotated[int, Field(ge=0)]


class CacheAnswer(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    questions: list[str]
    answer: str


class TurnScript(Payload):
    """client -> stages: the scripted turn (reference reply, hints): the simulation's oracle."""

    TYPE = "turn.script"
    user: str
    reply: str
    intent: str | None = None
    complexity: Literal["low", "medium", "high"] | None = None
    complete_at_pauses: list[bool] = Field(default_factory=list)
    words: Count
    cache: list[CacheAnswer] = Field(default_factory=list)


class UserWord(BaseModel):
    """One spoken word of a :class:`UserUtterance` (not a message of its own)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    text: str
    dur_ns: Count
    index: Count
    pause_before: bool
    last_word: bool
    # media time (issue 10): where the word's audio starts on the turn's audio timeline, and the silence
    # that follows it before the next word (None after the last word). The ASR decides endpoints from these,
    # never from when a message happened to arrive, so scheduling delay cannot change what is simulated.
    media_ns: Count = 0
    gap_after_ns: Count | None = None


class UserUtterance(Payload):
    """client -> asr: the user's utterance, sent as its first word's audio starts reaching the ASR.

    Every word with its place on the turn's media timeline: the ASR hears word ``i`` at the message's
    arrival plus ``words[i].media_ns - words[0].media_ns``, never earlier, and the uplink spans of the
    envelope (the first word's) move along that timeline with it. One message per utterance, not one per
    word: a word's message cost more CPU than all the ASR does with the word (bench/predict_throughput.py).
    """

    TYPE = "user.utterance"
    words: list[UserWord] = Field(min_length=1)


class SpeechStart(Payload):
    """client -> tts: the user started speaking over the reply (barge-in). asr -> tts when a real VAD heard
    it (``vad``): its detection is over, so the TTS stops at once rather than after the modelled
    ``tts.barge_in_detect_ms``."""

    TYPE = "user.speech_start"
    vad: bool = False


class Partial(Payload):
    """asr -> router/cache: interim transcript (``eager``: stable through a short silence)."""

    TYPE = "asr.partial"
    text: str
    words: Count
    segment: Count
    eager: bool = False


class Final(Payload):
    """asr -> router: final transcript of an endpointed segment."""

    TYPE = "asr.final"
    text: str
    words: Count
    segment: Count


class Route(Payload):
    """router/cache -> agent/council/cache: who serves this turn."""

    TYPE = "route"
    target: Target
    text: str
    words: Count
    segment: Count
    route: str = ""  # the routing decision, e.g. "single", "rule 0", "classifier:low (cache miss)"
    path: Path = Path.AGENT
    agent: str | None = None  # target agent: which of the agent stage's backends
    fallback: str | None = None  # target cache: where a miss goes (agent:NAME or council)
    attempt: Count | None = None  # preemptive attempt number (with hold, or target commit)
    hold: bool = False  # generate now, publish nothing until committed


class TurnMeta(BaseModel):
    """What answered the turn and what it cost; travels on reply.text and tts.audio to the client."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    backend: str
    path: Path
    route: str = ""
    input_tokens: Count = 0
    output_tokens: Count = 0
    wasted_tokens: Count = 0
    cost_usd: float = Field(0.0, ge=0)
    quality: float | None = None  # modelled, in [0, 1]
    false_hit: bool = False
    prerendered: bool = False
    members: list[str] = Field(default_factory=list)
    endpoint: EndpointMetrics | None = None  # a real endpoint's request metrics, on the reply's last chunk


class ReplyText(Payload):
    """agent/council -> tts: a chunk of reply text."""

    TYPE = "reply.text"
    text: str
    seq: Count
    final: bool
    words: Count
    segment: Count
    meta: TurnMeta


class Audio(Payload):
    """tts/cache -> client: a chunk of reply audio."""

    TYPE = "tts.audio"
    seq: Count
    text: str
    duration_ms: float = Field(ge=0)
    last: bool
    words: Count
    segment: Count
    meta: TurnMeta


_REPLY_TEXT_FIELDS = frozenset(ReplyText.model_fields)  # every one is passed (no defaults)
_AUDIO_FIELDS = frozenset(Audio.model_fields)


def reply_text(text: str, seq: int, final: bool, words: int, segment: int, meta: TurnMeta) -> ReplyText:
    """``ReplyText(...)``, built without pydantic's validation when every value is exactly of its field's type
    and in range (what the agent and council stages pass: a chunk per reply chunk); anything else is
    validated, and refused, as the constructor would."""
    if (
        type(text) is str
        and type(seq) is int
        and seq >= 0
        and type(final) is bool
        and type(words) is int
        and words >= 0
        and type(segment) is int
        and segment >= 0
        and type(meta) is TurnMeta
    ):
        fields = {"text": text, "seq": seq, "final": final, "words": words, "segment": segment, "meta": meta}
        return built(ReplyText, fields, set(_REPLY_TEXT_FIELDS))
    return ReplyText(text=text, seq=seq, final=final, words=words, segment=segment, meta=meta)


def audio(
    seq: int, text: str, duration_ms: float, last: bool, words: int, segment: int, meta: TurnMeta
) -> Audio:
    """``Audio(...)``, built without pydantic's validation when every value is exactly of its field's type and
    in range (what the TTS passes: a message per clause); anything else is validated, and refused, as the
    constructor would."""
    if (
        type(seq) is int
        and seq >= 0
        and type(text) is str
        and type(duration_ms) is float
        and 0.0 <= duration_ms < math.inf  # finite (a NaN fails the comparison): the model allows no inf/nan
        and type(last) is bool
        and type(words) is int
        and words >= 0
        and type(segment) is int
        and segment >= 0
        and type(meta) is TurnMeta
    ):
        fields = {
            "seq": seq, "text": text, "duration_ms": duration_ms, "last": last, "words": words,
            "segment": segment, "meta": meta,
        }  # fmt: skip
        return built(Audio, fields, set(_AUDIO_FIELDS))
    return Audio(
        seq=seq, text=text, duration_ms=duration_ms, last=last, words=words, segment=segment, meta=meta
    )


class Cancel(Payload):
    """anyone -> all: drop work for (session, turn[, segment | attempt])."""

    TYPE = "control.cancel"
    reason: CancelReason
    segment: Count | None = None
    attempt: Count | None = None
    error: str | None = Field(None, max_length=2000)  # with reason "failed": why


class SessionEnd(Payload):
    """client -> all: forget this session."""

    TYPE = "session.end"


PAYLOADS: dict[str, type[BaseModel]] = {
    m.TYPE: m
    for m in (TurnScript, UserUtterance, SpeechStart, Partial, Final, Route, ReplyText, Audio, Cancel)
}
PAYLOADS[SessionEnd.TYPE] = SessionEnd
PAYLOADS["turn.record"] = TurnRecord  # client -> anyone: the finished turn's measurement

MessageType = Literal[
    "turn.script",
    "user.utterance",
    "user.speech_start",
    "asr.partial",
    "asr.final",
    "route",
    "reply.text",
    "tts.audio",
    "control.cancel",
    "session.end",
    "turn.record",
]

AnyPayload: TypeAlias = Payload | TurnRecord  # what a parsed envelope carries: one of PAYLOADS
Segmented: TypeAlias = Partial | Final | Route | ReplyText | Audio  # payloads about one segment of a turn

# the envelope's payload type (covariant: an Envelope[Partial] is an Envelope[Segmented]; a bare
# ``Envelope`` is an Envelope[BaseModel]) and a payload type a function is generic in
P = TypeVar("P", bound=BaseModel, covariant=True, default=BaseModel)
Q = TypeVar("Q", bound=BaseModel)

_ids = itertools.count()
# unique per process across hosts (receivers drop redelivered duplicates by id): pid + 32 random bits
_origin = f"{os.getpid():x}{secrets.token_hex(4)}"


def next_id() -> str:
    return f"{_origin}-{next(_ids):x}"


def type_of(payload: BaseModel) -> str:
    """The message type of ``payload`` (an instance of a payload model or of a subclass of one)."""
    type_ = _TYPE_OF.get(payload.__class__)
    if type_ is not None:
        return type_
    if isinstance(payload, TurnRecord):
        return "turn.record"
    if isinstance(payload, Payload):
        return payload.TYPE
    raise TypeError(f"not a message payload: {type(payload).__name__}")


def message_type(cls: type[BaseModel]) -> str:
    """The message type whose payload is ``cls`` (one of :data:`PAYLOADS`)."""
    type_ = _TYPE_OF.get(cls)
    if type_ is None:
        raise TypeError(f"not a message payload: {cls.__name__}")
    return type_


class Envelope(BaseModel, Generic[P]):
    """Routing facts, the causal chain of spans, and the typed payload of ``type``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    v: Literal[2] = SCHEMA_VERSION
    type: MessageType
    run: str
    session: str
    turn: int = -1
    id: str = Field(default_factory=next_id)
    sent_ns: int = Field(default_factory=lambda: clock.now_ns())
    spans: list[Span] = Field(default_factory=list)
    # who sent it (stage kind/instance), its number in that sender's stream for this session and channel,
    # and a MAC (keyed BLAKE2b) of these routing facts under the run's token (voicepipe.stages.guard)
    src: str = Field("", max_length=64)
    seq: int = -1
    auth: str = Field("", max_length=64)
    payload: SerializeAsAny[P]

    @model_validator(mode="after")
    def _payload_fits_type(self) -> Envelope[P]:
        if type(self.payload) is not PAYLOADS[self.type]:
            raise ValueError(f"payload of a {self.type} message must be {PAYLOADS[self.type].__name__}")
        return self

    @classmethod
    def of(
        cls: builtins.type[Envelope[Q]],
        payload: Q,
        run: str,
        session: str,
        turn: int = -1,
        spans: list[Span] | None = None,
    ) -> Envelope[Q]:
        """A new envelope around an already validated payload (built without validating it again)."""
        type_ = _TYPE_OF.get(payload.__class__)
        if type_ is None:
            type_ = type_of(payload)  # an instance of a subclass of a payload model (rare: tests, plugins)
        # what model_construct does, without its per-field default handling (this is the bus's hot path)
        return built(cls, {
            "v": SCHEMA_VERSION, "type": type_, "run": run, "session": session, "turn": turn,
            "id": f"{_origin}-{next(_ids):x}", "sent_ns": clock.now_ns(), "spans": spans or [], "src": "",
            "seq": -1, "auth": "", "payload": payload,
        }, set(_ALL_FIELDS))  # fmt: skip

    def to_bytes(self) -> bytes:
        """The wire JSON (pydantic-core's serializer straight to bytes: faster here than orjson over
        ``model_dump``, measured in bench/msgcost.py's notes)."""
        return self.__pydantic_serializer__.to_json(self)

    @classmethod
    def model_json_schema(
        cls,
        by_alias: bool | None = None,
        ref_template: str = DEFAULT_REF_TEMPLATE,
        schema_generator: builtins.type[GenerateJsonSchema] = GenerateJsonSchema,
        mode: JsonSchemaMode = "validation",
        *,
        union_format: Literal["any_of", "primitive_type_array"] = "any_of",
    ) -> dict[str, Any]:
        """The wire schema: one variant per message type, each with its payload model."""
        schema = _WIRE.json_schema(
            by_alias=by_alias,
            ref_template=ref_template,
            union_format=union_format,
            schema_generator=schema_generator,
            mode=mode,
        )
        return {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "Envelope",
            "description": f"A voicepipe bus message (schema version {SCHEMA_VERSION}): routing facts, the "
            "causal chain of spans, and the typed payload of its type.",
            **schema,
        }


_ALL_FIELDS = frozenset(Envelope.model_fields)
_TYPE_OF: dict[type, str] = {m: t for t, m in PAYLOADS.items()}  # payload class -> its message type


def carries(env: Envelope[BaseModel], cls: type[Q]) -> TypeIs[Envelope[Q]]:
    """Does ``env`` carry a ``cls`` payload? (Narrows ``env`` for the type checker: a class test, no copy.)"""
    return isinstance(env.payload, cls)


def _literal(tag: str) -> Any:
    """``Literal[tag]`` for a tag known only at run time (an annotation built for pydantic, not mypy)."""
    return Literal[tag]


_VARIANTS: tuple[type[Envelope[Any]], ...] = tuple(
    create_model(
        f"{model.__name__}Message",
        __base__=Envelope,
        __doc__=(model.__doc__ or "").strip().split("\n")[0],
        type=(_literal(t), ...),
        payload=(model, ...),
    )
    for t, model in PAYLOADS.items()
)
_WIRE_FORM: Any = Annotated[Union[_VARIANTS], Field(discriminator="type")]  # noqa: UP007
_WIRE: TypeAdapter[Envelope[AnyPayload]] = TypeAdapter(_WIRE_FORM)


class BadMessage(ValueError):
    """A body that is not a valid envelope; carries a one-line reason."""


def parse(body: bytes | bytearray | str) -> Envelope[AnyPayload]:
    """The envelope in ``body`` as the wire variant of its type (its payload validated as that type's model),
    or :class:`BadMessage` with a one-line reason."""
    try:
        return _WIRE.validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise BadMessage(f"{where}: {err['msg']}") from None


def topic(run: str, session: str, channel: str) -> str:
    return f"{ROOT}/{run}/{session}/{channel}"


def channel_of(type_: str) -> str:
    return type_.replace(".", "/")


def deadletter_topic(run: str) -> str:
    return f"{ROOT}/{run}/deadletter"


def split_topic(t: str) -> tuple[str, str, str]:
    """``voicepipe/{run}/{session}/{channel...}`` -> (run, session, channel)."""
    parts = t.split("/", 3)
    if len(parts) < 4 or parts[0] != ROOT:
        raise BadMessage(f"topic {t!r} is not voicepipe/run/session/channel")
    return parts[1], parts[2], parts[3]
