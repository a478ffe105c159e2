"""Published measurements, and each as a run of the serving engine at its published configuration.

Every ``data/validation*.yaml`` lists published points (device, chips, model, precision, KV precision,
batch, prompt/output tokens, stack, metric, value, source, tier, provenance); :func:`points` reads them all
(a bad entry raises ValueError naming the file, point and field). :func:`prepare` turns one answerable
point into the engine run its metric is a figure of (:class:`Prepared`), or gives the reason it cannot be
answered; :mod:`~voicepipe.hardware.validate.fit` runs it
(:mod:`voicepipe.hardware.workload`, on :class:`voicepipe.hardware.serving.DeviceServer`).

B, the server's slots, is the published batch, or fewer when their KV does not fit at the mean context or
the engine's cap on running sequences is lower (:func:`voicepipe.hardware.model.running_sequences`); the
rest queue. The cap is the run's own (``max_seqs``: the ``--max-num-seqs`` / ``--max-batch-size`` its
source states, or ``trtllm-bench`` for a run that left it to that harness's tuning heuristic,
:mod:`~voicepipe.hardware.validate.harness`), else the stack's documented default. A saturated server (no
published batch) runs as many as fit under that cap. A per-token metric at concurrency B,
and a closed-loop client's throughput, are figures of a steady run (B clients, each holding one request in
flight); a median inter-token gap (``itl_median_ms``) is the median gap between the measured requests'
tokens (a step that also prefills is a longer gap). TTFT, end-to-end latency and a burst's throughput are
figures of a static batch: B requests arriving together, or a burst of ``num_prompts`` requests where
the source states how many it sent at once (more than fit: the server takes the rest as slots free,
in-flight, so the ramp and the drain are paid once, not once per B). A point whose client sent ``num_prompts``
requests at ``request_rate`` a second (open loop) runs as that: Poisson arrivals at that rate, as the
clients send them (:func:`voicepipe.hardware.workload.open_loop`: fixed seeds, enough draws for ~2,000
requests), the server runs what fits, and every figure is of those requests (a throughput over the first
arrival to the last finish).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from voicepipe.errors import UnsupportedSetting
from voicepipe.hardware import catalog
from voicepipe.hardware.catalog import BlockFp8Gemm
from voicepipe.hardware.model import (
    DEFAULT_EFFICIENCY,
    DoesNotFit,
    Speculative,
    System,
    make_system,
    matmul_params,
    running_sequences,
)
from voicepipe.hardware.validate.harness import trtllm_bench_max_batch, trtllm_bench_max_num_tokens
from voicepipe.hardware.workload import Lengths

Metric = Literal[
    "tpot_ms", "ttft_ms", "itl_ms", "itl_median_ms", "tok_s_user", "tok_s_total", "e2e_latency_s", "e2el_ms"
]

# per-token means of a server under steady concurrent load (the others time whole static batches); a
# median inter-token gap (itl_median_ms) is of the same run
STEADY_STATE = ("tpot_ms", "itl_ms", "tok_s_user")
BURST_METRICS = ("ttft_ms", "tok_s_total", "e2e_latency_s", "e2el_ms")  # the figures a burst of requests times
DEFAULT_PROMPT, DEFAULT_OUTPUT = 1024, 256  # where a source publishes no lengths (as `hardware predict`)
TRTLLM_BENCH = "trtllm-bench"  # a point's max_seqs: the run left max_batch_size to trtllm-bench's heuristic


class Point(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    device: str
    chips: int | None = Field(default=None, ge=1)  # None: not published; the model sizes the system
    model: str
    precision: str
    kv_precision: str | None = None
    batch: int | None = Field(default=None, ge=1)  # None: a saturated server (as many as fit, ≤ the cap)
    # the engine's cap on running sequences as the source ran it (vLLM --max-num-seqs, TensorRT-LLM
    # max_batch_size; per rank × ranks under attention DP), "trtllm-bench" (left to that harness's tuning
    # heuristic), or None: the stack's documented default
    max_seqs: Annotated[int, Field(ge=1)] | Literal["trtllm-bench"] | None = None
    # the step token budget as the source (or its harness) ran it (TensorRT-LLM max_num_tokens, vLLM
    # --max-num-batched-tokens), "trtllm-bench" (that harness's tuning heuristic), or None: the stack's default
    max_num_tokens: Annotated[int, Field(ge=1)] | Literal["trtllm-bench"] | None = None
    prompt_tokens: int | None = Field(
        default=None, ge=0
    )  # 0: pure decode (llama-bench tg); None: unpublished
    output_tokens: int | None = Field(default=None, ge=1)
    stack: str
    attention_dp: bool = False  # the source runs attention data-parallel (each chip its own sequences)
    # True: the source ran without CUDA/HIP graphs (vLLM --enforce-eager, SGLang --disable-cuda-graph)
    eager: bool = False
    scheduler_steps: int = Field(default=1, ge=1)  # vLLM V0 --num-scheduler-steps as the source ran it
    # the precision of the weights outside the routed experts in the checkpoint the source ran, where its
    # notes name one that stores them otherwise than the model's published checkpoint (llama.cpp's
    # "MXFP4 MoE" GGUF: MXFP4 experts, Q8_0 rest -> int8); None: the published checkpoint's (System)
    dense_precision: str | None = None
    # the block-scaled FP8 GEMM kernel the run's build ran, where its version's default or its stated
    # settings differ from the stack profile's (Stack.block_fp8_gemm); None: the profile's
    block_fp8_gemm: BlockFp8Gemm | None = None
    # True: the benchmark CLIENT holds `batch` requests in flight over many more requests in all (a
    # max-concurrency client: vLLM/SGLang bench --max-concurrency, genai-perf or trtllm-bench
    # --concurrency): its throughput is the loaded server's mean step, newcomers' prefills included, not a
    # static batch's one prefill and O decodes. A burst sent all at once (MLPerf Offline, benchmark_throughput,
    # trtllm-bench at infinite rate) is not: the server takes a static batch of what fits
    closed_loop: bool = False
    # an open-loop client: ``num_prompts`` requests sent at ``request_rate`` a second whatever the server
    # does (bench_serving --request-rate R --num-prompts N, a QPS sweep); without a rate, a burst of
    # ``num_prompts`` requests sent at once (trtllm-bench throughput's dataset, benchmark_throughput's
    # --num-prompts); None: not stated
    request_rate: float | None = Field(default=None, gt=0)
    num_prompts: int | None = Field(default=None, ge=1)
    # how the client drew each request's lengths around the recorded means (workload.request_lengths):
    # fixed (every request the same), uniform (a random dataset at range ratio 0: 1 … 2·mean − 1), or
    # exponential (a dataset sampled per request whose per-request lengths are not published: ShareGPT).
    # A burst of varied lengths runs its ``num_prompts`` requests where stated (its tail is its longest)
    lengths: Literal["fixed", "uniform", "exponential"] = "fixed"
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
    # vendor: makes the hardware; framework: maintains the serving stack measured; independent: neither
    publisher_family: Literal["vendor", "framework", "independent"] | None = None
    # provenance (issue 24): speculative decoding as run ("none", or the method with its settings), the
    # engine and its version as the source states them, and whether the timing was taken by a client over
    # HTTP ("client") or by the engine's own benchmark ("engine"); None/"" where the source does not say
    speculative: str | None = None
    engine: str = ""
    engine_version: str = ""
    timing: Literal["client", "engine"] | None = None
    # True: one of the two points an SRAM machine's constants were fitted to (devices.yaml); not evidence
    sram_fit: bool = False

    @model_validator(mode="after")
    def _closed_loop_is_a_throughput(self) -> Point:
        if self.closed_loop and self.metric != "tok_s_total":
            raise ValueError("closed_loop applies to tok_s_total only")
        if self.request_rate is not None and self.num_prompts is None:
            raise ValueError("request_rate needs num_prompts (an open-loop client's rate and count)")
        if self.num_prompts is not None and self.request_rate is None and (
            self.metric not in BURST_METRICS or self.closed_loop
        ):
            raise ValueError("num_prompts without request_rate is a burst sent at once (not a closed loop; "
                             "a throughput, TTFT or end-to-end metric)")
        if self.request_rate is not None and self.closed_loop:
            raise ValueError("request_rate is an open-loop client; closed_loop is the other kind")
        return self

    @property
    def held_out_with(self) -> str:
        return self.group or self.source

    @property
    def family(self) -> str:
        """What the family hold-out holds out together: the publisher's name (its text before any " (" or
        ","), so one vendor's docs and blogs, or one framework's maintainers, are one family and each
        independent author its own; without a publisher, the point's source group."""
        name = self.publisher.split(" (")[0].split(",")[0].strip()
        return name or self.held_out_with

    @property
    def is_speculative(self) -> bool:
        """Measured with speculative decoding (any method other than "none")."""
        return self.speculative not in (None, "", "none")

    def speculative_settings(self) -> Speculative | None:
        """The speculative model's settings the point states (``alpha=…``, ``gamma=…``, ``draft_cost=…`` in
        ``speculative``), or None when any is missing."""
        got = dict(re.findall(r"(alpha|gamma|draft_cost)=([0-9.]+)", self.speculative or ""))
        if not {"alpha", "gamma", "draft_cost"} <= got.keys():
            return None
        return Speculative(float(got["alpha"]), int(float(got["gamma"])), float(got["draft_cost"]))


