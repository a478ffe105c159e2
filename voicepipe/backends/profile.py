"""User profile files: an empirical service profile in a YAML file (or an inline mapping).

Same shape as a ``backends/empirical.yaml`` entry — ``ttft_ms: {median, p90}``, ``tokens_per_s``,
prices and ``*_source`` strings — plus what ``voicepipe calibrate`` and ``voicepipe profile import``
measure: ``source`` (date, URL host, settings) and ``points``, one row per (concurrency, prompt
length) with the vLLM-style statistics of that load level.

Model and contract: a profile backend is an :class:`~voicepipe.backends.empirical.EmpiricalBackend` for
one request on an otherwise idle endpoint. Its TTFT median/p90 and tok/s are the concurrency-1 rows;
with several prompt lengths measured at concurrency 1, the TTFT median and p90 are interpolated
linearly in the request's prompt length (clamped to the measured range). Higher-concurrency rows are
kept for reading (`--against`, reports), not used to model contention.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from voicepipe.backends.base import LLMRequest, Prices, Timing
from voicepipe.backends.empirical import EmpiricalBackend
from voicepipe.errors import UserError, from_validation
from voicepipe.files import read_yaml_mapping


class Stat(BaseModel):
    """One metric over a load level's requests (ms, or tok/s for throughputs)."""

    model_config = ConfigDict(extra="forbid")
    mean: float = Field(ge=0)
    median: float = Field(ge=0)
    p90: float = Field(ge=0)
    p99: float = Field(ge=0)


class Point(BaseModel):
    """Statistics of one load level: ``concurrency`` requests in flight, prompts of ``prompt_tokens``."""

    model_config = ConfigDict(extra="forbid")
    concurrency: int = Field(ge=1)
    prompt_tokens: float = Field(ge=0)  # mean prompt tokens the server counted (usage)
    output_tokens: float = Field(ge=0)  # mean completion tokens per request
    # token counts from the server's usage field; False: it sent none (llama-cpp-python 0.3), so
    # prompt_tokens is the length asked for and output_tokens the streamed pieces counted
    usage_reported: bool = True
    requests: int = Field(ge=1)
    failed: int = Field(0, ge=0)
    duration_s: float = Field(gt=0)
    ttft_ms: Stat
    tpot_ms: Stat
    itl_ms: Stat
    e2el_ms: Stat
    output_throughput: float = Field(ge=0)  # tok/s over the level, all requests together
    request_throughput: float = Field(ge=0)  # requests/s


class TTFT(BaseModel):
    model_config = ConfigDict(extra="forbid")
    median: float = Field(gt=0)
    p90: float = Field(gt=0)

    @model_validator(mode="after")
    def _order(self) -> TTFT:
        if self.p90 < self.median:
            raise ValueError("p90 must be >= median")
        return self


class Anchor(BaseModel):
    """What a measured profile ran on, for anchored predictions (``voicepipe calibrate --anchor``): the
    configuration as the hardware model names it and the measured figures of one load level (client-side
    means over its counted requests). Anchored predictions re-run the model on this configuration each
    time they are made, so the ratio always uses the model of the running version."""

    model_config = ConfigDict(extra="forbid")
    hardware: str  # catalog device (or a device YAML file)
    model: str  # catalog model
    precision: str
    kv_precision: str
    stack: str
    chips: int = Field(ge=1)
    concurrency: int = Field(ge=1)  # clients in flight at the anchored level
    prompt_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=2)
    ttft_ms: float = Field(gt=0)  # measured mean TTFT at that level
    tpot_ms: float = Field(gt=0)  # measured mean time per output token after the first
    measured: str  # how: tool, endpoint host, model served, date


