"""Published measurements, and each reduced to the raw parts of the engine steps its metric needs.

``data/validation.yaml`` lists published points (device, chips, model, precision, KV precision, batch,
prompt/output tokens, stack, metric, value, source, tier); :func:`points` reads them (a bad entry raises
ValueError naming the point and field). :func:`prepare` reduces one answerable point once to step parts
(:func:`voicepipe.hardware.model.step_parts`) at its published configuration, or gives the reason it cannot
be answered; :mod:`~voicepipe.hardware.validate.fit` turns those parts into metric values.

B, the batch that runs, is the published one, or fewer when their KV does not fit at the mean context
(:func:`voicepipe.hardware.model.running_sequences`). A per-token metric at concurrency B > 1 is
a loaded server's mean step (so is a closed-loop run's throughput): besides B decodes it prefills B·P/O
prompt tokens (every request brings P prompt tokens per O output tokens), on average half-way into their
prompt; a median inter-token gap
(``itl_median_ms``) is a decode-only step, since newcomers' prefills land in a minority of steps.
Three stack- or setting-specific dynamics add steps (:class:`Prepared`): a stack whose
first token comes from a decode step prefills P − 1 tokens and adds that step; a static batch that
outgrows its cache on a recompute-preempting stack (vLLM) runs :class:`voicepipe.hardware.model.Lockstep`'s
shrinking batch, re-prefill and tail; and under attention DP each decode step of a throughput run is
charged the expected wait for a rank that prefills a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from voicepipe.hardware import catalog
from voicepipe.hardware.model import (
    DEFAULT_EFFICIENCY,
    DoesNotFit,
    StepParts,
    System,
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

# per-token means of a server under steady concurrent load (the others time whole static batches); a
# median inter-token gap (itl_median_ms) is a decode-only step: newcomers' prefills land in a minority of steps
STEADY_STATE = ("tpot_ms", "itl_ms", "tok_s_user")
DEFAULT_PROMPT, DEFAULT_OUTPUT = 1024, 256  # where a source publishes no lengths (as `hardware predict`)
SATURATED = 512  # cap on "as many as fit" for a saturated server (trtllm-bench/vLLM throughput runs)


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
    extra: dict[str, Any] = {}
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


EXTRA = ("first", "shrink", "reprefill", "tail", "adp")  # further steps of a static-batch run (Prepared)
