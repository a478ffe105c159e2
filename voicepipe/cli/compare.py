"""``voicepipe compare``: the same scenarios under several configurations, one row each.

Configurations are planned by :func:`voicepipe.compare.plan_variants` (whole files, one varied field, or a
grid of two). Live runs are sequential and real time with the same seed; SIGINT, SIGTERM or a broker
outage stops the comparison with what was measured written and the exit code of :mod:`voicepipe.exitcodes`
(130, 143, 4; 3 when a configuration's turns were not all measured); ``--predict`` puts every configuration on virtual time instead (in parallel processes, the same
results as one by one), and its table says PREDICTED.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from voicepipe.cli.common import (
    Outputs,
    RecordSink,
    check_variants_speech,
    err,
    fail,
    load_scenarios,
    out,
    predicted_exports,
    progress_bar,
    progress_sink,
    user_errors,
    virtual_variants,
    write_outputs,
)
from voicepipe.cli.ending import Ending, finish, stopped_by
from voicepipe.cli.options import (
    ConfigsOpt,
    CsvOpt,
    FormatOpt,
    OtelOpt,
    OtlpOpt,
    OutputFormat,
    ReportOpt,
    ScenariosArg,
    SessionsOpt,
    SetOpt,
    VaryOpt,
    WideOpt,
    broker_block,
    writable,
)
from voicepipe.compare import compare_rows, display_names, plan_variants, verdict
from voicepipe.config import BrokerOverrides, PipelineConfig, config_dict
from voicepipe.errors import UserError
from voicepipe.executors import EXECUTOR_HELP, executor_for
from voicepipe.exitcodes import ExitCode
from voicepipe.modelled import require_keys
from voicepipe.parallel import ItemFailed
from voicepipe.records import TurnRecord, account
from voicepipe.report.advice import advice
from voicepipe.runner import run_pipeline
from voicepipe.runresult import RunResult
from voicepipe.scenario import Scenario
from voicepipe.stopping import stop_on_signals
from voicepipe.workers import run_live_loop


def compare_predicted(
    variants: list[tuple[str, PipelineConfig]],
    scs: list[Scenario],
    sessions: int,
    sink: RecordSink,
    fmt: OutputFormat,
    wide: bool,
    executor: str | None = None,
    outputs: Outputs | None = None,
) -> None:
    """`compare --predict`: one row per configuration from the stages on virtual time (no live run);
    ``outputs`` are the --report/--csv/--otel/--otlp-endpoint files, written from the predictions."""
    from voicepipe.predict import predict_each  # lazy: start-up time
    from voicepipe.report.table import PREDICTED, print_compare  # lazy: start-up time

    runs: dict[str, list[TurnRecord]] = {}
    with user_errors():
        variants = virtual_variants(variants)
        ex = executor_for(executor)
    try:  # the configurations in parallel (processes or a Ray cluster): same results as one by one
        each = predict_each([cfg for _, cfg in variants], scs, sessions, executor=ex)
    except ItemFailed as failed:
        if not isinstance(failed.error, ValueError):
            raise failed.error from None
        raise fail(f"configuration {variants[failed.index][0]!r}: {failed.error}") from None
    finally:
        ex.close()
    for (label, _cfg), preds in zip(variants, each, strict=True):
        runs[label] = [p.as_record(label) for p in preds]
        for p in preds:
            sink.write_raw({**p.to_json(), "label": label})
    sink.close()
    unwritten = [*sink.unwritten(), *predicted_exports(variants, each, outputs)]
    if fmt != OutputFormat.json:
        rows = compare_rows(runs)
        heading, names = display_names(list(runs))
        per_run = sum(len(s.turns) for s in scs) * sessions
        title = f"compare (predicted): {', '.join(s.name for s in scs)} · {per_run} turns each"
        print_compare(out, rows, names, heading, title, caption=PREDICTED, wide=wide)
        for line in verdict(rows, names):
            out.print(line, highlight=False, markup=False)
    if unwritten:
        raise typer.Exit(ExitCode.USAGE)


@broker_block
def compare(
    scenario: ScenariosArg,
    config: ConfigsOpt = None,
    vary: VaryOpt = None,
    set_: SetOpt = None,
    broker: BrokerOverrides = BrokerOverrides(),
    sessions: SessionsOpt = 1,
    json_out: Annotated[
        Path | None,
        typer.Option(
            "--json",
            metavar="FILE",
            help="Write every turn record (JSON lines) with its configuration label.",
            callback=writable,
        ),
    ] = None,
    fmt: FormatOpt = OutputFormat.table,
    csv: CsvOpt = None,
    report: ReportOpt = None,
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
    executor: Annotated[
        str | None, typer.Option("--executor", help="With --predict: " + EXECUTOR_HELP)
    ] = None,
) -> None:
    """Run the same scenarios under several configurations: one row each with latency, budget share, cost.

    Configurations are whole files (--config a.yaml --config b.yaml), one field varied (--vary agent.backend=sonnet-gpu,groq-llama-3.1-8b), or a grid of two fields (--vary twice).

    Runs are sequential and real time, with the same seed; Ctrl-C keeps what was measured.
    """
    from voicepipe.report.table import print_compare  # lazy: start-up time

    with user_errors():
        variants = plan_variants(config or [], vary or [], set_ or [], broker)
        scs = load_scenarios(scenario)
        check_variants_speech(variants, scs)
        if executor is not None and not predict:
            raise UserError("--executor", "only with --predict (a live compare runs one configuration at a time)")
        if not predict:
            for label, vcfg in variants:
                require_keys(vcfg, label if len(variants) > 1 else "")

    as_json = fmt == OutputFormat.json
    sink = RecordSink(json_out, stdout=as_json)
    if predict:
        outs = Outputs(report, csv, otel, otlp_endpoint)
        compare_predicted(variants, scs, sessions, sink, fmt, wide, executor, outs)
        return

    per_run = sum(len(s.turns) for s in scs) * sessions
    runs: dict[str, list[TurnRecord]] = {}
    results: dict[str, RunResult] = {}
    ending: Ending | None = None  # a signal, an outage or a failure stopped the comparison
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
                    results[label] = run_live_loop(
                        stop_on_signals(run_pipeline(cfg, scs, sessions, on_record=on_record))
                    )
                except BaseException as exc:  # keep what was measured, write it, then exit saying why
                    partial, ending = stopped_by(cfg, exc, sum(len(v) for v in runs.values()))
                    if partial is not None:
                        results[label] = partial
                    break
    except KeyboardInterrupt:  # between two runs
        ending = Ending(ExitCode.INTERRUPTED, "interrupted by SIGINT", signum=int(signal.SIGINT))
    finally:
        sink.close()
    interrupted = ending is not None

    runs = {k: v for k, v in runs.items() if v}
    if not runs:
        finish(ending, [], [], [])
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
                err.print(f"[bold yellow]warning:[/] {label}: {w}")
        if res.deadletters:
            err.print(f"[yellow]{label}: {res.deadletters} malformed bus message(s) dead-lettered[/]")
    cfgs = dict(variants)
    budget = next(iter(cfgs.values())).budget_ms
    writes = write_outputs(
        runs, {k: config_dict(cfgs[k]) for k in runs}, report, csv, otel, budget, otlp_endpoint,
        lambda: {k: advice(runs[k], cfgs[k], scenario) for k in runs},
        {k: res.incidents() for k, res in results.items()},
    )  # fmt: skip
    # every configuration's turns accounted for: one never started counts all its turns unmeasured
    accounts = [
        results[k].accounting() if k in results else account(runs.get(k, []), per_run) for k, _ in variants
    ]
    sink.restate()
    finish(ending, [], [r for rs in runs.values() for r in rs], accounts, [*sink.unwritten(), *writes.failed])
