"""The hardware agent's 80 % interval, carried into a turn's voice-to-voice latency and its verdict.

``predict`` and ``capacity`` model each turn's latency as one number. Where the LLM that answered the turn
is a hardware backend, that backend's modelled TTFT and decode step carry an 80 % range from the shipped
held-out residuals (:func:`voicepipe.hardware.validate.ranges`, the rule ``hardware predict`` prints).
:func:`spreads` gives each hardware agent of a configuration its range as factors on the modelled times,
and :func:`turn_range` carries them into a turn: the agent's ``ttft`` part is scaled by the TTFT range's
factors, its ``decode`` and ``queue`` parts by the step range's, every other part is kept, and the turn's
range is the hull of those sums and the point (``[fast end, slow end]``). It is first order: a slower device
would also queue longer under load; the queue part is scaled, not re-simulated.

:func:`voicepipe.records.verdict` then reads the turn: a *pass* only when the slow end is inside the
budget; *uncertain* when the fast end is inside and the slow end over (within budget only at the range's
fast end); a *miss* otherwise. An uncertain turn is not a pass (``within_budget`` is False for it).
Which batch regime's residuals speak for the agent: ``concurrency`` (sessions sharing the device, capped
at its max batch) — 1 is a request alone on the device (``predict`` with one session). An anchored agent
(``anchor:``, :mod:`voicepipe.backends.anchor`) is a measurement times the model's ratio, so its ranges are
those ``hardware predict --anchor`` prints: the cross-device ratio residuals
(:func:`voicepipe.hardware.validate.ratios.anchored_intervals`), not the model's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from voicepipe.backends import build_backend
from voicepipe.backends.hardware import HardwareBackend
from voicepipe.config import PipelineConfig
from voicepipe.hardware.validate import LEVEL, device_maker, points, ranges, shipped_accuracy
from voicepipe.hardware.validate.ratios import RatioResidual, anchored_intervals, residual_pairs
from voicepipe.records import BreakdownPart

RANGED_STAGE = "agent"  # the parts the agent stage adds to a turn's chain
TTFT_PARTS = ("ttft",)
STEP_PARTS = ("decode", "queue")


@dataclass(frozen=True)
class Spread:
    """One hardware agent's 80 % ranges as factors on its modelled times (low ≤ high; 1 = the model)."""

    backend: str
    ttft: tuple[float, float]
    step: tuple[float, float]
    thin: tuple[str, ...] = ()  # the slices that widened them (see voicepipe.hardware.validate.ranges)
    level: float = LEVEL


def spread_of(backend: HardwareBackend, concurrency: int = 1) -> Spread:
    """``backend``'s ranges at ``concurrency`` sequences on its device (capped at its max batch); an
    anchored backend's from the cross-device ratio residuals (the model's own where too few pairs)."""
    sys_ = backend.system
    dev = sys_.device
    batch = max(1, min(concurrency, backend.deployment.max_batch))
    stack = None if dev.kind == "sram" else sys_.serving.key  # an SRAM machine runs its vendor's software
    rng = ranges(shipped_accuracy(), {"ttft_ms": 1.0, "step_ms": 1.0}, dev.key, dev.kind, stack, sys_.model,
                 batch, sys_.precision, maker=device_maker(dev))  # fmt: skip
    if backend.anchor is not None:
        got, _ = anchored_intervals({"ttft_ms": 1.0, "step_ms": 1.0}, _ratio_residuals())
        ttft, step = got.get("ttft_ms", rng.intervals["ttft_ms"]), got.get("step_ms", rng.intervals["step_ms"])
        return Spread(backend.name, ttft, step, (), LEVEL)
    return Spread(backend.name, rng.intervals["ttft_ms"], rng.intervals["step_ms"], rng.thin, rng.level)


@cache
def _ratio_residuals() -> tuple[RatioResidual, ...]:
    """The shipped cross-device ratio residuals an anchored range is built from (read once)."""
    return tuple(residual_pairs(points(), shipped_accuracy().residuals))


def spreads(cfg: PipelineConfig, concurrency: int = 1) -> dict[str, Spread]:
    """Each hardware agent of ``cfg`` (``agent.backend`` and ``agent.extra``) by its backend name, the name
    a turn record's ``backend`` carries. Other backends (profiles, empirical, endpoints) have no range."""
    out: dict[str, Spread] = {}
    for spec in cfg.agent.backends().values():
        try:
            backend = build_backend(spec)
        except ValueError:  # not buildable here (the run itself reports it)
            continue
        if isinstance(backend, HardwareBackend) and backend.name not in out:
            out[backend.name] = spread_of(backend, concurrency)
    return out


def turn_range(
    latency_ms: float, breakdown: Sequence[BreakdownPart], spread: Spread | None
) -> tuple[float, float] | None:
    """The turn's latency range from its agent's ``spread`` (None without one: no range to carry)."""
    if spread is None:
        return None
    lo = hi = latency_ms
    for part in breakdown:
        if part.stage != RANGED_STAGE:
            continue
        f = spread.ttft if part.what in TTFT_PARTS else spread.step if part.what in STEP_PARTS else None
        if f is not None:
            lo += part.ms * (f[0] - 1.0)
            hi += part.ms * (f[1] - 1.0)
    return min(lo, latency_ms), max(hi, latency_ms)
