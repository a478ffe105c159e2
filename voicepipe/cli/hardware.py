"""``voicepipe hardware``: list / show the catalog, predict one configuration, sweep batch sizes,
validate against published measurements.

Every timing this prints is MODELLED by :mod:`voicepipe.hardware.model` (physics with fitted efficiency
factors, see docs/hardware-model.md), not measured. ``--hardware`` and ``--model`` take catalog names or
files (a device YAML, a Hugging Face ``config.json``). Tables fit the terminal's width: columns are
dropped lowest priority first. ``--format json`` prints JSON to stdout; ``--json FILE`` writes it to FILE.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import typer
from rich.console import Console
from rich.table import Table

from voicepipe.backends.empirical import profiles
from voicepipe.backends.hardware import FAST_MAX_BATCH, deploy, make_hardware_backend
from voicepipe.cli.emit import JsonOpt, WideOpt
from voicepipe.cli.emit import console as _console
from voicepipe.cli.emit import emit_json as _emit_json
from voicepipe.cli.emit import fail as _fail
from voicepipe.cli.emit import guard as _guard
from voicepipe.cli.emit import message as _message
from voicepipe.cli.hardware_list import print_catalog
from voicepipe.cli.hardware_validate import validate
from voicepipe.errors import UnsupportedSetting, UserError
from voicepipe.executors import EXECUTOR_HELP, executor_for
from voicepipe.hardware import catalog
from voicepipe.hardware.model import DoesNotFit, Prediction, Speculative
from voicepipe.hardware.model import predict as model_predict
from voicepipe.hardware.sweep import SweepJob, sweep_rows
from voicepipe.hardware.workload import Lengths
from voicepipe.parallel import ItemFailed
from voicepipe.report.term import Col, print_fitted

if TYPE_CHECKING:
    from voicepipe.hardware.validate import NearReport, Ranges

app = typer.Typer(
    help="Hardware models: which device/model answers inside the turn budget.", no_args_is_help=True,
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
)
MODELLED = "MODELLED by voicepipe.hardware (analytic physics model; not measured)"


def _accuracy() -> str:
    """How far such modelled numbers have been from published measurements (printed beside them)."""
    from voicepipe.hardware.validate import accuracy_line  # lazy: start-up time

    return accuracy_line()


def _modelled() -> str:
    return f"{MODELLED}; {_accuracy()}"


def _validation() -> dict[str, float | int]:
    from voicepipe.hardware.validate import shipped_accuracy  # lazy: start-up time

    return shipped_accuracy().summary.model_dump()


def _evidence_stack(dev: catalog.Device, stk: catalog.Stack | None) -> str | None:
    """The stack whose published points speak for this configuration: the chosen (or default) profile on
    an HBM device; None on an SRAM machine, which runs its vendor's own software."""
    return None if dev.kind == "sram" else (stk or catalog.stack()).key


def _near(dev: catalog.Device, mdl: catalog.ModelSpec, stk: catalog.Stack | None) -> NearReport:
    """How the model fared on published points sharing parts of this configuration."""
    from voicepipe.hardware.validate import near_report  # lazy: start-up time

    return near_report(dev.key, mdl, _evidence_stack(dev, stk))


def _ranges(dev: catalog.Device, mdl: catalog.ModelSpec, stk: catalog.Stack | None, batch: int, precision: str,
            values: dict[str, float]) -> Ranges:  # fmt: skip
    """The 80 % ranges of ``values`` from the shipped held-out residuals (voicepipe.hardware.validate.ranges)."""
    from voicepipe.hardware.validate import device_maker, ranges, shipped_accuracy  # lazy: start-up time

    return _guard(lambda: ranges(shipped_accuracy(), values, dev.key, dev.kind, _evidence_stack(dev, stk), mdl, batch,
                                 precision, maker=device_maker(dev)))  # fmt: skip


def _with_range(text: str, rng: Ranges, metric: str) -> str:
    from voicepipe.hardware.validate import fmt_range  # lazy: start-up time

    return f"{text} {fmt_range(*rng.intervals[metric])}"


