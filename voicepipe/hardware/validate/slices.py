"""Held-out error by slice, and 80 % intervals from the held-out residuals of a configuration's slices.

Every answered point (held out by publisher family, :func:`voicepipe.hardware.validate.fit.run`) falls in
one slice of each kind: publisher family (vendor, framework, independent), architecture (dense, MoE, MLA),
batch (1 or batched), phase (TTFT, decode: per-token metrics, or throughput/end-to-end) and precision
(16-bit or quantised). :func:`slice_table` gives each slice's median absolute error, signed bias (median
signed error) and count. A :class:`Residual` is one point's held-out log speed ratio (modelled over
published speed; > 0 reads faster) with its slices; the shipped ones are in the accuracy file.

:func:`interval` is conformal-style: the residuals of the points sharing the configuration's
architecture, batch regime, phase and precision (dropping precision, then architecture, then batch while
fewer than ``MIN_POINTS`` share them), their ranks ⌊(n+1)·0.1⌋ and ⌈(n+1)·0.9⌉ (wider with fewer
points), applied to the modelled value. :func:`coverage` measures how often such intervals, built without
the point's own family, hold the published value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

from voicepipe.hardware import catalog
from voicepipe.hardware.validate.fit import Row
from voicepipe.hardware.validate.points import Point

LEVEL = 0.8
MIN_POINTS = 15  # a cell with fewer residuals widens to a coarser one
SPEED = ("tok_s_user", "tok_s_total")
DECODE = ("tpot_ms", "itl_ms", "itl_median_ms", "tok_s_user")
SIXTEEN_BIT = ("bf16", "fp16", "fp32")
KINDS = ("family", "architecture", "batch", "phase", "precision")
# the prediction's metrics and the phase whose residuals speak for them
METRIC_PHASE = {"ttft_ms": "ttft", "step_ms": "decode", "tokens_per_second": "decode",
                "aggregate_tokens_per_second": "decode"}  # fmt: skip
RATES = ("tokens_per_second", "aggregate_tokens_per_second")


def architecture(model: catalog.ModelSpec) -> str:
    if model.kv_dim is not None:
        return "mla"
    return "moe" if model.is_moe else "dense"


def phase(metric: str) -> str:
    return "ttft" if metric == "ttft_ms" else "decode" if metric in DECODE else "throughput/e2e"


def batch_regime(batch: int | None) -> str:
    return "batch 1" if batch == 1 else "batched"


def precision_class(precision: str) -> str:
    return "16-bit" if precision in SIXTEEN_BIT else "quantised"


class Residual(BaseModel):
    """One answered point's held-out log speed ratio, with the slices it belongs to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    family: str  # the hold-out unit (Point.family)
    publisher_family: str
    architecture: str
    batch: str
    phase: str
    precision: str
    device_kind: str = "hbm"  # the device's memory kind: hbm or sram (whose physics differ)
    log_speed: float  # log(modelled speed / published speed)

    def slice(self, kind: str) -> str:
        return str(getattr(self, kind))


def residual(row: Row) -> Residual | None:
    p: Point = row.point
    if row.predicted is None or p.sram_fit or p.is_speculative:
        return None
    ratio = row.predicted / p.value
    speed = ratio if p.metric in SPEED else 1.0 / ratio
    return Residual(
        id=p.id, family=p.family, publisher_family=p.publisher_family or "unknown",
        architecture=architecture(catalog.model(p.model)), batch=batch_regime(p.batch), phase=phase(p.metric),
        precision=precision_class(p.precision), device_kind=catalog.device(p.device).kind,
        log_speed=round(math.log(speed), 4),
    )  # fmt: skip


def residuals(rows: Iterable[Row]) -> list[Residual]:
    return [r for row in rows if (r := residual(row)) is not None]


class SliceRow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    slice: str
    points: int
    median_abs_error_pct: float
    bias_pct: float  # median signed error of the speed (> 0: the model reads faster than measured)


def slice_table(res: Sequence[Residual]) -> list[SliceRow]:
    """Median absolute error, signed bias and count per slice of every kind (errors of the speed)."""
    out = []
    for kind in ("publisher_family", *KINDS[1:]):
        for name in sorted({r.slice(kind) for r in res}):
            s = np.array([r.log_speed for r in res if r.slice(kind) == name])
            err = np.expm1(s)  # speed error: modelled / published − 1
            out.append(SliceRow(kind=kind, slice=name, points=len(s),
                                median_abs_error_pct=round(float(np.median(np.abs(err))) * 100, 1),
                                bias_pct=round(float(np.median(err)) * 100, 1)))  # fmt: skip
    return out


