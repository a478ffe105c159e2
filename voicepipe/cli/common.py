"""What every command shares: the two consoles, the one-line failure, loading scenarios, turn-record
sinks and progress, the exports, the ``--require`` exit and the broker failure lines.

Streams: results go to :data:`out` (stdout) only; progress, per-turn lines when stderr is not a terminal,
warnings and errors go to :data:`err` (stderr). A bad input is one ``error:`` line and exit 2 (:func:`fail`,
:func:`user_errors`), never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from aiomqtt import MqttError
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from voicepipe import gate
from voicepipe.bus import BrokerOutage
from voicepipe.bus.mqtt import RunTopicsUnreachable
from voicepipe.bus.partition import replica_id
from voicepipe.config import PipelineConfig, check_speech, config_dict
from voicepipe.errors import UserError, redact_url
from voicepipe.exitcodes import ExitCode
from voicepipe.incidents import Incidents
from voicepipe.modelled import on_virtual_time
from voicepipe.records import TurnRecord, unmeasured
from voicepipe.report.export import push_otlp, write_csv, write_otel
from voicepipe.report.html import render_html
from voicepipe.report.term import SafeConsole
from voicepipe.runner import StagesMissing
from voicepipe.safeprint import printable
from voicepipe.scenario import Scenario, load_scenario
from voicepipe.stageset import STAGES

if TYPE_CHECKING:
    from voicepipe.predict import TurnPrediction

out = SafeConsole()  # control characters in printed text are escaped (voicepipe.safeprint)
err = SafeConsole(stderr=True)


def fail(msg: str) -> typer.Exit:
    """Print ``error: msg`` on stderr; the caller raises the returned exit (status 2)."""
    err.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    return typer.Exit(ExitCode.USAGE)


@contextmanager
def user_errors() -> Iterator[None]:
    """A :class:`UserError` inside becomes :func:`fail`'s line and exit 2."""
    try:
        yield
    except UserError as exc:
        raise fail(str(exc)) from None


def check_variants_speech(variants: list[tuple[str, PipelineConfig]], scs: list[Scenario]) -> None:
    """:func:`check_speech` for every configuration; with several, the error names the one that fails."""
    for label, vcfg in variants:
        try:
            check_speech(vcfg, scs)
        except UserError as exc:
            if len(variants) == 1:
                raise
            raise UserError(f"configuration {label!r}", str(exc)) from None


def virtual_variants(
    variants: list[tuple[str, PipelineConfig]], source: str = ""
) -> list[tuple[str, PipelineConfig]]:
    """The configurations as virtual time runs them (:func:`voicepipe.modelled.on_virtual_time`): an endpoint
    becomes its calibrated profile, one without a profile is a UserError (naming the configuration when there
    are several, else ``source``). Called before any work starts, so the refusal is the only line."""
    return [(label, on_virtual_time(cfg, label if len(variants) > 1 else source)) for label, cfg in variants]


def load_scenarios(names: list[str]) -> list[Scenario]:
    """The scenarios named on the command line; two with the same name are an error."""
    scs = [load_scenario(n) for n in names]
    seen: dict[str, str] = {}
    for sc in scs:
        if sc.name in seen:
            raise UserError(
                sc.source, f"name: {sc.name!r} is also the name of {seen[sc.name]} (names must differ)"
            )
        seen[sc.name] = sc.source
    return scs


def stage_names(raw: str | list[str] | None, where: str) -> list[str]:
    """Stage names given as ``a,b`` or as separate arguments, checked against the pipeline's stages."""
    names = [n.strip() for n in (raw.split(",") if isinstance(raw, str) else raw or []) if n.strip()]
    for n in names:
        if n not in STAGES or n == "client":
            allowed = ", ".join(k for k in STAGES if k != "client")
            raise UserError(where, f"unknown stage {n!r} (stages: {allowed})")
    return names


def unwritable_line(exc: OSError, option: str = "", path: Path | str | None = None) -> str:
    """``--csv out.csv: could not be written (No space left on device)``: one line naming the output."""
    name = path if path is not None else exc.filename
    return f"{option + ' ' if option else ''}{name}: could not be written ({exc.strerror or exc})"