GROWS = "the KV cache fills before they finish: the newest are evicted and recomputed"  # Prediction.preempts


def _range_note(level: float, thin: Sequence[str]) -> str:
    far = f"; far from evidence: {', '.join(thin)}" if thin else ""
    return (f"(low–high): the {level:.0%} range from the held-out residuals of this configuration's slices, "
            f"each publisher family one vote{far}")  # fmt: skip


def _print_near(con: Console, near: NearReport) -> None:
    from voicepipe.hardware.validate import evidence_lines  # lazy: start-up time

    for line in evidence_lines(near):
        con.print(line, highlight=False, markup=False)




def ttft_label(timing: str, batch: int) -> str:
    """The TTFT row's label: a request alone is on an idle device; among ``batch`` clients the mean TTFT
    includes the prefills it waits behind (and, past what fits or runs at once, the queue)."""
    where = "idle, no queue" if batch == 1 else f"mean over {batch} clients, queueing included"
    return f"TTFT ({timing}-side, {where})"


def _lengths(text: str) -> Lengths:
    """``--lengths`` as the engine's workload takes it (one-line error otherwise)."""
    if text not in get_args(Lengths):
        _fail(f"--lengths: use {', '.join(get_args(Lengths))}, got {text!r}")
    return cast(Lengths, text)


def _speculative(text: str | None) -> Speculative | None:
    if not text:
        return None
    parts = text.split(",")
    if len(parts) != 3:
        _fail(f"--speculative must be ALPHA,GAMMA,DRAFT_COST, got {text!r}")
    try:
        return Speculative(float(parts[0]), int(parts[1]), float(parts[2]))
    except ValueError as exc:
        _fail(f"--speculative: {exc}")


@app.command("list")
def list_(wide: bool = WideOpt) -> None:
    """Devices, models, serving stacks and empirical profiles in the catalog."""
    print_catalog(_console(), wide)


def _print_entry(con: Console, title: str, rows: dict[str, Any], sources: dict[str, str]) -> None:
    """Fields as a two-column table, then the sources as a readable list."""
    t = Table(title=title, title_justify="left")
    t.add_column("field")
    t.add_column("value", overflow="fold")
    for k, v in rows.items():
        if k in ("sources", "key", "prices", "quality", "name") or v is None:
            continue
        if isinstance(v, dict):  # a number table (peak FLOP/s by precision) or a nested record (engine memory)
            value = ", ".join(f"{a} {b:g}" if isinstance(b, int | float) else f"{a} {b}"
                              for a, b in v.items() if a != "sources" and b is not None)  # fmt: skip
        else:  # a whole number as one (80 GB, not 80.0), every other value as it is stored
            value = str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)
        t.add_row(k, value)
    con.print(t)
    con.print("Sources:")
    for k, src in sources.items():
        con.print(f"  - {k}: {src}", soft_wrap=True, highlight=False, markup=False)


