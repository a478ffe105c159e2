"""``voicepipe hardware``: list / show the catalog, predict one configuration, sweep batch sizes.

Every timing this prints is MODELLED by :mod:`voicepipe.hardware.model` (physics with fitted efficiency
factors, see docs/hardware-model.md), not measured.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from voicepipe.backends.empirical import profiles
from voicepipe.hardware import catalog
from voicepipe.hardware.backend import FAST_MAX_BATCH, deploy, make_hardware_backend
from voicepipe.hardware.model import (
    DoesNotFit,
    Speculative,
    decode_step_s,
    make_system,
    max_sequences,
    tokens_per_step,
)
from voicepipe.hardware.model import (
    predict as model_predict,
)

app = typer.Typer(
    help="Hardware models: which device/model answers inside the turn budget.", no_args_is_help=True
)
MODELLED = "MODELLED by voicepipe.hardware (analytic physics model; not measured)"
T = TypeVar("T")


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _guard(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except (ValueError, KeyError) as exc:
        _fail(str(exc).strip("'\""))


def _console() -> Console:
    return Console(file=sys.stdout, width=160)


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
def list_() -> None:
    """Devices, models and empirical profiles in the catalog."""
    con = _console()
    dev = Table(title="Devices (datasheet figures; `hardware show NAME` for sources)")
    for col in ("name", "kind", "memory / chip", "bandwidth", "bf16 TFLOP/s", "$/chip-h", "description"):
        dev.add_column(col)
    for key, d in catalog.devices().items():
        mem = f"{d.memory_gb:g} GB HBM" if d.kind == "hbm" else f"{d.sram_gb:g} GB SRAM"
        bw = f"{d.mem_bw_tbs:g} TB/s" if d.kind == "hbm" else f"{d.sram_bw_tbs:g} TB/s"
        dev.add_row(key, d.kind, mem, bw, f"{d.peak_tflops['bf16']:g}", f"{d.price_per_chip_hour:g}", d.name)
    con.print(dev)
    mdl = Table(title="Models (published configs)")
    for col in ("name", "layers", "hidden", "heads/kv", "params (B)", "active (B)", "precision", "quality"):
        mdl.add_column(col)
    for key, m in catalog.models().items():
        q = f"{m.quality.score:g} {m.quality.benchmark}" if m.quality else "-"
        active = f"{m.params_active_b:g}" if m.params_active_b else "="
        mdl.add_row(
            key, str(m.layers), str(m.hidden), f"{m.heads}/{m.kv_heads}", f"{m.params_total_b:g}", active,
            m.default_precision, q,
        )  # fmt: skip
    con.print(mdl)
    emp = Table(title="Empirical profiles (measured services)")
    for col in ("name", "TTFT median ms", "tok/s", "$/Mtok in/out", "description"):
        emp.add_column(col)
    for key, p in profiles().items():
        emp.add_row(
            key, f"{p['ttft_ms']['median']:g}", f"{p['tokens_per_s']:g}",
            f"{p['price_in_per_mtok']:g}/{p['price_out_per_mtok']:g}", p.get("description", ""),
        )  # fmt: skip
    con.print(emp)
    con.print("Use DEVICE/MODEL (e.g. cerebras-wse3/llama-3.1-8b) as an agent backend.")


def _kv_table(title: str, rows: dict[str, Any], sources: dict[str, str]) -> Table:
    t = Table(title=title)
    t.add_column("field")
    t.add_column("value")
    t.add_column("source")
    for k, v in rows.items():
        if k in ("sources", "key", "prices", "quality") or v is None:
            continue
        src = sources.get(k) or sources.get(
            "config" if k not in ("params_total_b", "params_active_b") else "params"
        )
        t.add_row(k, str(v), src or "")
    return t


@app.command()
def show(name: str = typer.Argument(..., help="device, model, empirical profile, or DEVICE/MODEL")) -> None:
    """A catalog entry with the source of every number."""
    con = _console()
    if name in catalog.devices():
        d = catalog.devices()[name]
        con.print(_kv_table(f"Device {name}", d.model_dump(), d.sources))
        return
    if name in catalog.models():
        m = catalog.models()[name]
        con.print(_kv_table(f"Model {name}", m.model_dump(), m.sources))
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
        p = profiles()[name]
        t = Table(title=f"Empirical profile {name} (measured, not modelled)")
        t.add_column("field")
        t.add_column("value")
        for k, v in p.items():
            t.add_row(k, str(v))
        con.print(t)
        return
    if "/" in name:
        backend = _guard(lambda: make_hardware_backend(name))
        con.print_json(json.dumps(backend.describe(), default=str))
        con.print(MODELLED)
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


@app.command()
def predict(
    hardware: str = typer.Option(..., "--hardware", "-H", help="device name (see `hardware list`)"),
    model: str = typer.Option(..., "--model", "-m", help="model name"),
    batch: int = typer.Option(1, "--batch", "-b", min=1, help="concurrent sequences decoding together"),
    prompt_tokens: int = typer.Option(1024, "--prompt-tokens", min=1),
    output_tokens: int = typer.Option(256, "--output-tokens", min=1),
    tp: int | None = typer.Option(None, "--tp", min=1, help="tensor-parallel width (HBM devices)"),
    precision: str | None = typer.Option(None, "--precision", help="bf16|fp16|fp8|int8|int4"),
    speculative: str | None = typer.Option(None, "--speculative", help="ALPHA,GAMMA,DRAFT_COST"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """One configuration on an idle device: TTFT, step time, tok/s, chips, bound."""
    dev, mdl = _check_lookup(hardware, model)
    if precision is not None and precision not in catalog.PRECISIONS:
        _fail(f"--precision: unknown precision {precision!r}; use one of {', '.join(catalog.PRECISIONS)}")
    spec = _speculative(speculative)
    try:
        p = model_predict(
            dev, mdl, precision=precision, batch=batch, prompt_tokens=prompt_tokens,
            output_tokens=output_tokens, tp=tp, spec=spec,
        )  # fmt: skip
    except DoesNotFit as exc:
        if as_json:
            typer.echo(json.dumps({"fits": False, "error": str(exc), "hardware": hardware, "model": model}))
        _fail(str(exc))
    except ValueError as exc:
        _fail(f"--tp: {exc}" if "tp" in str(exc) else str(exc))
    out = p.as_dict()
    out["modelled"] = True
    out["speculative"] = None if spec is None else spec.__dict__
    out["sources"] = {"device": dev.sources, "model": mdl.sources, "method": "docs/hardware-model.md"}
    if as_json:
        typer.echo(json.dumps(out, indent=2))
        return
    t = Table(title=f"{hardware}/{model} — {MODELLED}")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    rows = [
        ("chips", f"{p.chips}"),
        ("precision", p.precision),
        ("batch", f"{p.batch}"),
        ("fits", f"{p.fits} (max batch at this context: {p.max_batch_fits})"),
        ("weights", f"{p.weights_gb:.1f} GB"),
        ("KV cache", f"{p.kv_gb:.2f} GB"),
        ("TTFT (idle, no queue)", f"{p.ttft_ms:.1f} ms"),
        ("decode step", f"{p.step_ms:.2f} ms"),
        ("tok/s per request", f"{p.tokens_per_second:.1f}"),
        ("tok/s aggregate", f"{p.aggregate_tokens_per_second:.1f}"),
        ("bound", p.bound),
        ("step parts mem/compute/comm/fixed", f"{p.memory_ms:.2f}/{p.compute_ms:.2f}/{p.comm_ms:.2f}/{p.overhead_ms:.2f} ms"),
    ]  # fmt: skip
    for k, v in rows:
        t.add_row(k, v)
    _console().print(t)


def _batches(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        _fail(f"--batches must be comma-separated integers, got {text!r}")
    if not values or values[0] < 1:
        _fail(f"--batches must be integers >= 1, got {text!r}")
    return values


@app.command()
def sweep(
    hardware: str = typer.Option(..., "--hardware", "-H"),
    model: str = typer.Option(..., "--model", "-m"),
    batches: str = typer.Option("1,2,4,8,16,32,64,128,256", "--batches", help="comma-separated batch sizes"),
    prompt_tokens: int = typer.Option(1024, "--prompt-tokens", min=1),
    output_tokens: int = typer.Option(256, "--output-tokens", min=1),
    tp: int | None = typer.Option(None, "--tp", min=1),
    precision: str | None = typer.Option(None, "--precision"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Batching trade-off: step time, per-user and aggregate tok/s, $/Mtok; marks fast mode vs default."""
    dev, mdl = _check_lookup(hardware, model)
    if precision is not None and precision not in catalog.PRECISIONS:
        _fail(f"--precision: unknown precision {precision!r}; use one of {', '.join(catalog.PRECISIONS)}")
    bs = _batches(batches)
    cfg: dict[str, Any] = {"hardware": hardware, "model": model, "precision": precision, "tp": tp}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    dep = _guard(lambda: deploy(cfg))
    bs = sorted(set(bs) | {FAST_MAX_BATCH, dep.max_batch})
    ctx_max = prompt_tokens + output_tokens
    ctx = prompt_tokens + output_tokens / 2
    rows: list[dict[str, Any]] = []
    for b in bs:
        if dev.kind == "sram":
            system = make_system(dev, mdl, dep.system.precision, seqs=b, context=ctx_max)
        else:
            system = dep.system
        fits = max_sequences(system, ctx_max) >= b
        row: dict[str, Any] = {"batch": b, "chips": system.chips, "fits": fits}
        if fits:
            step = float(decode_step_s(system, b, ctx, dep.spec))
            user = tokens_per_step(dep.spec) / step
            agg = user * b
            cost = system.chips * dev.price_per_chip_hour / (agg * 3600) * 1e6
            row.update(step_ms=step * 1e3, per_user_tps=user, aggregate_tps=agg, usd_per_mtok_out=cost)
        row["mode"] = ", ".join(
            m for m, hit in (("fast", b == FAST_MAX_BATCH), ("default max_batch", b == dep.max_batch)) if hit
        )
        rows.append(row)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "hardware": hardware, "model": model, "precision": dep.system.precision,
                    "default_max_batch": dep.max_batch, "fast_max_batch": FAST_MAX_BATCH,
                    "modelled": True, "rows": rows,
                },
                indent=2,
            )
        )  # fmt: skip
        return
    t = Table(title=f"{hardware}/{model} @ {dep.system.precision}, {prompt_tokens} in / {output_tokens} out")
    for col in ("batch", "chips", "step ms", "tok/s per user", "tok/s aggregate", "$/Mtok out", "mode"):
        t.add_column(col, justify="right")
    for r in rows:
        if not r["fits"]:
            t.add_row(str(r["batch"]), str(r["chips"]), "does not fit", "", "", "", r["mode"])
            continue
        t.add_row(
            str(r["batch"]), str(r["chips"]), f"{r['step_ms']:.2f}", f"{r['per_user_tps']:.1f}",
            f"{r['aggregate_tps']:.0f}", f"{r['usd_per_mtok_out']:.3f}", r["mode"],
        )  # fmt: skip
    con = _console()
    con.print(t)
    con.print(
        f"{MODELLED}. $/Mtok = chips x ${dev.price_per_chip_hour}/chip-h / aggregate throughput. "
        f"fast = max_batch {FAST_MAX_BATCH} (faster per user, lower aggregate, dearer per token); "
        f"default max_batch = {dep.max_batch}."
    )