class ProfileFile(BaseModel):
    """A profile as written to / read from YAML."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    description: str = ""
    ttft_ms: TTFT
    ttft_source: str = "not given"
    tokens_per_s: float = Field(gt=0)
    tokens_per_s_source: str = "not given"
    price_in_per_mtok: float = Field(0.0, ge=0)
    price_out_per_mtok: float = Field(0.0, ge=0)
    price_source: str = "not given (prices 0)"
    quality_model: str | None = None
    source: dict[str, Any] = Field(default_factory=dict)  # date, host, tool, settings
    points: list[Point] = Field(default_factory=list)
    anchor: Anchor | None = None  # set by `calibrate --anchor`: the measured configuration


class ProfileBackend(EmpiricalBackend):
    """An empirical backend from a user's profile; TTFT follows the prompt length when measured."""

    def __init__(self, prof: ProfileFile, name: str, quality: float | None) -> None:
        super().__init__(
            name=name,
            ttft_median_s=prof.ttft_ms.median / 1e3,
            ttft_p90_s=prof.ttft_ms.p90 / 1e3,
            tokens_per_s=prof.tokens_per_s,
            prices=Prices(prof.price_in_per_mtok, prof.price_out_per_mtok, prof.price_source),
            quality=quality,
            sources={"ttft_source": prof.ttft_source, "tokens_per_s_source": prof.tokens_per_s_source},
            kind="profile",
            description=prof.description,
        )
        solo = sorted((p for p in prof.points if p.concurrency == 1), key=lambda p: p.prompt_tokens)
        self._by_prompt = solo if len({p.prompt_tokens for p in solo}) > 1 else []
        self.profile = prof

    def predict(self, req: LLMRequest, rng: np.random.Generator) -> Timing:
        t = super().predict(req, rng)
        if not self._by_prompt:
            return t
        xs = [p.prompt_tokens for p in self._by_prompt]
        median = float(np.interp(req.prompt_tokens, xs, [p.ttft_ms.median for p in self._by_prompt]))
        # keep the drawn quantile: scale the draw by the interpolated median
        return Timing(ttft_s=t.ttft_s * median / (self.ttft_median_s * 1e3), tpot_s=t.tpot_s)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "source": self.profile.source, "points": len(self.profile.points)}


def parse_profile(data: dict[str, Any], where: str) -> ProfileFile:
    try:
        return ProfileFile.model_validate(data)
    except ValidationError as exc:
        raise from_validation(where, exc, model=ProfileFile) from None


def looks_like_profile(spec: object) -> bool:
    """A path to a YAML file (``./my.yaml``), or an inline mapping with ``ttft_ms``."""
    if isinstance(spec, dict):
        return "ttft_ms" in spec
    return isinstance(spec, str) and spec.endswith((".yaml", ".yml"))


def load_profile(spec: str | dict[str, Any], quality_of=lambda model: None) -> ProfileBackend:
    """Build a profile backend from a file path or an inline mapping (UserError names file and field)."""
    if isinstance(spec, dict):
        prof = parse_profile(spec, "inline profile")
        return ProfileBackend(prof, prof.name or "profile", quality_of(prof.quality_model))
    path = Path(spec)
    if not path.exists():
        raise UserError(spec, "no such profile file")
    prof = parse_profile(read_yaml_mapping(path), spec)  # the file guard refuses FIFOs, devices, big files
    return ProfileBackend(prof, prof.name or path.stem, quality_of(prof.quality_model))


def profile_from_points(
    points: list[Point],
    source: dict[str, Any],
    how: str,
    name: str | None = None,
    prices: tuple[float, float, str] = (0.0, 0.0, "not given (prices 0)"),
) -> ProfileFile:
    """The profile a measurement implies: idle figures from its lowest-concurrency, shortest-prompt row.

    ``how`` says how the numbers were measured (it goes into each ``*_source``)."""
    if not points:
        raise ValueError("no measured points")
    base = min(points, key=lambda p: (p.concurrency, p.prompt_tokens))
    tps = 1e3 / base.tpot_ms.median if base.tpot_ms.median > 0 else base.output_throughput
    at = f"concurrency {base.concurrency}, {base.prompt_tokens:.0f} prompt tokens, {base.requests} requests"
    return ProfileFile(
        name=name,
        description=f"measured: {how}",
        ttft_ms=TTFT(median=base.ttft_ms.median, p90=max(base.ttft_ms.p90, base.ttft_ms.median)),
        ttft_source=f"{how}; TTFT median/p90 at {at}",
        tokens_per_s=tps,
        tokens_per_s_source=f"{how}; 1000 / median TPOT at {at}",
        price_in_per_mtok=prices[0],
        price_out_per_mtok=prices[1],
        price_source=prices[2],
        source=source,
        points=points,
    )


def dump_profile(prof: ProfileFile) -> str:
    import yaml

    header = (
        "# voicepipe empirical profile (measured). Use it as agent.backend: ./this-file.yaml\n"
        "# ttft_ms / tokens_per_s: one request on an idle endpoint; points: every load level measured.\n"
    )
    return header + yaml.safe_dump(prof.model_dump(mode="json", exclude_none=True), sort_keys=False)
