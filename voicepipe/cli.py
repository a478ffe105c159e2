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
    run_id: str | None = None,
    external: frozenset[str] = frozenset(),
):
    from voicepipe.runner import run_pipeline

    total = sum(len(s.turns) for s in scenarios) * sessions
    with progress_bar(total, label) as prog:
        task = prog.task_ids[0]

        def on_record(r: TurnRecord) -> None:
            sink(r)
            prog.advance(task)

        return asyncio.run(
            run_pipeline(cfg, scenarios, sessions, on_record=on_record, run_id=run_id, external=external)
        )


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
    run_id: Annotated[str | None, typer.Option("--run-id", help="Run id (topics voicepipe/RUN/...).")] = None,
    external: Annotated[
        str | None,
        typer.Option(
            "--external", help="Stages served by `voicepipe stage` processes, e.g. asr,router,agent,tts."
        ),
    ] = None,
) -> None:
    """Play scenarios through the pipeline over MQTT and measure every turn against the budget."""
    from voicepipe.report.table import print_paths, print_summary, print_turns

    with user_errors():
        cfg = load_config(config, set_ or [], broker)
        scs = load_scenarios(scenario)
        ext = stage_names(external, "--external")
        if ext and not cfg.broker.url:
            raise UserError("--external", "stages in other processes need a broker (--broker URL)")
        if ext and not run_id:
            raise UserError("--external", "give the run id the stage processes serve (--run-id)")
    sink = RecordSink(json_out)
    result = None
    try:
        result = run_live(cfg, scs, sessions, sink, "running", run_id, frozenset(ext))
    except KeyboardInterrupt:
        err.print(f"interrupted: keeping {len(sink.records)} measured turns")
    except Exception as exc:
        failure = _run_error(cfg, exc)
        if failure is None:
            raise
        raise failure from None
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
    print_paths(out, sink.records)
    if result:
        out.print(
            f"[dim]run {result.run} on {result.broker}; broker probe "
            f"{result.probe_ms:.1f} ms round trip; measured on the client's clock, predicted = modelled spans[/]"
            if result.probe_ms is not None
            else f"[dim]run {result.run} on {result.broker}[/]"
        )
    write_outputs({"": sink.records}, {"": config_dict(cfg)}, report, csv, otel, cfg.budget_ms)


ConfigsOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--config",
        "-c",
        help="Pipeline config YAML (repeatable: one row per file; with --vary, several files are crossed "
        "with the varied values, one file is the base).",
    ),
]
VaryOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--vary",
        help="Vary one config field: path.to.field=v1,v2,... (values parsed as YAML like --set; a value "
        "containing a comma is not supported). Give twice for a grid of two fields.",
    ),
]


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
    return None


def _safe_url(url: str) -> str:
    """The broker URL without its password."""
    from urllib.parse import urlparse

    u = urlparse(url if "://" in url else f"mqtt://{url}")
    return url if not u.password else url.replace(f":{u.password}@", ":***@", 1)


