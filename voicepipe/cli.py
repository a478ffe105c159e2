"""Command line: ``voicepipe run``, ``scenarios``, ``hardware``, ``predict``, ``compare``.

Bad input prints one line naming the file and field and exits 2 — never a traceback. Turn records are
written as they are measured, so an interrupted run keeps what it had.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from voicepipe.config import PipelineConfig, config_dict, load_config
from voicepipe.errors import UserError
from voicepipe.records import TurnRecord
from voicepipe.scenario import Scenario, load_scenario, shipped

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Does a voice pipeline answer inside the human turn budget (~800 ms), and what would change it?",
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)

try:
    from voicepipe.cli_hardware import app as hardware_app

    app.add_typer(hardware_app, name="hardware", help="LLM hardware models: list, show, predict, sweep.")
except ImportError:  # pragma: no cover - ships with the package
    pass


def fail(msg: str) -> typer.Exit:
    err.print(f"[bold red]error:[/] {msg}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


@contextmanager
def user_errors() -> Iterator[None]:
    try:
        yield
    except UserError as exc:
        raise fail(str(exc)) from None


ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="Pipeline config YAML.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config field: path.to.field=value (repeatable)."),
]
BrokerOpt = Annotated[
    str | None,
    typer.Option(
        "--broker",
        "-b",
        help="mqtt://[user:pass@]host:port (default: env VOICEPIPE_BROKER, config, embedded)",
    ),
]
ScenariosArg = Annotated[list[str], typer.Argument(help="Scenario files or shipped names (see `scenarios`).")]


def load_scenarios(names: list[str]) -> list[Scenario]:
    return [load_scenario(n) for n in names]


class RecordSink:
    """Writes turn records as they arrive (JSON lines), so nothing measured is lost."""

    def __init__(self, path: Path | None, label: str = "") -> None:
        self.path = path
        self.label = label
        self.fh = path.open("w") if path else None
        self.records: list[TurnRecord] = []

    def __call__(self, rec: TurnRecord) -> None:
        if self.label:
            rec.label = self.label
        self.records.append(rec)
        if self.fh:
            self.fh.write(json.dumps(rec.model_dump(mode="json")) + "\n")
            self.fh.flush()

    def close(self) -> None:
        if self.fh:
            self.fh.close()


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


def run_live(
    cfg: PipelineConfig,
    scenarios: list[Scenario],
    sessions: int,
    sink: Callable[[TurnRecord], None],
    label: str,
):
    from voicepipe.runner import run_pipeline

    total = sum(len(s.turns) for s in scenarios) * sessions
    with progress_bar(total, label) as prog:
        task = prog.task_ids[0]

        def on_record(r: TurnRecord) -> None:
            sink(r)
            prog.advance(task)

        return asyncio.run(run_pipeline(cfg, scenarios, sessions, on_record=on_record))


def write_outputs(
    runs: dict[str, list[TurnRecord]],
    configs: dict[str, dict[str, Any]],
    report: Path | None,
    csv: Path | None,
    otel: Path | None,
    budget_ms: float,
) -> None:
    records = [r for rs in runs.values() for r in rs]
    if report:
        from voicepipe.report.html import render_html

        report.write_text(render_html(runs, configs, budget_ms=budget_ms), encoding="utf-8")
        err.print(f"report: {report}")
    if csv:
        from voicepipe.report.export import write_csv

        write_csv(records, csv)
        err.print(f"csv: {csv}")
    if otel:
        from voicepipe.report.export import write_otel

        write_otel(records, otel)
        err.print(f"otel: {otel}")


@app.command()
def run(
    scenario: ScenariosArg,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    broker: BrokerOpt = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write one JSON turn record per line.")
    ] = None,
    sessions: Annotated[int, typer.Option("--sessions", "-n", min=1, help="Concurrent copies of each.")] = 1,
    report: Annotated[Path | None, typer.Option("--report", help="Self-contained HTML report.")] = None,
    csv: Annotated[Path | None, typer.Option("--csv", help="Turn records as CSV.")] = None,
    otel: Annotated[Path | None, typer.Option("--otel", help="Per-turn spans as OTLP/JSON traces.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Summary only, no per-turn table.")] = False,
) -> None:
    """Play scenarios through the pipeline over MQTT and measure every turn against the budget."""
    from voicepipe.report.table import print_summary, print_turns

    with user_errors():
        cfg = load_config(config, set_ or [], broker)
        scs = load_scenarios(scenario)
    sink = RecordSink(json_out)
    result = None
    try:
        result = run_live(cfg, scs, sessions, sink, "running")
    except KeyboardInterrupt:
        err.print(f"interrupted: keeping {len(sink.records)} measured turns")
    except OSError as exc:
        raise fail(f"broker {cfg.broker.url or 'embedded'}: cannot connect ({exc})") from None
    except Exception as exc:
        if type(exc).__name__ == "MqttError":
            raise fail(f"broker {cfg.broker.url or 'embedded'}: {exc}") from None
        raise
    finally:
        sink.close()
    if result:
        for w in result.warnings:
            err.print(f"[bold yellow]warning:[/] {w}", soft_wrap=True)
        if result.deadletters:
            err.print(f"[yellow]{result.deadletters} malformed bus message(s) dead-lettered[/]")
    if not quiet:
        print_turns(out, sink.records, cfg.budget_ms)
    print_summary(out, {"": sink.records})
    if result:
        out.print(
            f"[dim]run {result.run} on {result.broker}; broker probe "
            f"{result.probe_ms:.1f} ms round trip; measured on the client's clock, predicted = modelled spans[/]"
            if result.probe_ms is not None
            else f"[dim]run {result.run} on {result.broker}[/]"
        )
    write_outputs({"": sink.records}, {"": config_dict(cfg)}, report, csv, otel, cfg.budget_ms)


@app.command()
def scenarios() -> None:
    """List the shipped scenarios."""
    t = Table(title="shipped scenarios", title_justify="left")
    t.add_column("name")
    t.add_column("turns", justify="right")
    t.add_column("description")
    for p in shipped():
        try:
            s = load_scenario(str(p))
        except UserError as exc:
            t.add_row(p.stem, "?", f"[red]{exc}[/]")
            continue
        t.add_row(p.stem, str(len(s.turns)), s.description)
    out.print(t)


def main() -> None:
    try:
        app()
    except UserError as exc:  # pragma: no cover - commands catch their own
        err.print(f"error: {exc}")
        sys.exit(2)


if __name__ == "__main__":
    main()
