"""Cross-device ratios: how well the model predicts one device's figure relative to another's.

An anchored prediction (``voicepipe hardware predict --anchor PROFILE``) uses the model for a ratio only:
the user's measured figure on the anchor device times (model on the target / model on the anchor). Its
error is the error of that ratio, which this module measures on sources that measured two devices (or
two chip counts) with one harness.

**Pairs** (:func:`pairs`): two published points of one harness — the same source, or the same group of
files one publisher wrote (:attr:`Point.held_out_with`: one author's per-device result files are one
harness; the publisher family must match too) — with the same model, precision, KV precision, stack,
batch (an open-loop client's request rate and count instead), prompt and output lengths, metric, load
shape (closed loop, attention DP), speculative settings, engine, engine version and timing (the stack's
default where the point states none: :func:`timing`), but a
different device or chip count. Every two such points form one pair. Only points that are evidence are
paired: answered, not one of the points an SRAM machine was fitted to, not speculative (as
:func:`voicepipe.hardware.validate.slices.residual`).

**Ratio error** (:func:`ratio_pairs`): both points' held-out predictions come from the run with their
publisher family left out of the fit (a harness is one family, so both under the same constants), so the
ratio is out of sample. With ``s`` a point's log speed residual (log of modelled over published speed),
the predicted speed ratio over the measured one is ``exp(s_b − s_a)``; a pair's error is
``exp(|s_b − s_a|) − 1``, the larger of its two directions (anchored on a, or on b).

:func:`ratio_band` gives the 80 % band of those log ratio residuals (each pair in both directions), per
phase where a phase has enough pairs from enough publisher families, for an anchored prediction's range.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

from voicepipe.hardware import catalog
from voicepipe.hardware.validate.fit import Row
from voicepipe.hardware.validate.points import Point, stack_key
from voicepipe.hardware.validate.slices import (
    LEVEL,
    METRIC_PHASE,
    MIN_FAMILIES,
    RATES,
    SPEED,
    Residual,
    phase,
    speed_band,
)

MIN_RATIOS = 15  # a phase with fewer ratio residuals (both directions) takes the band of every pair
PairKey = tuple[object, ...]


def pair_key(p: Point) -> PairKey:
    """What two points must share to be one harness's measurement of two devices (device and chips aside)."""
    # an open loop's published concurrency is an outcome of the run; its rate and count are the setting
    load = (p.request_rate, p.num_prompts) if p.request_rate is not None else (p.batch, p.num_prompts)
    return (p.held_out_with, p.family, p.model, p.precision, p.kv_precision, stack_key(p.stack), load,
            p.prompt_tokens, p.output_tokens, p.metric, p.closed_loop, p.attention_dp, p.eager, p.scheduler_steps,
            p.max_seqs,
            p.dense_precision, p.block_fp8_gemm, p.speculative or "none", p.engine, p.engine_version,
            timing(p))  # fmt: skip


def timing(p: Point) -> str:
    """Where the point's times were taken, as the engine runs it: the point's own ``timing``, else its
    stack's default (the ``timing`` of its :class:`~voicepipe.hardware.specs.Stack`, as ``System`` reads it)."""
    return p.timing or catalog.stack(p.stack).timing


def is_evidence(p: Point) -> bool:
    return not p.sram_fit and not p.is_speculative


def pairs(points: Iterable[Point]) -> list[tuple[Point, Point]]:
    """Every two evidence points of one harness (:func:`pair_key`) on different devices or chip counts,
    in the order the points come."""
    groups: dict[PairKey, list[Point]] = {}
    for p in points:
        if is_evidence(p):
            groups.setdefault(pair_key(p), []).append(p)
    return [
        (a, b)
        for group in groups.values()
        for a, b in itertools.combinations(group, 2)
        if (a.device, a.chips) != (b.device, b.chips)
    ]


def log_speed(p: Point, predicted: float) -> float:
    """log(modelled speed / published speed): a rate's ratio, a time's inverse."""
    ratio = predicted / p.value
    return math.log(ratio if p.metric in SPEED else 1.0 / ratio)


