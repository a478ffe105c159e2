"""``voicepipe calibrate URL --model M --out my.yaml`` and ``voicepipe profile import results.json``.

Everything ``calibrate`` prints is MEASURED on the endpoint (client side: this process's monotonic clock,
from sending a request to each streamed piece arriving), except the ``--against`` columns, which are the
hardware model's prediction for the same settings (MODELLED).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from voicepipe.backends.calibrate import (
    Settings,
    Versus,
    against,
    anchor_of,
    calibrate,
    from_vllm_bench,
    hardware_model,
    source_of,
)
from voicepipe.backends.openai import config_from_spec
from voicepipe.backends.profile import Point, dump_profile, profile_from_points
from voicepipe.cli.calibrate_speech import calibrate_speech
from voicepipe.cli.common import err, out
from voicepipe.cli.options import writable
from voicepipe.errors import UserError
from voicepipe.exitcodes import ExitCode

profile_app = typer.Typer(
    help="User profiles: import a `vllm bench serve` result.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
)


def _ints(raw: str, where: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise UserError(where, f"{raw!r}: expected integers separated by commas") from None
    if not vals or min(vals) < 1:
        raise UserError(where, f"{raw!r}: expected integers >= 1")
    return vals


def api_base(url: str) -> str:
    """``http://host:8080`` -> ``http://host:8080/v1`` (an explicit path is kept)."""
    parts = urlsplit(url)
    return url.rstrip("/") + "/v1" if parts.path in ("", "/") else url.rstrip("/")


def vllm_table(points: list[Point], title: str) -> Table:
    """vLLM's serving-benchmark summary, one column per load level (MEASURED)."""
    t = Table(title=title, title_justify="left")
    t.add_column("metric")
    for p in points:
        t.add_column(f"c={p.concurrency}, {p.prompt_tokens:.0f} in", justify="right")
    rows: list[tuple[str, list[str]]] = [
        ("Successful requests", [str(p.requests) for p in points]),
        ("Failed requests", [str(p.failed) for p in points]),
        ("Benchmark duration (s)", [f"{p.duration_s:.2f}" for p in points]),
        ("Mean output tokens", [f"{p.output_tokens:.1f}" for p in points]),
        ("Request throughput (req/s)", [f"{p.request_throughput:.2f}" for p in points]),
        ("Output token throughput (tok/s)", [f"{p.output_throughput:.1f}" for p in points]),
    ]
    for name, attr in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2EL", "e2el_ms")):
        for q in ("mean", "median", "p99"):
            label = f"{q.capitalize() if q != 'p99' else 'P99'} {name} (ms)"
            rows.append((label, [f"{getattr(getattr(p, attr), q):.2f}" for p in points]))
    for name, vals in rows:
        t.add_row(name, *vals)
    return t


def versus_table(rows: list[Versus], spec: str) -> Table:
    t = Table(title=f"measured vs the hardware model {spec} (MODELLED, same settings)", title_justify="left")
    for c in (
        "clients",
        "TTFT meas.",
        "TTFT model",
        "TPOT meas.",
        "TPOT model",
        "tok/s meas.",
        "tok/s model",
    ):
        t.add_column(c, justify="right")
    for v in rows:
        t.add_row(
            str(v.concurrency),
            f"{v.measured_ttft_ms:.1f} ms",
            f"{v.modelled_ttft_ms:.1f} ms ({v.modelled_ttft_ms / v.measured_ttft_ms:.2g}x)",
            f"{v.measured_tpot_ms:.2f} ms",
            f"{v.modelled_tpot_ms:.2f} ms ({v.modelled_tpot_ms / v.measured_tpot_ms:.2g}x)"
            if v.measured_tpot_ms
            else "-",
            f"{v.measured_throughput:.0f}",
            f"{v.modelled_throughput:.0f} ({v.modelled_throughput / v.measured_throughput:.2g}x)",
        )
    return t


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UserError(str(path), f"cannot write ({exc.strerror or exc})") from None


def _fail(exc: UserError) -> typer.Exit:
    err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
    return typer.Exit(ExitCode.USAGE)