@app.command()
def show(name: str = typer.Argument(..., help="device, model, empirical profile, or DEVICE/MODEL")) -> None:
    """A catalog entry with the source of every number."""
    con = _console()
    if name in catalog.devices():
        d = catalog.devices()[name]
        _print_entry(con, f"Device {name}: {d.name}", d.model_dump(), d.sources)
        return
    if name in catalog.stacks():
        st = catalog.stacks()[name]
        _print_entry(con, f"Serving stack {name}: {st.name}", st.model_dump(exclude={"platforms"}), st.sources)
        for maker, over in st.platforms.items():  # the profile's build on one maker's devices (Stack.on)
            changed = {k: v for k, v in over.items() if k not in ("name", "sources")}
            _print_entry(con, f"On {maker} devices: {over['name']}", changed, over.get("sources") or {})
        return
    if name in catalog.models():
        m = catalog.models()[name]
        _print_entry(con, f"Model {name}", m.model_dump(), m.sources)
        if m.quality:
            con.print(
                f"quality: {m.quality.score:g} ({m.quality.benchmark}) — {m.sources.get('quality', '')}"
            )
        for dev, p in m.prices.items():
            con.print(f"public price on {dev}: ${p.input:g} in / ${p.output:g} out per Mtok — {p.source}")
        return
    if name in catalog.quality_only():
        q = catalog.quality_only()[name]
        con.print(f"{name}: quality {q.quality.score:g} ({q.quality.benchmark}) — {q.sources['quality']}")
        return
    if name in profiles():
        prof = profiles()[name]
        t = Table(title=f"Empirical profile {name} (measured, not modelled)", title_justify="left")
        t.add_column("field")
        t.add_column("value", overflow="fold")
        for k, v in prof.items():
            t.add_row(k, str(v))
        con.print(t)
        return
    if "/" in name:
        backend = _guard(lambda: make_hardware_backend(name))
        con.print_json(json.dumps(backend.describe(), default=str))
        con.print(_modelled())
        sys_ = backend.system
        _print_near(con, _near(sys_.device, sys_.model, sys_.serving))
        return
    _fail(
        f"unknown NAME {name!r}: not a device ({', '.join(catalog.devices())}), a model, "
        "an empirical profile, or DEVICE/MODEL"
    )


def _check_lookup(hardware: str, model: str) -> tuple[catalog.Device, catalog.ModelSpec]:
    try:
        dev = catalog.device(hardware)
    except ValueError as exc:
        _fail(f"--hardware: {exc}")
    try:
        mdl = catalog.model(model)
    except ValueError as exc:
        _fail(f"--model: {exc}")
    return dev, mdl


def _options(precision: str | None, kv_precision: str | None, stack: str | None) -> catalog.Stack | None:
    if precision is not None and precision not in catalog.PRECISIONS:
        _fail(f"--precision: unknown precision {precision!r}; use one of {', '.join(catalog.PRECISIONS)}")
    if kv_precision is not None and kv_precision not in catalog.KV_PRECISIONS:
        _fail(f"--kv-precision: unknown {kv_precision!r}; use one of {', '.join(catalog.KV_PRECISIONS)}")
    try:
        return None if stack is None else catalog.stack(stack)
    except ValueError as exc:
        _fail(f"--stack: {exc}")


HardwareOpt = typer.Option(..., "--hardware", "-H", help="device name (`hardware list`) or a device .yaml")
ModelOpt = typer.Option(..., "--model", "-m", help="model name or a Hugging Face config.json")
PrecisionOpt = typer.Option(None, "--precision", help="weights: bf16|fp16|fp8|int8|int4|fp4")
KvOpt = typer.Option(None, "--kv-precision", help="KV cache: bf16|fp16|fp8|int8|fp4 (default: the stack's rule: "
                     "vLLM and SGLang keep 16 bit, others the weights' format where it is one)")  # fmt: skip
PromptOpt = typer.Option(1024, "--prompt-tokens", min=1, help="tokens in each request's prompt")
OutputOpt = typer.Option(256, "--output-tokens", min=1, help="tokens each request generates")
TpOpt = typer.Option(None, "--tp", min=1, help="tensor-parallel width (HBM devices; default: the smallest power of two that holds the model)")
StackOpt = typer.Option(None, "--stack", help="serving stack profile (`hardware list`; default vllm)")
FormatOpt = typer.Option("table", "--format", help="table or json (stdout)")
EagerOpt = typer.Option(
    False, "--eager", help="no CUDA/HIP graphs (vLLM --enforce-eager, SGLang --disable-cuda-graph)"
)
StepsOpt = typer.Option(
    1, "--scheduler-steps", min=1, help="vLLM V0 multi-step scheduling: host work once per N decode steps"
)
MaxSeqsOpt = typer.Option(None, "--max-seqs", min=1, help="the engine's cap on running sequences (vLLM "
                          "--max-num-seqs, TensorRT-LLM --max_batch_size); default: the stack's")  # fmt: skip
