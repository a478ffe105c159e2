"""Measure a speech endpoint (``voicepipe calibrate --stage asr|tts``) and turn it into a stage profile.

Contract (:func:`measure`): for each (length, concurrency) level, ``concurrency`` clients each keep one
request in flight (a closed loop) until ``requests`` have completed, after one uncounted warm-up request per
client. Lengths are seconds of audio (ASR: the first L s of a passage espeak-ng reads at 150 wpm, posted as
one segment, exactly as the real ASR stage posts one) or words of text (TTS: the first N words of a fixed
passage, as one clause). Per request, on this process's monotonic clock:

* ASR **finalisation**: request sent -> the final transcript (``transcript.text.done`` or the JSON body),
  the real ASR stage's measured ``finalise`` span;
* TTS **time to first audio**: request sent -> the first audio chunk, the real TTS stage's measured span.

:func:`fit` is a least-squares line through the one-client medians (ms vs length) with its r2;
:func:`profile` evaluates it at a reference length and carries the measured p90/median ratio, so the
length-independent modelled figure (``asr.finalize_ms`` / ``tts.ttfb_ms``) is stated with where it came
from. All figures are MEASURED; :func:`versus` puts the modelled stage's figure beside them.
"""

from __future__ import annotations

import asyncio
import platform
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np

from voicepipe.audio.engines import espeak
from voicepipe.backends.base import EndpointError
from voicepipe.backends.speech import SpeechEndpoint, synthesize_stream, transcribe
from voicepipe.backends.speech_profile import SETTING

PASSAGE = (
    "Good morning, I would like a large oat milk latte and a warm croissant, and could you tell me what time "
    "the cafe closes today because I need to pick up a birthday cake for my sister later this afternoon, "
    "thank you very much for your help and have a lovely day."
)


@dataclass(frozen=True)
class Level:
    concurrency: int
    length: float  # seconds of audio (asr) or words (tts)
    requests: int
    failed: int
    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float
    error: str | None = None  # the first failure's reason


def words(n: int) -> str:
    w = PASSAGE.split()
    return " ".join((w * (n // len(w) + 1))[:n])


async def audio_of(seconds: float) -> bytes:
    """The first ``seconds`` of :data:`PASSAGE` read by espeak-ng (16 kHz s16le; repeated if too short)."""
    x = await espeak(PASSAGE, 150)
    n = round(seconds * 16_000)
    return np.resize(x, n).astype("<i2").tobytes()


async def _one(ep: SpeechEndpoint, payload: bytes | str) -> float:
    t0 = time.monotonic_ns()
    if isinstance(payload, bytes):
        await transcribe(ep, payload)
        return (time.monotonic_ns() - t0) / 1e6
    async for got, _x in synthesize_stream(ep, payload):
        return (got - t0) / 1e6
    raise EndpointError(f"{ep.host} sent no audio")


async def _level(ep: SpeechEndpoint, payload: bytes | str, length: float, conc: int, requests: int) -> Level:
    async def safe() -> float | str:
        try:
            return await _one(ep, payload)
        except EndpointError as exc:
            return str(exc)

    await asyncio.gather(*(safe() for _ in range(conc)))  # warm-up: connections, caches (not counted)
    left = requests
    got: list[float | str] = []

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            got.append(await safe())

    await asyncio.gather(*(client() for _ in range(min(conc, requests))))
    ok = [g for g in got if isinstance(g, float)]
    errs = [g for g in got if isinstance(g, str)]
    a = np.asarray(ok or [0.0])
    return Level(
        concurrency=conc, length=length, requests=len(ok), failed=len(errs), mean_ms=float(a.mean()),
        median_ms=float(np.median(a)), p90_ms=float(np.percentile(a, 90)), p99_ms=float(np.percentile(a, 99)),
        error=errs[0] if errs else None,
    )  # fmt: skip


async def measure(
    ep: SpeechEndpoint, lengths: tuple[float, ...], concurrency: tuple[int, ...], requests: int
) -> list[Level]:
    """Every (length, concurrency) level on the endpoint (see the module docstring)."""
    out = []
    for length in lengths:
        payload: bytes | str = await audio_of(length) if ep.kind == "asr" else words(round(length))
        for c in concurrency:
            out.append(await _level(ep, payload, length, c, requests))
    return out


@dataclass(frozen=True)
class Fit:
    intercept_ms: float
    slope_ms: float  # per second of audio (asr) or per word (tts)
    r2: float

    def at(self, length: float) -> float:
        return max(0.0, self.intercept_ms + self.slope_ms * length)


def fit(levels: list[Level]) -> Fit:
    """ms = intercept + slope x length through the lowest concurrency's medians (r2 1 for one length)."""
    c = min(lv.concurrency for lv in levels)
    pts = [(lv.length, lv.median_ms) for lv in levels if lv.concurrency == c and lv.requests]
    if not pts:
        raise EndpointError(f"every request at {c} client(s) failed: {levels[0].error}")
    x, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    if len(set(x.tolist())) < 2:
        return Fit(float(y.mean()), 0.0, 1.0)
    slope, icpt = np.polyfit(x, y, 1)
    resid = y - (icpt + slope * x)
    tot = float(((y - y.mean()) ** 2).sum())
    return Fit(float(icpt), float(slope), 1.0 - float((resid**2).sum()) / tot if tot else 1.0)


def profile(
    ep: SpeechEndpoint, levels: list[Level], reference: float, settings: dict[str, Any]
) -> dict[str, Any]:
    """The profile mapping (:mod:`voicepipe.backends.speech_profile`): the fit at ``reference``, with the
    p90/median ratio of the one-client level nearest to it."""
    f = fit(levels)
    c = min(lv.concurrency for lv in levels)
    near = min((lv for lv in levels if lv.concurrency == c and lv.requests), key=lambda lv: abs(lv.length - reference))
    ratio = near.p90_ms / near.median_ms if near.median_ms else 1.0
    median = f.at(reference)
    return {
        "kind": ep.kind,
        SETTING[ep.kind]: {"median": round(median, 3), "p90": round(median * max(1.0, ratio), 3)},
        "fit": {
            **{k: round(v, 4) for k, v in asdict(f).items()}, "reference": reference,
            "unit": "seconds of audio" if ep.kind == "asr" else "words",
            "over": f"medians at {c} client(s); p90 = median x the measured p90/median at {near.length:g}",
        },
        "points": [asdict(lv) for lv in levels],
        "source": {
            "tool": f"voicepipe calibrate --stage {ep.kind}", "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": ep.host, "model": ep.model, "client": platform.node(), "settings": settings,
            "measured": "client side, this process's monotonic clock: request sent -> "
            + ("final transcript" if ep.kind == "asr" else "first audio chunk"),
        },
    }


@dataclass(frozen=True)
class Versus:
    concurrency: int
    length: float
    measured_median_ms: float
    measured_p90_ms: float
    modelled_median_ms: float
    modelled_p90_ms: float


def versus(levels: list[Level], kind: Literal["asr", "tts"], modelled: tuple[float, float]) -> list[Versus]:
    """Each measured level beside the modelled stage's figure (length- and load-independent: one lognormal)."""
    return [
        Versus(lv.concurrency, lv.length, lv.median_ms, lv.p90_ms, modelled[0], modelled[1])
        for lv in levels
        if lv.requests
    ]
