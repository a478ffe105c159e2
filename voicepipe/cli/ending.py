"""How a live run (``run``, ``compare``) ends: the exit code (:mod:`voicepipe.exitcodes`) and the one
line on stderr that says why, after every output that was asked for has been written.

:func:`stopped_by` turns what ended a run early — a signal (:mod:`voicepipe.stopping`), a broker outage
past its window, Ctrl-C outside the event loop, an internal error — into an :class:`Ending` and the run
result the run had (None when it had none). A start-up failure with nothing measured (a broker that
cannot be reached) stays its usual one line and exit 2. :func:`finish` prints the last lines and exits.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
import typer
from rich.markup import escape

from voicepipe import gate
from voicepipe.cli.common import err, run_error
from voicepipe.config import PipelineConfig
from voicepipe.exitcodes import ExitCode, for_signal, signal_name
from voicepipe.records import Accounting, TurnRecord
from voicepipe.runresult import RunAborted, RunResult
from voicepipe.stopping import Interrupted

log = structlog.get_logger("voicepipe.run")


@dataclass
class Ending:
    code: ExitCode
    why: str  # "interrupted by SIGTERM", "broker ... unreachable ...", "internal error: ..."
    printed: bool = False  # the error line was printed already (run_error's own line)
    signum: int | None = None  # the signal that stopped the run


def stopped_by(
    cfg: PipelineConfig, exc: BaseException, measured: int
) -> tuple[RunResult | None, Ending]:
    """The run's result (if it had one) and its ending, for an exception a live run raised; re-raises a
    start-up failure with nothing measured as its one-line exit, and exits it never caught."""
    if isinstance(exc, Interrupted):
        result = exc.result if isinstance(exc.result, RunResult) else None
        why = f"interrupted by {signal_name(exc.signum)}"
        return result, Ending(for_signal(exc.signum), why, signum=exc.signum)
    if isinstance(exc, RunAborted):  # the broker stayed away past broker.outage_window_s
        return exc.result, Ending(ExitCode.BROKER_OUTAGE, str(exc))
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C outside the event loop (start-up, shut-down)
        return None, Ending(ExitCode.INTERRUPTED, "interrupted by SIGINT", signum=int(signal.SIGINT))
    if not isinstance(exc, Exception):
        raise exc
    failure = run_error(cfg, exc)  # prints its one line
    if failure is not None:
        if not measured:
            raise failure from None
        return None, Ending(ExitCode(failure.exit_code), "", printed=True)
    log.debug("run failed", exc_info=exc)  # -vv shows the traceback
    why = f"internal error: {type(exc).__name__}: {exc} (run with -vv for the traceback)"
    return None, Ending(ExitCode.INTERNAL_ERROR, why)


def finish(
    ending: Ending | None,
    reqs: list[gate.Requirement],
    records: list[TurnRecord],
    accounts: list[Accounting],
    unwritten: Sequence[str] = (),
) -> None:
    """The last lines on stderr and the exit: each ``--require`` missed, the turns not measured, the early
    end; then the exit code of the first that applies (:mod:`voicepipe.exitcodes`), or return (0).
    ``unwritten``: the outputs that could not be written (their lines are printed already): exit 2."""
    missed = gate.missed(reqs, records)
    for line in missed:
        err.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    expected = sum(a.expected for a in accounts)
    done = sum(a.completed for a in accounts)
    n = len(records)
    if ending is not None:
        if not ending.printed:
            err.print(
                f"[bold red]error:[/] {escape(ending.why)}: run ended after {n} measured turn{'s' * (n != 1)}"
                + (f" ({expected - done} of {expected} expected not measured)" if done < expected else ""),
                highlight=False, soft_wrap=True,
            )  # fmt: skip
        raise typer.Exit(ending.code)
    if unwritten:
        raise typer.Exit(ExitCode.USAGE)
    if done < expected:
        err.print(
            f"[bold red]error:[/] {expected - done} of {expected} expected turns not measured (the turns line "
            "above says why)",
            highlight=False, soft_wrap=True,
        )  # fmt: skip
        raise typer.Exit(ExitCode.TURNS_NOT_MEASURED)
    if missed:
        raise typer.Exit(ExitCode.REQUIREMENT_MISSED)
