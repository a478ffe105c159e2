"""``voicepipe scenarios``: list the shipped scenarios (the default), ``scenarios new NAME`` writes a
commented starter file that loads as it is (format: docs/scenarios.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from voicepipe.cli.common import err, out, user_errors
from voicepipe.cli.options import WideOpt
from voicepipe.errors import UserError
from voicepipe.report.term import Col, print_fitted
from voicepipe.scenario import load_scenario, shipped, starter
from voicepipe.shipped import config_summaries

app = typer.Typer(
    help="Scenarios: list the shipped ones (default), write a starter file (`new NAME`).",
    invoke_without_command=True,
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def scenarios(ctx: typer.Context, wide: WideOpt = False) -> None:
    """List the shipped scenarios (format: docs/scenarios.md; `scenarios new NAME` writes a starter)."""
    if ctx.invoked_subcommand is not None:
        return
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
    cols = [Col("name", justify="left", text=True, min_width=10),
            Col("description", priority=1, justify="left", text=True, min_width=20)]  # fmt: skip
    print_fitted(out, cols, config_summaries(), wide=wide, title="shipped configs (-c NAME)")


@app.command("new")
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
