"""Modelled answer quality: a model's public benchmark accuracy in [0, 1] (see ``data/models.yaml``).

``quality_of(model)`` is the catalog's base score (mostly MMLU). ``at_complexity(q, complexity)`` makes it
depend on the turn's scripted difficulty: ``q * low/medium`` for ``low``, ``q * high/medium`` for ``high``,
``q`` for ``medium`` or no hint, capped at 1. The ratios come from one published table (the catalog's
``difficulty`` list: Llama 3.1 Instruct's ARC-Challenge, MMLU and MMLU-Pro by size); a model uses the
reference whose MMLU is nearest its own base score, so stronger models lose less on hard turns.
MODELLED, not measured: benchmark ratios stand in for how a turn's difficulty changes a model's answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from voicepipe.hardware.catalog import _read, models, quality_only


@dataclass(frozen=True)
class DifficultyRef:
    """One model's published scores (in %) on an easy, the base and a hard benchmark, with the source."""

    name: str
    low: float
    medium: float
    high: float
    source: str


def quality_of(model_name: str | None) -> float | None:
    """Accuracy in [0, 1] for a catalog model (``llama-3.1-8b``, ``DEVICE/MODEL``, ``claude-3.5-sonnet``).

    ``None`` when the name is unknown or the model has no published score.
    """
    if not model_name:
        return None
    name = model_name.split("/", 1)[-1].strip().lower()
    spec = models().get(name)
    if spec is not None:
        return None if spec.quality is None else spec.quality.score / 100.0
    other = quality_only().get(name)
    return None if other is None else other.quality.score / 100.0


@cache
def difficulty_references() -> tuple[DifficultyRef, ...]:
    refs = tuple(DifficultyRef(**r) for r in _read("models.yaml")["difficulty"])
    for r in refs:
        if not r.source or not 0 < r.high < r.medium < r.low <= 100:
            raise ValueError(f"models.yaml difficulty {r.name}: need 0 < high < medium < low <= 100 and a source")
    return refs


def reference_for(q: float) -> DifficultyRef:
    """The published reference whose base score is nearest ``q`` (in [0, 1])."""
    return min(difficulty_references(), key=lambda r: abs(r.medium / 100.0 - q))


def at_complexity(q: float | None, complexity: str | None) -> float | None:
    """Base accuracy ``q`` at a turn's complexity (``low``/``medium``/``high``; None = medium)."""
    if q is None or complexity in (None, "medium"):
        return q
    ref = reference_for(q)
    if complexity == "low":
        return min(1.0, q * ref.low / ref.medium)
    if complexity == "high":
        return q * ref.high / ref.medium
    raise ValueError(f"unknown complexity {complexity!r}")
