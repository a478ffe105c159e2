"""Fit the few global constants to the published points; predictions held out by publisher family, by the engine.

Every point is a run of the serving engine (:mod:`~voicepipe.hardware.validate.points`,
:mod:`voicepipe.hardware.workload`): its metric is a figure of that run (mean TTFT, mean time per output
token, mean decode-only step, throughput, end-to-end latency). A held-out row is the engine's run under
the constants fitted without any point of its publisher family.

The fit needs thousands of constant sets θ = (η_mem, MFU, η_wq, η_moe, τ) over all points, so it re-times
each point's step mix rather than re-running it: a figure is a weighted sum of the run's step times
(:meth:`voicepipe.hardware.workload.Run.weights`), so one run at the shipped constants gives a point's
stretches (merged where they share a batch shape, at most ``MAX_ROWS``) and their weights, and a candidate
θ re-times them in one numpy broadcast. That is exact while θ leaves the order of the run's events alone
(the held-out rows are real runs either way).

The fit minimises the mean absolute log error over the training points, each point's error capped at a
factor ``LOSS_CAP`` (so a point the physics cannot explain stops pulling the shared constants), inside
published ranges (a coarse grid, then a pattern search), with a weak pull towards published mid-range
values so constants no training point constrains stay there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from functools import cache
from typing import Any

import numpy as np

from voicepipe.hardware.model import (
    BOOL_PARTS,
    DEFAULT_EFFICIENCY,
    FITTED,
    Efficiency,
    FArray,
    StepParts,
    combine,
    step_parts,
)
from voicepipe.hardware.serving import DeviceServer
from voicepipe.hardware.validate.points import Point, Prepared, points, prepare
from voicepipe.hardware.workload import Figure, Run, open_loop, static_batch, steady, throughput
from voicepipe.kept import kept

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
MAX_ROWS = 24  # a run's stretches merged into at most this many batch shapes for the fit
STEADY_ROUNDS = 2  # a steady run: the burst that fills the device, then one measured round


def efficiency(theta: FArray | None) -> Efficiency:
    return DEFAULT_EFFICIENCY if theta is None else replace(DEFAULT_EFFICIENCY, **dict(zip(FITTED, map(float, theta), strict=True)))


def engine_run(x: Prepared, theta: FArray | None = None) -> Run:
    """The point's run on the engine under the constants ``theta`` (None: the shipped ones)."""
    assert x.system is not None
    server = DeviceServer(replace(x.system, eff=efficiency(theta)), max_batch=max(x.batch, 1), prompt_cache=False,
                          spec=x.spec)  # fmt: skip
    if x.workload == "static":
        return static_batch(server, x.requests, x.prompt, x.out, lengths=x.lengths)
    if x.workload == "open":
        return open_loop(server, x.requests, x.rate, x.prompt, x.out, lengths=x.lengths)
    rounds = 1 if x.requests == 1 else STEADY_ROUNDS
    return steady(server, x.requests, x.prompt, x.out, rounds=rounds, lengths=x.lengths)


def form(x: Prepared) -> tuple[Figure, float, bool]:
    """(figure, scale, inverted): the metric is ``scale · figure`` or ``scale / figure``."""
    m = x.point.metric
    if m in ("tpot_ms", "itl_ms"):
        return "tpot", 1e3, False
    if m == "itl_median_ms":
        return "decode_step", 1e3, False
    if m == "tok_s_user":
        return "tpot", 1.0, True
    if m == "ttft_ms":
        return "ttft", 1e3, False
    if m in ("e2e_latency_s", "e2el_ms"):
        # a burst's published latency is the harness's wall time for the whole batch, to its last request
        # (benchmark_latency: one llm.generate over the batch; docs §3); a closed loop's is per request
        fig: Figure = "duration" if x.workload == "static" else "e2e"
        return fig, 1.0 if m == "e2e_latency_s" else 1e3, False
    if x.workload == "steady":  # tok_s_total of a closed loop: N·O per request lifetime (Little's law)
        return "e2e", float(x.requests * x.out), True
    return "duration", float(x.requests * x.out), True


