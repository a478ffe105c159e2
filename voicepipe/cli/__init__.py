"""Command line: ``voicepipe run``, ``compare``, ``predict``, ``stage``, ``capacity``, ``scenarios``,
``schema``, ``hardware``, ``calibrate``, ``profile``.

This package builds the typer :data:`app` from one module per command and holds :func:`main`, the console
entry point (``voicepipe = "voicepipe.cli:main"``; ``python -m voicepipe`` and ``python -m voicepipe.cli``
run it too). Shared options are in :mod:`voicepipe.cli.options`, shared helpers in
:mod:`voicepipe.cli.common`.

Bad input prints one line naming the file and field and exits 2 — never a traceback. Turn records are
written as they are measured, so an interrupted run keeps what it had.

A reader that closes the pipe early (``voicepipe hardware list | head -1``) ends the command at that
write, quietly, with exit 141 (128 + SIGPIPE), not 1 (a missed ``--require``) nor 2 (a full disk).

Streams: results (tables, ``--format json`` lines) go to stdout only; progress, per-turn lines when stderr
is not a terminal, warnings and logs (:mod:`voicepipe.logs`) go to stderr. Option names are the same in
every command: ``--json FILE`` writes JSON lines to a file, ``--format json`` writes them to stdout,
``--wide`` shows every column, ``--otel FILE`` / ``--otlp-endpoint URL`` export traces.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
from enum import StrEnum
from typing import Annotated, NoReturn

import typer

from voicepipe import __version__
from voicepipe.cli import calibrate, capacity, compare, hardware, predict, run, scenarios, schema, stage
from voicepipe.cli.closedpipe import closed, guard_streams
from voicepipe.cli.common import err, out, unwritable_line
from voicepipe.clock.gc import tune_for_runs
from voicepipe.errors import UserError
from voicepipe.exitcodes import ExitCode
from voicepipe.safeprint import printable

app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    help="Does a voice pipeline answer inside the human turn budget (~800 ms), and what would change it?",
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
)


class LogFormatChoice(StrEnum):
    console = "console"
    json = "json"


class LogLevelChoice(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


def _version(value: bool) -> None:
    if value:
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
    from voicepipe.logs import configure, level_from_flags  # lazy: start-up time

    configure(level_from_flags(verbose, quiet, log_level.value if log_level else None), log_format.value)


# registration order is the order `voicepipe --help` lists them (commands first, then groups)
app.add_typer(
    hardware.app,
    name="hardware",
    help="LLM hardware models: list, show, predict, sweep, validate against published measurements.",
)
app.command("calibrate")(calibrate.calibrate_cmd)
app.add_typer(calibrate.profile_app, name="profile", help="User profiles: import a `vllm bench serve` result.")
app.command("run")(run.run)
app.command("compare")(compare.compare)
app.command("predict")(predict.predict)
app.command("stage")(stage.stage)
app.add_typer(scenarios.app, name="scenarios")
app.add_typer(schema.app, name="schema")
app.command("capacity")(capacity.capacity)

# click's base error, under whichever click typer uses (its own copy since typer 0.22, click before)
_ClickError: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def global_option_hint(exc: Exception) -> str:
    """For an option the command does not have but ``voicepipe`` itself does (``run X -v``): where it goes."""
    name = getattr(exc, "option_name", None)
    ctx = getattr(exc, "ctx", None)
    if not name or ctx is None or ctx.parent is None:
        return ""
    root = ctx.find_root().command
    opt = next((p for p in root.params if name in p.opts or name in p.secondary_opts), None)
    if opt is None:
        return ""
    given = name if getattr(opt, "is_flag", False) or getattr(opt, "count", False) else f"{name} {opt.metavar or 'VALUE'}"
    chain = []
    c = ctx
    while c.parent is not None:
        chain.append(c.info_name)
        c = c.parent
    command = " ".join(reversed(chain))
    return f"; {name} is an option of voicepipe itself: it goes before the command (`voicepipe {given} {command} ...`)"


def internal_error_line(exc: BaseException) -> str:
    """The one line an uncaught exception prints: its type and message on one line (`-vv` also logs the
    traceback, without local variables)."""
    return printable(
        f"error: internal error ({type(exc).__name__}: {exc}); please report it (`-vv` logs the traceback)",
        newlines=False,
    )


# a write the device refused for want of room: from no named file, it is stdout's (`> /dev/full`)
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _stdout_refused(exc: OSError) -> NoReturn:
    """stdout would not take the results (a full disk, ``> /dev/full``): one line naming it, exit 2 like
    any output not written. stdout is pointed at the null device first, so the interpreter's flush at exit
    does not fail again (exit 120 and an "Exception ignored" report)."""
    with contextlib.suppress(OSError, ValueError):  # no real descriptor (a test runner's): no flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    err.print(f"error: {unwritable_line(exc, path='stdout')}", highlight=False, markup=False, soft_wrap=True)
    sys.exit(ExitCode.USAGE)


def main() -> None:
    """The console entry point. Click's own errors (an unknown command or option, a bad option value)
    print as one line naming the option, with where to look, and exit 2, like every other bad input; any
    other uncaught exception is one line and exit 5, ``ExitCode.INTERNAL_ERROR`` (:func:`internal_error_line`).
    The command line is a program of its own, so it opts in to the runs' GC tuning (a library caller keeps
    its process's settings: :mod:`voicepipe.clock.gc`). A reader that closes stdout or stderr early
    (``| head``) ends the command quietly with exit 141 (:mod:`voicepipe.cli.closedpipe`)."""
    tune_for_runs()
    guard_streams()
    try:
        rc = app(standalone_mode=False)
        sys.stdout.flush()  # what is still buffered meets a closed pipe or a full disk here, not at exit
    except _ClickError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # a group run bare: its help, as click prints it
            exc.show()  # type: ignore[attr-defined]
            sys.exit(getattr(exc, "exit_code", ExitCode.USAGE))
        ctx = getattr(exc, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        message = exc.format_message() + global_option_hint(exc)  # type: ignore[attr-defined]
        err.print(f"error: {message}{where}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(getattr(exc, "exit_code", ExitCode.USAGE))
    except typer.Abort:
        err.print("aborted")
        sys.exit(ExitCode.INTERRUPTED)
    except KeyboardInterrupt:  # Ctrl-C where no command catches it (a live run keeps what it measured)
        err.print("interrupted")
        sys.exit(ExitCode.INTERRUPTED)
    except UserError as exc:  # a library path that raised it past its command's user_errors()
        err.print(f"error: {exc}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(ExitCode.USAGE)
    except OSError as exc:  # a file the system would not take (disk full, folder gone): not a bug
        if exc.filename is None and exc.errno in _FULL:  # the named outputs catch their own: stdout's
            _stdout_refused(exc)
        if exc.filename is None:
            logging.getLogger("voicepipe.cli").debug("uncaught exception", exc_info=True)
            err.print(internal_error_line(exc), highlight=False, markup=False, soft_wrap=True)
            sys.exit(ExitCode.INTERNAL_ERROR)
        err.print(printable(f"error: {unwritable_line(exc)}", newlines=False), highlight=False, markup=False,
                  soft_wrap=True)  # fmt: skip
        sys.exit(ExitCode.USAGE)
    except Exception as exc:  # a bug: one line (never a traceback, whose frames could hold secrets)
        logging.getLogger("voicepipe.cli").debug("uncaught exception", exc_info=True)
        err.print(internal_error_line(exc), highlight=False, markup=False, soft_wrap=True)
        sys.exit(ExitCode.INTERNAL_ERROR)
    if closed():  # a thread's write met the closed pipe (its SystemExit ended only that thread)
        sys.exit(ExitCode.PIPE_CLOSED)
    sys.exit(rc if isinstance(rc, int) else 0)
