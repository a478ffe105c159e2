"""Validation against published measurements: fit the few global constants, leave-one-source-out error.

``data/validation.yaml`` lists published points (device, chips, model, precision, KV precision, batch,
prompt/output tokens, stack, metric, value, source, tier). Each answerable point is reduced once to the
raw parts of the engine steps its metric needs (:func:`voicepipe.hardware.model.step_parts`); a metric
is then a closed-form function of those parts and the constants θ = (η_mem, MFU, η_wq, η_moe, τ)::

    decode   t_d = step(B sequences at context P + O/2)
    prefill  t_p = step(B prompts of P tokens at once) + stack request cost
    tpot_ms, itl_ms, itl_median_ms = t_d          tok_s_user = 1/t_d        ttft_ms = t_p
    tok_s_total = B·O / (t_p + O·t_d)          e2e_latency_s, e2el_ms = t_p + (O − 1)·t_d
    tok_s_total of a closed-loop run (``closed_loop``: B kept in flight over many requests) = B / t_d
    (plus, under attention DP, the run's prefill waits spread over its steps)

(B is the batch that runs: the published one, or fewer when their KV does not fit at the mean context,
:func:`voicepipe.hardware.model.running_sequences`.) A per-token metric at concurrency B > 1 is
a loaded server's mean step (so is a closed-loop run's throughput): besides B decodes it prefills B·P/O
prompt tokens (every request brings P prompt tokens per O output tokens), on average half-way into their
prompt; a median inter-token gap
(``itl_median_ms``) is a decode-only step, since newcomers' prefills land in a minority of steps.
Three stack- or setting-specific dynamics add steps to these forms (:class:`Prepared`): a stack whose
first token comes from a decode step prefills P − 1 tokens and adds that step; a static batch that
outgrows its cache on a recompute-preempting stack (vLLM) runs :class:`voicepipe.hardware.model.Lockstep`'s
shrinking batch, re-prefill and tail; and under attention DP each decode step of a throughput run is
charged the expected wait for a rank that prefills a prompt.
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
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from voicepipe.hardware import catalog
from voicepipe.hardware.model import (
    DEFAULT_EFFICIENCY,
    FITTED,
    DoesNotFit,
    FArray,
    StepParts,
    System,
    combine,
    kv_capacity_tokens,
    lockstep,
    make_system,
    rank_local_prefill_parts,
    request_overhead_s,
    running_sequences,
    step_parts,
)

Metric = Literal[
    "tpot_ms", "ttft_ms", "itl_ms", "itl_median_ms", "tok_s_user", "tok_s_total", "e2e_latency_s", "e2el_ms"
]

# search box for each fitted constant: the published range (docs/hardware-model.md §2)
BOUNDS: dict[str, tuple[float, float]] = {
    "eta_mem": (0.55, 0.95),
    "mfu": (0.25, 1.0),
    "eta_wq": (0.35, 1.0),
    "eta_moe": (0.35, 1.0),
    "layer_s": (1e-6, 60e-6),
}
# per-token means of a server under steady concurrent load (the others time whole static batches); a
# median inter-token gap (itl_median_ms) is a decode-only step: newcomers' prefills land in a minority of steps
STEADY_STATE = ("tpot_ms", "itl_ms", "tok_s_user")
DEFAULT_PROMPT, DEFAULT_OUTPUT = 1024, 256  # where a source publishes no lengths (as `hardware predict`)
SATURATED = 512  # cap on "as many as fit" for a saturated server (trtllm-bench/vLLM throughput runs)
PRIOR_WEIGHT = 0.002  # weak pull to published mid-range values: decides only what the data leave free
LOSS_CAP = 1.5  # a point's loss stops growing at a factor 1.5 off (+50 % / −33 %)
PRIOR = {"eta_mem": 0.80, "mfu": 0.60, "eta_wq": 0.70, "eta_moe": 0.70, "layer_s": 10e-6}


class Point(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    device: str
    chips: int | None = Field(default=None, ge=1)  # None: not published; the model sizes the system
    model: str
    precision: str
    kv_precision: str | None = None
    batch: int | None = Field(default=None, ge=1)  # None: a saturated server (as many as fit, ≤ SATURATED)
    prompt_tokens: int | None = Field(
        default=None, ge=0
    )  # 0: pure decode (llama-bench tg); None: unpublished
    output_tokens: int | None = Field(default=None, ge=1)
    stack: str
    attention_dp: bool = False  # the source runs attention data-parallel (each chip its own sequences)
    # True: the benchmark CLIENT holds `batch` requests in flight over many more requests in all (a
    # max-concurrency client: vLLM/SGLang bench --max-concurrency, genai-perf or trtllm-bench
    # --concurrency): its throughput is the loaded server's mean step, newcomers' prefills included, not a
    # static batch's one prefill and O decodes. A burst sent all at once (MLPerf Offline, benchmark_throughput,
    # trtllm-bench at infinite rate) is not: the server takes a static batch of what fits
    closed_loop: bool = False
    metric: Metric
    value: float = Field(gt=0)
    date: str
    source: str
    # what leave-one-source-out holds out together: one publication whose rows sit in several files (an
    # MLPerf round's per-system result files); None: the source URL alone
    group: str | None = None
    tier: Literal[1, 2]
    notes: str = ""
    # who published the figure, and whether they make the machine (vendor) or measured it (independent)
    publisher: str = ""
    publisher_family: Literal["vendor", "independent"] | None = None
    # True: one of the two points an SRAM machine's constants were fitted to (devices.yaml); not evidence
    sram_fit: bool = False

    @model_validator(mode="after")
    def _closed_loop_is_a_throughput(self) -> Point:
        if self.closed_loop and self.metric != "tok_s_total":
            raise ValueError("closed_loop applies to tok_s_total only")
        return self

    @property
    def held_out_with(self) -> str:
        return self.group or self.source


@cache
def points() -> tuple[Point, ...]:
    """The shipped validation points (raises ValueError naming the point and field)."""
    text = resources.files("voicepipe.hardware").joinpath("data", "validation.yaml").read_text()
    raw = (yaml.safe_load(text) or {}).get("points") or []
    out = []
    for i, item in enumerate(raw):
        try:
            out.append(Point(**item))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = item.get("id", f"#{i}") if isinstance(item, dict) else f"#{i}"
            raise ValueError(
                f"validation.yaml: points[{where}].{'.'.join(map(str, err['loc']))}: {err['msg']}"
            ) from None
    return tuple(out)


@dataclass(frozen=True)
class Prepared:
    """A point reduced to the raw parts its metric needs (or the reason it cannot be answered).

    The fields named in ``EXTRA`` are further steps of a run, each with how many times it runs: the
    decode step that emits token 0 on a ``first_token_from_decode`` stack; for a recompute-preempting
    stack whose static batch outgrows its cache (:class:`voicepipe.hardware.model.Lockstep`) the
    shrinking-batch steps, the evicted sequences' re-prefill and their tail steps; under attention DP
    the rank-local prefill that holds up the other ranks."""

    point: Point
    reason: str = ""
    decode: StepParts | None = None
    prefill: StepParts | None = None
    request_s: float = 0.0
    batch: int = 0  # the batch that runs (≤ the published one)
    out: int = 0  # output tokens (DEFAULT_OUTPUT where unpublished)
    # 0 when the prefill pass has no tokens (a 1-token prompt whose first token comes from a decode step)
    prefill_runs: float = 1.0
    first: tuple[StepParts, float] | None = None  # the decode step that emits token 0, and 1 (or none)
    # (parts, times) replacing `times` of the run's decode steps (preemption, above)
    shrink: tuple[StepParts, float] | None = None
    reprefill: tuple[StepParts, float] | None = None
    tail: tuple[StepParts, float] | None = None
    adp: tuple[StepParts, float] | None = None  # attention DP: a rank's context holding up the others


def stack_key(name: str) -> str:
    """The catalog profile a point's stack name stands for."""
    return {"tensorrt-llm": "trtllm", "turbomind": "lmdeploy", "mlc-llm": "mlc", "llamacpp": "llama.cpp"}.get(
        name.lower(), name.lower()
    )


