"""80 % ranges for the numbers `hardware predict` and `sweep` model, from the shipped held-out residuals.

Pure: :func:`ranges` reads an :class:`~voicepipe.hardware.validate.evidence.Accuracy` (the shipped one is
``data/validation-accuracy.json``: its ``residuals`` are each published point's log speed ratio predicted
with the point's publisher family held out, with the point's slices, device, device maker and stack), so a
prediction's range costs no validation run.

The rule is :func:`voicepipe.hardware.validate.slices.band` (the same function
:func:`~voicepipe.hardware.validate.slices.coverage` scores, held out by family), per metric (``ttft_ms``
reads the TTFT residuals; ``step_ms`` and ``tokens_per_second`` the decode ones;
``aggregate_tokens_per_second``, a loaded server's output over whole requests, the throughput ones):

0. **Its kind of machine.** Only residuals of devices of the configuration's memory kind (HBM devices, or
   SRAM machines: Cerebras, Groq) speak for it: the two physics miss in different ways.
1. **Its cell (Mondrian).** Among those, the residuals sharing the configuration's phase, device maker,
   architecture, batch regime, stack profile (its version era with it: vllm-v0 vs vllm) and precision
   class; while fewer than ``MIN_POINTS`` (19) share them, or they come from fewer than ``MIN_FAMILIES``
   (3) publisher families, the last key is dropped (precision, then stack, batch, architecture, maker).
   The band is the cell's family-weighted 10th and 90th percentiles
   (:func:`~voicepipe.hardware.validate.slices.family_band`: each publisher family one vote, its n
   residuals 1/n each — the family is what the hold-out leaves out and what a new publisher will be); the
   percentiles are of signed residuals (themselves held out), so a cell's bias is in the band.
2. **Far from evidence, wider.** The configuration's *thin* slices are those of its device, stack,
   architecture, batch regime and precision class with fewer than ``THIN`` (10) residuals (a device or
   stack with no published point has 0; an SRAM machine runs its vendor's software, so it has no stack
   slice). With ``k`` thin slices the band becomes the union of the cell's band and the family-weighted
   band, at level ``1 − 0.2 / 2^(k−1)`` (80 % for one thin slice, 90 % for two, ...), of the cell ``k``
   keys coarser (every residual of the kind once no key is left): each kind of evidence missing forgets
   one more thing the configuration shares with its evidence.

The true speed is the modelled speed over exp(residual): a rate's range is ``value·exp(−high)`` to
``value·exp(−low)``, a time's ``value·exp(low)`` to ``value·exp(high)``. Every bound is modelled, not
measured; the level is what the held-out residuals cover, not a guarantee (docs/hardware-model.md §3,
"Intervals", gives the coverage measured on held-out points).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from voicepipe.hardware import catalog
from voicepipe.hardware.validate.evidence import Accuracy
from voicepipe.hardware.validate.slices import (
    LEVEL,
    METRIC_PHASE,
    RATES,
    band,
    config_query,
    device_maker,
)

METRICS = tuple(METRIC_PHASE)  # ttft_ms, step_ms, tokens_per_second, aggregate_tokens_per_second


@dataclass(frozen=True)
class Ranges:
    """The 80 % range of each modelled metric, and the slices that widened them (``"device x (0 points)"``)."""

    intervals: dict[str, tuple[float, float]]
    thin: tuple[str, ...]
    level: float = LEVEL


def ranges(acc: Accuracy, values: Mapping[str, float], device: str, device_kind: str, stack: str | None,
           model: catalog.ModelSpec, batch: int, precision: str, maker: str | None = None) -> Ranges:  # fmt: skip
    """The 80 % range of each of ``values`` (keys among METRICS) for this configuration (module rule).
    ``maker``: the device's maker (:func:`slices.device_maker`; default: the catalog device's)."""
    if maker is None:
        try:
            maker = device_maker(catalog.device(device))
        except ValueError:  # not a catalog device: no maker cell matches it
            maker = ""
    out: dict[str, tuple[float, float]] = {}
    thin: tuple[str, ...] = ()
    for metric, value in values.items():
        q = config_query(model, batch, precision, metric, device, maker, stack, device_kind)
        (lo, hi), thin = band(acc.residuals, q)
        if metric in RATES:
            out[metric] = (value * math.exp(-hi), value * math.exp(-lo))
        else:
            out[metric] = (value * math.exp(lo), value * math.exp(hi))
    return Ranges(intervals=out, thin=thin)


def fmt_range(lo: float, hi: float) -> str:
    """``(180–470)``: a range at the precision a table shows it."""

    def num(x: float) -> str:
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"

    return f"({num(lo)}–{num(hi)})"