def calibrate_cmd(
    url: Annotated[
        str, typer.Argument(help="API base of an OpenAI-compatible server, e.g. http://127.0.0.1:8080/v1")
    ],
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Write the profile YAML here.", callback=writable)],
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Model name the server serves (required for llm).")
    ] = None,
    stage: Annotated[
        str, typer.Option(help="llm (chat completions), asr (/audio/transcriptions) or tts (/audio/speech).")
    ] = "llm",
    lengths: Annotated[
        str | None, typer.Option(help="asr: seconds of audio (1,2,4); tts: words of text (3,8,16).")
    ] = None,
    reference: Annotated[
        float | None, typer.Option(help="asr/tts: the length the profile's figure is for (2 s / 8 words).")
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="asr/tts: the config whose model --against shows.")
    ] = None,
    concurrency: Annotated[str, typer.Option(help="Clients in flight, comma-separated levels.")] = "1,4,16",
    requests: Annotated[int, typer.Option(min=1, help="Counted requests per level (warm-up excluded).")] = 32,
    prompt_tokens: Annotated[str, typer.Option(help="Prompt length(s) in tokens, comma-separated.")] = "256",
    output_tokens: Annotated[int, typer.Option(min=1, help="max_tokens per request.")] = 64,
    ignore_eos: Annotated[
        bool, typer.Option(help="Send ignore_eos (vLLM/llama.cpp/SGLang) for exact lengths.")
    ] = False,
    api_key_env: Annotated[str | None, typer.Option(help="Environment variable holding the API key.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds without data before a request fails.")] = 60.0,
    name: Annotated[str | None, typer.Option(help="Profile name (default: the file name).")] = None,
    price_in: Annotated[float, typer.Option(help="USD per million input tokens (for cost).")] = 0.0,
    price_out: Annotated[float, typer.Option(help="USD per million output tokens.")] = 0.0,
    versus: Annotated[
        str | None,
        typer.Option(
            "--against",
            help="Also print the hardware model DEVICE/MODEL at the same settings (asr/tts: `model`).",
        ),
    ] = None,
    anchor: Annotated[
        bool, typer.Option("--anchor", help="Record the --against configuration and this measurement in the "
                           "profile, for `hardware predict --anchor` and a backend's `anchor:`.")
    ] = False,
    stack: Annotated[str | None, typer.Option(help="--against: the serving stack the server runs.")] = None,
    precision: Annotated[str | None, typer.Option(help="--against: the weights' precision it serves.")] = None,
    tp: Annotated[int | None, typer.Option(min=1, help="--against: its tensor-parallel width (chips).")] = None,
) -> None:
    """Measure an OpenAI-compatible endpoint (vLLM-style table) and write an empirical profile."""
    try:
        if stage in ("asr", "tts"):
            calibrate_speech(
                "asr" if stage == "asr" else "tts", api_base(url), model, out_path, _ints(concurrency, "--concurrency"),
                requests, lengths, reference, api_key_env, timeout, versus, config,
            )  # fmt: skip
            return
        if stage != "llm":
            raise UserError("--stage", f"{stage!r}: expected llm, asr or tts")
        if not model:
            raise UserError("--model", "the model name the server serves is required for --stage llm")
        settings = Settings(
            concurrency=_ints(concurrency, "--concurrency"),
            requests=requests,
            prompt_tokens=_ints(prompt_tokens, "--prompt-tokens"),
            output_tokens=output_tokens,
            ignore_eos=ignore_eos,
        )
        spec = {"endpoint": api_base(url), "model": model, "timeout": timeout}
        if api_key_env:
            if api_key_env not in os.environ:
                raise UserError("--api-key-env", f"environment variable {api_key_env!r} is not set")
            spec["api_key_env"] = api_key_env
        try:
            cfg = config_from_spec(spec)
        except ValueError as exc:
            raise UserError("calibrate", str(exc)) from None
        if anchor and not versus:
            raise UserError("--anchor", "needs --against DEVICE/MODEL: the configuration the server runs")
        for flag, given in (("--stack", stack), ("--precision", precision), ("--tp", tp)):
            if given is not None and not versus:
                raise UserError(flag, "describes the --against configuration: give --against DEVICE/MODEL too")
        hw_spec: str | dict[str, object] | None = versus
        if versus and (stack or precision or tp):
            hw, _, mdl = versus.partition("/")
            hw_spec = {"hardware": hw, "model": mdl, "stack": stack, "precision": precision, "tp": tp}
            hw_spec = {k: v for k, v in hw_spec.items() if v is not None}
        hw_model = hardware_model(hw_spec) if hw_spec else None  # an unknown DEVICE/MODEL fails first
        total = len(settings.prompt_tokens) * len(settings.concurrency) * settings.requests
        progress = Progress(
            TextColumn("[bold]calibrating"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
            TimeElapsedColumn(), console=err, transient=True, disable=not err.is_terminal,
        )  # fmt: skip
        with progress:
            task = progress.add_task("calibrate", total=total)
            points = asyncio.run(calibrate(cfg, settings, lambda: progress.advance(task)))
        src = source_of(cfg, settings)
        prof = profile_from_points(
            points,
            src,
            how=f"voicepipe calibrate against {cfg.host} ({cfg.model}), {source_of(cfg, settings)['date']}",
            name=name or out_path.stem,
            prices=(
                price_in,
                price_out,
                "given to voicepipe calibrate" if price_in or price_out else "not given (prices 0)",
            ),
        )
        if anchor and versus and hw_model is not None:
            measured = f"voicepipe calibrate against {cfg.host} ({cfg.model}), {src['date']}, client-side means"
            prof.anchor = anchor_of(points, versus.partition("/")[0], hw_model, measured)
        _write(out_path, dump_profile(prof))
        out.print(vllm_table(points, f"MEASURED: {cfg.host} {cfg.model} (client-side, warm-up excluded)"))
        if not all(p.usage_reported for p in points):
            out.print(
                "note: the server sent no usage counts: prompt tokens are the length asked for, output tokens the streamed pieces"
            )
        if hw_spec and versus:
            out.print(versus_table(against(hw_spec, points), versus))
        if prof.anchor is not None:
            a = prof.anchor
            out.print(
                f"anchor: {a.hardware} x {a.chips} {a.model} {a.precision} (KV {a.kv_precision}) with {a.stack}, "
                f"{a.concurrency} client(s), {a.prompt_tokens} in / {a.output_tokens} out: TTFT {a.ttft_ms:.1f} ms, "
                f"TPOT {a.tpot_ms:.2f} ms (means); --stack/--precision/--tp say what the server runs. "
                f"Use: voicepipe hardware predict -H DEVICE -m {a.model} --anchor {out_path}",
                highlight=False, soft_wrap=True,
            )  # fmt: skip
        out.print(
            f"wrote {out_path}: TTFT median {prof.ttft_ms.median:.1f} ms, p90 {prof.ttft_ms.p90:.1f} ms, "
            f"{prof.tokens_per_s:.1f} tok/s (one request, idle endpoint); use it as agent.backend: {out_path}"
        )
    except UserError as exc:
        raise _fail(exc) from None


@profile_app.command("import")
def import_cmd(
    results: Annotated[Path, typer.Argument(help="A `vllm bench serve --save-result` JSON file.")],
    out_path: Annotated[
        Path | None, typer.Option("--out", "-o", help="Profile YAML (default: RESULTS.yaml).", callback=writable)
    ] = None,
    name: Annotated[str | None, typer.Option(help="Profile name.")] = None,
) -> None:
    """Convert a `vllm bench serve` result JSON into a voicepipe profile."""
    try:
        points, source, notes = from_vllm_bench(results)
        target = out_path or results.with_suffix(".yaml")
        how = f"vllm bench serve result {results.name} ({source['date']}, {source['model']})"
        prof = profile_from_points(points, {**source, "notes": notes}, how=how, name=name or target.stem)
        _write(target, dump_profile(prof))
        out.print(vllm_table(points, f"MEASURED by vllm bench serve: {source['model']}"))
        for n in notes:
            out.print(f"note: {n}")
        out.print(f"wrote {target}: TTFT median {prof.ttft_ms.median:.1f} ms, {prof.tokens_per_s:.1f} tok/s")
    except UserError as exc:
        raise _fail(exc) from None

