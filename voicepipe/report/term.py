"""Terminal tables that fit the real terminal: numbers whole, text wrapped, columns dropped by priority.

The contract every row table printed by the CLI follows (each builds its rows as :class:`Col` + cells and
calls :func:`print_fitted`; ``hardware list``, ``sweep`` and ``validate`` too — the two-column
quantity/value tables of ``hardware show`` and ``predict`` are plain rich tables):

* The width is the console's (rich reads the real terminal, ``COLUMNS`` when piped, 80 by default).
* Numeric columns (``text=False``) are never wrapped or cut: a number is shown in full or not at all.
* Text columns (``text=True``) wrap at word boundaries and give up their width first; each keeps at least
  ``min_width`` characters and its longest word (up to ``WORD_CAP``: a longer token, a URL, folds). When
  the columns that are never dropped cannot keep their words whole, the words fold instead: a number is
  never cut to keep a word.
* A text column with ``max_lines`` shows at most that many wrapped lines of a cell, the last ending in
  "…" when the text was longer (a long utterance stays a few lines; the JSON keeps the whole text).
* When even that does not fit, whole columns are dropped, the highest ``priority`` number first (0 = never
  dropped), and a dim note under the table names what was hidden and that ``--wide`` shows it.
* ``wide=True`` keeps every column on one line each and renders at the table's natural width, wider than
  the terminal if need be (for piping into ``less -S`` or a file).
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from rich import box
from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from voicepipe.safeprint import printable


class SafeConsole(Console):
    """A rich console that prints text, never terminal commands: the text of every segment it renders has
    its control characters escaped (:func:`voicepipe.safeprint.printable`); rich's own styling and cursor
    control (control segments) are kept. Every console of the CLI is one. Cells of fitted tables are
    escaped before layout too (:func:`fitted_table`), so their widths are right; elsewhere an escaped
    character is wider than the layout planned, which only a hostile text meets."""

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        for seg in super().render(renderable, options):
            if seg.control:
                yield seg
            else:
                safe = printable(seg.text)
                yield seg if safe is seg.text else Segment(safe, seg.style, seg.control)


@dataclass(frozen=True)
class Parts:
    """A text cell made of items that must not be split (``"agent ttft 1,115"``): joined by ``sep`` on one
    line when they fit the column, else greedily onto several lines, breaking only between items."""

    items: tuple[str, ...]
    sep: str = ", "

    def one_line(self) -> str:
        return self.sep.join(self.items)

    def lines(self, width: int) -> str:
        out: list[str] = []
        for it in self.items:
            if out and len(out[-1]) + len(self.sep) + len(it) <= width:
                out[-1] += self.sep + it
            else:
                out.append(it)
        return "\n".join(out) or "—"


def hyphenated(name: str) -> Parts:
    """An id such as ``trtllm05-h100-gptj-fp8-b1`` as a cell that breaks only after a hyphen (the hyphen
    kept at the line's end), never inside a part of the id."""
    pieces = name.split("-")
    return Parts((*(p + "-" for p in pieces[:-1]), pieces[-1]), sep="")


Cell = str | Text | Parts
SEP = 1  # SIMPLE_HEAD draws a one-space column separator; no outer edge, no padding


@dataclass(frozen=True)
class Col:
    header: str  # may hold a line break: "p50\nms"
    priority: int = 0  # 0: never dropped; larger numbers are dropped first when the terminal is narrow
    justify: Literal["left", "right", "center"] = "right"
    text: bool = False  # free text: may wrap; numbers (text=False) are shown whole
    min_width: int = 8  # a text column's narrowest width
    max_width: int | None = None  # a text column's widest (None: as wide as its longest cell)
    max_lines: int | None = None  # a text column's tallest cell, in wrapped lines (None: no limit)


def _cell_width(c: Cell) -> int:
    if isinstance(c, Parts):
        return len(c.one_line())
    t = c if isinstance(c, Text) else Text(c)
    return max((t.cell_len if "\n" not in t.plain else max(Text(x).cell_len for x in t.plain.split("\n"))), 0)


def natural_width(col: Col, cells: Sequence[Cell]) -> int:
    head = max(len(h) for h in col.header.split("\n"))
    return max([head, *(_cell_width(c) for c in cells)])


def _header_min(col: Col) -> int:
    """A text column's header words must not split mid-word."""
    return max(len(w) for line in col.header.split("\n") for w in line.split() or [""])


WORD_CAP = 32  # a longer word (a URL, a path) may fold rather than take the whole table


def _word_min(cells: Sequence[Cell]) -> int:
    """The longest word of a text column's cells (up to WORD_CAP): wrapping happens between words, so the
    column keeps at least this width while the table can still fit by dropping others."""
    words = [
        w for c in cells if not isinstance(c, Parts) for w in (c.plain if isinstance(c, Text) else c).split()
    ]
    return min(WORD_CAP, max([0, *(len(w) for w in words)]))


def _text_min(col: Col, cells: Sequence[Cell], words: bool = True) -> int:
    """A text column's narrowest width: its own minimum, its header's longest word, the longest item of a
    Parts cell, and (``words``) its cells' longest word — capped at the column's natural width."""
    items = max([0, *(len(x) for c in cells if isinstance(c, Parts) for x in c.items)])
    base = max(col.min_width, _header_min(col), _word_min(cells) if words else 0)
    return max(items, min(natural_width(col, cells), base))


def choose_columns(cols: Sequence[Col], rows: Sequence[Sequence[Cell]], width: int) -> tuple[list[int], bool]:
    """The columns to show in ``width`` characters, and whether text columns keep their longest words.

    Drop by descending priority until the numeric columns at full width plus the text columns at their
    minimum fit, the minimum keeping each column's longest word; if even the columns that are never dropped
    do not fit that way, start again with minima that let a long word fold."""
    nat = [natural_width(c, [r[i] for r in rows]) for i, c in enumerate(cols)]

    def need(idx: list[int], words: bool) -> int:
        widths = [_text_min(cols[i], [r[i] for r in rows], words) if cols[i].text else nat[i] for i in idx]
        return sum(widths) + SEP * (len(idx) - 1)

    for words in (True, False):
        keep = list(range(len(cols)))
        while need(keep, words) > width:
            droppable = [i for i in keep if cols[i].priority > 0]
            if not droppable:
                break
            keep.remove(max(droppable, key=lambda i: (cols[i].priority, i)))
        if need(keep, words) <= width:
            return keep, words
    return keep, False


def text_widths(
    cols: Sequence[Col],
    rows: Sequence[Sequence[Cell]],
    keep: Sequence[int],
    width: int,
    words: bool = True,
) -> dict[int, int]:
    """The width each kept text column gets from what the numbers leave: the narrowest columns whole
    first (up to their natural or maximum width) as long as the others keep their minimum; never below a
    column's minimum (:func:`_text_min`; ``words`` as :func:`choose_columns` decided)."""
    nat = {i: natural_width(cols[i], [r[i] for r in rows]) for i in keep}
    text = [i for i in keep if cols[i].text]
    left = width - sum(nat[i] + SEP for i in keep if not cols[i].text) - SEP * max(0, len(text) - 1)
    lo = {i: _text_min(cols[i], [r[i] for r in rows], words) for i in text}
    hi = {i: max(lo[i], min(nat[i], cols[i].max_width or nat[i])) for i in text}
    out: dict[int, int] = {}
    order = sorted(
        text, key=lambda i: hi[i]
    )  # narrow first: served whole while the others keep their minimum
    for k, i in enumerate(order):
        rest = sum(lo[j] for j in order[k + 1 :])
        out[i] = max(lo[i], min(hi[i], left - rest))
        left -= out[i]
    return out


def _safe(c: Cell) -> Cell:
    """The cell with control characters escaped (styles of a Text kept where its length is unchanged)."""
    if isinstance(c, Parts):
        return Parts(tuple(printable(i, newlines=False) for i in c.items), c.sep)
    if isinstance(c, Text):
        safe = printable(c.plain)
        return c if safe == c.plain else Text(safe, style=c.style)
    return printable(c)


def capped(text: str, width: int, max_lines: int) -> str:
    """``text`` wrapped at word boundaries to ``width`` (a longer word folds) and cut to ``max_lines``
    lines, the last ending in "…" when something was left out."""
    lines = textwrap.wrap(text, max(1, width), break_long_words=True, break_on_hyphens=False)
    if len(lines) <= max_lines:
        return "\n".join(lines)
    kept = lines[:max_lines]
    last = kept[-1]
    if len(last) >= width:  # no room for the ellipsis: drop the last word (or, a single word, a letter)
        last = last.rsplit(" ", 1)[0] if " " in last else last[: max(0, width - 1)]
    kept[-1] = last.rstrip() + "…"
    return "\n".join(kept)


def _render(c: Cell, w: int | None, max_lines: int | None = None) -> str | Text:
    if isinstance(c, Parts):
        return c.one_line() if w is None else c.lines(w)
    if w is None or max_lines is None:
        return c
    plain = c.plain if isinstance(c, Text) else c
    short = capped(plain, w, max_lines)
    if short.replace("\n", " ") == " ".join(plain.split()):
        return c  # fits as it is: rich wraps it the same way, styles kept
    return Text(short, style=c.style) if isinstance(c, Text) else short


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
    rows = [[_safe(c) for c in r] for r in rows]
    title = printable(title, newlines=False) if title else title
    keep, words = (list(range(len(cols))), True) if wide else choose_columns(cols, rows, width)
    text_w = {} if wide else text_widths(cols, rows, keep, width, words)
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
        min_width=min(width, len(title)) if title else None,  # a title never wraps above a narrow table
    )
    for i in keep:
        c = cols[i]
        if c.text and not wide:
            t.add_column(
                c.header,
                justify=c.justify,
                min_width=text_w[i],  # the planned width: rich must not shrink it below the plan
                max_width=text_w[i],
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
        t.add_row(*(_render(r[i], text_w.get(i), cols[i].max_lines) for i in keep))
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
    # print(width=...) cannot exceed the console's own width, so widen the console for this one print
    saved = console.width
    console.width = max(saved, need)
    try:
        console.print(renderable, crop=False)
    finally:
        console.width = saved
