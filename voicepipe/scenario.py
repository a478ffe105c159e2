"""Scripted conversations: what the user says (with timing and hesitations) and the reference replies."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic.json_schema import SkipJsonSchema

from voicepipe.errors import from_validation
from voicepipe.files import read_wav, read_yaml_mapping
from voicepipe.limits import (
    MAX_CACHE_ENTRIES,
    MAX_LIST,
    MAX_MS,
    MAX_SPEECH_MS,
    MAX_TURNS,
    Ms,
    Name,
    Text,
    Wpm,
)
from voicepipe.shipped import resolve as resolve_shipped
from voicepipe.shipped import shipped_dir, shipped_scenarios
from voicepipe.text import PAUSE, audio_ms, pause_ms, plain

# Strict: no coercion of text or booleans into numbers; no NaN/inf; every number and text bounded
# (voicepipe/limits.py says why each bound is where it is).
FILE_MODEL = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def longest_pause_ms(utterance: str) -> float:
    """The longest silence marker (``[900]``, ``[pause 900ms]``, ``[1.2s]``) in an utterance, in ms."""
    return max((pause_ms(m) for m in PAUSE.finditer(utterance)), default=0.0)


# "[pause]", "[Pause ms]": a pause marker's word without its number would be spoken as words
_NO_DURATION = re.compile(r"\[\s*pause\b[^\]\d]*\]", re.IGNORECASE)


def durationless_pause(utterance: str) -> str | None:
    """The first ``[pause]``-like marker that gives no duration, or None."""
    m = _NO_DURATION.search(utterance)
    return None if m is None else m.group(0)


class Turn(BaseModel):
    model_config = FILE_MODEL

    # before `user`: the user field's check reads it (a turn is text, a recording, or both)
    wav: str | None = Field(
        None,
        max_length=4096,
        description="A recorded caller: a WAV file (16 kHz mono 16-bit PCM; a relative path is relative to the "
        "scenario file) the real-audio caller streams instead of synthesising `user`. Real audio only.",
    )
    user: Text = Field(
        "",
        validate_default=True,
        description='What the user says. "[700]", "[pause 700ms]" or "[1.2s]" insert a silence (ms unless "s"). '
        "Required unless `wav` is given; with `wav`, the reference text the word error rate is scored against.",
    )  # what the user says; "[900]" / "[pause 900ms]" / "[1.2s]" mark silences inside it
    reply: Text = Field(description="The reference reply the simulated assistant speaks.")
    words_per_minute: Wpm | None = Field(
        None, description="User speaking rate for this turn (default: client.words_per_minute, 150)."
    )
    gap_ms: Ms = Field(400.0, description="Silence (ms) after the reply ends before the user speaks again.")
    intent: Name | None = Field(
        None, description="Free label the router's rules can match (router.rules.when.intent)."
    )
    complexity: Literal["low", "medium", "high"] | None = Field(
        None, description="Hint the router's rules can match (router.rules.when.complexity)."
    )
    # smart-turn annotation: is the utterance complete at each pause? (list per pause; default: no)
    complete_at_pauses: list[bool] = Field(
        default_factory=list,
        max_length=MAX_LIST,
        description="One per pause in `user`: is the utterance complete there? Read by smart endpointing "
        "(asr.smart_source=annotation); missing entries mean not complete; more than the pauses is an error.",
    )
    barge_in_after_ms: Ms | None = Field(
        None, description="The user talks over the reply this many ms after its first audio."
    )  # user talks over the reply this long after it starts
    barge_in: Text = Field("wait, sorry", description="What the user says when barging in.")

    @field_validator("reply")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not plain(v):
            raise ValueError("must not be empty")
        return v

    @field_validator("user", "barge_in")
    @classmethod
    def _pauses_bounded(cls, v: str) -> str:
        if (bad := durationless_pause(v)) is not None:
            raise ValueError(f"{bad} has no duration (write [pause 700ms], [700] or [1.2s])")
        if longest_pause_ms(v) > MAX_MS:
            raise ValueError(f"a pause marker is longer than {MAX_MS:,.0f} ms")
        return v

    @field_validator("user")
    @classmethod
    def _user_or_wav(cls, v: str, info: ValidationInfo) -> str:
        if not plain(v) and info.data.get("wav") is None:
            raise ValueError("must not be empty (or give `wav`, a recording of the turn)")
        return v

    @field_validator("complete_at_pauses")
    @classmethod
    def _one_per_pause(cls, v: list[bool], info: ValidationInfo) -> list[bool]:
        user = info.data.get("user")
        if user is None:
            return v  # `user` itself is invalid; that error is the one reported
        pauses = len(PAUSE.findall(user))
        if len(v) > pauses:
            raise ValueError(
                f"{len(v)} entries but `user` has {pauses} pause{'' if pauses == 1 else 's'} (one per pause marker)"
            )
        return v


class CacheEntry(BaseModel):
    model_config = FILE_MODEL

    questions: list[Text] = Field(
        min_length=1, max_length=MAX_LIST, description="Phrasings that should hit this entry."
    )
    answer: Text = Field(description="The answer the cache speaks (pre-rendered audio).")


class Scenario(BaseModel):
    model_config = FILE_MODEL

    name: Name = Field(description="Unique name; session ids are NAME-0, NAME-1, ...")
    description: Text = Field("", description="One line shown by `voicepipe scenarios`.")
    turns: list[Turn] = Field(min_length=1, max_length=MAX_TURNS, description="The conversation, in order.")
    cache: list[CacheEntry] = Field(
        default_factory=list,
        max_length=MAX_CACHE_ENTRIES,
        description="Answers predicted in advance for the speculative cache.",
    )  # answers predicted in advance (issue 4)
    source: SkipJsonSchema[str] = Field("", exclude=True)


def reply_speech_ms(text: str, words_per_minute: float) -> float:
    """How long the TTS takes to say ``text`` (the audio of all its words, as voicepipe.stages.tts times it)."""
    return audio_ms(text.split(), words_per_minute)


def too_long(field: str, ms: float, rate: str) -> str | None:
    """The one-line complaint when a line takes longer than :data:`MAX_SPEECH_MS` to say, else None."""
    if ms <= MAX_SPEECH_MS:
        return None
    return (
        f"{field}: takes {ms / 60_000:.1f} minutes to say at {rate}; "
        f"one line may take at most {MAX_SPEECH_MS / 60_000:g} minutes"
    )




def shipped() -> list[Path]:
    return shipped_scenarios()


def resolve(name_or_path: str) -> Path:
    """A scenario path: the file given, else a shipped scenario of that name (see :mod:`voicepipe.shipped`)."""
    return resolve_shipped(name_or_path, shipped_dir(), "scenario")


def load_scenario(name_or_path: str) -> Scenario:
    path = resolve(name_or_path)
    src = str(path)
    data = read_yaml_mapping(path, "a mapping with name and turns")
    try:
        sc = Scenario.model_validate(data)
    except ValidationError as exc:
        raise from_validation(src, exc, model=Scenario) from None
    sc.source = src
    for i, t in enumerate(sc.turns):
        if t.wav is not None:
            wav = path.parent / t.wav
            read_wav(wav, f"{src}: turns.{i}.wav")  # refused now (one line), not mid-run
            t.wav = str(wav)
    return sc


def starter(name: str) -> str:
    """A commented starter scenario named ``name`` (``voicepipe scenarios new``); it loads as it is."""
    import json

    template = (shipped_dir() / "templates" / "starter.yaml").read_text(encoding="utf-8")
    return template.replace("NAME_HERE", json.dumps(name))


def session_id(scenario: Scenario, index: int) -> str:
    """The bus-safe session id of the ``index``-th concurrent copy of a scenario."""
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in scenario.name)
    return f"{safe}-{index}"