MaxTokensOpt = typer.Option(None, "--max-num-tokens", min=1, help="the engine's step token budget (vLLM "
                            "--max-num-batched-tokens, TensorRT-LLM --max_num_tokens, SGLang --chunked-prefill-size): "
                            "prompts share a step up to it; default: the stack's (one prompt a step where it sets none)")  # fmt: skip
AdpOpt = typer.Option(False, "--attention-dp", help="attention data parallelism (SGLang --enable-dp-attention, "
                      "TensorRT-LLM enable_attention_dp, vLLM --data-parallel-size): each chip runs the attention "
                      "of its own share of the sequences; two chips or more")  # fmt: skip
LengthsOpt = typer.Option("fixed", "--lengths", help="the requests' lengths: fixed (every one the stated lengths), "
                          "uniform (1 … twice the stated, a random dataset at range ratio 0) or exponential (a "
                          "dataset like ShareGPT: most short, a few long, at the stated means)")  # fmt: skip
LEVEL = 0.8  # the ranges' level (voicepipe.hardware.validate.slices.LEVEL; a test keeps them equal)
RANGED = ("ttft_ms", "step_ms", "tokens_per_second", "aggregate_tokens_per_second")  # metrics with a range
SWEEP_KEYS = {"ttft_ms": "ttft_ms", "step_ms": "step_ms", "tokens_per_second": "per_user_tps",
              "aggregate_tokens_per_second": "aggregate_tps"}  # fmt: skip
def _predict(
    dev: catalog.Device, mdl: catalog.ModelSpec, batch: int, prompt_tokens: int, output_tokens: int,
    tp: int | None, precision: str | None, kv_precision: str | None, stk: catalog.Stack | None,
    spec: Speculative | None, timing: Literal["client", "engine"] | None = None, eager: bool = False,
    scheduler_steps: int = 1, max_seqs: int | None = None, max_num_tokens: int | None = None,
    lengths: Lengths = "fixed", attention_dp: bool = False,
) -> Prediction:  # fmt: skip
    """``hardware predict``'s call; a sweep row (:class:`voicepipe.hardware.sweep.SweepJob`) makes the same
    one without ``spec`` (same chips for the same batch)."""
    return model_predict(
        dev, mdl, precision=precision, batch=batch, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        tp=tp, spec=spec, kv_precision=kv_precision, stack=stk, timing=timing, eager=eager,
        scheduler_steps=scheduler_steps, max_seqs=max_seqs, max_num_tokens=max_num_tokens, lengths=lengths,
        attention_dp=attention_dp,
    )  # fmt: skip