def prepare(p: Point) -> Prepared:
    """Reduce one point to step parts at its published configuration."""
    try:
        dev = catalog.device(p.device)
    except ValueError:
        return Prepared(p, reason=f"device {p.device!r} is not in the catalog")
    try:
        mdl = catalog.model(p.model)
    except ValueError:
        return Prepared(p, reason=f"model {p.model!r} is not in the catalog")
    try:
        stk = catalog.stack(stack_key(p.stack))
    except ValueError:
        return Prepared(p, reason=f"stack {p.stack!r} has no profile in data/stacks.yaml")
    prompt = DEFAULT_PROMPT if p.prompt_tokens is None else p.prompt_tokens
    out = DEFAULT_OUTPUT if p.output_tokens is None else p.output_tokens
    if p.precision not in catalog.PRECISIONS:
        return Prepared(p, reason=f"precision {p.precision!r} is not modelled")
    if p.kv_precision is not None and p.kv_precision not in catalog.KV_PRECISIONS:
        return Prepared(p, reason=f"kv precision {p.kv_precision!r} is not modelled")
    ctx_max = prompt + out
    asked = SATURATED if p.batch is None else p.batch
    if dev.kind == "sram" or p.chips is None:
        try:
            system = make_system(
                dev, mdl, p.precision, seqs=1 if dev.kind == "hbm" else asked, context=ctx_max,
                kv_precision=p.kv_precision, stack=stk,
            )  # fmt: skip
        except DoesNotFit as exc:
            return Prepared(p, reason=str(exc))
        batch = asked if dev.kind == "sram" else min(asked, running_sequences(system, prompt, out))
    else:
        if p.chips > dev.max_tp:
            return Prepared(
                p, reason=f"{p.chips} chips exceed {dev.key}'s tensor-parallel group ({dev.max_tp})"
            )
        system = System(
            dev, mdl, p.precision, p.chips, DEFAULT_EFFICIENCY, p.kv_precision, stk, p.attention_dp
        )
        batch = min(asked, running_sequences(system, prompt, out))
        if batch < 1:
            return Prepared(p, reason=f"weights do not fit {p.chips} x {dev.key} at {p.precision}")
    ctx = prompt + out / 2.0
    # a static batch started at once, unless the client keeps the batch in flight over many requests
    static = p.metric in ("tok_s_total", "e2e_latency_s", "e2el_ms") and not p.closed_loop
    steady = p.metric in STEADY_STATE or p.closed_loop  # closed_loop: tok_s_total only (validator)
    grows = None
    # (the lockstep model counts every token of the cache: not for a stack that keeps only local windows)
    keeps_all = mdl.window is None or not system.serving.window_kv
    if (
        static
        and p.batch is not None
        and dev.kind == "hbm"
        and system.serving.preempt_recompute
        and keeps_all
    ):
        grows = lockstep(kv_capacity_tokens(system), batch, prompt, out)
    extra: dict[str, tuple[StepParts, float]] = {}
    if steady and batch > 1:
        # a loaded server's mean step also prefills newcomers: B requests of P prompt and O output
        # tokens bring B·P/O prompt tokens per step, on average half-way into their prompt
        decode = step_parts(
            system, batch, batch * ctx, prefill_tokens=batch * prompt / out, prefill_cached=prompt / 2.0
        )
    elif grows is not None:
        # all B run until the cache is full, then the batch shrinks and the evicted rejoin at the end
        decode = step_parts(system, batch, batch * (prompt + grows.full_steps / 2.0))
        extra["shrink"] = (step_parts(system, grows.shrink_batch, grows.capacity), grows.shrink_steps)
        extra["reprefill"] = (
            step_parts(system, 0, 0, prefill_tokens=grows.reprefill_tokens, prefill_seqs=grows.evicted),
            1.0,
        )
        extra["tail"] = (
            step_parts(system, grows.tail_batch, grows.tail_batch * grows.tail_context),
            grows.tail_steps,
        )
    else:
        decode = step_parts(system, batch, batch * ctx)
    if p.metric == "tok_s_total" and system.attention_dp and system.chips > 1:
        # in-flight batching under attention DP: a step takes as long as its slowest rank (TensorRT-LLM's
        # ADP balance blog), so a prompt prefilled on one rank holds up all of them. Each rank admits
        # λ = B/(N·O) prompts a step; a step carries at least one with probability 1 − (1 − λ)^N, and
        # then costs one prompt's rank-local prefill, where the closed form spreads λ of it per step
        lam = min(1.0, batch / system.chips / out)
        busy = 1.0 - (1.0 - lam) ** system.chips
        extra["adp"] = (rank_local_prefill_parts(system, max(prompt, 1)), out * max(0.0, busy - lam))
    first_by_decode = dev.kind == "hbm" and system.serving.first_token_from_decode
    # all B prompts in one prefill pass: B·P tokens through the weights, attention per prompt (P²/2 each);
    # a stack whose first token comes from a decode step prefills all but the last prompt token
    pf_tokens = max(prompt - 1, 0) if first_by_decode else max(prompt, 1)
    prefill = step_parts(system, 0, 0, prefill_tokens=batch * max(pf_tokens, 1), prefill_seqs=batch)
    if first_by_decode:
        extra["first"] = (step_parts(system, batch, batch * max(prompt, 1)), 1.0)
    return Prepared(
        p, decode=decode, prefill=prefill, request_s=request_overhead_s(system), batch=batch, out=out,
        prefill_runs=1.0 if pf_tokens > 0 else 0.0, **extra,
    )  # fmt: skip


