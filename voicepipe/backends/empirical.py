"""Empirical backends: a measured service profile (TTFT distribution + tok/s), no physics."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np
import yaml

from voicepipe.backends.base import LLMRequest, Prices, ScheduledStream, Timing

Z90 = 1.2815515655446004  # standard normal 90th percentile


@dataclass
class EmpiricalBackend:
    name: str
    ttft_median_s: float
    ttft_p90_s: float
    tokens_per_s: float
    prices: Prices
    quality: float | None
    sources: dict[str, str]
    kind: str = "empirical"
    description: str = ""

    def predict(self, req: LLMRequest, rng: np.random.Generator) -> Timing:
        sigma = math.log(self.ttft_p90_s / self.ttft_median_s) / Z90
        ttft = self.ttft_median_s * math.exp(sigma * float(rng.standard_normal()))
        return Timing(ttft_s=ttft, tpot_s=1.0 / self.tokens_per_s)

    def start(self, req: LLMRequest, t0_ns: int, rng: np.random.Generator) -> ScheduledStream:
        return ScheduledStream(self.predict(req, rng), t0_ns)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kind": self.kind,
            "description": self.description,
            "ttft_ms_median": self.ttft_median_s * 1e3,
            "ttft_ms_p90": self.ttft_p90_s * 1e3,
            "tokens_per_s": self.tokens_per_s,
            "price_in_per_mtok": self.prices.input_per_mtok,
            "price_out_per_mtok": self.prices.output_per_mtok,
            "quality": self.quality,
            "sources": self.sources,
        }


@cache
def profiles() -> dict[str, dict]:
    text = resources.files("voicepipe.backends").joinpath("empirical.yaml").read_text()
    return yaml.safe_load(text)


def make_empirical(name: str, quality_of=lambda model: None) -> EmpiricalBackend:
    p = profiles()[name]
    return EmpiricalBackend(
        name=name,
        ttft_median_s=p["ttft_ms"]["median"] / 1e3,
        ttft_p90_s=p["ttft_ms"]["p90"] / 1e3,
        tokens_per_s=float(p["tokens_per_s"]),
        prices=Prices(p["price_in_per_mtok"], p["price_out_per_mtok"], p["price_source"]),
        quality=quality_of(p.get("quality_model")),
        sources={k: v for k, v in p.items() if k.endswith("_source")},
        description=p.get("description", ""),
    )
