"""The ``hardware`` commands' two ways out: a one-line usage error (exit 2), and a JSON payload written
to ``--json FILE`` and/or stdout (``--format json``). Shared by ``hardware predict``/``sweep``/``validate``
and ``hardware predict --anchor`` so both say the same thing the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn

import typer

from voicepipe.exitcodes import ExitCode
from voicepipe.safeprint import printable


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