def _stack_parts(parts: list[StepParts]) -> StepParts:
    arrays = {f.name: np.array([float(getattr(x, f.name)) for x in parts]) for f in fields(StepParts)}
    arrays["weight_only"] = arrays["weight_only"].astype(bool)
    arrays["sram"] = arrays["sram"].astype(bool)
    return StepParts(**arrays)


EXTRA = ("first", "shrink", "reprefill", "tail", "adp")  # further steps of a static-batch run (Prepared)


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


# rates (higher is faster); every other metric is a time
SPEED_METRICS: frozenset[Metric] = frozenset({"tok_s_user", "tok_s_total"})


def speed_ratio(row: Row) -> float | None:
    """Modelled speed over published speed (> 1: the model is optimistic), whatever the metric: a rate's
    ratio, a time's inverse ratio."""
    if row.predicted is None:
        return None
    ratio = row.predicted / row.point.value
    return ratio if row.point.metric in SPEED_METRICS else 1.0 / ratio


class Evidence(BaseModel):
    """Held-out error over a set of published points (all of them, or those sharing one model, device...)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    points: int
    sources: int
    median_error_pct: float
    within_30_pct: int  # share of the points within ±30 %, in %
    speed_ratio: float  # median modelled / published speed (a time inverted): > 1 reads faster than measured
    faster_pct: int  # share of the points the model reads faster than measured, in %


class Summary(Evidence):
    tier1_median_error_pct: float


class Accuracy(BaseModel):
    """What the CLI prints beside every modelled number: the cross-validated error in a few figures, and
    the same figures per group of points that share a model, device, stack or a combination of them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    summary: Summary
    by_model_device_stack: dict[str, Evidence]  # keys: "MODEL on DEVICE with STACK"
    by_model_device: dict[str, Evidence]  # keys: "MODEL on DEVICE"
    by_model_stack: dict[str, Evidence]  # keys: "MODEL with STACK"
    by_model: dict[str, Evidence]
    by_architecture: dict[str, Evidence]  # keys: architecture()
    by_device: dict[str, Evidence]
    by_stack: dict[str, Evidence]


