"""Backend registry: resolve a config's backend spec to a :class:`Backend`.

A spec is an empirical profile name (``sonnet-gpu``), a hardware shorthand ``DEVICE/MODEL``
(``cerebras-wse3/llama-3.1-8b``), a mapping ``{hardware: ..., model: ..., precision, tp, max_batch,
speculative, fast}``, a user profile (a path ``./my.yaml`` or an inline mapping with ``ttft_ms``, see
:mod:`~voicepipe.backends.profile`), or a real OpenAI-compatible endpoint (``openai:URL#model`` or a
mapping with ``endpoint:``, see :mod:`~voicepipe.backends.openai`). Hardware backends share one simulated device per distinct configuration within a
:class:`BackendPool`, so every session and agent pointing at it batches together.
"""

from __future__ import annotations

from typing import Any

from voicepipe.backends.base import Backend
from voicepipe.backends.empirical import make_empirical, profiles
from voicepipe.backends.hardware import make_hardware_backend
from voicepipe.backends.openai import EndpointBackend, config_from_spec, parse_shorthand
from voicepipe.backends.profile import load_profile, looks_like_profile
from voicepipe.errors import UserError, did_you_mean
from voicepipe.hardware.quality import quality_of


class UnknownBackend(ValueError):
    pass


def empirical_names() -> list[str]:
    return sorted(profiles())


def _quality_of(model: str | None) -> float | None:
    if not model:
        return None
    return quality_of(model)


def resolve_named(data: Any) -> Any:
    """Replace backend names from a pipeline config's ``backends:`` section by their specs (agent.backend,
    agent.extra, council.members, council.judge); an endpoint or inline profile keeps its name as label."""
    if not isinstance(data, dict) or not isinstance(data.get("backends"), dict) or not data["backends"]:
        return data
    named: dict[str, Any] = data["backends"]

    def sub(spec: Any) -> Any:
        if not isinstance(spec, str) or spec not in named:
            return spec
        v = named[spec]
        if isinstance(v, dict) and ("endpoint" in v or "ttft_ms" in v) and "name" not in v:
            return {"name": spec, **v}
        return v

    out = dict(data)
    if isinstance(agent := out.get("agent"), dict):
        agent = out["agent"] = dict(agent)
        if "backend" in agent:
            agent["backend"] = sub(agent["backend"])
        if isinstance(agent.get("extra"), dict):
            agent["extra"] = {k: sub(v) for k, v in agent["extra"].items()}
    if isinstance(council := out.get("council"), dict):
        council = out["council"] = dict(council)
        if isinstance(council.get("members"), list):
            council["members"] = [sub(m) for m in council["members"]]
        if "judge" in council:
            council["judge"] = sub(council["judge"])
    return out


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


def is_endpoint_spec(spec: object) -> bool:
    """Does ``spec`` name a real OpenAI-compatible endpoint (``openai:URL#model`` or ``{endpoint: ...}``)?"""
    return (isinstance(spec, str) and spec.startswith("openai:")) or (isinstance(spec, dict) and "endpoint" in spec)


def _endpoint(spec: str | dict[str, Any]) -> Backend:
    try:
        mapping = parse_shorthand(spec) if isinstance(spec, str) else spec
        cfg = config_from_spec(mapping)
    except ValueError as exc:
        raise UnknownBackend(str(exc)) from None
    profile = None
    if mapping.get("profile") is not None:
        try:
            profile = _profile(mapping["profile"])
        except UnknownBackend as exc:
            raise UnknownBackend(f"profile: {exc}") from None
    return EndpointBackend(cfg, profile)


def _profile(spec: str | dict[str, Any]) -> Backend:
    try:
        return load_profile(spec, _quality_of)
    except UserError as exc:
        raise UnknownBackend(str(exc)) from None


def build_backend(spec: str | dict[str, Any]) -> Backend:
    if isinstance(spec, str) and spec in profiles():
        return make_empirical(spec, _quality_of)
    if is_endpoint_spec(spec):
        return _endpoint(spec)
    if looks_like_profile(spec):
        return _profile(spec)
    if isinstance(spec, dict) or "/" in str(spec):
        try:
            return make_hardware_backend(spec)
        except (KeyError, ValueError) as exc:
            raise UnknownBackend(str(exc).strip("'\"")) from None
    raise UnknownBackend(
        f"unknown backend {spec!r}{did_you_mean(str(spec), empirical_names())}; empirical: {', '.join(empirical_names())}; "
        "DEVICE/MODEL (see `voicepipe hardware list`); a profile file ./NAME.yaml; or openai:URL#model"
    )