class RatioPair(BaseModel):
    """One pair's measured and predicted speed ratio (b over a), both predictions held out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    a: str  # point ids
    b: str
    source: str  # the harness: the source, or the group of files it sits in (Point.held_out_with)
    model: str
    metric: str
    phase: str
    a_device: str  # "device x chips"
    b_device: str
    measured_speed_ratio: float  # speed of b / speed of a, as published
    predicted_speed_ratio: float  # the same from the held-out predictions
    log_error: float  # log(predicted / measured ratio) = s_b − s_a

    @property
    def error(self) -> float:
        """exp(|log error|) − 1: the larger of the pair's two directions."""
        return math.expm1(abs(self.log_error))


def _where(p: Point) -> str:
    return f"{p.device} x {p.chips if p.chips is not None else '?'}"


def _speed(p: Point, value: float) -> float:
    return value if p.metric in SPEED else 1.0 / value


def ratio_pair(a: Point, pred_a: float, b: Point, pred_b: float) -> RatioPair:
    """A pair's ratios from the two points and their held-out predictions."""
    measured = _speed(b, b.value) / _speed(a, a.value)
    predicted = _speed(b, pred_b) / _speed(a, pred_a)
    return RatioPair(
        a=a.id, b=b.id, source=a.held_out_with, model=a.model, metric=a.metric, phase=phase(a.metric),
        a_device=_where(a), b_device=_where(b), measured_speed_ratio=round(measured, 6),
        predicted_speed_ratio=round(predicted, 6), log_error=round(math.log(predicted / measured), 6),
    )  # fmt: skip


def ratio_pairs(rows: Sequence[Row]) -> list[RatioPair]:
    """The pairs of a validation run's answered rows (held-out predictions), see the module doc."""
    pred = {r.point.id: r.predicted for r in rows if r.predicted is not None}
    return [
        ratio_pair(a, pred[a.id], b, pred[b.id])
        for a, b in pairs(r.point for r in rows if r.point.id in pred)
    ]


RatioResidual = tuple[str, float, str]  # (phase, log ratio residual, the pair's publisher family)


def residual_pairs(points: Iterable[Point], res: Sequence[Residual]) -> list[RatioResidual]:
    """(phase, log ratio residual, family) of every pair whose points have shipped residuals (the
    accuracy file's held-out ``log_speed``), each pair in both directions: what an anchored range is
    built from."""
    by_id = {r.id: r for r in res}
    out = []
    for a, b in pairs(p for p in points if p.id in by_id):
        d = by_id[b.id].log_speed - by_id[a.id].log_speed
        out += [(phase(a.metric), d, a.family), (phase(a.metric), -d, a.family)]
    return out