@cache
def points() -> tuple[Point, ...]:
    """The shipped validation points, every ``validation*.yaml`` in the data folder in name order (raises
    ValueError naming the file, point and field)."""
    data = resources.files("voicepipe.hardware").joinpath("data")
    out = []
    for name in sorted(f.name for f in data.iterdir() if f.name.startswith("validation") and f.name.endswith(".yaml")):
        raw = (yaml.safe_load(data.joinpath(name).read_text()) or {}).get("points") or []
        for i, item in enumerate(raw):
            try:
                out.append(Point(**item))
            except ValidationError as exc:
                err = exc.errors()[0]
                where = item.get("id", f"#{i}") if isinstance(item, dict) else f"#{i}"
                raise ValueError(
                    f"{name}: points[{where}].{'.'.join(map(str, err['loc']))}: {err['msg']}"
                ) from None
    return tuple(out)


@dataclass(frozen=True)
class Prepared:
    """A point as a run of the serving engine (or the reason it cannot be answered).

    ``workload`` is ``static`` (``requests`` arriving together at t = 0), ``steady`` (``requests``
    clients each holding one in flight, :func:`voicepipe.hardware.workload.steady`) or ``open`` (``requests``
    sent at ``rate`` a second, Poisson, :func:`voicepipe.hardware.workload.open_loop`); ``batch`` is
    the server's slots (what fits, at most the published batch; an open loop's: what fits, at most its
    requests)."""

    point: Point
    reason: str = ""
    system: System | None = None
    workload: Literal["static", "steady", "open"] = "static"
    rate: float = 0.0  # open: requests a second
    requests: int = 0
    batch: int = 0  # the batch that runs (≤ the published one)
    prompt: int = 0
    out: int = 0  # output tokens (DEFAULT_OUTPUT where unpublished)
    spec: Speculative | None = None  # the stated speculative settings the run decodes with
    lengths: Lengths = "fixed"  # the requests' lengths around prompt / out (Point.lengths)


