"""Backend registry: resolve a config's backend spec to a :class:`Backend`.

A spec is an empirical profile name (``sonnet-gpu``), a hardware shorthand ``DEVICE/MODEL``
(``cerebras-wse3/llama-3.1-8b``), or a mapping ``{hardware: ..., model: ..., precision, tp, max_batch,
speculative, fast}``. Hardware backends share one simulated device per distinct configuration within a
:class:`BackendPool`, so every session and agent pointing at it batches together.
"""

from __future__ import annotations

from typing import Any

from voicepipe.backends.base import Backend
from voicepipe.backends.empirical import make_empirical, profiles


class UnknownBackend(ValueError):
    pass


def empirical_names() -> list[str]:
    return sorted(profiles())


def _quality_of(model: str | None) -> float | None:
    if not model:
        return None
    try:
        from voicepipe.hardware.quality import quality_of
    except ImportError:  # hardware catalog not present
        return None
    return quality_of(model)


class BackendPool:
    """Builds backends for one run; hardware backends with equal specs share one device instance."""

    def __init__(self) -> None:
        self._cache: dict[str, Backend] = {}

    def get(self, spec: str | dict[str, Any]) -> Backend:
        key = spec if isinstance(spec, str) else repr(sorted(spec.items()))
        if key not in self._cache:
            self._cache[key] = build_backend(spec)
        return self._cache[key]


def validate_spec(spec: str | dict[str, Any]) -> None:
    """Raise UnknownBackend with a one-line reason if ``spec`` names nothing we can build."""
    build_backend(spec)


def build_backend(spec: str | dict[str, Any]) -> Backend:
    if isinstance(spec, str) and spec in profiles():
        return make_empirical(spec, _quality_of)
    if isinstance(spec, dict) or "/" in str(spec):
        try:
            from voicepipe.hardware.backend import make_hardware_backend
        except ImportError as exc:  # pragma: no cover - hardware package always ships
            raise UnknownBackend(f"hardware backends unavailable: {exc}") from None
        try:
            return make_hardware_backend(spec)
        except (KeyError, ValueError) as exc:
            raise UnknownBackend(str(exc).strip("'\"")) from None
    raise UnknownBackend(
        f"unknown backend {spec!r}; empirical: {', '.join(empirical_names())}; "
        "or DEVICE/MODEL (see `voicepipe hardware list`)"
    )
