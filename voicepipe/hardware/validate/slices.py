"""Held-out error by slice, and 80 % intervals from the held-out residuals of a configuration's slices.

Every answered point (held out by publisher family, :func:`voicepipe.hardware.validate.fit.run`) falls in
one slice of each kind: publisher family (vendor, framework, independent), architecture (dense, MoE, MLA),
batch (1 or batched), phase (TTFT, decode: per-token metrics, or throughput/end-to-end) and precision
(16-bit or quantised). :func:`slice_table` gives each slice's median absolute error, signed bias (median
signed error) and count. A :class:`Residual` is one point's held-out log speed ratio (modelled over
published speed; > 0 reads faster) with its slices; the shipped ones are in the accuracy file.

:func:`band` is the interval rule (Mondrian, conformal-style, see :mod:`~voicepipe.hardware.validate.ranges`):
the family-weighted 10th and 90th percentiles (every publisher family one vote) of the residuals in the
finest cell of the configuration's phase, device maker, architecture, batch regime, stack and precision
that holds ``MIN_POINTS`` residuals from ``MIN_FAMILIES`` families, widened where the configuration's
slices are thin. :func:`coverage` measures how often that
band, built for each point's own configuration without the point's family's residuals, holds the point.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict

from voicepipe.hardware import catalog
from voicepipe.hardware.validate.fit import Row
from voicepipe.hardware.validate.points import Point, stack_key

LEVEL = 0.8
# a cell with fewer residuals widens to a coarser one: 19 was the smallest n whose conformal ranks
# ⌊(n+1)·0.1⌋, ⌈(n+1)·0.9⌉ stand at the level (twenty-fourth pass); the family-weighted percentiles that
# replaced the ranks (twenty-seventh pass) have no such rule, and every value from 15 to 39 covers 80-84 %
MIN_POINTS = 19
SPEED = ("tok_s_user", "tok_s_total")
DECODE = ("tpot_ms", "itl_ms", "itl_median_ms", "tok_s_user")
SIXTEEN_BIT = ("bf16", "fp16", "fp32")
KINDS = ("family", "architecture", "batch", "phase", "precision")
# the prediction's metrics and the phase whose residuals speak for them: a loaded server's aggregate tok/s
# (B clients' output over their whole requests, prefills included) is the figure the throughput points publish
METRIC_PHASE = {"ttft_ms": "ttft", "step_ms": "decode", "tokens_per_second": "decode",
                "aggregate_tokens_per_second": "throughput/e2e"}  # fmt: skip
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


def device_maker(dev: catalog.Device) -> str:
    """Who makes the device (:attr:`~voicepipe.hardware.specs.Device.maker`: "NVIDIA", "AMD", ...)."""
    return dev.maker


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
    # the device, its maker (device_maker) and the stack profile (points.stack_key: its era with it, e.g.
    # vllm-v0 vs vllm); "" in an accuracy file written before they were recorded (then no cell matches them)
    device: str = ""
    maker: str = ""
    stack: str = ""
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
        precision=precision_class(p.precision), device_kind=(dev := catalog.device(p.device)).kind,
        device=dev.key, maker=device_maker(dev), stack=stack_key(p.stack), log_speed=round(math.log(speed), 4),
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


# the cell's keys, finest last: a cell too thin drops the last key first (precision, then stack, batch, ...)
CELL_KEYS = ("phase", "maker", "architecture", "batch", "stack", "precision")
MIN_FAMILIES = 3  # ... or with residuals from fewer publisher families than this (one family is one harness)
THIN = 10  # a slice with fewer residuals than this is far from evidence


@dataclass(frozen=True)
class Query:
    """What an interval is asked for: the slices of one configuration and metric. ``stack`` None: any
    stack speaks for it (an SRAM machine runs its vendor's own software)."""

    phase: str
    architecture: str
    batch: str
    precision: str
    device: str
    maker: str
    stack: str | None
    device_kind: str = "hbm"

    def slice(self, kind: str) -> str | None:
        value: str | None = getattr(self, kind)
        return value


def query_of(r: Residual) -> Query:
    """The query a residual's own point answers (for the held-out coverage)."""
    return Query(phase=r.phase, architecture=r.architecture, batch=r.batch, precision=r.precision,
                 device=r.device, maker=r.maker, stack=None if r.device_kind == "sram" else r.stack,
                 device_kind=r.device_kind)  # fmt: skip


def cell_keys(res: Sequence[Residual], q: Query) -> list[str]:
    """The keys of the finest cell around ``q`` (:data:`CELL_KEYS`, the last dropped first) whose residuals
    of ``q``'s device kind number at least MIN_POINTS from at least MIN_FAMILIES families; [] when only
    every residual of the kind is enough (or not even that)."""
    pool = [r for r in res if r.device_kind == q.device_kind]
    keys = [k for k in CELL_KEYS if q.slice(k) is not None]
    while keys and not enough([r for r in pool if all(r.slice(k) == q.slice(k) for k in keys)]):
        keys.pop()
    return keys


def enough(cell: Sequence[Residual]) -> bool:
    """Whether a cell stands on its own: MIN_POINTS residuals from MIN_FAMILIES publisher families."""
    return len(cell) >= MIN_POINTS and len({r.family for r in cell}) >= MIN_FAMILIES


def cell_of_keys(res: Sequence[Residual], q: Query, keys: Sequence[str]) -> list[Residual]:
    """The residuals of ``q``'s device kind that share ``q``'s value of every one of ``keys``."""
    return [r for r in res if r.device_kind == q.device_kind and all(r.slice(k) == q.slice(k) for k in keys)]


def cell_members(res: Sequence[Residual], q: Query) -> list[Residual]:
    """The residuals of ``q``'s device kind in the finest cell around ``q`` (:func:`cell_keys`)."""
    return cell_of_keys(res, q, cell_keys(res, q))


def thin_slices(res: Sequence[Residual], q: Query) -> tuple[str, ...]:
    """``q``'s slices (device, stack, architecture, batch regime, precision class) with fewer than THIN
    residuals, as ``"kind name (n points)"``."""
    kinds = ["device", *(["stack"] if q.stack is not None else []), "architecture", "batch", "precision"]
    counts = [(k, q.slice(k), sum(r.slice(k) == q.slice(k) for r in res)) for k in kinds]
    return tuple(f"{kind} {name} ({n} points)" for kind, name, n in counts if n < THIN)


def speed_band(values: Sequence[float], level: float = LEVEL) -> tuple[float, float] | None:
    """(low, high) conformal ranks of the log speed residuals; None when too few for the level."""
    s = np.sort(np.asarray(values, dtype=float))
    n = len(s)
    tail = (1 - level) / 2
    # rounded first: (1 − 0.8) / 2 is 0.09999… in binary, which would put 20 · 0.1 at rank 1, not 2
    lo, hi = math.floor(round((n + 1) * tail, 9)), math.ceil(round((n + 1) * (1 - tail), 9))
    if lo < 1 or hi > n:
        return None
    return float(s[lo - 1]), float(s[hi - 1])


def family_band(res: Sequence[Residual], level: float = LEVEL) -> tuple[float, float] | None:
    """The equal-tailed ``level`` band of the log speed residuals with every publisher family one vote:
    each of a family's n residuals weighs 1/n. The low end is the largest residual with at most
    (1 − level)/2 of the weight below it, the high end the smallest with at most that much above it.
    None for no residuals.

    A family is the unit the hold-out leaves out and the unit a new configuration's publisher will be:
    a harness with 140 points is one harness's bias, not 140 pieces of evidence (docs §3, *Intervals*)."""
    if not 0 < level <= 1:
        raise ValueError(f"a band's level is in (0, 1], not {level}")
    if not res:
        return None
    count: dict[str, int] = {}
    for r in res:
        count[r.family] = count.get(r.family, 0) + 1
    order = sorted(res, key=lambda r: r.log_speed)
    values = np.array([r.log_speed for r in order])
    cum = np.cumsum([1.0 / count[r.family] for r in order]) / len(count)
    tail = (1 - level) / 2
    # rounded first, as speed_band: a family's 1/n weights need not sum to exactly 1 in binary
    cum = np.round(cum, 9)
    lo = int(np.searchsorted(cum, round(tail, 9), side="right"))
    hi = int(np.searchsorted(cum, round(1 - tail, 9), side="left"))
    return float(values[lo]), float(values[min(hi, len(values) - 1)])


def band(res: Sequence[Residual], q: Query,
         exclude_family: str | None = None) -> tuple[tuple[float, float], tuple[str, ...]]:  # fmt: skip
    """The 80 % band of log(modelled / true speed) for ``q``, and its thin slices: the one rule behind
    every printed range and its measured coverage (docs/hardware-model.md §3, "Intervals").

    Only residuals of other families than ``exclude_family`` count (coverage() passes the point's own).
    The cell's family-weighted band (:func:`cell_keys`, :func:`family_band`; its extremes when even every
    residual of the kind is too few, :func:`enough`); with ``k`` thin slices, the union with the
    family-weighted band, at level ``1 − 0.2 / 2^(k−1)``, of the cell ``k`` keys coarser (every residual of
    the device kind once no key is left)."""
    pool = [r for r in res if r.family != exclude_family]
    if not any(r.device_kind == q.device_kind for r in pool):
        raise ValueError(f"no residuals of {q.device_kind} devices: no interval can be given")
    thin = thin_slices(pool, q)
    keys = cell_keys(pool, q)
    got = cell_band(cell_of_keys(pool, q, keys), LEVEL)
    if thin:
        coarse = cell_of_keys(pool, q, keys[: max(0, len(keys) - len(thin))])
        wide = cell_band(coarse, 1 - (1 - LEVEL) / 2 ** (len(thin) - 1))
        got = (min(got[0], wide[0]), max(got[1], wide[1]))
    return got, thin


def cell_band(cell: Sequence[Residual], level: float) -> tuple[float, float]:
    """:func:`family_band` of a cell that stands on its own (:func:`enough`); a smaller one (every residual
    of a device kind with few points, the SRAM machines' today) gives the widest seen, its extremes: too
    few families for their percentiles to mean the level."""
    got = family_band(cell, level)
    assert got is not None  # the device kind has residuals: every cell of it holds some
    if not enough(cell):
        values = [r.log_speed for r in cell]
        return min(values), max(values)
    return got


def config_query(model: catalog.ModelSpec, batch: int, precision: str, metric: str, device: str, maker: str,
                 stack: str | None, device_kind: str = "hbm") -> Query:  # fmt: skip
    """The query of a configuration's ``metric`` (:data:`METRIC_PHASE` names the phase that speaks for it)."""
    return Query(phase=METRIC_PHASE[metric], architecture=architecture(model), batch=batch_regime(batch),
                 precision=precision_class(precision), device=device, maker=maker, stack=stack,
                 device_kind=device_kind)  # fmt: skip


class Coverage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    slice: str
    points: int
    covered_pct: float
    median_width: float  # high / low


def coverage(res: Sequence[Residual]) -> list[Coverage]:
    """How often the band :func:`band` builds for a point's own configuration without its family's
    residuals (cell, thin slices and all) holds its residual, overall and per slice (the residual itself
    is held out by family too)."""
    hits: list[tuple[Residual, bool, float]] = []
    for r in res:
        try:
            (lo, hi), _ = band(res, query_of(r), exclude_family=r.family)
        except ValueError:  # no other family measured its kind of device: no interval to score
            continue
        hits.append((r, lo <= r.log_speed <= hi, math.exp(hi - lo)))

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