def architecture(model: catalog.ModelSpec) -> str:
    """The model's class as far as the physics distinguishes it: MLA attention, mixture of experts, dense."""
    if model.kv_dim is not None:
        return "mla"
    return "moe" if model.is_moe else "dense"


def evidence(rows: list[Row]) -> Evidence:
    """Held-out error figures over the answered ones of ``rows`` (at least one)."""
    answered = [r for r in rows if r.error is not None]
    errs = np.array([abs(r.error) for r in answered if r.error is not None])
    speed = np.array([v for r in answered if (v := speed_ratio(r)) is not None])
    return Evidence(
        points=len(answered),
        sources=len({r.point.held_out_with for r in answered}),
        median_error_pct=round(float(np.median(errs)) * 100, 1),
        within_30_pct=round(float((errs <= 0.30).mean()) * 100),
        speed_ratio=round(float(np.median(speed)), 2),
        faster_pct=round(float((speed > 1.0).mean()) * 100),
    )


def _grouped(rows: list[Row], key: Callable[[Point], str]) -> dict[str, Evidence]:
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(key(r.point), []).append(r)
    return {k: evidence(v) for k, v in sorted(groups.items())}


def accuracy(rep: Report) -> Accuracy:
    """:class:`Accuracy` of a validation run."""
    answered = [r for r in rep.rows if r.error is not None and not r.point.sram_fit]  # fit points: no evidence
    return Accuracy(
        summary=Summary(
            **evidence(answered).model_dump(),
            tier1_median_error_pct=round(float(np.median(rep.errors(1))) * 100, 1),
        ),
        by_model_device_stack=_grouped(
            answered, lambda p: f"{p.model} on {p.device} with {stack_key(p.stack)}"
        ),
        by_model_device=_grouped(answered, lambda p: f"{p.model} on {p.device}"),
        by_model_stack=_grouped(answered, lambda p: f"{p.model} with {stack_key(p.stack)}"),
        by_model=_grouped(answered, lambda p: p.model),
        by_architecture=_grouped(answered, lambda p: architecture(catalog.model(p.model))),
        by_device=_grouped(answered, lambda p: p.device),
        by_stack=_grouped(answered, lambda p: stack_key(p.stack)),
    )


