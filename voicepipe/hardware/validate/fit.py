"""Fit the few global constants to the published points; leave-one-source-out predictions.

A metric is a closed-form function of a point's step parts (:mod:`~voicepipe.hardware.validate.points`)
and the constants θ = (η_mem, MFU, η_wq, η_moe, τ)::

    decode   t_d = step(B sequences at context P + O/2)
    prefill  t_p = step(B prompts of P tokens at once) + stack request cost
    tpot_ms, itl_ms, itl_median_ms = t_d          tok_s_user = 1/t_d        ttft_ms = t_p
    tok_s_total = B·O / (t_p + O·t_d)          e2e_latency_s, e2el_ms = t_p + (O − 1)·t_d
    tok_s_total of a closed-loop run (``closed_loop``: B kept in flight over many requests) = B / t_d
    (plus, under attention DP, the run's prefill waits spread over its steps)

The fit minimises the mean absolute log error over the training points, each point's error capped at a
factor ``LOSS_CAP`` (so a point the physics cannot explain stops pulling the shared constants), inside
published ranges (a coarse grid, then a pattern search), with a weak pull towards published mid-range
values so constants no training point constrains stay there.
Candidate θ are evaluated in one numpy broadcast, so a fit takes tens of milliseconds and
leave-one-source-out (refit without every point of one source, predict that source; a point's
``group``, where set, joins files of one publication into one source) about a second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cache

import numpy as np

from voicepipe.hardware.model import FITTED, FArray, StepParts, combine
from voicepipe.hardware.validate.points import EXTRA, Point, Prepared, points, prepare

# search box for each fitted constant: the published range (docs/hardware-model.md §2)
BOUNDS: dict[str, tuple[float, float]] = {
    "eta_mem": (0.55, 0.95),
    "mfu": (0.25, 1.0),
    "eta_wq": (0.35, 1.0),
    "eta_moe": (0.35, 1.0),
    "layer_s": (1e-6, 60e-6),
}
PRIOR_WEIGHT = 0.002  # weak pull to published mid-range values: decides only what the data leave free
LOSS_CAP = 1.5  # a point's loss stops growing at a factor 1.5 off (+50 % / −33 %)
PRIOR = {"eta_mem": 0.80, "mfu": 0.60, "eta_wq": 0.70, "eta_moe": 0.70, "layer_s": 10e-6}


def _stack_parts(parts: Sequence[StepParts | None]) -> StepParts:
    assert all(x is not None for x in parts)
    arrays = {f.name: np.array([float(getattr(x, f.name)) for x in parts]) for f in fields(StepParts)}
    arrays["weight_only"] = arrays["weight_only"].astype(bool)
    arrays["sram"] = arrays["sram"].astype(bool)
    return StepParts(**arrays)



@dataclass(frozen=True)
class Batch:
    """Answerable points as arrays (one column per point)."""

    items: tuple[Prepared, ...]
    decode: StepParts
    prefill: StepParts
    request_s: FArray
    batch: FArray
    out: FArray
    value: FArray
    metric: np.ndarray  # of metric names
    prefill_runs: FArray
    # for each name in EXTRA: the steps' parts (a point without them repeats its decode parts) and counts
    extra: dict[str, tuple[StepParts, FArray]]


def _metric_form(x: Prepared) -> str:
    """The closed form a point's metric takes: a closed-loop run's throughput is its own form."""
    closed = x.point.closed_loop and x.batch > 1
    return "tok_s_closed" if closed else x.point.metric


def batch_of(items: list[Prepared]) -> Batch:
    ok = [x for x in items if x.decode is not None and x.prefill is not None]
    extra = {}
    for name in EXTRA:
        got = [getattr(x, name) for x in ok]
        parts = [g[0] if g is not None else x.decode for g, x in zip(got, ok, strict=True)]
        extra[name] = (_stack_parts(parts), np.array([g[1] if g is not None else 0.0 for g in got]))
    return Batch(
        items=tuple(items),
        decode=_stack_parts([x.decode for x in ok]),
        prefill=_stack_parts([x.prefill for x in ok]),
        request_s=np.array([x.request_s for x in items]),
        batch=np.array([float(x.batch) for x in items]),
        out=np.array([float(x.out) for x in items]),
        value=np.array([x.point.value for x in items]),
        metric=np.array([_metric_form(x) for x in items]),
        prefill_runs=np.array([x.prefill_runs for x in items]),
        extra=extra,
    )


def predicted(b: Batch, theta: FArray) -> FArray:
    """Metric values for every point (last axis) under every constant set (rows of ``theta``: G × 4)."""
    th = np.atleast_2d(theta)
    cols = [th[:, i : i + 1] for i in range(len(FITTED))]
    t_d = combine(b.decode, *cols)[2]
    runs = {k: (combine(parts, *cols)[2], n) for k, (parts, n) in b.extra.items()}
    first_t, first_n = runs["first"]
    # TTFT: the prefill pass (and, where the stack emits token 0 from a decode step, that step)
    t_p = b.prefill_runs * combine(b.prefill, *cols)[2] + b.request_s + first_n * first_t
    # decode steps of a static run: O (O − 1 after the first-token step; the tok_s_total form counts
    # one more than e2e), of which those a shrinking batch runs are charged at their own step
    moved = sum(runs[k][0] * runs[k][1] for k in ("shrink", "reprefill", "tail", "adp"))
    shrunk = runs["shrink"][1]
    e2e = t_p + (b.out - 1.0 - shrunk) * t_d + moved
    total = t_p + (b.out - first_n - shrunk) * t_d + moved
    adp_per_step = runs["adp"][0] * runs["adp"][1] / b.out
    m = b.metric
    return np.select(
        [
            (m == "tpot_ms") | (m == "itl_ms") | (m == "itl_median_ms"),
            m == "ttft_ms",
            m == "tok_s_user",
            m == "tok_s_total",
            m == "tok_s_closed",
            m == "e2e_latency_s",
            m == "e2el_ms",
        ],
        # a closed loop's mean step also carries its share of the attention-DP prefill waits (adp)
        [
            t_d * 1e3,
            t_p * 1e3,
            1.0 / t_d,
            b.batch * b.out / total,
            b.batch / (t_d + adp_per_step),
            e2e,
            e2e * 1e3,
        ],
    )


def _loss(b: Batch, theta: FArray) -> FArray:
    # absolute log error, capped: a point the physics misses by more than LOSS_CAP (software of another
    # era, hardware not as stated) stops pulling the constants every other point shares
    err = np.minimum(np.abs(np.log(predicted(b, theta) / b.value)), math.log(LOSS_CAP)).mean(axis=-1)
    default = np.array([PRIOR[k] for k in FITTED])
    prior = (np.log(np.atleast_2d(theta) / default) ** 2).sum(axis=-1)
    return err + PRIOR_WEIGHT * prior


def fit(b: Batch, start_steps: int = 3, tol: float = 1e-3) -> FArray:
    """θ minimising the loss inside BOUNDS: the best of a coarse ``start_steps``^k grid, then a pattern
    search (each round tries ± one step along every axis at once, halving the step when none helps)."""
    lo = np.array([BOUNDS[k][0] for k in FITTED])
    hi = np.array([BOUNDS[k][1] for k in FITTED])
    axes = [np.linspace(a, z, start_steps + 2)[1:-1] for a, z in zip(lo, hi, strict=True)]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, len(FITTED))
    losses = _loss(b, grid)
    best, best_loss = grid[int(np.argmin(losses))], float(losses.min())
    step = (hi - lo) / (start_steps + 1) / 2.0
    moves = np.concatenate([np.diag(np.ones(len(FITTED))), -np.diag(np.ones(len(FITTED)))])
    while np.any(step / (hi - lo) > tol):
        cand = np.clip(best + moves * step, lo, hi)
        cl = _loss(b, cand)
        i = int(np.argmin(cl))
        if cl[i] < best_loss - 1e-12:
            best, best_loss = cand[i], float(cl[i])
        else:
            step = step / 2.0
    return best


@dataclass(frozen=True)
class Row:
    point: Point
    predicted: float | None  # leave-one-source-out prediction
    reason: str = ""

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else (self.predicted - self.point.value) / self.point.value


@dataclass(frozen=True)
class Report:
    rows: tuple[Row, ...]
    theta_all: dict[str, float]  # fitted on every answerable point
    sources: int

    def errors(self, tier: int | None = None) -> FArray:
        return np.array(
            [
                abs(r.error)
                for r in self.rows
                if r.error is not None and not r.point.sram_fit and (tier is None or r.point.tier == tier)
            ]
        )


@cache
def run() -> Report:
    """Fit on all points (the shipped defaults' basis) and leave-one-source-out predictions."""
    prepared = [prepare(p) for p in points()]
    ok = [x for x in prepared if not x.reason]
    full = batch_of(ok)
    theta_all = fit(full)
    sources = sorted({x.point.held_out_with for x in ok})
    loso: dict[str, float] = {}
    for src in sources:
        train = [x for x in ok if x.point.held_out_with != src]
        test = [x for x in ok if x.point.held_out_with == src]
        theta = fit(batch_of(train)) if train else theta_all
        for x, v in zip(test, predicted(batch_of(test), theta)[0], strict=True):
            loso[x.point.id] = float(v)
    rows = tuple(Row(x.point, loso.get(x.point.id), x.reason) for x in prepared)
    return Report(rows, dict(zip(FITTED, (float(f"{v:.3g}") for v in theta_all), strict=True)), len(sources))


def summary_lines(rep: Report) -> list[str]:
    def stat(errs: FArray) -> str:
        if len(errs) == 0:
            return "no points"
        return f"median {np.median(errs) * 100:.1f} %, worst {errs.max() * 100:.1f} % over {len(errs)} points"

    unanswered = sum(1 for r in rep.rows if r.predicted is None)
    theta = ", ".join(
        f"{k} {v * 1e6:.3g} µs" if k.endswith("_s") else f"{k} {v:g}" for k, v in rep.theta_all.items()
    )
    return [
        f"leave-one-source-out absolute error, tier 1: {stat(rep.errors(1))}",
        f"leave-one-source-out absolute error, all tiers: {stat(rep.errors())}",
        f"{len(rep.rows)} points from {rep.sources} sources; {unanswered} cannot be answered (reason in the table)",
        f"constants fitted on every answerable point: {theta}",
    ]


def markdown(rep: Report) -> str:
    """The residual table and summary for docs/hardware-model.md."""
    lines = [
        "| id | tier | metric | published | predicted (held out) | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in rep.rows:
        pred = f"{r.predicted:.4g}" if r.predicted is not None else f"cannot answer: {r.reason}"
        err = f"{r.error * 100:+.1f} %" if r.error is not None else "—"
        lines.append(
            f"| {r.point.id}{' (SRAM fit, not held out)' if r.point.sram_fit else ''} | {r.point.tier} | {r.point.metric} | {r.point.value:g} | {pred} | {err} |"
        )
    lines.append("")
    lines.extend(f"* {s}" for s in summary_lines(rep))
    return "\n".join(lines)


BEGIN, END = "<!-- validation:begin -->", "<!-- validation:end -->"
