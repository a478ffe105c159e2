"""Virtual time needs a model of every LLM: a real endpoint on a virtual clock is replaced by its profile.

A virtual-time run (``predict``, ``capacity``, ``compare --predict``: :func:`voicepipe.runner.simulate_async`)
cannot send requests to a real OpenAI-compatible server: the clock is not the server's, and no request
should leave the machine for a prediction. So :func:`on_virtual_time` is the one check every such run
passes through. It walks every backend spec of a configuration (``agent.backend``, ``agent.extra.*``,
``council.members.*``, ``council.judge``; router routes name these agents, so they are covered) and:

* an endpoint whose spec names a calibrated profile (``{endpoint: URL, model: M, profile: my.yaml}``, the
  file ``voicepipe calibrate`` writes, or an inline profile mapping) becomes that profile, inlined, under
  the endpoint's own name (so a prediction's ``backend`` column matches a live run's) and with the
  endpoint's ``prices`` when it gives them (the live run's cost);
* an endpoint without one (``openai:URL#model``, or a mapping without ``profile:``) is a
  :class:`~voicepipe.errors.UserError` naming the field, with the line that calibrates it.

Every other spec (empirical names, hardware, profile files) is kept as it is. The result is a new
configuration; the input is not changed. A configuration with no endpoint comes back unchanged (the same
object), so calling this twice costs nothing.

The live counterpart is :func:`require_keys`: a live run (``run``, ``compare``, ``stage``) sends requests,
so every endpoint (LLM or speech) whose spec names an ``api_key_env`` needs that variable set, checked
before anything starts (a UserError naming the field). Virtual time sends none, so a calibrated endpoint
predicts without its key.
"""

from __future__ import annotations

import os
from typing import Any

from voicepipe.backends import build_backend, is_endpoint_spec
from voicepipe.backends.openai import EndpointBackend
from voicepipe.backends.profile import ProfileBackend
from voicepipe.backends.speech import speech_endpoint
from voicepipe.config import PipelineConfig
from voicepipe.errors import UserError

Spec = str | dict[str, Any]


def calibrate_hint(url: str, model: str) -> str:
    """How to give an endpoint a profile, as one clause."""
    return (
        f"`voicepipe calibrate {url} --model {model} --out my.yaml`, then use `agent.backend: my.yaml` "
        "(or add `profile: my.yaml` to the endpoint's mapping)"
    )


def profile_spec(spec: Spec, field: str, source: str = "") -> Spec:
    """``spec`` itself, or for an endpoint its calibrated profile as an inline mapping (see the module)."""
    if not is_endpoint_spec(spec):
        return spec
    where = ": ".join(p for p in (source, field) if p)
    try:
        backend = build_backend(spec)
    except ValueError as exc:  # config loading checked it already; a library caller may not have
        raise UserError(where, str(exc)) from None
    assert isinstance(backend, EndpointBackend)
    prof = backend.profile
    if not isinstance(prof, ProfileBackend):
        raise UserError(
            where,
            f"{backend.name} is a live server; virtual time (predict, capacity, compare --predict) runs an "
            f"endpoint as its calibrated profile, and it names none: {calibrate_hint(backend.cfg.url, backend.cfg.model)}",
        )
    inline: dict[str, Any] = prof.profile.model_dump(mode="json", exclude_none=True)
    inline["name"] = backend.name
    inline["description"] = (
        f"calibrated profile of {backend.name} (modelled on virtual time)"
        + (f": {prof.profile.description}" if prof.profile.description else "")
    )
    if isinstance(spec, dict) and spec.get("prices") is not None:  # the endpoint's own prices win, as live
        p = backend.prices
        inline |= {"price_in_per_mtok": p.input_per_mtok, "price_out_per_mtok": p.output_per_mtok,
                   "price_source": p.source}  # fmt: skip
    return inline


def on_virtual_time(cfg: PipelineConfig, source: str = "") -> PipelineConfig:
    """``cfg`` with every endpoint replaced by its calibrated profile; UserError for one without a profile.
    ``source`` (a file or a configuration's label) starts the error's line."""
    agent, council = cfg.agent, cfg.council
    specs: list[Spec] = [agent.backend, *agent.extra.values(), *council.members]
    if council.judge is not None:
        specs.append(council.judge)
    if not any(is_endpoint_spec(s) for s in specs):
        return cfg
    new_agent = agent.model_copy(
        update={
            "backend": profile_spec(agent.backend, "agent.backend", source),
            "extra": {k: profile_spec(v, f"agent.extra.{k}", source) for k, v in agent.extra.items()},
        }
    )
    new_council = council.model_copy(
        update={
            "members": [profile_spec(m, f"council.members.{i}", source) for i, m in enumerate(council.members)],
            "judge": None if council.judge is None else profile_spec(council.judge, "council.judge", source),
        }
    )
    return cfg.model_copy(update={"agent": new_agent, "council": new_council})


LOCAL_SPEECH = ("model", "pocketsphinx", "espeak-ng")


def require_keys(cfg: PipelineConfig, source: str = "") -> None:
    """UserError naming the field of the first endpoint whose ``api_key_env`` variable is not set."""
    specs: list[tuple[str, Spec]] = [("agent.backend", cfg.agent.backend)]
    specs += [(f"agent.extra.{k}", v) for k, v in cfg.agent.extra.items()]
    specs += [(f"council.members.{i}", m) for i, m in enumerate(cfg.council.members)]
    specs += [] if cfg.council.judge is None else [("council.judge", cfg.council.judge)]
    for field, spec in specs:
        if is_endpoint_spec(spec):
            backend = build_backend(spec)
            assert isinstance(backend, EndpointBackend)
            _need(backend.cfg.api_key_env, field, source)
    if cfg.asr.engine not in LOCAL_SPEECH:
        _need(speech_endpoint("asr", cfg.asr.engine).api_key_env, "asr.engine", source)
    if cfg.tts.engine not in LOCAL_SPEECH:
        _need(speech_endpoint("tts", cfg.tts.engine).api_key_env, "tts.engine", source)


def _need(var: str | None, field: str, source: str) -> None:
    if var is not None and var not in os.environ:
        where = ": ".join(p for p in (source, field) if p)
        raise UserError(where, f"api_key_env: environment variable {var!r} is not set (a live run sends it)")