ACCURACY_FILE = "validation-accuracy.json"  # in voicepipe/hardware/data, written by update_doc


@cache
def shipped_accuracy() -> Accuracy:
    """The :func:`accuracy` of the shipped set, read from the file :func:`update_doc` writes (a test keeps
    it equal to a fresh run), so printing it costs no fit."""
    text = resources.files("voicepipe.hardware").joinpath("data", ACCURACY_FILE).read_text()
    return Accuracy.model_validate_json(text)


def accuracy_line(acc: Accuracy | None = None) -> str:
    a = (shipped_accuracy() if acc is None else acc).summary
    return (
        f"cross-validated on {a.points} published measurements, nearly all GPUs (the fitted GPU constants "
        f"refit without each source): median error {a.median_error_pct} % (tier 1: "
        f"{a.tier1_median_error_pct} %), {a.within_30_pct} % within ±30 % — `voicepipe hardware "
        "validate`, docs/hardware-model.md §3"
    )


FEW = 5  # the nearest evidence is the most specific group with at least this many points
ODD = 1.15  # a median speed ratio beyond ×/÷ this ...
ONE_SIDED = 80  # ... with this share of the points on that side, from two sources or more, is a direction
Kind = Literal[
    "model_device_stack", "model_device", "model_stack", "model", "device", "stack", "architecture"
]