class RatioSummary(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    pairs: int
    sources: int
    harnesses: int  # distinct pair keys (one source may hold several: per model, metric, batch...)
    median_error_pct: float
    within_10_pct: int  # share of pairs, in %
    within_30_pct: int
    by_phase: dict[str, float]  # median error % per phase
    by_source: dict[
        str, tuple[int, float]
    ]  # source URL: (pairs, median error %); two sources give most pairs
    point_median_error_pct: float  # the same points' own held-out median error, for comparison


def _median_pct(rp: Sequence[RatioPair]) -> float:
    return round(float(np.median([p.error for p in rp])) * 100, 1)


def ratio_summary(rp: Sequence[RatioPair], rows: Sequence[Row]) -> RatioSummary | None:
    """Figures over the pairs (None without any); ``rows`` give the paired points' own error beside them."""
    if not rp:
        return None
    errs = np.array([p.error for p in rp])
    ids = {p.a for p in rp} | {p.b for p in rp}
    own = [abs(r.error) for r in rows if r.point.id in ids and r.error is not None]
    keys = {pair_key(r.point) for r in rows if r.point.id in ids}
    return RatioSummary(
        pairs=len(rp), sources=len({p.source for p in rp}), harnesses=len(keys),
        median_error_pct=round(float(np.median(errs)) * 100, 1),
        within_10_pct=round(float((errs <= 0.10).mean()) * 100), within_30_pct=round(float((errs <= 0.30).mean()) * 100),
        by_phase={ph: _median_pct([p for p in rp if p.phase == ph]) for ph in sorted({p.phase for p in rp})},
        by_source={src: (sum(p.source == src for p in rp), _median_pct([p for p in rp if p.source == src]))
                   for src in sorted({p.source for p in rp})},
        point_median_error_pct=round(float(np.median(own)) * 100, 1) if own else 0.0,
    )  # fmt: skip


def ratio_line(s: RatioSummary | None) -> str:
    """The summary line `hardware validate` prints."""
    if s is None:
        return "cross-device ratios: no source measured two devices with one harness"
    phases = ", ".join(f"{k} {v:g} %" for k, v in s.by_phase.items())
    per_source = sorted(v for _, v in s.by_source.values())
    return (
        f"cross-device ratios (same source and settings, two devices or chip counts; held out by family): "
        f"median error {s.median_error_pct:g} % over {s.pairs} pairs from {s.sources} sources "
        f"({s.within_10_pct} % within ±10 %, {s.within_30_pct} % within ±30 %; by phase: {phases}; "
        f"per source {', '.join(f'{v:g} %' for v in per_source)}); the same points' own median error "
        f"{s.point_median_error_pct:g} %"
    )


def ratio_band(
    ratios: Sequence[RatioResidual], metric: str, level: float = LEVEL
) -> tuple[tuple[float, float], str] | None:
    """(low, high) of the log ratio residuals for a prediction's ``metric`` (a key of METRIC_PHASE) and
    what they came from: its phase's residuals when at least MIN_RATIOS from at least MIN_FAMILIES
    publisher families (one family's harness is one setup, as for the interval cells), else every pair's.
    None: too few."""
    ph = METRIC_PHASE[metric]
    own = [d for p, d, _ in ratios if p == ph]
    families = {f for p, _, f in ratios if p == ph}
    if len(own) >= MIN_RATIOS and len(families) >= MIN_FAMILIES and (band := speed_band(own, level)) is not None:
        return band, f"{len(own) // 2} {ph} pairs"
    every = [d for _, d, _ in ratios]
    band = speed_band(every, level)
    return None if band is None else (band, f"{len(every) // 2} pairs of every phase ({len(own) // 2} {ph})")


class RatioReport(BaseModel):
    """`hardware validate`'s JSON section: the summary and every pair."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    summary: RatioSummary | None
    error: str = "exp(|log(predicted speed ratio / measured speed ratio)|) - 1, the larger of both directions"
    pairs: list[RatioPair]


def ratio_report(rows: Sequence[Row]) -> RatioReport:
    rp = ratio_pairs(rows)
    return RatioReport(summary=ratio_summary(rp, rows), pairs=rp)


def ratio_lines(rows: Sequence[Row], every: bool = False) -> list[str]:
    """The summary line, and with ``every`` one line per pair (largest error first)."""
    rep = ratio_report(rows)
    lines = [ratio_line(rep.summary)]
    if every:
        for p in sorted(rep.pairs, key=lambda p: -p.error):
            lines.append(
                f"  {p.a} / {p.b}: {p.metric}, {p.a_device} -> {p.b_device}: speed ratio measured "
                f"{p.measured_speed_ratio:.3g}, predicted {p.predicted_speed_ratio:.3g} ({p.error * 100:.1f} %)"
            )
    return lines


def anchored_intervals(values: dict[str, float], ratios: Sequence[RatioResidual],
                       level: float = LEVEL) -> tuple[dict[str, tuple[float, float]], dict[str, str]]:  # fmt: skip
    """The ``level`` range of each anchored value (keys among METRIC_PHASE) from the cross-device ratio
    residuals (:func:`ratio_band`), and what each range came from. A metric without enough pairs has none."""
    out, basis = {}, {}
    for metric, value in values.items():
        got = ratio_band(ratios, metric, level)
        if got is None:
            continue
        (lo, hi), basis[metric] = got
        out[metric] = (
            (value * math.exp(-hi), value * math.exp(-lo))
            if metric in RATES
            else (value * math.exp(lo), value * math.exp(hi))
        )
    return out, basis


def ratio_accuracy(ratios: Sequence[RatioResidual]) -> dict[str, float | int]:
    """Pairs and median ratio error (%) of :func:`residual_pairs` (what an anchored prediction prints)."""
    errs = np.expm1(np.abs([d for _, d, _ in ratios]))  # both directions of a pair have the same |d|
    return {
        "pairs": len(ratios) // 2,
        "median_error_pct": round(float(np.median(errs)) * 100, 1) if len(errs) else 0.0,
    }
