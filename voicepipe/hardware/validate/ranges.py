"""80 % ranges for the numbers `hardware predict` and `sweep` model, from the shipped held-out residuals.

Pure: :func:`ranges` reads an :class:`~voicepipe.hardware.validate.evidence.Accuracy` (the shipped one is
``data/validation-accuracy.json``: its ``residuals`` are each published point's log speed ratio predicted
with the point's publisher family held out, and ``by_device``/``by_stack`` count the points per device and
stack), so a prediction's range costs no validation run.

The rule, per metric (``ttft_ms`` reads the TTFT residuals; ``step_ms``, ``tokens_per_second`` and
``aggregate_tokens_per_second`` the decode ones):

0. **Its kind of machine.** Only residuals of devices of the configuration's memory kind (HBM devices, or
   SRAM machines: Cerebras, Groq) speak for it: the two physics miss in different ways.
1. **Its cell.** Among those, the residuals sharing the configuration's phase, batch regime (1 or batched),
   architecture (dense, MoE, MLA) and precision class (16-bit or quantised), coarsened (precision, then
   architecture, then batch dropped) while fewer than 15 share them; the conformal ranks
   ⌊(n+1)·0.1⌋ and ⌈(n+1)·0.9⌉ of those residuals give the band (:func:`slices.interval`).
2. **Far from evidence, wider.** The configuration's *thin* slices are those of its device, stack,
   architecture, batch regime and precision class with fewer than ``THIN`` (10) shipped points (a device
   or stack with no published point has 0; an SRAM machine runs its vendor's software, so it has no stack
   slice). With ``k`` thin slices the band becomes the union of the cell's band and the band of **all**
   residuals of its kind at level ``1 − 0.2 / 2^(k−1)`` (80 % for one thin slice, 90 % for two, 95 % for three, ...),
   so each missing kind of evidence widens the range.

The true speed is the modelled speed over exp(residual): a rate's range is ``value·exp(−high)`` to
``value·exp(−low)``, a time's ``value·exp(low)`` to ``value·exp(high)``. Every bound is modelled, not
measured; the level is what the held-out residuals cover, not a guarantee (docs/hardware-model.md §3
gives the coverage measured on held-out points).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from voicepipe.hardware import catalog
from voicepipe.hardware.validate.evidence import Accuracy
from voicepipe.hardware.validate.slices import (
    LEVEL,
    METRIC_PHASE,
    RATES,
    Residual,
    architecture,
    batch_regime,
    cell,
    config_slices,
    precision_class,
    speed_band,
)

THIN = 10  # a slice with fewer shipped points than this is far from evidence
METRICS = tuple(METRIC_PHASE)  # ttft_ms, step_ms, tokens_per_second, aggregate_tokens_per_second


@dataclass(frozen=True)
class Ranges:
    """The 80 % range of each modelled metric, and the slices that widened them (``"device x (0 points)"``)."""

    intervals: dict[str, tuple[float, float]]
    thin: tuple[str, ...]
    level: float = LEVEL


def thin_slices(acc: Accuracy, device: str, stack: str | None, model: catalog.ModelSpec, batch: int,
                precision: str) -> tuple[str, ...]:  # fmt: skip
    """The configuration's slices with fewer than THIN shipped points, as ``"kind name (n points)"``."""
    res = acc.residuals
    counts = [
        ("device", device, acc.by_device[device].points if device in acc.by_device else 0),
        *([("stack", stack, acc.by_stack[stack].points if stack in acc.by_stack else 0)] if stack else []),
        ("architecture", a := architecture(model), sum(r.architecture == a for r in res)),
        ("batch", b := batch_regime(batch), sum(r.batch == b for r in res)),
        ("precision", p := precision_class(precision), sum(r.precision == p for r in res)),
    ]
    return tuple(f"{kind} {name} ({n} points)" for kind, name, n in counts if n < THIN)


def _band(res: Sequence[Residual], want: dict[str, str], thin: int) -> tuple[float, float]:
    band = speed_band(cell(res, want))
    every = [r.log_speed for r in res]
    if band is None:  # too few residuals even for the coarsest cell: the widest seen
        band = (min(every), max(every))
    if thin:
        wide = speed_band(every, 1 - (1 - LEVEL) / 2 ** (thin - 1)) or (min(every), max(every))
        band = (min(band[0], wide[0]), max(band[1], wide[1]))
    return band


def ranges(acc: Accuracy, values: Mapping[str, float], device: str, device_kind: str, stack: str | None,
           model: catalog.ModelSpec, batch: int, precision: str) -> Ranges:  # fmt: skip
    """The 80 % range of each of ``values`` (keys among METRICS) for this configuration (module rule)."""
    res = [r for r in acc.residuals if r.device_kind == device_kind]
    if not res:
        raise ValueError(f"the accuracy file has no residuals of {device_kind} devices: no interval can be given")
    thin = thin_slices(acc, device, stack, model, batch, precision)
    out = {}
    for metric, value in values.items():
        lo, hi = _band(res, config_slices(model, batch, precision, metric), len(thin))
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
