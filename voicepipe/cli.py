"""Command line: ``voicepipe run``, ``compare``, ``predict``, ``stage``, ``scenarios``, ``schema``, ``hardware``.

Bad input prints one line naming the file and field and exits 2 — never a traceback. Turn records are
written as they are measured, so an interrupted run keeps what it had.

Streams: results (tables, ``--format json`` lines) go to stdout only; progress, per-turn lines when stderr
is not a terminal, warnings and logs (:mod:`voicepipe.logs`) go to stderr. Option names are the same in
every command: ``--json FILE`` writes JSON lines to a file, ``--format json`` writes them to stdout,
``--wide`` shows every column, ``--otel FILE`` / ``--otlp-endpoint URL`` export traces.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from voicepipe import gate
from voicepipe.config import BrokerOverrides, PipelineConfig, config_dict, load_config
from voicepipe.errors import UserError
from voicepipe.records import TurnRecord
from voicepipe.scenario import Scenario, check_speech, load_scenario, shipped

app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    help="Does a voice pipeline answer inside the human turn budget (~800 ms), and what would change it?",
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)

try:
    from voicepipe.cli_hardware import app as hardware_app

    app.add_typer(
        hardware_app,
        name="hardware",
        help="LLM hardware models: list, show, predict, sweep, validate against published measurements.",
    )
except ImportError:  # pragma: no cover - ships with the package
    pass

from voicepipe.cli_calibrate import register as _register_calibrate  # noqa: E402

_register_calibrate(app)  # `calibrate URL --model M --out my.yaml`, `profile import results.json`


class LogFormatChoice(StrEnum):
    console = "console"
    json = "json"


class LogLevelChoice(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class OutputFormat(StrEnum):
    table = "table"
    json = "json"


def _version(value: bool) -> None:
    if value:
        from voicepipe import __version__

        out.print(f"voicepipe {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, metavar="", help="Print the version and exit."
        ),
    ] = False,
    verbose: Annotated[
        int,
        typer.Option("--verbose", "-v", count=True, help="More log lines on stderr (-v info, -vv debug)."),
    ] = 0,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", metavar="", help="Only errors in the log on stderr.")
    ] = False,
    log_format: Annotated[
        LogFormatChoice,
        typer.Option(
            "--log-format", envvar="VOICEPIPE_LOG_FORMAT", help="Log lines on stderr: console or json."
        ),
    ] = LogFormatChoice.console,
    log_level: Annotated[
        LogLevelChoice | None,
        typer.Option("--log-level", envvar="VOICEPIPE_LOG_LEVEL", help="Log level (overrides -v/-q)."),
    ] = None,
) -> None:
    """Does a voice pipeline answer inside the human turn budget (~800 ms), and what would change it?"""
    from voicepipe.logs import configure, level_from_flags

    configure(level_from_flags(verbose, quiet, log_level.value if log_level else None), log_format.value)


def fail(msg: str) -> typer.Exit:
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


@contextmanager
def user_errors() -> Iterator[None]:
    try:
        yield
    except UserError as exc:
        raise fail(str(exc)) from None


WideOpt = Annotated[
    bool,
    typer.Option("--wide/--fit", metavar="", help="Show every column, wider than the terminal if need be."),
]
FormatOpt = Annotated[
    OutputFormat,
    typer.Option("--format", help="stdout: tables, or JSON lines (one turn record each, nothing else)."),
]
OtelOpt = Annotated[
    Path | None, typer.Option("--otel", metavar="FILE", help="Per-turn spans as OTLP/JSON traces.")
]
OtlpOpt = Annotated[
    str | None,
    typer.Option(
        "--otlp-endpoint",
        metavar="URL",
        envvar="OTEL_EXPORTER_OTLP_ENDPOINT",
        help="Push per-turn traces over OTLP/HTTP, e.g. http://localhost:4318 (env OTEL_EXPORTER_OTLP_ENDPOINT).",
    ),
]
RequireOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--require",
        metavar="NAME<=N",
        help="Exit 1 unless the turns meet it, e.g. 'p90<=800,within>=0.9' (p50 p90 p99 within ok tax_p50; "
        "repeatable).",
    ),
]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", metavar="FILE", help="Pipeline config YAML.")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="FIELD=VALUE",
        help="Override a config field: path.to.field=value (repeatable).",
    ),
]
BrokerOpt = Annotated[
    str | None,
    typer.Option(
        "--broker",
        "-b",
        metavar="URL",
        help="mqtt://host:port or mqtts://host:port (default: env VOICEPIPE_BROKER, config, embedded); "
        "user name from env VOICEPIPE_BROKER_USERNAME, password from --password-file or env "
        "VOICEPIPE_BROKER_PASSWORD",
    ),
]
CaFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--ca-file", metavar="FILE", help="PEM CA file that signed the broker's certificate (mqtts://)."
    ),
]
CertFileOpt = Annotated[
    Path | None, typer.Option("--cert-file", metavar="FILE", help="Client certificate (PEM) for mqtts://.")
]
KeyFileOpt = Annotated[
    Path | None, typer.Option("--key-file", metavar="FILE", help="Unencrypted private key of --cert-file.")
]
PasswordFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--password-file",
        metavar="FILE",
        help="File whose first line is the broker password (or env VOICEPIPE_BROKER_PASSWORD).",
    ),
]
InsecureOpt = Annotated[
    bool,
    typer.Option(
        "--insecure", metavar="", help="mqtts:// without verifying the broker's certificate (testing only)."
    ),
]


def broker_options(
    url: str | None,
    ca_file: Path | None = None,
    cert_file: Path | None = None,
    key_file: Path | None = None,
    password_file: Path | None = None,
    insecure: bool = False,
) -> BrokerOverrides:
    def s(p: Path | None) -> str | None:
        return str(p) if p is not None else None

    return BrokerOverrides(url, s(ca_file), s(cert_file), s(key_file), s(password_file), insecure)


ScenariosArg = Annotated[
    list[str],
    typer.Argument(metavar="SCENARIO", help="Scenario files or shipped names (see `scenarios`)."),
]


def check_variants_speech(variants: list[tuple[str, PipelineConfig]], scs: list[Scenario]) -> None:
    """:func:`check_speech` for every configuration; with several, the error names the one that fails."""
    for label, vcfg in variants:
        try:
            check_speech(vcfg, scs)
        except UserError as exc:
            if len(variants) == 1:
                raise
            raise UserError(f"configuration {label!r}", str(exc)) from None


def load_scenarios(names: list[str]) -> list[Scenario]:
    scs = [load_scenario(n) for n in names]
    seen: dict[str, str] = {}
    for sc in scs:
        if sc.name in seen:
            raise UserError(
                sc.source, f"name: {sc.name!r} is also the name of {seen[sc.name]} (names must differ)"
            )
        seen[sc.name] = sc.source
    return scs


class RecordSink:
    """Writes turn records as they arrive (JSON lines to ``--json FILE`` and/or stdout), so nothing measured
    is lost; derives the per-turn metric columns (ttft_ms...) the records carry."""

    def __init__(self, path: Path | None, label: str = "", stdout: bool = False) -> None:
        self.path = path
        self.label = label
        self.fh = path.open("w") if path else None
        self.stdout = stdout
        self.records: list[TurnRecord] = []

    def __call__(self, rec: TurnRecord) -> None:
        if self.label:
            rec.label = self.label
        self.records.append(rec)
        line = json.dumps(rec.model_dump(mode="json")) + "\n"
        if self.fh:
            self.fh.write(line)
            self.fh.flush()
        if self.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()

    def write_raw(self, data: dict[str, Any]) -> None:
        """One JSON line that is not a turn record (a prediction)."""
        line = json.dumps(data) + "\n"
        if self.fh:
            self.fh.write(line)
        if self.stdout:
            sys.stdout.write(line)

    def close(self) -> None:
        if self.fh:
            self.fh.close()
            self.fh = None
        if self.stdout:
            sys.stdout.flush()


def progress_bar(total: int, label: str) -> Progress:
    p = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("turns"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal or total <= 2,
    )
    p.add_task(label, total=total)
    return p


def turn_line(r: TurnRecord, done: int, total: int) -> str:
    """The one stderr line per finished turn printed when stderr is not a terminal (no progress bar)."""
    from voicepipe.report.table import top_parts

    lat = "timeout" if r.measured_ms is None else f"{r.measured_ms:,.0f} ms"
    ok = "ok" if r.within_budget else "miss"
    who = f"{r.label}: " if r.label else ""
    return f"[{done}/{total}] {who}{r.session} #{r.turn} {lat} {ok} ({top_parts(r, 1)})"


def progress_sink(
    prog: Progress, total: int, sink: Callable[[TurnRecord], None], done: list[int] | None = None
) -> Callable[[TurnRecord], None]:
    """``sink`` plus progress: the bar on a terminal, else one line per finished turn on stderr
    (``done`` is a shared counter when several runs make one progress)."""
    task = prog.task_ids[0]
    done = done if done is not None else [0]

    def on_record(r: TurnRecord) -> None:
        sink(r)
        done[0] += 1
        prog.advance(task)
        if not err.is_terminal:
            err.print(turn_line(r, done[0], total), highlight=False, markup=False, soft_wrap=True)

    return on_record


def run_live(
    cfg: PipelineConfig,
    scenarios: list[Scenario],
    sessions: int,
    sink: Callable[[TurnRecord], None],
    label: str,
    run_id: str | None = None,
    external: frozenset[str] = frozenset(),
    workers: int = 0,
):
    from voicepipe.runner import run_live_loop, run_pipeline

    total = sum(len(s.turns) for s in scenarios) * sessions
    with progress_bar(total, label) as prog:
        on_record = progress_sink(prog, total, sink)
        return run_live_loop(
            run_pipeline(
                cfg,
                scenarios,
                sessions,
                on_record=on_record,
                run_id=run_id,
                external=external,
                workers=workers,
            )
        )


def write_outputs(
    runs: dict[str, list[TurnRecord]],
    configs: dict[str, dict[str, Any]],
    report: Path | None,
    csv: Path | None,
    otel: Path | None,
    budget_ms: float,
    otlp_endpoint: str | None = None,
    fixes: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """Write the requested exports; ``fixes`` (only called for a report) gives label → advice."""
    records = [r for rs in runs.values() for r in rs]
    if report:
        from voicepipe.report.html import render_html

        html = render_html(runs, configs, budget_ms=budget_ms, fixes=fixes() if fixes else None)
        report.write_text(html, encoding="utf-8")
        err.print(f"report: {report}")
    if csv:
        from voicepipe.report.export import write_csv

        write_csv(records, csv)
        err.print(f"csv: {csv}")
    if otel:
        from voicepipe.report.export import write_otel

        write_otel(records, otel)
        err.print(f"otel: {otel}")
    if otlp_endpoint:
        from voicepipe.report.export import push_otlp

        with user_errors():
            n = push_otlp(records, otlp_endpoint)
        err.print(f"otlp: {n} spans pushed to {otlp_endpoint}", highlight=False)


@app.command()
def run(
    scenario: ScenariosArg,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    broker: BrokerOpt = None,
    ca_file: CaFileOpt = None,
    cert_file: CertFileOpt = None,
    key_file: KeyFileOpt = None,
    password_file: PasswordFileOpt = None,
    insecure: InsecureOpt = False,
    json_out: Annotated[
        Path | None, typer.Option("--json", metavar="FILE", help="Write one JSON turn record per line.")
    ] = None,
    summary_json: Annotated[
        Path | None,
        typer.Option(
            "--summary-json",
            metavar="FILE",
            help="Write the run's counters as JSON: turns expected/completed/failed/lost with reasons, "
            "messages received/dead-lettered by reason, event-loop lag.",
        ),
    ] = None,
    fmt: FormatOpt = OutputFormat.table,
    sessions: Annotated[int, typer.Option("--sessions", "-n", min=1, help="Concurrent copies of each.")] = 1,
    report: Annotated[
        Path | None, typer.Option("--report", metavar="FILE", help="Self-contained HTML report.")
    ] = None,
    csv: Annotated[Path | None, typer.Option("--csv", metavar="FILE", help="Turn records as CSV.")] = None,
    otel: OtelOpt = None,
    otlp_endpoint: OtlpOpt = None,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet/--turns", "-q", metavar="", help="Summary only (no per-turn table), or every turn."
        ),
    ] = False,
    wide: WideOpt = False,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Run id (topics voicepipe/RUN/...).")] = None,
    external: Annotated[
        str | None,
        typer.Option(
            "--external", help="Stages served by `voicepipe stage` processes, e.g. asr,router,agent,tts."
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            min=0,
            max=64,
            help="Spread the stages over N worker processes (ASR, router, TTS replicated with session "
            "affinity); needs --broker.",
        ),
    ] = 0,
    require: RequireOpt = None,
) -> None:
    """Play scenarios through the pipeline over MQTT and measure every turn against the budget."""
    from voicepipe.report.advice import advice, base_command, print_advice
    from voicepipe.report.table import print_paths, print_summary, print_turns

    with user_errors():
        opts = broker_options(broker, ca_file, cert_file, key_file, password_file, insecure)
        cfg = load_config(config, set_ or [], opts)
        scs = load_scenarios(scenario)
        check_speech(cfg, scs)
        reqs = gate.parse(require)
        ext = stage_names(external, "--external")
        if ext and not cfg.broker.url:
            raise UserError("--external", "stages in other processes need a broker (--broker URL)")
        if ext and not run_id:
            raise UserError("--external", "give the run id the stage processes serve (--run-id)")
        if workers and not cfg.broker.url:
            from voicepipe.runner import WORKERS_NEED_BROKER

            raise UserError("--workers", WORKERS_NEED_BROKER)
        if workers and ext:
            raise UserError("--workers", "give --workers or --external, not both")
        if ext:
            from voicepipe.stages.guard import require_shared_token

            require_shared_token("--external")
    from rich.markup import escape as rich_escape

    from voicepipe.runner import RunAborted

    as_json = fmt == OutputFormat.json
    sink = RecordSink(json_out, stdout=as_json)
    result = None
    aborted = None
    try:
        result = run_live(cfg, scs, sessions, sink, "running", run_id, frozenset(ext), workers)
    except RunAborted as exc:  # the broker stayed away: keep and write what was measured, then exit 3
        result, aborted = exc.result, exc
    except KeyboardInterrupt:
        err.print(f"interrupted: keeping {len(sink.records)} measured turns")
    except Exception as exc:
        failure = _run_error(cfg, exc)
        if failure is None:
            raise
        raise failure from None
    finally:
        sink.close()
        if result and summary_json:  # the run's counters (the turn records stay one per line in --json)
            summary_json.write_text(json.dumps(result.summary_json(), indent=2) + "\n", encoding="utf-8")
    if result:
        for w in result.warnings:
            err.print(f"[bold yellow]warning:[/] {w}", soft_wrap=True)
        print_run_counters(result)
        for d in result.deaths:
            err.print(f"[bold yellow]stage process died:[/] {d}", soft_wrap=True, highlight=False)
    if not as_json:
        if not quiet:
            print_turns(out, sink.records, cfg.budget_ms, wide=wide)
        print_summary(out, {"": sink.records}, wide=wide, caption=quiet)
        print_paths(out, sink.records, wide=wide)
        if result:
            out.print(
                f"[dim]run {result.run} on {result.broker}; broker probe {result.probe_ms:.1f} ms round trip[/]"
                if result.probe_ms is not None
                else f"[dim]run {result.run} on {result.broker}[/]"
            )
    fix = advice(sink.records, cfg, scenario, base_command("run", scenario, config, set_ or []))
    if fix:
        print_advice(err if as_json else out, fix)
    name = config.stem if config else "default config"  # the report names a run by its configuration
    write_outputs(
        {name: sink.records}, {name: config_dict(cfg)}, report, csv, otel, cfg.budget_ms, otlp_endpoint,
        lambda: {name: fix},
    )  # fmt: skip
    if aborted is not None:
        err.print(
            f"[bold red]error:[/] {rich_escape(str(aborted))}: run ended after {len(sink.records)} measured turns",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(3)
    gate_exit(reqs, sink.records)


ConfigsOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--config",
        "-c",
        metavar="FILE",
        help="Pipeline config YAML (repeatable: one row per file; with --vary, several files are crossed "
        "with the varied values, one file is the base).",
    ),
]
VaryOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--vary",
        metavar="FIELD=V1,V2",
        help="Vary one config field: path.to.field=v1,v2,... (values parsed as YAML like --set; a value "
        "containing a comma is not supported). Give twice for a grid of two fields.",
    ),
]


def print_run_counters(result: Any) -> None:
    """Every expected turn accounted for, what the stages refused, and whether the load let us measure."""
    acc = result.accounting()
    style = "" if acc.completed == acc.expected else "yellow"
    err.print(f"[{style}]{acc.line()}[/]" if style else acc.line(), highlight=False, soft_wrap=True)
    c = result.counters
    dead = sum(c.dead.values())
    why = "; ".join(f"{n} {r}" for r, n in c.dead.most_common())
    err.print(
        f"bus: {c.received} received, {dead} dead-lettered{f' ({why})' if why else ''}, {c.late} late, "
        f"{c.lost} lost in transit, {c.handler_errors} handler errors",
        style="yellow" if dead or c.lost or c.handler_errors else None, highlight=False, soft_wrap=True,
    )  # fmt: skip
    if result.lag is not None:
        err.print(result.lag.verdict(), style="bold red" if result.lag.overloaded else None, highlight=False,
                  soft_wrap=True)  # fmt: skip


def _run_error(cfg: PipelineConfig, exc: BaseException) -> typer.Exit | None:
    """The one-line failure for a broker that cannot be reached; None for anything else."""
    from aiomqtt import MqttError

    where = f"broker {_safe_url(cfg.broker.url) if cfg.broker.url else 'embedded'}"
    if isinstance(exc, OSError):
        return fail(f"{where}: cannot connect ({exc})")
    if isinstance(exc, MqttError):  # refused (bad credentials), lost connection, ...
        return fail(f"{where}: {exc}")
    from voicepipe.runner import StagesMissing

    if isinstance(exc, StagesMissing):
        return fail(str(exc))
    from voicepipe.bus import BrokerOutage
    from voicepipe.bus.mqtt import RunTopicsUnreachable

    if isinstance(exc, RunTopicsUnreachable):
        return fail(str(exc))

    if isinstance(exc, BrokerOutage):  # the broker stayed away past broker.outage_window_s
        fail(str(exc))
        return typer.Exit(3)
    return None


def _safe_url(url: str) -> str:
    """The broker URL without its password."""
    from voicepipe.errors import redact_url

    return redact_url(url)


def _compare_predicted(
    variants: list, scs: list[Scenario], sessions: int, sink: RecordSink, fmt: OutputFormat, wide: bool
) -> None:
    """`compare --predict`: one row per configuration from the stages on virtual time (no live run)."""
    from voicepipe.compare import compare_rows, display_names, verdict
    from voicepipe.parallel import ItemFailed
    from voicepipe.predict import predict_each
    from voicepipe.report.table import PREDICTED, print_compare

    runs: dict[str, list[TurnRecord]] = {}
    try:  # the configurations in parallel processes: same results as one by one
        each = predict_each([cfg for _, cfg in variants], scs, sessions)
    except ItemFailed as failed:
        if not isinstance(failed.error, ValueError):
            raise failed.error from None
        raise fail(f"configuration {variants[failed.index][0]!r}: {failed.error}") from None
    for (label, _cfg), preds in zip(variants, each, strict=True):
        runs[label] = [p.as_record(label) for p in preds]
        for p in preds:
            sink.write_raw({**p.to_json(), "label": label})
    sink.close()
    if fmt == OutputFormat.json:
        return
    rows = compare_rows(runs)
    heading, names = display_names(list(runs))
    per_run = sum(len(s.turns) for s in scs) * sessions
    title = f"compare (predicted): {', '.join(s.name for s in scs)} · {per_run} turns each"
    print_compare(out, rows, names, heading, title, caption=PREDICTED, wide=wide)
    for line in verdict(rows, names):
        out.print(line, highlight=False, markup=False)


@app.command()
def compare(
    scenario: ScenariosArg,
    config: ConfigsOpt = None,
    vary: VaryOpt = None,
    set_: SetOpt = None,
    broker: BrokerOpt = None,
    ca_file: CaFileOpt = None,
    cert_file: CertFileOpt = None,
    key_file: KeyFileOpt = None,
    password_file: PasswordFileOpt = None,
    insecure: InsecureOpt = False,
    sessions: Annotated[int, typer.Option("--sessions", "-n", min=1, help="Concurrent copies of each.")] = 1,
    json_out: Annotated[
        Path | None,
        typer.Option(
            "--json",
            metavar="FILE",
            help="Write every turn record (JSON lines) with its configuration label.",
        ),
    ] = None,
    fmt: FormatOpt = OutputFormat.table,
    csv: Annotated[Path | None, typer.Option("--csv", metavar="FILE", help="Turn records as CSV.")] = None,
    report: Annotated[
        Path | None, typer.Option("--report", metavar="FILE", help="Self-contained HTML report.")
    ] = None,
    otel: OtelOpt = None,
    otlp_endpoint: OtlpOpt = None,
    predict: Annotated[
        bool,
        typer.Option(
            "--predict/--run",
            metavar="",
            help="Predict on virtual time instead of running (no waiting; for large grids).",
        ),
    ] = False,
    wide: WideOpt = False,
) -> None:
    """Run the same scenarios under several configurations: one row each with latency, budget share, cost.

    Configurations are whole files (--config a.yaml --config b.yaml), one field varied (--vary agent.backend=sonnet-gpu,groq-llama-3.1-8b), or a grid of two fields (--vary twice).

    Runs are sequential and real time, with the same seed; Ctrl-C keeps what was measured.
    """
    from voicepipe.compare import compare_rows, display_names, plan_variants, verdict
    from voicepipe.report.table import print_compare

    with user_errors():
        opts = broker_options(broker, ca_file, cert_file, key_file, password_file, insecure)
        variants = plan_variants(config or [], vary or [], set_ or [], opts)
        scs = load_scenarios(scenario)
        check_variants_speech(variants, scs)

    as_json = fmt == OutputFormat.json
    sink = RecordSink(json_out, stdout=as_json)
    if predict:
        _compare_predicted(variants, scs, sessions, sink, fmt, wide)
        return
    from voicepipe.runner import run_live_loop, run_pipeline

    per_run = sum(len(s.turns) for s in scs) * sessions
    runs: dict[str, list[TurnRecord]] = {}
    results = {}
    interrupted = False
    done = [0]
    try:
        with progress_bar(per_run * len(variants), "comparing") as prog:
            task = prog.task_ids[0]
            for i, (label, cfg) in enumerate(variants):
                prog.update(task, description=f"{i + 1}/{len(variants)} {label}")
                sink.label = label
                got = runs.setdefault(label, [])

                def keep(r: TurnRecord, got: list[TurnRecord] = got) -> None:
                    sink(r)
                    got.append(r)

                on_record = progress_sink(prog, per_run * len(variants), keep, done)
                try:
                    results[label] = run_live_loop(run_pipeline(cfg, scs, sessions, on_record=on_record))
                except Exception as exc:
                    failure = _run_error(cfg, exc)
                    if failure is None:
                        raise
                    raise failure from None
    except KeyboardInterrupt:
        interrupted = True
        n = sum(len(v) for v in runs.values())
        err.print(f"interrupted: keeping {n} measured turns")
    finally:
        sink.close()

    runs = {k: v for k, v in runs.items() if v}
    if not runs:
        return
    rows = compare_rows(runs)
    heading, names = display_names(list(runs))
    sc_names = ", ".join(s.name for s in scs)
    title = f"compare: {sc_names} · {per_run} turns each" + (" · interrupted" if interrupted else "")
    if not as_json:
        print_compare(out, rows, names, heading, title, expected=per_run, wide=wide)
        for line in verdict(rows, names):
            out.print(line, highlight=False, markup=False)
    seen: set[str] = set()
    for label, res in results.items():
        for w in res.warnings:
            if w not in seen:
                seen.add(w)
                err.print(f"[bold yellow]warning:[/] {label}: {w}", soft_wrap=True)
        if res.deadletters:
            err.print(f"[yellow]{label}: {res.deadletters} malformed bus message(s) dead-lettered[/]")
    cfgs = dict(variants)
    budget = next(iter(cfgs.values())).budget_ms
    from voicepipe.report.advice import advice

    write_outputs(
        runs, {k: config_dict(cfgs[k]) for k in runs}, report, csv, otel, budget, otlp_endpoint,
        lambda: {k: advice(runs[k], cfgs[k], scenario) for k in runs},
    )  # fmt: skip


@app.command()
def predict(
    scenario: ScenariosArg,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    sessions: Annotated[int, typer.Option("--sessions", "-n", min=1, help="Concurrent copies of each.")] = 1,
    json_out: Annotated[
        Path | None, typer.Option("--json", metavar="FILE", help="One JSON prediction per line.")
    ] = None,
    fmt: FormatOpt = OutputFormat.table,
    wide: WideOpt = False,
    require: RequireOpt = None,
) -> None:
    """Predict every turn's latency and breakdown: the live stages on virtual time — no broker, no waiting.

    The pipeline's own code on an in-memory bus with zero hops: a live run's predicted_ms equals this for
    the same turn and seed (to within bus hops where timing overlaps or sessions queue on one device).
    """
    from voicepipe.predict import predict as predict_turns
    from voicepipe.report.advice import advice, base_command, print_advice
    from voicepipe.report.table import print_predictions

    with user_errors():
        cfg = load_config(config, set_ or [])
        scs = load_scenarios(scenario)
        check_speech(cfg, scs)
        reqs = gate.parse(require)
        try:
            preds = predict_turns(cfg, scs, sessions)
        except ValueError as exc:
            raise UserError(f"{config or 'config'}{' (with --set)' if set_ else ''}", str(exc)) from None
    sink = RecordSink(json_out, stdout=fmt == OutputFormat.json)
    for p in preds:
        sink.write_raw(p.to_json())
    sink.close()
    records = [p.as_record() for p in preds]
    if fmt != OutputFormat.json:
        print_predictions(out, records, cfg.budget_ms, wide=wide)
        fix = advice(records, cfg, scenario, base_command("predict", scenario, config, set_ or []))
        if fix:
            print_advice(out, fix)
    gate_exit(reqs, records)


def gate_exit(reqs: list[gate.Requirement], records: list[TurnRecord]) -> None:
    """After everything is printed and written: name each ``--require`` the turns missed, then exit 1."""
    lines = gate.missed(reqs, records)
    for line in lines:
        err.print(f"[bold red]error:[/] {line}", highlight=False, soft_wrap=True)
    if lines:
        raise typer.Exit(1)


def stage_names(raw: str | list[str] | None, where: str) -> list[str]:
    from voicepipe.runner import STAGES

    names = [n.strip() for n in (raw.split(",") if isinstance(raw, str) else raw or []) if n.strip()]
    for n in names:
        if n not in STAGES or n == "client":
            allowed = ", ".join(k for k in STAGES if k != "client")
            raise UserError(where, f"unknown stage {n!r} (stages: {allowed})")
    return names


@app.command()
def stage(
    names: Annotated[list[str], typer.Argument(help="Stages to serve: asr router agent cache council tts.")],
    run_id: Annotated[str, typer.Option("--run-id", help="The run to serve (same as `run --run-id`).")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    broker: BrokerOpt = None,
    ca_file: CaFileOpt = None,
    cert_file: CertFileOpt = None,
    key_file: KeyFileOpt = None,
    password_file: PasswordFileOpt = None,
    insecure: InsecureOpt = False,
) -> None:
    """Serve some stages of a run in this process (the rest, and the client, run elsewhere).

    Same broker, run id and config as the `voicepipe run ... --external NAMES` that plays the scenario;
    all processes must share one host clock (CLOCK_MONOTONIC). Stops on Ctrl-C or SIGTERM.
    """
    from voicepipe.runner import run_live_loop, serve_stages, until_signalled

    with user_errors():
        opts = broker_options(broker, ca_file, cert_file, key_file, password_file, insecure)
        cfg = load_config(config, set_ or [], opts)
        chosen = stage_names(names, "stage")
        if not cfg.broker.url:
            raise UserError("--broker", "stages in separate processes need a broker URL")
        from voicepipe.stages.guard import require_shared_token

        require_shared_token("voicepipe stage")
    err.print(f"serving {', '.join(chosen)} for run {run_id} on {_safe_url(cfg.broker.url)}", highlight=False)
    try:
        run_live_loop(until_signalled(serve_stages(cfg, chosen, run_id)))
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        failure = _run_error(cfg, exc)
        if failure is None:
            raise
        raise failure from None


scenarios_app = typer.Typer(
    help="Scenarios: list the shipped ones (default), write a starter file (`new NAME`).",
    invoke_without_command=True,
)
app.add_typer(scenarios_app, name="scenarios")


@scenarios_app.callback()
def scenarios(ctx: typer.Context, wide: WideOpt = False) -> None:
    """List the shipped scenarios (format: docs/scenarios.md; `scenarios new NAME` writes a starter)."""
    if ctx.invoked_subcommand is not None:
        return
    from voicepipe.report.term import Col, print_fitted

    rows = []
    for p in shipped():
        try:
            s = load_scenario(str(p))
        except UserError as exc:
            rows.append([p.stem, "?", f"[red]{exc}[/]"])
            continue
        rows.append([p.stem, str(len(s.turns)), s.description])
    cols = [
        Col("name", justify="left", text=True, min_width=10),
        Col("turns"),
        Col("description", priority=1, justify="left", text=True, min_width=20),
    ]
    print_fitted(out, cols, rows, wide=wide, title="shipped scenarios")


@scenarios_app.command("new")
def scenarios_new(
    name: Annotated[str, typer.Argument(help="Scenario name; also the file name (NAME.yaml) unless -o.")],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", metavar="FILE", help="Where to write (default NAME.yaml)."),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force/--no-force", metavar="", help="Overwrite an existing file.")
    ] = False,
) -> None:
    """Write a commented starter scenario (every field explained; see docs/scenarios.md)."""
    from voicepipe.scenario import starter

    given = Path(name)
    if (
        given.suffix in (".yaml", ".yml") or len(given.parts) > 1
    ):  # `new path/to/booking.yaml`: name it booking
        path, name = output or (given if given.suffix else given.with_suffix(".yaml")), given.stem
    else:
        path = output or Path(f"{name}.yaml")
    with user_errors():
        if path.exists() and not force:
            raise UserError(str(path), "already exists (--force overwrites)")
        text = starter(name)
        path.write_text(text, encoding="utf-8")
        load_scenario(str(path))  # the starter must load as it is
    err.print(f"wrote {path}: edit it, then `voicepipe run {path}`", highlight=False)


schema_app = typer.Typer(help="JSON Schemas of the files and messages voicepipe reads.", no_args_is_help=True)
app.add_typer(schema_app, name="schema")


def _print_schema(model: type) -> None:
    sys.stdout.write(json.dumps(model.model_json_schema(), indent=2) + "\n")  # type: ignore[attr-defined]


@schema_app.command("scenario")
def schema_scenario() -> None:
    """JSON Schema of a scenario file (docs/scenarios.md explains every field)."""
    _print_schema(Scenario)


@schema_app.command("config")
def schema_config() -> None:
    """JSON Schema of a pipeline config file."""
    _print_schema(PipelineConfig)


@schema_app.command("messages")
def schema_messages() -> None:
    """JSON Schema of the bus envelope every MQTT message carries."""
    from voicepipe.messages import Envelope

    _print_schema(Envelope)


# click's base error, under whichever click typer uses (its own copy since typer 0.22, click before)
_ClickError: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def main() -> None:
    """The console entry point. Click's own errors (an unknown command or option, a bad option value)
    print as one line naming the option, with where to look, and exit 2, like every other bad input."""
    try:
        rc = app(standalone_mode=False)
    except _ClickError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # a group run bare: its help, as click prints it
            exc.show()  # type: ignore[attr-defined]
            sys.exit(getattr(exc, "exit_code", 2))
        ctx = getattr(exc, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        message = exc.format_message()  # type: ignore[attr-defined]
        err.print(f"error: {message}{where}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(getattr(exc, "exit_code", 2))
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except UserError as exc:  # pragma: no cover - commands catch their own
        err.print(f"error: {exc}")
        sys.exit(2)
    sys.exit(rc if isinstance(rc, int) else 0)


from voicepipe.cli_capacity import register as _register_capacity  # noqa: E402 - needs the helpers above

_register_capacity(sys.modules[__name__])

if __name__ == "__main__":
    main()