def compare_table(
    rows: list,
    names: list[str],
    heading: str,
    title: str,
    stage_width: int | None = None,
    expected: int | None = None,
    caption: str = "latency measured on the client clock over MQTT; cost and quality modelled from catalog "
    "prices/benchmarks",
) -> Table:
    """One row per configuration: percentiles, budget shares, modelled cost and quality, and the largest
    stages (on one line, or wrapped into lines of ``stage_width``)."""
    from rich import box
    from rich.text import Text

    from voicepipe.compare import fmt_usd, join_parts

    budgets = {r.budget_ms for r in rows}
    budget = budgets.pop() if len(budgets) == 1 else None
    t = Table(
        title=title,
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        padding=(0, 1, 0, 0),
        caption=caption,
        caption_justify="left",
        caption_style="dim",
    )
    name_w = min(24, max(len(heading), *(len(n) for n in names)))
    t.add_column(heading, no_wrap=True, min_width=name_w, max_width=30, overflow="ellipsis")
    for h in ("p50", "p90", "p99"):
        t.add_column(f"{h}\nms", justify="right", no_wrap=True, min_width=5)
    t.add_column(f"≤{budget:.0f}\nms" if budget else "in\nbudget", justify="right", no_wrap=True, min_width=4)
    t.add_column("<200\nms", justify="right", no_wrap=True, min_width=4)
    t.add_column("$ per\n1k turns", justify="right", no_wrap=True, min_width=7)
    t.add_column("quality\nmodelled", justify="right", no_wrap=True, min_width=8)
    t.add_column("largest stages\n(mean ms)", min_width=12, no_wrap=True, overflow="ellipsis")

    def ms(v: float | None) -> str:
        return "—" if v is None else f"{v:,.0f}"

    for name, r in zip(names, rows, strict=True):
        share_style = "green" if r.within_budget >= 0.9 else "red" if r.within_budget < 0.5 else "yellow"
        p50 = Text(ms(r.p50_ms), style=("green" if r.fits else "red") + (" bold" if r.best_p50 else ""))
        planned = max(r.turns, expected or 0)
        label = Text(name + (f" ({r.answered}/{planned})" if r.answered < planned else ""))
        cost = Text(fmt_usd(r.cost_per_1k_usd), style="bold cyan" if r.cheapest else "")
        qual = Text(
            "—" if r.quality is None else f"{r.quality * 100:.0f}%",
            style="bold cyan" if r.best_quality else "",
        )
        stages = join_parts([f"{st} {v:,.0f}" for st, v in r.top_stages(3)], stage_width) or "—"
        t.add_row(
            label,
            p50,
            ms(r.p90_ms),
            ms(r.p99_ms),
            Text(f"{r.within_budget * 100:.0f}%", style=share_style),
            f"{r.under_200ms * 100:.0f}%",
            cost,
            qual,
            stages,
        )
    return t


def _compare_predicted(variants: list, scs: list[Scenario], sessions: int, json_out: Path | None) -> None:
    """`compare --predict`: one row per configuration from the stages on virtual time (no live run)."""
    from voicepipe.compare import compare_rows, display_names, verdict
    from voicepipe.predict import predict as predict_turns
    from voicepipe.report.table import PREDICTED

    runs: dict[str, list[TurnRecord]] = {}
    lines: list[str] = []
    for label, cfg in variants:
        try:
            preds = predict_turns(cfg, scs, sessions)
        except ValueError as exc:
            raise fail(f"configuration {label!r}: {exc}") from None
        runs[label] = [p.as_record(label) for p in preds]
        lines += [json.dumps({**p.to_json(), "label": label}) + "\n" for p in preds]
    if json_out:
        json_out.write_text("".join(lines))
    rows = compare_rows(runs)
    heading, names = display_names(list(runs))
    per_run = sum(len(s.turns) for s in scs) * sessions
    title = f"compare (predicted): {', '.join(s.name for s in scs)} · {per_run} turns each"
    out.print(compare_table(rows, names, heading, title, caption=PREDICTED))
    for line in verdict(rows, names):
        out.print(line, highlight=False, markup=False, soft_wrap=True)