@app.command()
def predict(
    hardware: str = HardwareOpt,
    model: str = ModelOpt,
    batch: int = typer.Option(1, "--batch", min=1, help="concurrent sequences decoding together"),
    prompt_tokens: int = PromptOpt,
    output_tokens: int = OutputOpt,
    tp: int | None = TpOpt,
    precision: str | None = PrecisionOpt,
    kv_precision: str | None = KvOpt,
    stack: str | None = StackOpt,
    speculative: str | None = typer.Option(
        None, "--speculative", help="ALPHA,GAMMA,DRAFT_COST: draft acceptance (0-1), drafts a step, a draft step's "
        "cost as a share of the target's (e.g. 0.7,4,0.05)"
    ),
    anchor: Path | None = typer.Option(None, "--anchor", help="a `calibrate --anchor` profile: its measurement x the model's ratio"),
    ttft_timing: str | None = typer.Option(
        None, "--ttft-timing", help="client (over the server's HTTP path, tokens streamed through its API process) or engine; default: the stack's"
    ),
    eager: bool = EagerOpt,
    scheduler_steps: int = StepsOpt,
    max_seqs: int | None = MaxSeqsOpt,
    max_num_tokens: int | None = MaxTokensOpt,
    lengths: str = LengthsOpt,
    attention_dp: bool = AdpOpt,
    fmt: str = FormatOpt,
    json_out: Path | None = JsonOpt,
) -> None:
    """One configuration, a request alone or among --batch clients: TTFT, step time, tok/s, chips, bound."""
    kind = _lengths(lengths)
    dev, mdl = _check_lookup(hardware, model)
    stk = _options(precision, kv_precision, stack)
    spec = _speculative(speculative)
    if ttft_timing not in (None, "client", "engine"):
        _fail(f"--ttft-timing: use client or engine, got {ttft_timing!r}")
    timing = cast(Literal["client", "engine"] | None, ttft_timing)
    if anchor is not None:  # ANCHORED numbers: voicepipe.cli.anchored
        if timing is not None:
            _fail("--ttft-timing: an anchored TTFT keeps the timing of the anchor's own measurement (client-side)")
        if (eager or scheduler_steps != 1 or max_seqs is not None or max_num_tokens is not None or lengths != "fixed"
                or attention_dp):
            flag = ("--eager" if eager else "--scheduler-steps" if scheduler_steps != 1
                    else "--max-seqs" if max_seqs is not None
                    else "--max-num-tokens" if max_num_tokens is not None
                    else "--attention-dp" if attention_dp else "--lengths")  # fmt: skip
            _fail(f"{flag}: an anchored prediction keeps the run settings of the anchor's own measurement")
        from voicepipe.cli.anchored import predict_anchored

        return predict_anchored(anchor, dev, mdl, batch, prompt_tokens, output_tokens, tp, precision, kv_precision,
                                stack, spec, fmt, json_out)  # fmt: skip
    try:
        p = _predict(dev, mdl, batch, prompt_tokens, output_tokens, tp, precision, kv_precision, stk, spec, timing,
                     eager, scheduler_steps, max_seqs, max_num_tokens, kind, attention_dp)  # fmt: skip
    except DoesNotFit as exc:
        if fmt == "json":
            typer.echo(json.dumps({"fits": False, "error": str(exc), "hardware": hardware, "model": model}))
        _fail(str(exc))
    except UnsupportedSetting as exc:
        _fail(_message(exc))
    except ValueError as exc:
        _fail(f"--tp: {exc}" if "tp" in str(exc) else str(exc))
    out = p.as_dict()
    out["modelled"] = True
    rng = _ranges(dev, mdl, stk, p.batch, p.precision, {m: getattr(p, m) for m in RANGED})
    out["intervals"] = {m: list(v) for m, v in rng.intervals.items()}
    out["interval_level"] = rng.level
    out["interval_far_from_evidence"] = list(rng.thin)
    out["weight_only"] = dev.kind == "hbm" and dev.weight_only(p.precision)  # no math at that precision
    out["validation"] = _validation()
    near = _near(dev, mdl, stk)
    out["validation_near"] = near.model_dump()
    out["speculative"] = None if spec is None else spec.__dict__
    out["eager"], out["scheduler_steps"], out["max_num_tokens"] = eager, scheduler_steps, max_num_tokens
    out["attention_dp"] = attention_dp
    out["lengths"] = lengths
    out["sources"] = {"device": dev.sources, "model": mdl.sources, "method": "docs/hardware-model.md"}
    if _emit_json(out, fmt, json_out):
        return
    fits = "yes" if p.fits else f"NO: runs {p.effective_batch} of {p.batch} at a time, queues the rest"
    rows = [
        ("chips", f"{p.chips}" + (" (attention DP: each runs the attention of its own sequences)" if attention_dp else "")),
        ("precision (weights / KV)", f"{p.weights_label()} / {p.kv_precision}"),
        *([("weight-only", f"no {p.precision} math here: bf16 matmuls")] if out["weight_only"] else []),
        ("stack", p.stack),
        ("stack build", p.stack_build),
        ("batch", f"{p.batch}" + ("" if lengths == "fixed" else f" ({lengths} lengths around {prompt_tokens} in / {output_tokens} out)")),
        ("fits", fits),
        ("max batch at this context", f"{p.max_batch_fits}" + (f" (engine cap {p.max_seqs})" if p.max_seqs else "")),
        *([("as they grow", GROWS)] if p.preempts else []),
        ("weights", f"{p.weights_gb:.1f} GB"),
        ("KV cache", f"{p.kv_gb:.2f} GB"),
        *([("engine reserve (activations, buffers)", f"{p.engine_reserve_gb:.1f} GB")] if p.engine_reserve_gb else []),
        (ttft_label(p.ttft_timing, p.batch), _with_range(f"{p.ttft_ms:,.1f} ms", rng, "ttft_ms")),
        ("decode step", _with_range(f"{p.step_ms:.2f} ms", rng, "step_ms")),
        ("tok/s per request", _with_range(f"{p.tokens_per_second:,.1f}", rng, "tokens_per_second")),
        ("tok/s aggregate", _with_range(f"{p.aggregate_tokens_per_second:,.1f}", rng, "aggregate_tokens_per_second")),
        ("bound", p.bound),
        ("step: memory / compute", f"{p.memory_ms:.2f} / {p.compute_ms:.2f} ms"),
        ("step: all-reduce / fixed", f"{p.comm_ms:.2f} / {p.overhead_ms:.2f} ms"),
    ]
    t = Table(title=f"{dev.key}/{mdl.key}", title_justify="left", caption=MODELLED)
    t.add_column("quantity")
    t.add_column("value", justify="right", overflow="fold")
    for k, v in rows:
        t.add_row(k, v)
    con = _console()
    con.print(t)
    con.print(_range_note(rng.level, rng.thin), highlight=False, markup=False)
    con.print(_accuracy())
    _print_near(con, near)


