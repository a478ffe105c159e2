"""The ``hardware`` commands' ways out: a one-line usage error (exit 2), a JSON payload written to ``--json
FILE`` and/or stdout (``--format json``), and tables on a console at the terminal's width (``--wide``
keeps every column). Shared by ``hardware predict``/``sweep``/``validate`` and ``hardware predict
--anchor`` so they say the same thing the same way."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import typer
from rich.console import Console

from voicepipe.cli.options import writable
from voicepipe.errors import UnsupportedSetting
from voicepipe.exitcodes import ExitCode
from voicepipe.report.term import SafeConsole
from voicepipe.safeprint import printable

T = TypeVar("T")

JsonOpt = typer.Option(None, "--json", help="also write the result as JSON to this file", callback=writable)
WideOpt = typer.Option(False, "--wide/--fit", help="Show every column, wider than the terminal if need be.")


def fail(message: str) -> NoReturn:
    """One ``error:`` line on stderr, exit 2."""
    typer.echo(f"error: {printable(message, newlines=False)}", err=True)
    raise typer.Exit(ExitCode.USAGE)


def emit_json(payload: object, fmt: str, json_out: Path | None) -> bool:
    """Write ``payload`` to ``json_out`` and/or stdout; True when stdout got JSON (no table wanted)."""
    text = json.dumps(payload, indent=2, default=str)
    if json_out is not None:
        try:
            json_out.write_text(text + "\n")
        except OSError as exc:
            fail(f"--json {json_out}: cannot write ({exc.strerror or exc})")
    if fmt == "json":
        typer.echo(text)
        return True
    if fmt != "table":
        fail(f"--format: use table or json, got {fmt!r}")
    return False


def guard(fn: Callable[[], T]) -> T:
    """``fn()``, with a ValueError or KeyError from the catalog or the model as one usage-error line."""
    try:
        return fn()
    except (ValueError, KeyError) as exc:
        fail(message(exc))


def message(exc: Exception) -> str:
    """The one-line text of a catalog or model error, naming the command-line option where it is one
    (a run setting the stack has no switch for: ``--eager``, ``--scheduler-steps``)."""
    if isinstance(exc, UnsupportedSetting):
        return f"--{exc.setting.replace('_', '-')}: {exc.why}"
    return str(exc).strip("'\"")


def console() -> Console:
    """Rich console at the real terminal width (80 when not a terminal)."""
    return SafeConsole(file=sys.stdout)  # control characters in printed text are escaped


def num(x: float) -> str:
    """A measured or modelled value for a table: thousands separated, four significant digits below."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"
