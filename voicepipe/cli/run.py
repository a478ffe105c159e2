"""``voicepipe run``: play scenarios through the pipeline over MQTT and measure every turn against the budget.

Turn records are written as they are measured (``--json FILE``, ``--format json``). However the run ends —
finished, SIGINT, SIGTERM, a broker outage past its window, an internal error — every output asked for
(``--json``, ``--csv``, ``--report``, ``--otel``, ``--summary-json``) is written with the turns measured so
far, then one line says why and the exit code (:mod:`voicepipe.exitcodes`) says it too: 0 ok, 1 a
``--require`` missed, 2 bad input or a broker unreachable at the start, 3 expected turns not measured,
4 a broker outage ended the run, 5 an internal error, 130 SIGINT, 143 SIGTERM.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from voicepipe import gate
from voicepipe.audio.engines import REAL_AUDIO_SETS, check_engines
from voicepipe.cli.common import (
    RecordSink,
    Writes,
    err,
    external_plan,
    load_scenarios,
    out,
    progress_bar,
    progress_sink,
    user_errors,
    write_outputs,
)
from voicepipe.cli.ending import Ending, finish, stopped_by
from voicepipe.cli.options import (
    ConfigOpt,
    CsvOpt,
    FormatOpt,
    OtelOpt,
    OtlpOpt,
    OutputFormat,
    ReportOpt,
    RequireOpt,
    ScenariosArg,
    SessionsOpt,
    SetOpt,
    WideOpt,
    broker_block,
    writable,
)
from voicepipe.config import BrokerOverrides, PipelineConfig, check_speech, config_dict, load_config
from voicepipe.errors import UserError, check_run_id
from voicepipe.modelled import require_keys
from voicepipe.records import TurnRecord
from voicepipe.report.advice import advice, base_command, print_advice
from voicepipe.runner import WORKERS_NEED_BROKER, run_pipeline
from voicepipe.runresult import RunResult, distrust_reasons, refused_by_reason
from voicepipe.scenario import Scenario
from voicepipe.stages.guard import require_shared_token
from voicepipe.stopping import stop_on_signals
from voicepipe.workers import run_live_loop


def run_live(
    cfg: PipelineConfig,
    scenarios: list[Scenario],
    sessions: int,
    sink: Callable[[TurnRecord], None],
    label: str,
    run_id: str | None = None,
    external: frozenset[str] = frozenset(),
    workers: int = 0,
    plan: list[list[str]] | None = None,
) -> RunResult:
    """One live run with progress on stderr; every record goes to ``sink`` as it is measured."""
    total = sum(len(s.turns) for s in scenarios) * sessions
    with progress_bar(total, label) as prog:
        on_record = progress_sink(prog, total, sink)
        return run_live_loop(
            stop_on_signals(  # SIGINT / SIGTERM: the run winds down and raises Interrupted with its result
                run_pipeline(
                    cfg,
                    scenarios,
                    sessions,
                    on_record=on_record,
                    run_id=run_id,
                    external=external,
                    workers=workers,
                    plan=plan,
                )
            )
        )


def refusals_line(result: RunResult) -> str:
    """Every refused delivery by reason (dead letters and the bus's duplicate-id drops), for the report."""
    refused = refused_by_reason(result.counters)
    why = "; ".join(f"{n} {r}" for r, n in refused.items())
    return (f"bus: {result.counters.received} messages received, {sum(refused.values())} refused"
            f"{f' ({why})' if why else ''}")  # fmt: skip


def print_run_counters(result: RunResult) -> None:
    """Every expected turn accounted for, what the stages refused, and whether the load let us measure
    (wrapped between words at the console width)."""
    acc = result.accounting()
    style = "" if acc.completed == acc.expected else "yellow"
    err.print(f"[{style}]{acc.line()}[/]" if style else acc.line(), highlight=False)
    c = result.counters
    dead = sum(c.dead.values())
    why = "; ".join(f"{n} {r}" for r, n in c.dead.most_common())
    err.print(
        f"bus: {c.received} received, {dead} dead-lettered{f' ({why})' if why else ''}, "
        f"{c.duplicates} duplicates dropped (envelope id seen before: redelivered, replayed or tampered), "
        f"{c.late} late, {c.lost} lost in transit, {c.handler_errors} handler errors",
        style="yellow" if dead or c.duplicates or c.lost or c.handler_errors else None, highlight=False,
    )  # fmt: skip
    untrusted = sum(not r.trusted for r in result.records)
    if result.lag is not None or untrusted:
        kinds = "; ".join(f"{n} {r}" for r, n in distrust_reasons(result.records).items())
        overloaded = result.lag is not None and result.lag.overloaded
        line = trust_line(result.lag.verdict() if result.lag is not None else "", overloaded, untrusted, kinds)
        err.print(line, style="bold red" if overloaded or untrusted else None, highlight=False)


def trust_line(verdict: str, overloaded: bool, untrusted: int, kinds: str) -> str:
    """The event-loop lag verdict, then the turns a long stall hit (named on their own: the run's p99 can
    hide a few long stalls). After a trusted verdict they are a "but"; after LOAD TOO HIGH, one more count."""
    if not untrusted:
        return verdict
    joint = ("; and " if overloaded else " — but ") if verdict else ""
    turns = f"{untrusted} turn{'' if untrusted == 1 else 's'}"
    return (f"{verdict}{joint}NOT TRUSTED for {turns} ({kinds}): this process's load may have made their "
            "latency and tax (each record's `distrust` says why)")  # fmt: skip


@broker_block
def run(
    scenario: ScenariosArg,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    broker: BrokerOverrides = BrokerOverrides(),
    json_out: Annotated[
        Path | None, typer.Option(
            "--json", metavar="FILE", help="Write one JSON turn record per line.", callback=writable
        )
    ] = None,
    summary_json: Annotated[
        Path | None,
        typer.Option(
            "--summary-json",
            metavar="FILE",
            help="Write the run's counters as JSON: turns expected/completed/failed/lost with reasons, "
            "messages received/refused by reason (dead letters, duplicate ids), event-loop lag, and the "
            "turns not trusted (an event-loop stall or a message burst while they were in flight).",
            callback=writable,
        ),
    ] = None,
    fmt: FormatOpt = OutputFormat.table,
    sessions: SessionsOpt = 1,
    report: ReportOpt = None,
    csv: CsvOpt = None,
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
            "--external",
            help="Stages served by `voicepipe stage` processes, e.g. asr,router,agent,tts; NAME:N waits for "
            "N replicas (`voicepipe stage NAME --replicas N`).",
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            min=0,
            max=64,
            help="Spread the stages over N worker processes (ASR, router, agent, TTS replicated with session "
            "affinity); needs --broker.",
        ),
    ] = 0,
    require: RequireOpt = None,
    audio: Annotated[
        str,
        typer.Option(
            "--audio",
            help="model: words as timed messages; real: a synthesized caller speaks real audio through "
            "Silero VAD, PocketSphinx and espeak-ng (pip install 'voicepipe[audio]', apt-get install espeak-ng).",
        ),
    ] = "model",
    record: Annotated[
        Path | None,
        typer.Option("--record", metavar="DIR", help="Real audio: one stereo WAV per session (caller left)."),
    ] = None,
) -> None:
    """Play scenarios through the pipeline over MQTT and measure every turn against the budget."""
    from voicepipe.report.table import print_paths, print_summary, print_turns  # lazy: start-up time

    with user_errors():
        if audio not in ("model", "real"):
            raise UserError("--audio", f"{audio!r}: expected model or real")
        sets = [*(REAL_AUDIO_SETS if audio == "real" else ()), *(set_ or [])]
        if record is not None:
            sets.append(f"client.record={json.dumps(str(record))}")
        cfg = load_config(config, sets, broker)
        require_keys(cfg, str(config) if config else "")
        if cfg.real_stages:
            check_engines(cfg.vad.engine, cfg.asr.engine, cfg.tts.engine, cfg.client.voice)
        if record is not None and not cfg.audio_caller:
            why = "recordings need an audio caller: --audio real or client.voice espeak-ng"
            raise UserError("--record", why)
        scs = load_scenarios(scenario)
        check_speech(cfg, scs)
        reqs = gate.parse(require)
        ext, plan = external_plan(external)
        if ext and not cfg.broker.url:
            raise UserError("--external", "stages in other processes need a broker (--broker URL)")
        if run_id is not None:
            check_run_id(run_id)
        if ext and not run_id:
            raise UserError("--external", "give the run id the stage processes serve (--run-id)")
        if workers and not cfg.broker.url:
            raise UserError("--workers", WORKERS_NEED_BROKER)
        if workers and ext:
            raise UserError("--workers", "give --workers or --external, not both")
        if ext:
            require_shared_token("--external")

    as_json = fmt == OutputFormat.json
    sink = RecordSink(json_out, stdout=as_json)
    result: RunResult | None = None
    ending: Ending | None = None
    try:
        result = run_live(cfg, scs, sessions, sink, "running", run_id, frozenset(ext), workers, plan)
    except BaseException as exc:  # a signal, an outage, a failure: keep and write what was measured
        result, ending = stopped_by(cfg, exc, len(sink.records))
    finally:
        sink.close()
    expected = sum(len(s.turns) for s in scs) * sessions
    # what the outputs describe: the run's result, or (stopped before it had one) the turns that arrived
    held = result or RunResult(run=run_id or "", broker="", records=list(sink.records), expected_turns=expected)
    if result is None and ending is not None:  # stopped before the run had a result
        held.signalled = ending.signum
        held.ended = None if ending.signum is not None else ending.why or "a failure of the run"
    writes = Writes()
    if summary_json:  # the run's counters (the turn records stay one per line in --json)
        text = json.dumps(held.summary_json(), indent=2) + "\n"
        writes("--summary-json", summary_json, lambda: summary_json.write_text(text, encoding="utf-8"))
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
    if result:  # the notes after the tables, so that they are the last thing read
        for w in result.warnings:
            err.print(f"[bold yellow]warning:[/] {w}")
        print_run_counters(result)
        for d in result.deaths:
            err.print(f"[bold yellow]stage process died:[/] {d}", highlight=False)
    fix = advice(sink.records, cfg, scenario, base_command("run", scenario, config, set_ or []))
    if fix:
        print_advice(err if as_json else out, fix)
    name = config.stem if config else "default config"  # the report names a run by its configuration
    write_outputs(
        {name: sink.records}, {name: config_dict(cfg)}, report, csv, otel, cfg.budget_ms, otlp_endpoint,
        lambda: {name: fix}, {name: held.incidents()}, notes={name: [refusals_line(result)]} if result else None,
        writes=writes,
    )  # fmt: skip
    sink.restate()
    finish(ending, reqs, sink.records, [held.accounting()], [*sink.unwritten(), *writes.failed])