def cell(res: Sequence[Residual], want: dict[str, str], exclude_family: str | None = None) -> list[float]:
    """The residuals of the finest cell around ``want`` with at least MIN_POINTS (coarsening in order)."""
    pool = [r for r in res if r.family != exclude_family]
    keys = ["phase", "batch", "architecture", "precision"]
    while True:
        got = [r.log_speed for r in pool if all(r.slice(k) == want[k] for k in keys)]
        if len(got) >= MIN_POINTS or not keys:
            return got
        keys.pop()  # precision first, then architecture, then batch


def speed_band(values: Sequence[float], level: float = LEVEL) -> tuple[float, float] | None:
    """(low, high) conformal ranks of the log speed residuals; None when too few for the level."""
    s = np.sort(np.asarray(values, dtype=float))
    n = len(s)
    tail = (1 - level) / 2
    lo, hi = math.floor((n + 1) * tail), math.ceil((n + 1) * (1 - tail))
    if lo < 1 or hi > n:
        return None
    return float(s[lo - 1]), float(s[hi - 1])


def interval(value: float, rate: bool, want: dict[str, str], res: Sequence[Residual],
             exclude_family: str | None = None) -> tuple[float, float] | None:  # fmt: skip
    """The 80 % range of a modelled ``value`` (a rate when ``rate``, else a time): the true speed is the
    modelled speed over exp(residual)."""
    band = speed_band(cell(res, want, exclude_family))
    if band is None:
        return None
    lo, hi = band  # log(modelled/true speed): true speed = modelled · exp(−s)
    if rate:
        return value * math.exp(-hi), value * math.exp(-lo)
    return value * math.exp(lo), value * math.exp(hi)


def config_slices(model: catalog.ModelSpec, batch: int, precision: str, metric: str) -> dict[str, str]:
    return {"architecture": architecture(model), "batch": batch_regime(batch), "phase": METRIC_PHASE[metric],
            "precision": precision_class(precision)}  # fmt: skip


class Coverage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    slice: str
    points: int
    covered_pct: float
    median_width: float  # high / low


def coverage(res: Sequence[Residual]) -> list[Coverage]:
    """How often the interval built without a point's own family holds its published value, overall and
    per slice (the residual itself is held out by family too)."""
    hits: list[tuple[Residual, bool, float]] = []
    for r in res:
        band = speed_band(cell(res, {k: r.slice(k) for k in KINDS[1:]}, exclude_family=r.family))
        if band is None:
            continue
        hits.append((r, band[0] <= r.log_speed <= band[1], math.exp(band[1] - band[0])))

    def row(kind: str, name: str, sel: list[tuple[Residual, bool, float]]) -> Coverage:
        return Coverage(kind=kind, slice=name, points=len(sel),
                        covered_pct=round(100 * float(np.mean([h for _, h, _ in sel])), 1),
                        median_width=round(float(np.median([w for _, _, w in sel])), 2))  # fmt: skip

    out = [row("all", "all", hits)] if hits else []
    for kind in ("publisher_family", *KINDS[1:]):
        for name in sorted({r.slice(kind) for r, _, _ in hits}):
            out.append(row(kind, name, [h for h in hits if h[0].slice(kind) == name]))
    return out


def slice_lines(res: Sequence[Residual]) -> list[str]:
    """The per-slice table as `hardware validate` prints it."""
    cov = {(c.kind, c.slice): c for c in coverage(res)}
    lines = ["held out by publisher family, per slice (speed error; bias > 0: reads fast):",
             f"  {'slice':<28} {'points':>6} {'median |err|':>12} {'bias':>8} {'80 % covers':>11} {'width':>6}"]  # fmt: skip
    for s in slice_table(res):
        c = cov.get((s.kind, s.slice))
        cv = f"{c.covered_pct:.0f} %" if c else "—"
        w = f"{c.median_width:.2f}×" if c else "—"
        lines.append(f"  {s.kind + ': ' + s.slice:<28} {s.points:>6} {s.median_abs_error_pct:>10.1f} % "
                     f"{s.bias_pct:>+6.1f} % {cv:>11} {w:>6}")  # fmt: skip
    if (c := cov.get(("all", "all"))) is not None:
        lines.append(f"  80 % intervals cover {c.covered_pct:.0f} % of {c.points} held-out points, "
                     f"median width {c.median_width:.2f}×")  # fmt: skip
    return lines