def twins(model: catalog.ModelSpec) -> list[str]:
    """Catalog models with this model's architecture (a user's config.json of a catalogued model), by the
    fields the physics reads (for MLA the latent width, not the head layout a config states for its
    projections), parameter counts within 2 %; those with the most published points first."""
    same = ["layers", "hidden", "heads", "experts", "experts_active", "kv_dim", "window"]
    if model.kv_dim is None:
        same += ["kv_heads", "head_dim"]
    found = [
        key
        for key, m in catalog.models().items()
        if all(getattr(m, f) == getattr(model, f) for f in same)
        and math.isclose(m.params_total_b, model.params_total_b, rel_tol=0.02)
    ]
    counts = shipped_accuracy().by_model
    return sorted(found, key=lambda k: -(counts[k].points if k in counts else 0))


class Group(BaseModel):
    """Published points that share a part of a configuration, with their held-out error."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Kind
    label: str
    evidence: Evidence
    command: str  # the `voicepipe hardware validate` call that lists them


class NearReport(BaseModel):
    """How the model fared on the published points that share parts of one configuration, most specific
    first, and how to read the prediction from the nearest of them (text and JSON are this one object)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str  # as given: a catalog key or a config.json path
    catalogued_as: str | None  # the catalog model whose points speak for it (itself, or a twin)
    twins: list[str]  # every catalog model with its architecture (a config.json)
    held_out: bool  # False on an SRAM machine: its per-layer time is fitted to its vendor's speeds
    groups: list[Group]
    unmeasured: list[str]  # parts of the configuration no published point has
    nearest: Group | None  # the most specific group with at least FEW points
    reading: str  # how to read the prediction, from the nearest group


def _reading(g: Group | None, held_out: bool) -> str:
    if not held_out:
        return (
            "not held out: an SRAM machine's constants are fitted to two published speeds "
            "(`voicepipe hardware show DEVICE`); its other published points are held out (docs §4)"
        )
    if g is None:
        return f"no group of this configuration has {FEW} published points or more: its error is unknown"
    e = g.evidence
    spread = f"median error {e.median_error_pct:g} %, {e.within_30_pct} % of points within ±30 %"
    if e.sources >= 2 and e.speed_ratio > ODD and e.faster_pct >= ONE_SIDED:
        return f"it read faster than measured on {e.faster_pct} % of them ({spread}): a best case"
    if e.sources >= 2 and e.speed_ratio < 1 / ODD and e.faster_pct <= 100 - ONE_SIDED:
        return f"it read slower than measured on {100 - e.faster_pct} % of them ({spread}): a worst case"
    return f"no consistent direction ({e.faster_pct} % read faster); {spread}"