def _batches(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        _fail(f"--batches must be comma-separated integers, got {text!r}")
    if not values or values[0] < 1:
        _fail(f"--batches must be integers >= 1, got {text!r}")
    return values


def _sweep_rows(job: SweepJob, batches: list[int], executor: str | None) -> list[dict[str, Any]]:
    """The rows on the ``--executor`` named; a user error or a row's ValueError is one line, exit 2."""
    try:
        ex = executor_for(executor)
    except UserError as exc:
        _fail(str(exc))
    with closing(ex):
        try:
            return sweep_rows(job, batches, ex)
        except ItemFailed as failed:
            if not isinstance(failed.error, (ValueError, KeyError)):
                raise failed.error from None
            _fail(str(failed.error).strip("'\""))


@app.command()
def sweep(
    hardware: str = HardwareOpt,
    model: str = ModelOpt,
    batches: str = typer.Option("1,2,4,8,16,32,64,128,256", "--batches", help="comma-separated batch sizes"),
    prompt_tokens: int = PromptOpt,
    output_tokens: int = OutputOpt,
    tp: int | None = TpOpt,
    precision: str | None = PrecisionOpt,
    kv_precision: str | None = KvOpt,
    stack: str | None = StackOpt,
    eager: bool = EagerOpt,
    scheduler_steps: int = StepsOpt,
    max_seqs: int | None = MaxSeqsOpt,
    max_num_tokens: int | None = MaxTokensOpt,
    lengths: str = LengthsOpt,
    attention_dp: bool = AdpOpt,
    fmt: str = FormatOpt,
    json_out: Path | None = JsonOpt,
    wide: bool = WideOpt,
    executor: str | None = typer.Option(None, "--executor", help=EXECUTOR_HELP),
) -> None:
    """Batching trade-off: step time, per-user and aggregate tok/s, $/Mtok; marks fast mode vs default.

    Each row is exactly `hardware predict --batch B` (same chips, same numbers)."""
    kind = _lengths(lengths)
    dev, mdl = _check_lookup(hardware, model)
    stk = _options(precision, kv_precision, stack)
    bs = _batches(batches)
    cfg: dict[str, Any] = {"hardware": hardware, "model": model, "precision": precision, "tp": tp,
                           "kv_precision": kv_precision, "stack": stack, "eager": eager,
                           "scheduler_steps": scheduler_steps, "attention_dp": attention_dp}  # fmt: skip
    # the backend's default deployment (its max_batch marks the "default" row); --max-seqs is a cap, not a
    # batch the backend must hold at its sizing context (a backend's max_batch is sized strictly), so it only
    # replaces that mark: a row past what fits runs what fits, as `hardware predict --max-seqs` does
    dep = _guard(lambda: deploy({k: v for k, v in cfg.items() if v is not None}))
    default = dep.max_batch if max_seqs is None else max_seqs
    bs = sorted(set(bs) | {FAST_MAX_BATCH, default})
    job = SweepJob(dev, mdl, prompt_tokens, output_tokens, tp, precision, kv_precision, stk, FAST_MAX_BATCH,
                   default, eager, scheduler_steps, max_seqs, max_num_tokens, kind, attention_dp)  # fmt: skip
    rows = _sweep_rows(job, bs, executor)
    rngs = []
    for r in rows:
        rng = _ranges(dev, mdl, stk, r["batch"], dep.system.precision, {m: r[k] for m, k in SWEEP_KEYS.items()})
        r["intervals"] = {m: list(v) for m, v in rng.intervals.items()}
        r["interval_far_from_evidence"] = list(rng.thin)
        rngs.append(rng)
    near = _near(dev, mdl, stk)
    payload = {
        "hardware": dev.key, "model": mdl.key, "precision": dep.system.precision, "kv_precision": dep.system.kv,
        "stack": dep.system.serving.key, "stack_build": dep.system.serving.name, "ttft_timing": dep.system.ttft_timing,
        "eager": dep.system.eager, "scheduler_steps": dep.system.scheduler_steps, "max_num_tokens": max_num_tokens,
        "attention_dp": dep.system.attention_dp,
        "lengths": lengths, "default_max_batch": default, "fast_max_batch": FAST_MAX_BATCH,
        "modelled": True, "validation": _validation(), "interval_level": LEVEL,
        "validation_near": near.model_dump(), "rows": rows,
    }  # fmt: skip
    if _emit_json(payload, fmt, json_out):
        return
    cols = [Col("batch"), Col("chips"), Col("step ms"), Col("tok/s user"), Col("tok/s total"), Col("$/Mtok out", 1),
            Col(f"TTFT ms\n{dep.system.ttft_timing}", 2), Col("mode", 1, "left")]  # fmt: skip
    cells = [
        [
            str(r["batch"]) if r["fits"] else f"{r['batch']}→{r['effective_batch']}", str(r["chips"]),
            f"{r['step_ms']:.2f}",  # its range is tok/s user's, inverted (JSON has both)
            _with_range(f"{r['per_user_tps']:.1f}", g, "tokens_per_second"),
            _with_range(f"{r['aggregate_tps']:,.0f}", g, "aggregate_tokens_per_second"),
            f"{r['usd_per_mtok_out']:.3f}", _with_range(f"{r['ttft_ms']:,.0f}", g, "ttft_ms"), r["mode"],
        ]
        for r, g in zip(rows, rngs, strict=True)
    ]  # fmt: skip
    con = _console()
    title = f"{dev.key}/{mdl.key} @ {dep.system.precision}, {prompt_tokens} in / {output_tokens} out" + (
        "" if lengths == "fixed" else f" ({lengths} lengths around them)")
    print_fitted(con, cols, cells, wide=wide, title=title)
    con.print(
        f"{_modelled()}. B→N: B sequences do not fit (their KV, or the engine's cap), the server runs N at a time. "
        f"$/Mtok = chips x ${dev.price_per_chip_hour}/chip-h / aggregate throughput. fast = max_batch "
        f"{FAST_MAX_BATCH}; default = "
        + (f"the backend's max_batch {default}." if max_seqs is None else f"the engine's cap {default} (--max-seqs).")
    )
    thin = sorted({t for g in rngs for t in g.thin})
    con.print(_range_note(LEVEL, thin), highlight=False, markup=False)
    _print_near(con, near)


app.command("validate")(validate)