class Writes:
    """The outputs a command writes after its run, each attempted even when an earlier one failed (nothing
    measured is lost to one bad path); :attr:`failed` holds one printed line per output not written, and
    :func:`voicepipe.cli.ending.finish` exits 2 for them."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, option: str, path: Path | str, write: Callable[[], object]) -> bool:
        try:
            write()
        except OSError as exc:
            self.fail(unwritable_line(exc, option, path))
            return False
        return True

    def fail(self, line: str) -> None:
        self.failed.append(line)
        err.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)


def external_plan(raw: str | None) -> tuple[list[str], list[list[str]] | None]:
    """``--external asr:2,router``: the stage kinds served elsewhere, and (when a count is given) every
    replica the run waits for (``voicepipe stage ... --replicas N`` serves ``NAME.0`` .. ``NAME.N-1``)."""
    kinds: list[str] = []
    counts: list[int] = []
    for item in [x.strip() for x in (raw or "").split(",") if x.strip()]:
        name, _, n = item.partition(":")
        if n and (not n.isdigit() or not 1 <= int(n) <= 64):
            raise UserError("--external", f"{item!r}: a replica count is NAME:N with N from 1 to 64")
        if not name.strip():
            raise UserError("--external", f"{item!r}: a stage name comes before the replica count (NAME:N)")
        if name.strip() in kinds:
            raise UserError("--external", f"{name.strip()!r} is named twice")
        kinds += stage_names(name, "--external")
        counts.append(int(n) if n else 1)
    if ":" not in (raw or ""):
        return kinds, None
    return kinds, [[replica_id(k, i)] for k, c in zip(kinds, counts, strict=True) for i in range(c)]


class RecordSink:
    """Writes turn records as they arrive (JSON lines to ``--json FILE`` and/or stdout), so nothing measured
    is lost; derives the per-turn metric columns (ttft_ms...) the records carry. A file the system stops
    taking (a full disk) is said once and dropped; the run and its records go on (:meth:`unwritten`)."""

    def __init__(self, path: Path | None, label: str = "", stdout: bool = False) -> None:
        self.path = path
        self.label = label
        self.fh = path.open("w") if path else None
        self.stdout = stdout
        self.records: list[TurnRecord] = []
        self.failed: str | None = None  # why --json stopped being written

    def __call__(self, rec: TurnRecord) -> None:
        if self.label:
            rec.label = self.label
        self.records.append(rec)
        self._line(json.dumps(rec.model_dump(mode="json")) + "\n")

    def write_raw(self, data: dict[str, Any]) -> None:
        """One JSON line that is not a turn record (a prediction)."""
        self._line(json.dumps(data) + "\n")

    def _line(self, line: str) -> None:
        if self.fh:
            try:
                self.fh.write(line)
                self.fh.flush()
            except OSError as exc:
                self._fail(exc)
        if self.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()

    def _fail(self, exc: OSError) -> None:
        self.failed = unwritable_line(exc, "--json", self.path)
        err.print(f"[bold red]error:[/] {escape(self.failed)}", highlight=False, soft_wrap=True)
        fh, self.fh = self.fh, None
        if fh is not None:
            with contextlib.suppress(OSError):
                fh.close()

    def close(self) -> None:
        if self.fh:
            try:
                self.fh.close()
            except OSError as exc:
                self._fail(exc)
            self.fh = None
        if self.stdout:
            sys.stdout.flush()

    def unwritten(self) -> list[str]:
        """The line saying why ``--json`` stopped being written, if it did."""
        return [self.failed] if self.failed else []

    def restate(self) -> None:
        """Say the ``--json`` failure again at the end of a live run: it was said when it happened, above the
        turns and the summary, and stderr ends with the line saying why the exit is not 0."""
        if self.failed:
            err.print(f"[bold red]error:[/] {escape(self.failed)}", highlight=False, soft_wrap=True)


def progress_bar(total: int, label: str) -> Progress:
    """A transient bar on stderr, only when stderr is a terminal and there are more than two turns."""
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
    from voicepipe.report.table import top_parts  # lazy: start-up time

    lat = unmeasured(r) if r.measured_ms is None else f"{r.measured_ms:,.0f} ms"
    ok = "ok" if r.within_budget else "miss, talked over the user" if r.talked_over else "miss"
    who = f"{r.label}: " if r.label else ""
    why = r.error if r.error and not r.breakdown else top_parts(r, 1)  # a failed turn: its reason
    return printable(f"[{done}/{total}] {who}{r.session} #{r.turn} {lat} {ok} ({why})", False)


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


def write_outputs(
    runs: dict[str, list[TurnRecord]],
    configs: dict[str, dict[str, Any]],
    report: Path | None,
    csv: Path | None,
    otel: Path | None,
    budget_ms: float,
    otlp_endpoint: str | None = None,
    fixes: Callable[[], dict[str, Any]] | None = None,
    incidents: Mapping[str, Incidents] | None = None,
    predicted: bool = False,
    notes: dict[str, list[str]] | None = None,
    writes: Writes | None = None,
) -> Writes:
    """Write the requested exports; ``fixes`` (only called for a report) gives label → advice;
    ``incidents`` (label → outages, stage deaths, early end) go in the report's Incidents section;
    ``predicted``: the records are predictions (the report says so); ``notes`` (label → lines) what a
    live run counted beyond its records, for the report. Each is attempted even when one before it could
    not be written; the result (``writes``, or a new one) lists those that failed."""
    writes = writes if writes is not None else Writes()
    records = [r for rs in runs.values() for r in rs]
    if report:
        html = render_html(
            runs, configs, budget_ms=budget_ms, fixes=fixes() if fixes else None, incidents=incidents,
            predicted=predicted, notes=notes,
        )
        if writes("--report", report, lambda: report.write_text(html, encoding="utf-8")):
            err.print(f"report: {report}")
    if csv and writes("--csv", csv, lambda: write_csv(records, csv)):
        err.print(f"csv: {csv}")
    if otel and writes("--otel", otel, lambda: write_otel(records, otel)):
        err.print(f"otel: {otel}")
    if otlp_endpoint:
        with user_errors():
            n = push_otlp(records, otlp_endpoint)
        err.print(f"otlp: {n} spans pushed to {otlp_endpoint}", highlight=False)
    return writes


@dataclass(frozen=True)
class Outputs:
    """The export files a command was asked for (``--report``, ``--csv``, ``--otel``, ``--otlp-endpoint``)."""

    report: Path | None = None
    csv: Path | None = None
    otel: Path | None = None
    otlp_endpoint: str | None = None

    def wanted(self) -> bool:
        return any(v is not None for v in (self.report, self.csv, self.otel, self.otlp_endpoint))


def predicted_exports(
    variants: Sequence[tuple[str, PipelineConfig]],
    each: Sequence[Sequence[TurnPrediction]],
    outputs: Outputs | None,
) -> list[str]:
    """The exports of a prediction (``compare --predict``), through :func:`write_outputs` like a live run's:
    records whose latency is the prediction, with the virtual run's modelled spans (run ``predict``; trace
    times are the virtual clock placed at the moment of export); the report says PREDICTED."""
    if outputs is None or not outputs.wanted():
        return []
    at = time.time_ns()
    runs = {
        label: [p.export_record(label, at) for p in preds]
        for (label, _), preds in zip(variants, each, strict=True)
    }
    cfgs = dict(variants)
    configs = {k: config_dict(cfgs[k]) for k in runs}
    budget = variants[0][1].budget_ms if variants else 800.0
    # the report's tables read a turn's latency from measured_ms (it is the prediction there, and the page
    # says PREDICTED); the CSV and traces are rows for other tools: nothing in them claims a measurement
    writes = write_outputs(runs, configs, outputs.report, None, None, budget, predicted=True)
    unmeasured = {
        k: [r.model_copy(update={"measured_ms": None, "tax_ms": None}) for r in rs] for k, rs in runs.items()
    }
    write_outputs(unmeasured, configs, None, outputs.csv, outputs.otel, budget, outputs.otlp_endpoint, writes=writes)
    return writes.failed


def gate_exit(reqs: list[gate.Requirement], records: list[TurnRecord], unwritten: Sequence[str] = ()) -> None:
    """After everything is printed and written: name each ``--require`` the turns missed, then exit 2 when
    an output could not be written (``unwritten``, printed already), else 1 when a requirement was missed."""
    lines = gate.missed(reqs, records)
    for line in lines:
        err.print(f"[bold red]error:[/] {line}", highlight=False, soft_wrap=True)
    if unwritten:
        raise typer.Exit(ExitCode.USAGE)
    if lines:
        raise typer.Exit(ExitCode.REQUIREMENT_MISSED)


def run_error(cfg: PipelineConfig, exc: BaseException) -> typer.Exit | None:
    """The one-line failure for a broker that cannot be reached; None for anything else."""
    where = f"broker {safe_url(cfg.broker.url) if cfg.broker.url else 'embedded'}"
    if isinstance(exc, OSError):
        return fail(f"{where}: cannot connect ({exc})")
    if isinstance(exc, MqttError):  # refused (bad credentials), lost connection, ...
        return fail(f"{where}: {exc}")
    if isinstance(exc, StagesMissing | UserError):  # UserError: a live start of the same run id (--run-id)
        return fail(str(exc))
    if isinstance(exc, RunTopicsUnreachable):
        return fail(str(exc))
    if isinstance(exc, BrokerOutage):  # the broker stayed away past broker.outage_window_s
        fail(str(exc))
        return typer.Exit(ExitCode.BROKER_OUTAGE)
    return None


def safe_url(url: str) -> str:
    """The broker URL without its password."""
    return redact_url(url)