def stack_key(name: str) -> str:
    """The catalog profile a point's stack name stands for."""
    return {"tensorrt-llm": "trtllm", "turbomind": "lmdeploy", "mlc-llm": "mlc", "llamacpp": "llama.cpp"}.get(
        name.lower(), name.lower()
    )


def prepare(p: Point) -> Prepared:
    """A point's configuration as an engine run (see :class:`Prepared`). A speculative point runs with
    the speculative model at its stated settings; without them it is left out, never run without it."""
    spec = p.speculative_settings()
    if p.is_speculative and spec is None:
        return Prepared(p, reason="speculative, no α")  # the speculative model needs α, γ and draft cost
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
    if p.dense_precision is not None and p.dense_precision not in catalog.PRECISIONS:
        return Prepared(p, reason=f"dense precision {p.dense_precision!r} is not modelled")
    ctx_max = prompt + out
    stated = p.max_seqs if isinstance(p.max_seqs, int) else None
    if dev.kind == "sram" or p.chips is None:
        try:
            system = make_system(
                dev, mdl, p.precision, seqs=1 if dev.kind == "hbm" else (p.batch or 1), context=ctx_max,
                kv_precision=p.kv_precision, stack=stk, timing=p.timing, eager=p.eager,
                scheduler_steps=p.scheduler_steps, max_seqs=stated, dense_precision=p.dense_precision,
            )  # fmt: skip
        except (DoesNotFit, UnsupportedSetting) as exc:
            return Prepared(p, reason=str(exc))
    else:
        if p.chips > dev.max_tp:
            return Prepared(
                p, reason=f"{p.chips} chips exceed {dev.key}'s tensor-parallel group ({dev.max_tp})"
            )
        try:
            system = System(
                dev, mdl, p.precision, p.chips, DEFAULT_EFFICIENCY, p.kv_precision, stk, p.attention_dp, p.timing,
                p.eager, p.scheduler_steps, stated, p.dense_precision,
            )  # fmt: skip
        except UnsupportedSetting as exc:  # a setting its stack has no switch for: the point is mis-recorded
            return Prepared(p, reason=str(exc))
    if p.block_fp8_gemm is not None:  # the run's own block-FP8 GEMM kernel (a run setting, not the sizing)
        system = replace(system, block_fp8_gemm=p.block_fp8_gemm)
    if p.max_seqs == TRTLLM_BENCH:
        system = replace(system, max_seqs=trtllm_bench_max_batch(system, prompt, out))
    if p.max_num_tokens == TRTLLM_BENCH:
        system = replace(system, max_num_tokens=trtllm_bench_max_num_tokens(system, prompt, out))
    elif isinstance(p.max_num_tokens, int):
        system = replace(system, max_num_tokens=p.max_num_tokens)
    # the server's slots: what fits under the engine's cap, at most the published batch
    room = running_sequences(system, prompt, out)
    asked = room if p.batch is None else p.batch
    batch = asked if dev.kind == "sram" else min(asked, room)
    if batch < 1:
        return Prepared(p, reason=f"weights do not fit {p.chips} x {dev.key} at {p.precision}")
    if p.metric == "ttft_ms" and p.prompt_tokens is not None and dev.kind == "hbm":
        # no cold prefill beats the datasheet peak: a TTFT under it was served from a prefix cache (or its
        # lengths are not what was run), so it says nothing about the physics of a prefill
        # (the output head runs for the prompt's last token only)
        flops = 2.0 * (matmul_params(mdl) * p.prompt_tokens - mdl.embed_params * (p.prompt_tokens - 1))
        floor_ms = flops / (system.chips * dev.peak_flops(p.precision)) * 1e3
        if p.value < floor_ms:
            return Prepared(p, reason="below peak FLOPs")  # docs §3: a TTFT under its compute floor
    # a per-token mean at concurrency B, and a closed-loop client's throughput, are a loaded server's;
    # the rest time a burst of requests arriving together (as many as published; "saturated": what fits)
    if p.request_rate is not None and p.num_prompts is not None:
        # an open-loop client: its requests arrive at its rate whatever the server does; the server runs
        # as many as fit under its cap (the published batch, a mean concurrency, is an outcome here)
        return Prepared(p, system=system, workload="open", rate=p.request_rate, requests=p.num_prompts,
                        batch=min(room, p.num_prompts) if dev.kind == "hbm" else batch, prompt=prompt, out=out,
                        spec=spec, lengths=p.lengths)  # fmt: skip
    steady = p.metric in STEADY_STATE or p.metric == "itl_median_ms" or p.closed_loop
    requests = asked if p.batch is not None else batch
    if not steady and p.num_prompts is not None:
        # the burst the source sent: past the slots, the rest start in flight as requests finish
        requests = p.num_prompts
    return Prepared(p, system=system, workload="steady" if steady else "static", requests=requests,
                    batch=batch, prompt=prompt, out=out, spec=spec, lengths=p.lengths)  # fmt: skip