@app.command()
def compare(
    scenario: ScenariosArg,
    config: ConfigsOpt = None,
    vary: VaryOpt = None,
    set_: SetOpt = None,
    broker: BrokerOpt = None,
    sessions: Annotated[int, typer.Option("--sessions", "-n", min=1, help="Concurrent copies of each.")] = 1,
    json_out: Annotated[
        Path | None,
        typer.Option("--json", help="Write every turn record (JSON lines) with its configuration label."),
    ] = None,
    csv: Annotated[Path | None, typer.Option("--csv", help="Turn records as CSV.")] = None,
    report: Annotated[Path | None, typer.Option("--report", help="Self-contained HTML report.")] = None,
    otel: Annotated[Path | None, typer.Option("--otel", help="Per-turn spans as OTLP/JSON traces.")] = None,
    predict: Annotated[
        bool,
        typer.Option(
            "--predict", help="Predict on virtual time instead of running (no waiting; for large grids)."
        ),
    ] = False,
) -> None:
    """Run the same scenarios under several configurations: one row each with latency, budget share, cost.

    Configurations are whole files (--config a.yaml --config b.yaml), one field varied (--vary agent.backend=sonnet-gpu,groq-llama-3.1-8b), or a grid of two fields (--vary twice).

    Runs are sequential and real time, with the same seed; Ctrl-C keeps what was measured.
    """
    from voicepipe.compare import compare_rows, display_names, join_parts, plan_variants, verdict

    with user_errors():
        variants = plan_variants(config or [], vary or [], set_ or [], broker)
        scs = load_scenarios(scenario)

    if predict:
        _compare_predicted(variants, scs, sessions, json_out)
        return
    from voicepipe.runner import run_pipeline

    per_run = sum(len(s.turns) for s in scs) * sessions
    sink = RecordSink(json_out)
    runs: dict[str, list[TurnRecord]] = {}
    results = {}
    interrupted = False
    try:
        with progress_bar(per_run * len(variants), "comparing") as prog:
            task = prog.task_ids[0]
            for i, (label, cfg) in enumerate(variants):
                prog.update(task, description=f"{i + 1}/{len(variants)} {label}")
                sink.label = label
                got = runs.setdefault(label, [])

                def on_record(r: TurnRecord, got: list[TurnRecord] = got) -> None:
                    sink(r)
                    got.append(r)
                    prog.advance(task)

                try:
                    results[label] = asyncio.run(run_pipeline(cfg, scs, sessions, on_record=on_record))
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
    from rich.measure import Measurement

    table = compare_table(rows, names, heading, title, expected=per_run)
    excess = Measurement.get(out, out.options.update_width(1000), table).maximum - out.width
    if excess > 0:  # fold the stage parts onto more lines rather than cut anything
        widest = max(len(join_parts([f"{st} {v:,.0f}" for st, v in r.top_stages(3)])) for r in rows)
        table = compare_table(rows, names, heading, title, max(1, widest - excess), per_run)
    out.print(table)
    for line in verdict(rows, names):
        out.print(line, highlight=False, markup=False, soft_wrap=True)
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
    write_outputs(runs, {k: config_dict(cfgs[k]) for k in runs}, report, csv, otel, budget)


@app.command()
def predict(
    scenario: ScenariosArg,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    sessions: Annotated[int, typer.Option("--sessions", "-n", min=1, help="Concurrent copies of each.")] = 1,
    json_out: Annotated[Path | None, typer.Option("--json", help="One JSON prediction per line.")] = None,
) -> None:
    """Predict every turn's latency and breakdown: the live stages on virtual time — no broker, no waiting.

    The pipeline's own code on an in-memory bus with zero hops: a live run's predicted_ms equals this for
    the same turn and seed (to within bus hops where timing overlaps or sessions queue on one device).
    """
    from voicepipe.predict import predict as predict_turns
    from voicepipe.report.table import print_predictions

    with user_errors():
        cfg = load_config(config, set_ or [])
        scs = load_scenarios(scenario)
        try:
            preds = predict_turns(cfg, scs, sessions)
        except ValueError as exc:
            raise UserError(str(config or "config"), str(exc)) from None
    if json_out:
        json_out.write_text("".join(json.dumps(p.to_json()) + "\n" for p in preds))
    print_predictions(out, [p.as_record() for p in preds], cfg.budget_ms)


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
) -> None:
    """Serve some stages of a run in this process (the rest, and the client, run elsewhere).

    Same broker, run id and config as the `voicepipe run ... --external NAMES` that plays the scenario;
    all processes must share one host clock (CLOCK_MONOTONIC). Stops on Ctrl-C.
    """
    from voicepipe.runner import serve_stages

    with user_errors():
        cfg = load_config(config, set_ or [], broker)
        chosen = stage_names(names, "stage")
        if not cfg.broker.url:
            raise UserError("--broker", "stages in separate processes need a broker URL")
    err.print(f"serving {', '.join(chosen)} for run {run_id} on {cfg.broker.url}", highlight=False)
    try:
        asyncio.run(serve_stages(cfg, chosen, run_id))
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        failure = _run_error(cfg, exc)
        if failure is None:
            raise
        raise failure from None


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


from voicepipe.cli_capacity import register as _register_capacity  # noqa: E402 - needs the helpers above

_register_capacity(sys.modules[__name__])

if __name__ == "__main__":
    main()
