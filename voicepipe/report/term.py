"""Terminal tables that fit the real terminal: numbers whole, text wrapped, columns dropped by priority.

The contract every table printed by the CLI follows (``cli_hardware`` can adopt it by building its rows
as :class:`Col` + cells and calling :func:`print_fitted`):

* The width is the console's (rich reads the real terminal, ``COLUMNS`` when piped, 80 by default).
* Numeric columns (``text=False``) are never wrapped or cut: a number is shown in full or not at all.
* Text columns (``text=True``) wrap at word boundaries (``overflow="fold"`` for long tokens) and give up
  their width first; each keeps at least ``min_width`` characters.
* When even that does not fit, whole columns are dropped, the highest ``priority`` number first (0 = never
  dropped), and a dim note under the table names what was hidden and that ``--wide`` shows it.
* ``wide=True`` keeps every column on one line each and renders at the table's natural width, wider than
  the terminal if need be (for piping into ``less -S`` or a file).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rich import box
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

Cell = str | Text
SEP = 1  # SIMPLE_HEAD draws a one-space column separator; no outer edge, no padding


@dataclass(frozen=True)
class Col:
    header: str  # may hold a line break: "p50\nms"
    priority: int = 0  # 0: never dropped; larger numbers are dropped first when the terminal is narrow
    justify: Literal["left", "right", "center"] = "right"
    text: bool = False  # free text: may wrap; numbers (text=False) are shown whole
    min_width: int = 8  # a text column's narrowest width
    max_width: int | None = None  # a text column's widest (None: as wide as its longest cell)


def _cell_width(c: Cell) -> int:
    t = c if isinstance(c, Text) else Text(c)
    return max((t.cell_len if "\n" not in t.plain else max(Text(x).cell_len for x in t.plain.split("\n"))), 0)


def natural_width(col: Col, cells: Sequence[Cell]) -> int:
    head = max(len(h) for h in col.header.split("\n"))
    return max([head, *(_cell_width(c) for c in cells)])


def _header_min(col: Col) -> int:
    """A text column's header words must not split mid-word."""
    return max(len(w) for line in col.header.split("\n") for w in line.split() or [""])


def choose_columns(cols: Sequence[Col], rows: Sequence[Sequence[Cell]], width: int) -> list[int]:
    """Indices of the columns to show in ``width`` characters: drop by descending priority until the
    numeric columns at full width plus the text columns at their minimum fit."""
    keep = list(range(len(cols)))
    nat = [natural_width(c, [r[i] for r in rows]) for i, c in enumerate(cols)]

    def need(idx: list[int]) -> int:
        total = 0
        for i in idx:
            c = cols[i]
            w = min(nat[i], max(c.min_width, _header_min(c))) if c.text else nat[i]
            total += w + SEP
        return total - SEP

    while need(keep) > width:
        droppable = [i for i in keep if cols[i].priority > 0]
        if not droppable:
            break
        keep.remove(max(droppable, key=lambda i: (cols[i].priority, i)))
    return keep


def fitted_table(
    cols: Sequence[Col],
    rows: Sequence[Sequence[Cell]],
    width: int,
    *,
    wide: bool = False,
    title: str | None = None,
    caption: str | None = None,
) -> tuple[Table, list[str]]:
    """The table for ``width`` columns and the headers of the columns it had to hide."""
    keep = list(range(len(cols))) if wide else choose_columns(cols, rows, width)
    t = Table(
        title=title,
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 0, 0, 0),
        caption=caption,
        caption_justify="left",
        caption_style="dim",
    )
    for i in keep:
        c = cols[i]
        if c.text and not wide:
            t.add_column(
                c.header,
                justify=c.justify,
                min_width=min(natural_width(c, [r[i] for r in rows]), max(c.min_width, _header_min(c))),
                max_width=c.max_width,
                overflow="fold",
                ratio=None,
            )
        else:
            t.add_column(
                c.header,
                justify=c.justify,
                no_wrap=True,
                min_width=natural_width(c, [r[i] for r in rows]) if not c.text else None,
            )
    for r in rows:
        t.add_row(*(r[i] for i in keep))
    hidden = [cols[i].header.replace("\n", " ") for i in range(len(cols)) if i not in keep]
    return t, hidden


def print_fitted(
    console: Console,
    cols: Sequence[Col],
    rows: Sequence[Sequence[Cell]],
    *,
    wide: bool = False,
    title: str | None = None,
    caption: str | None = None,
) -> None:
    """Print a fitted table (see the module docstring) and, if columns were hidden, a note naming them."""
    table, hidden = fitted_table(cols, rows, console.width, wide=wide, title=title, caption=caption)
    print_wide(console, table, wide)
    if hidden:
        console.print(
            Text(f"hidden at {console.width} columns: {', '.join(hidden)} (--wide shows all)", style="dim")
        )


def print_wide(console: Console, renderable: RenderableType, wide: bool) -> None:
    """Print at the console width, or — with ``wide`` — at the renderable's natural width."""
    if not wide:
        console.print(renderable)
        return
    from rich.measure import Measurement

    need = Measurement.get(console, console.options.update_width(10_000), renderable).maximum
    console.print(renderable, width=max(console.width, need), crop=False)
