"""Modelled answer quality: a model's public benchmark accuracy in [0, 1] (see ``data/models.yaml``)."""

from __future__ import annotations

from voicepipe.hardware.catalog import models, quality_only


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