def metric_of(x: Prepared, r: Run) -> float:
    """The point's metric from its run (the one figure the fit re-times)."""
    fig, scale, inv = form(x)
    if x.point.metric == "tok_s_total":
        return throughput(r, static=x.workload != "steady")
    v = r.figure(fig)
    return scale / v if inv else scale * v


def _stack_parts(parts: list[StepParts]) -> StepParts:
    arrays = {f.name: np.concatenate([np.broadcast_to(np.asarray(getattr(x, f.name), dtype=float),
                                                      np.shape(x.kv_s)).ravel() for x in parts]) for f in fields(StepParts)}  # fmt: skip
    return StepParts(**{**arrays, **{k: arrays[k].astype(bool) for k in BOOL_PARTS}})


def _merged(r: Run, w: FArray) -> tuple[FArray, ...]:
    """(weights, decoders, kv, prefill, cached, prompts, span) of the stretches merged by batch shape
    (≤ MAX_ROWS)."""
    keep = w > 0
    w, d, kv, n, c = w[keep], r.decoders[keep], r.kv[keep], r.prefill[keep], r.cached[keep]
    ps, span = r.prompts[keep], r.span[keep]
    if len(w) == 0:
        return np.zeros(1), np.ones(1), np.ones(1), np.zeros(1), np.zeros(1), np.ones(1), np.zeros(1)
    shapes = np.unique(np.stack([n, ps]), axis=1).shape[1]
    per = max(1, MAX_ROWS // max(shapes, 1))
    edges = np.unique(np.quantile(d, np.linspace(0, 1, per + 1)))
    dbin = np.clip(np.searchsorted(edges, d, side="right") - 1, 0, max(len(edges) - 2, 0))
    key = np.unique(np.stack([dbin, n, c, ps]), axis=1, return_inverse=True)[1].ravel()
    k = key.max() + 1
    ws = np.bincount(key, w, k).astype(float)
    mean = lambda v: np.bincount(key, w * v, k) / ws  # noqa: E731
    return ws, mean(d), mean(kv), mean(n), mean(c), np.maximum(mean(ps), 1.0), mean(span)


@dataclass(frozen=True)
class Batch:
    """Answerable points as the fit re-times them: every point's merged stretches, end to end."""

    items: tuple[Prepared, ...]
    parts: StepParts  # one column per merged stretch
    weights: FArray
    starts: np.ndarray  # first column of each point
    add: FArray  # the per-request cost where the figure includes it
    scale: FArray
    inverted: np.ndarray
    value: FArray


def batch_of(items: list[Prepared], theta: FArray | None = None) -> Batch:
    """The points' step mixes from runs under ``theta`` (None: the shipped constants)."""
    parts, weights, starts, add, scale, inv = [], [], [], [], [], []
    col = 0
    for x in items:
        assert x.system is not None
        r = engine_run(x, theta)
        fig, sc, iv = form(x)
        w, d, kv, n, c, ps, span = _merged(r, r.weights(fig))
        parts.append(step_parts(x.system, d, kv, prefill_tokens=n, prefill_cached=c, prefill_seqs=ps, prefill_span=span))
        weights.append(w)
        starts.append(col)
        col += len(w)
        add.append(r.added_s(fig))
        scale.append(sc)
        inv.append(iv)
    return Batch(
        items=tuple(items), parts=_stack_parts(parts), weights=np.concatenate(weights) if weights else np.zeros(0),
        starts=np.array(starts, dtype=int), add=np.array(add), scale=np.array(scale), inverted=np.array(inv, dtype=bool),
        value=np.array([x.point.value for x in items]),
    )  # fmt: skip


def predicted(b: Batch, theta: FArray) -> FArray:
    """Metric values for every point (last axis) under every constant set (rows of ``theta``)."""
    th = np.atleast_2d(theta)
    out = []
    for lo in range(0, len(th), 32):  # candidates in chunks: a chunk's array is 32 x the stretches
        cols = [th[lo : lo + 32, i : i + 1] for i in range(len(FITTED))]
        t = combine(b.parts, *cols)[2]
        x = np.add.reduceat(t * b.weights, b.starts, axis=-1) + b.add
        out.append(np.where(b.inverted, b.scale / x, b.scale * x))
    return np.concatenate(out)


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
    predicted: float | None  # held-out prediction (the point's whole publisher family left out of the fit)
    reason: str = ""

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else (self.predicted - self.point.value) / self.point.value


@dataclass(frozen=True)
class Report:
    rows: tuple[Row, ...]
    theta_all: dict[str, float]  # fitted on every answerable point
    sources: int
    families: int = 0  # publisher families held out one at a time

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
    """Fit on all points (the shipped defaults' basis) and held-out predictions by publisher family
    (:attr:`~voicepipe.hardware.validate.points.Point.family`): each point is a run of the engine under
    the constants fitted without every point of its family. A speculative point is predicted (with its
    stated settings) but never trains the fit, whose re-timing has no speculative term.

    Minutes of work that depend on this package alone: kept on disk between processes (:mod:`voicepipe.kept`,
    keyed by the package's content)."""
    return kept("validation", held_out, _dump, _load)


def _dump(rep: Report) -> dict[str, Any]:
    rows = [[r.point.id, r.predicted, r.reason] for r in rep.rows]
    return {"rows": rows, "theta_all": rep.theta_all, "sources": rep.sources, "families": rep.families}


def _load(data: dict[str, Any]) -> Report:
    pts = points()
    rows = data["rows"]
    if [r[0] for r in rows] != [p.id for p in pts]:
        raise ValueError("kept for other points")
    return Report(
        tuple(Row(p, None if r[1] is None else float(r[1]), str(r[2])) for p, r in zip(pts, rows, strict=True)),
        {k: float(v) for k, v in data["theta_all"].items()},
        int(data["sources"]),
        int(data["families"]),
    )


def held_out(pts: Sequence[Point] | None = None) -> Report:
    """:func:`run`'s work, uncached, on ``pts`` (default: every published point): the fit on all of them,
    and each point predicted by the engine under the constants fitted without its publisher family."""
    prepared = [prepare(p) for p in (points() if pts is None else pts)]
    ok = [x for x in prepared if not x.reason]
    trainable = [i for i, x in enumerate(ok) if x.spec is None]
    full = batch_of([ok[i] for i in trainable])
    theta_all = fit(full)
    families = sorted({x.point.family for x in ok})
    held: dict[str, float] = {}
    for fam in families:
        train = [j for j, i in enumerate(trainable) if ok[i].point.family != fam]
        theta = fit(subset(full, train)) if train else theta_all
        for x in ok:
            if x.point.family == fam:
                held[x.point.id] = metric_of(x, engine_run(x, theta))
    rows = tuple(Row(x.point, held.get(x.point.id), x.reason) for x in prepared)
    sources = len({x.point.held_out_with for x in ok})
    shipped = dict(zip(FITTED, (float(f"{v:.3g}") for v in theta_all), strict=True))
    return Report(rows, shipped, sources, len(families))


def subset(b: Batch, keep: list[int]) -> Batch:
    """The batch of the points at ``keep`` (their stretches, re-indexed)."""
    ends = np.append(b.starts[1:], len(b.weights))
    cols = np.concatenate([np.arange(b.starts[i], ends[i]) for i in keep]) if keep else np.zeros(0, dtype=int)
    lengths = np.array([ends[i] - b.starts[i] for i in keep], dtype=int)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int) if keep else np.zeros(0, dtype=int)
    parts = StepParts(**{f.name: np.asarray(getattr(b.parts, f.name))[cols] for f in fields(StepParts)})
    return Batch(items=tuple(b.items[i] for i in keep), parts=parts, weights=b.weights[cols], starts=starts,
                 add=b.add[keep], scale=b.scale[keep], inverted=b.inverted[keep], value=b.value[keep])  # fmt: skip


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
        f"leave-one-family-out absolute error, tier 1: {stat(rep.errors(1))}",
        f"leave-one-family-out absolute error, all tiers: {stat(rep.errors())}",
        f"{len(rep.rows)} points from {rep.sources} sources and {rep.families} publisher families; "
        f"{unanswered} cannot be answered (reason in the table)",
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