def near_report(
    device: str, model: catalog.ModelSpec, stack: str | None, acc: Accuracy | None = None
) -> NearReport:
    """The evidence for a configuration (``stack`` None: an SRAM machine, which runs its vendor's software
    and which GPU points of the same model say nothing about)."""
    a = shipped_accuracy() if acc is None else acc
    own = model.key in catalog.models()
    tw = [] if own else twins(model)
    key = model.key if own else (tw[0] if tw else None)
    arch = architecture(model)
    candidates: list[tuple[Kind, str, Evidence | None, list[str]]] = []
    if key is not None:
        m = key
        on, with_ = f" on {device}", f" with {stack}"
        if stack is None:
            candidates.append(("model_device", f"{m}{on}", a.by_model_device.get(f"{m}{on}"),
                               ["--model", m, "--device", device]))  # fmt: skip
        else:
            candidates += [
                ("model_device_stack", f"{m}{on}{with_}",
                 a.by_model_device_stack.get(f"{m}{on}{with_}"), ["--model", m, "--device", device, "--stack", stack]),
                ("model_device", f"{m}{on}, any stack", a.by_model_device.get(f"{m}{on}"),
                 ["--model", m, "--device", device]),
                ("model_stack", f"{m}{with_}, any device", a.by_model_stack.get(f"{m}{with_}"),
                 ["--model", m, "--stack", stack]),
                ("model", f"{m}, any device or stack", a.by_model.get(m), ["--model", m]),
            ]  # fmt: skip
    dev_label = f"{device}, any model" + ("" if stack is None else " or stack")
    candidates.append(("device", dev_label, a.by_device.get(device), ["--device", device]))
    if stack is not None:
        candidates.append(
            ("stack", f"{stack}, any model or device", a.by_stack.get(stack), ["--stack", stack])
        )
        candidates.append(("architecture", f"{arch.upper() if arch != 'dense' else arch} models, any device or stack",
                           a.by_architecture.get(arch), ["--architecture", arch]))  # fmt: skip
    groups: list[Group] = []
    for kind, label, e, flags in candidates:
        # none, or the very figures of a more specific group (the same points)
        if e is None or any(e == g.evidence for g in groups):
            continue
        if kind == "architecture" and key is not None and (ev := a.by_model.get(key)) and ev.points >= FEW:
            continue  # the model's own points say more than its architecture's
        groups.append(
            Group(
                kind=kind, label=label, evidence=e, command="voicepipe hardware validate " + " ".join(flags)
            )
        )
    unmeasured = [
        what for what, present in ((device, device in a.by_device), (stack or "", stack is None or stack in a.by_stack))
        if not present
    ]  # fmt: skip
    nearest = next((g for g in groups if g.evidence.points >= FEW), None)
    held_out = stack is not None
    return NearReport(
        model=model.key, catalogued_as=key, twins=tw, held_out=held_out, groups=groups,
        unmeasured=unmeasured, nearest=nearest if held_out else None, reading=_reading(nearest, held_out),
    )  # fmt: skip


def _figures(e: Evidence) -> str:
    pts = (
        f"{e.points} point{'s' if e.points != 1 else ''} / {e.sources} source{'s' if e.sources != 1 else ''}"
    )
    return f"median error {e.median_error_pct:g} %, speed {e.speed_ratio:.2f}×, {pts}"


def evidence_lines(r: NearReport) -> list[str]:
    """The report as the lines `hardware predict` and `sweep` print under the prediction."""
    head = "published points sharing parts of this configuration, most specific first"
    lines = [f"held-out error on {head}:" if r.held_out else f"{head}:"]
    if r.catalogued_as is None and r.model not in catalog.models():
        lines.append(
            f"  {r.model}: not the architecture of a catalogued model, so no published point of its own"
        )
    elif r.catalogued_as != r.model:
        also = f" (as is {', '.join(r.twins[1:])})" if len(r.twins) > 1 else ""
        lines.append(
            f"  {r.model}: the architecture of catalogued {r.catalogued_as}{also}, whose points follow"
        )
    lines += [f"  {g.label}: {_figures(g.evidence)}" for g in r.groups]
    lines += [f"  {what}: no published point, so its error is unknown" for what in r.unmeasured]
    lines.append("  (speed: modelled / measured, median; > 1× reads faster than measured)")
    where = f"nearest ({r.nearest.label}): " if r.nearest else ""
    lines.append(f"  {where}{r.reading}")
    if r.nearest is not None:
        lines.append(f"  rows: {r.nearest.command}")
    return lines


def update_doc(path: str = "docs/hardware-model.md") -> None:
    """Rewrite the validation table between the markers in ``path`` and the shipped accuracy summary."""
    from voicepipe.hardware.doctable import write_between

    rep = run()
    write_between(path, BEGIN, END, markdown(rep))
    target = Path(__file__).parent / "data" / ACCURACY_FILE
    target.write_text(accuracy(rep).model_dump_json(indent=2) + "\n")
