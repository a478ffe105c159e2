"""A tiny hand-written SVG chart kit: stacked horizontal bars, step CDFs, scatter plots.

Pure string building, every piece of text escaped; no external resources, so the output can be inlined
into a self-contained HTML file. Lines drawn at a latency budget carry the CSS class ``budget-line`` so
tests (and readers' stylesheets) can find them.
"""

from __future__ import annotations

import html
import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

STAGE_ORDER: tuple[str, ...] = ("transport", "asr", "router", "cache", "council", "agent", "tts", "bus")
STAGE_COLOURS: dict[str, str] = {
    "transport": "#6b7a8f",
    "asr": "#4e79a7",
    "router": "#b07aa1",
    "cache": "#59a14f",
    "council": "#f28e2b",
    "agent": "#e15759",
    "tts": "#2a9d8f",
    "bus": "#c9b8a8",
}
FALLBACK_COLOURS: tuple[str, ...] = ("#9c755f", "#edc948", "#ff9da7", "#86bcb6", "#8cd17d", "#d37295")
SERIES_COLOURS: tuple[str, ...] = (
    "#1f5fa8",
    "#d1495b",
    "#2e933c",
    "#8e44ad",
    "#e08e0b",
    "#16a4b5",
    "#6d4c41",
    "#c2185b",
)
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"
INK = "#222"
MUTED = "#666"
GRID = "#e6e6e6"
HALO = 'stroke="#fff" stroke-width="3" stroke-linejoin="round" paint-order="stroke"'  # legible over lines


def esc(text: object) -> str:
    """Escape any value for use as SVG/HTML text or a quoted attribute."""
    return html.escape(str(text), quote=True)


def stage_colour(stage: str) -> str:
    """The stage's fixed colour; unknown stages get a stable fallback colour from their name."""
    if stage in STAGE_COLOURS:
        return STAGE_COLOURS[stage]
    return FALLBACK_COLOURS[zlib.crc32(stage.encode()) % len(FALLBACK_COLOURS)]


def stage_sort_key(stage: str) -> tuple[int, str]:
    return (STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER), stage)


def series_colour(i: int) -> str:
    return SERIES_COLOURS[i % len(SERIES_COLOURS)]


def fmt_num(v: float) -> str:
    """Compact number for tick labels and notes: 0, 250, 1.5k-free plain style."""
    if v == 0:
        return "0"
    if abs(v) >= 100 or float(v).is_integer():
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}".rstrip("0").rstrip(".")


def nice_ticks(hi: float, n: int = 6) -> list[float]:
    """Ticks from 0 to at least ``hi`` on a 1/2/2.5/5 x 10^k step."""
    if not math.isfinite(hi) or hi <= 0:
        hi = 1.0
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    count = math.ceil(hi / step - 1e-9)
    return [round(i * step, 10) for i in range(count + 1)]


def text_width(text: str, size: float = 12) -> float:
    """Rough rendered width of sans-serif text (no font metrics available here)."""
    return len(text) * size * 0.56


def fit_text(text: str, width: float, size: float = 12) -> str:
    """``text`` cut with an ellipsis so that it fits ``width`` pixels (by :func:`text_width`)."""
    if text_width(text, size) <= width:
        return text
    n = max(1, int(width / (size * 0.56)) - 1)
    return text[:n].rstrip() + "…"


def fit_middle(text: str, width: float, size: float = 12) -> str:
    """``text`` cut in the middle with an ellipsis so that it fits ``width`` pixels: the start and the end,
    where names and turn numbers differ, both stay."""
    if text_width(text, size) <= width:
        return text
    n = max(2, int(width / (size * 0.56)) - 1)
    head = (n + 1) // 2
    return text[:head].rstrip() + "…" + text[len(text) - (n - head) :].lstrip()


LABEL_MAX_W = 230.0
LABEL_SHARE = 0.24  # the label column's widest, as a share of the chart's width
MIN_FONT_PX = 10  # no chart text is drawn smaller (charts are drawn at the width they are shown at)


def label_max(width: float) -> float:
    """The widest label column of an :func:`hbar_chart` ``width`` pixels wide."""
    return min(LABEL_MAX_W, width * LABEL_SHARE)


def bar_label_width(labels: Iterable[str], widest: float = LABEL_MAX_W) -> float:
    """The label column of an :func:`hbar_chart`: wide enough for the longest label, at most ``widest``."""
    return min(widest, max([60.0, *(text_width(t) + 12 for t in labels)]))


@dataclass(frozen=True)
class Segment:
    value: float
    colour: str
    label: str = ""  # drawn inside the segment when it fits
    tip: str = ""  # hover tooltip
    faded: bool = False
    short: str = ""  # drawn instead of ``label`` when only a shorter text fits


@dataclass(frozen=True)
class Bar:
    label: str
    segments: Sequence[Segment] = ()
    note: str = ""  # drawn right of the bar, e.g. "912 ms" or "timeout"
    note_colour: str = MUTED
    tip: str = ""


@dataclass(frozen=True)
class RefLine:
    value: float
    label: str
    css: str = "ref-line"  # "budget-line" for the latency budget
    colour: str = MUTED
    dash: str = "5 4"


@dataclass(frozen=True)
class LegendItem:
    label: str
    colour: str
    shape: Literal["box", "line", "dot", "dash"] = "box"
    faded: bool = False


@dataclass(frozen=True)
class Series:
    label: str
    colour: str
    values: Sequence[float | None] = ()  # CDF: None = never arrived (timeout)
    points: Sequence[tuple[float, float, str]] = field(default_factory=tuple)  # scatter: x, y, tooltip


def budget_ref(budget_ms: float) -> RefLine:
    return RefLine(budget_ms, f"{fmt_num(budget_ms)} ms budget", "budget-line", "#b00020", "7 4")


def _svg_open(width: float, height: float, aria: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {width:.0f} {height:.0f}" '
        f'width="{width:.0f}" height="{height:.0f}" role="img" aria-label="{esc(aria)}" '
        f'font-family="{esc(FONT)}" font-size="12" style="max-width:100%;height:auto">'
        f"<title>{esc(aria)}</title>"
    )


def legend(items: Sequence[LegendItem], x: float, y: float, max_width: float) -> tuple[str, float]:
    """Legend items flowed left to right, wrapping; returns (svg, height used)."""
    if not items:
        return "", 0.0
    out = ['<g class="legend">']
    cx, cy, row_h = x, y, 18.0
    for it in items:
        w = 22 + text_width(it.label) + 16
        if cx > x and cx + w > x + max_width:
            cx, cy = x, cy + row_h
        op = ' fill-opacity="0.5"' if it.faded else ""
        if it.shape == "box":
            out.append(f'<rect x="{cx:.1f}" y="{cy:.1f}" width="14" height="11" fill="{it.colour}"{op}/>')
        elif it.shape == "dot":
            out.append(f'<circle cx="{cx + 7:.1f}" cy="{cy + 5.5:.1f}" r="4.5" fill="{it.colour}"/>')
        else:
            dash = ' stroke-dasharray="5 3"' if it.shape == "dash" else ""
            out.append(
                f'<line x1="{cx:.1f}" y1="{cy + 5.5:.1f}" x2="{cx + 16:.1f}" y2="{cy + 5.5:.1f}" '
                f'stroke="{it.colour}" stroke-width="2.5"{dash}/>'
            )
        out.append(f'<text x="{cx + 21:.1f}" y="{cy + 10:.1f}" fill="{INK}">{esc(it.label)}</text>')
        cx += w
    out.append("</g>")
    return "".join(out), cy - y + row_h + 6


def _x_axis(x0: float, x1: float, y_top: float, y_bot: float, ticks: Sequence[float], unit: str) -> str:
    hi = ticks[-1]
    out = ['<g class="axis x-axis">']
    for t in ticks:
        x = x0 + (x1 - x0) * t / hi
        out.append(f'<line x1="{x:.1f}" y1="{y_top:.1f}" x2="{x:.1f}" y2="{y_bot:.1f}" stroke="{GRID}"/>')
        out.append(
            f'<text x="{x:.1f}" y="{y_bot + 15:.1f}" text-anchor="middle" fill="{MUTED}">{fmt_num(t)}</text>'
        )
    out.append(f'<line x1="{x0:.1f}" y1="{y_bot:.1f}" x2="{x1:.1f}" y2="{y_bot:.1f}" stroke="#999"/>')
    out.append(
        f'<text x="{(x0 + x1) / 2:.1f}" y="{y_bot + 32:.1f}" text-anchor="middle" fill="{INK}">'
        f"{esc(unit)}</text></g>"
    )
    return "".join(out)


def _vref(ref: RefLine, x: float, y_top: float, y_bot: float, anchor: str = "start") -> str:
    dx = 4 if anchor == "start" else -4
    return (
        f'<g class="{esc(ref.css)}"><line x1="{x:.1f}" y1="{y_top:.1f}" x2="{x:.1f}" y2="{y_bot:.1f}" '
        f'stroke="{ref.colour}" stroke-width="1.8" stroke-dasharray="{ref.dash}"/>'
        f'<text x="{x + dx:.1f}" y="{y_top + 10:.1f}" text-anchor="{anchor}" fill="{ref.colour}" '
        f'font-weight="600" font-size="11" {HALO}>{esc(ref.label)}</text></g>'
    )


def _hi(values: Iterable[float], refs: Sequence[RefLine], floor: float = 1.0) -> float:
    return max([floor, *values, *(r.value * 1.08 for r in refs)])


NOTE_SLACK = 1.15  # rendered text may run wider than text_width's estimate; keep this much more clear


def note_width(notes: Iterable[str]) -> float:
    """The room right of the plot that bar notes (11 px) need, with slack for wider real fonts."""
    return max([0.0, *(text_width(n, 11) * NOTE_SLACK + 10 for n in notes if n)])


def clear_of(x: float, w: float, lines: Sequence[float], pad: float = 4) -> float:
    """A left edge at or right of ``x`` for text ``w`` wide that crosses none of the vertical ``lines``."""
    for line in sorted(lines):
        if x - pad < line < x + w * NOTE_SLACK + pad:
            x = line + pad + 1
    return x


def hbar_chart(
    bars: Sequence[Bar],
    *,
    x_label: str,
    refs: Sequence[RefLine] = (),
    legend_items: Sequence[LegendItem] = (),
    aria: str = "bar chart",
    width: float = 960,
    bar_h: float = 16,
    gap: float = 5,
    x_max: float | None = None,
    label_w: float | None = None,
    note_w: float | None = None,
) -> str:
    """Stacked horizontal bars, one per row, segments left to right, with vertical reference lines.

    Labels longer than the label column are cut in the middle with an ellipsis (the bar's tooltip keeps the
    whole text). A bar's note (its latency) that would cross a reference line moves to just past it.
    Charts meant to be compared side by side pass the same ``x_max``, ``label_w`` and ``note_w`` so that
    a millisecond falls at the same pixel in each."""
    label_w = label_w if label_w is not None else bar_label_width((b.label for b in bars), label_max(width))
    note_w = note_w if note_w is not None else note_width(b.note for b in bars)
    x0, x1 = label_w, width - max(16.0, note_w)
    leg_svg, leg_h = legend(legend_items, x0, 8, x1 - x0)
    top = 8 + leg_h + 16  # room for reference-line labels
    totals = [sum(s.value for s in b.segments) for b in bars]
    ticks = nice_ticks(x_max if x_max is not None else _hi(totals, refs))
    hi = ticks[-1]
    plot_h = max(1, len(bars)) * (bar_h + gap) + gap
    bot = top + plot_h
    height = bot + 42

    def sx(v: float) -> float:
        return x0 + (x1 - x0) * min(max(v, 0.0), hi) / hi

    out = [_svg_open(width, height, aria), leg_svg, _x_axis(x0, x1, top, bot, ticks, x_label)]
    if not bars:
        out.append(
            f'<text x="{(x0 + x1) / 2:.1f}" y="{top + plot_h / 2 + 4:.1f}" text-anchor="middle" '
            f'fill="{MUTED}">no turns to show</text>'
        )
    notes: list[str] = []
    for i, b in enumerate(bars):
        y = top + gap + i * (bar_h + gap)
        out.append('<g class="bar">')
        shown = fit_middle(b.label, x0 - 12)
        tip = b.tip or (b.label if shown != b.label else "")
        if tip:
            out.append(f"<title>{esc(tip)}</title>")
        out.append(
            f'<text x="{x0 - 8:.1f}" y="{y + bar_h * 0.72:.1f}" text-anchor="end" fill="{INK}">'
            f"{esc(shown)}</text>"
        )
        acc = 0.0
        for s in b.segments:
            if s.value <= 0:
                continue
            xa, xb = sx(acc), sx(acc + s.value)
            acc += s.value
            if xb - xa < 0.05:
                continue
            op = ' fill-opacity="0.5"' if s.faded else ""
            out.append(
                f'<rect class="seg" x="{xa:.2f}" y="{y:.1f}" width="{xb - xa:.2f}" height="{bar_h:.1f}" '
                f'fill="{s.colour}"{op} stroke="#fff" stroke-width="0.6">'
                f"{f'<title>{esc(s.tip)}</title>' if s.tip else ''}</rect>"
            )
            fits = [t for t in (s.label, s.short) if t and xb - xa > text_width(t, 10) + 6]
            if fits and bar_h >= 13:
                out.append(
                    f'<text x="{(xa + xb) / 2:.1f}" y="{y + bar_h * 0.7:.1f}" text-anchor="middle" '
                    f'font-size="10" fill="#fff" pointer-events="none">{esc(fits[0])}</text>'
                )
        out.append("</g>")
        if b.note:  # drawn after the reference lines so they stay legible
            nx = clear_of(sx(acc) + 5, text_width(b.note, 11), [sx(r.value) for r in refs])
            notes.append(
                f'<text class="note" x="{nx:.1f}" y="{y + bar_h * 0.72:.1f}" font-size="11" '
                f'fill="{b.note_colour}" {HALO}>{esc(b.note)}</text>'
            )
    for r in refs:
        out.append(_vref(r, sx(r.value), top - 14, bot))
    out.extend(notes)
    out.append("</svg>")
    return "".join(out)


def _plot_frame(
    width: float, height: float, legend_items: Sequence[LegendItem], left: float = 58, right: float = 24
) -> tuple[str, float, float, float, float]:
    """Legend on top; returns (legend svg, x0, x1, y_top, y_bot) of the plot area."""
    x0, x1 = left, width - right
    leg_svg, leg_h = legend(legend_items, x0, 8, x1 - x0)
    return leg_svg, x0, x1, 8 + leg_h + 18, height - 44


def _y_axis(
    x0: float, x1: float, y_top: float, y_bot: float, ticks: Sequence[float], label: str, pct: bool = False
) -> str:
    hi = ticks[-1]
    out = ['<g class="axis y-axis">']
    for t in ticks:
        y = y_bot - (y_bot - y_top) * t / hi
        txt = f"{t * 100:.0f}%" if pct else fmt_num(t)
        out.append(f'<line x1="{x0:.1f}" y1="{y:.1f}" x2="{x1:.1f}" y2="{y:.1f}" stroke="{GRID}"/>')
        out.append(f'<text x="{x0 - 6:.1f}" y="{y + 4:.1f}" text-anchor="end" fill="{MUTED}">{txt}</text>')
    out.append(f'<line x1="{x0:.1f}" y1="{y_top:.1f}" x2="{x0:.1f}" y2="{y_bot:.1f}" stroke="#999"/>')
    cy = (y_top + y_bot) / 2
    out.append(
        f'<text x="14" y="{cy:.1f}" text-anchor="middle" fill="{INK}" transform="rotate(-90 14 {cy:.1f})">'
        f"{esc(label)}</text></g>"
    )
    return "".join(out)


def cdf_chart(
    series: Sequence[Series],
    *,
    x_label: str,
    refs: Sequence[RefLine] = (),
    aria: str = "latency CDF",
    width: float = 960,
    height: float = 380,
    x_max: float | None = None,
) -> str:
    """Empirical step CDFs, one line per series. ``None`` values count in the denominator but never arrive,
    so a series with timeouts levels off below 100%."""
    items = [LegendItem(s.label, s.colour, "line") for s in series]
    items += [LegendItem(r.label, r.colour, "dash") for r in refs]
    leg_svg, x0, x1, top, bot = _plot_frame(width, height, items)
    finite = [v for s in series for v in s.values if v is not None]
    xt = nice_ticks(x_max if x_max is not None else _hi(finite, refs))
    hi = xt[-1]
    yt = [0, 0.25, 0.5, 0.75, 1.0]

    def sx(v: float) -> float:
        return x0 + (x1 - x0) * min(max(v, 0.0), hi) / hi

    def sy(p: float) -> float:
        return bot - (bot - top) * p

    out = [_svg_open(width, height, aria), leg_svg]
    out.append(_y_axis(x0, x1, top, bot, yt, "share of turns answered by then", pct=True))
    out.append(_x_axis(x0, x1, top, bot, xt, x_label))
    for s in series:
        vals = sorted(v for v in s.values if v is not None)
        n = len(s.values)
        if not n:
            continue
        d = [f"M{sx(0):.1f},{sy(0):.1f}"]
        for i, v in enumerate(vals):
            d.append(f"H{sx(v):.1f}V{sy((i + 1) / n):.1f}")
        d.append(f"H{x1:.1f}")
        out.append(
            f'<path class="cdf" d="{"".join(d)}" fill="none" stroke="{s.colour}" stroke-width="2.2">'
            f"<title>{esc(s.label)}</title></path>"
        )
    for r in refs:
        out.append(_vref(r, sx(r.value), top - 14, bot))
    out.append("</svg>")
    return "".join(out)


def scatter_chart(
    series: Sequence[Series],
    *,
    x_label: str,
    y_label: str,
    refs_x: Sequence[RefLine] = (),
    refs_y: Sequence[RefLine] = (),
    diagonal: str = "",
    aria: str = "scatter plot",
    width: float = 960,
    height: float = 420,
) -> str:
    """Points per series on a shared square-ish scale; optional y = x diagonal (labelled ``diagonal``)."""
    items = [LegendItem(s.label, s.colour, "dot") for s in series]
    if diagonal:
        items.append(LegendItem(diagonal, "#888", "dash"))
    items += [LegendItem(r.label, r.colour, "dash") for r in refs_y]
    leg_svg, x0, x1, top, bot = _plot_frame(width, height, items, left=62)
    xs = [p[0] for s in series for p in s.points]
    ys = [p[1] for s in series for p in s.points]
    ticks = nice_ticks(_hi([*xs, *ys], [*refs_x, *refs_y]))
    hi = ticks[-1]

    def sx(v: float) -> float:
        return x0 + (x1 - x0) * min(max(v, 0.0), hi) / hi

    def sy(v: float) -> float:
        return bot - (bot - top) * min(max(v, 0.0), hi) / hi

    out = [_svg_open(width, height, aria), leg_svg]
    out.append(_y_axis(x0, x1, top, bot, ticks, y_label))
    out.append(_x_axis(x0, x1, top, bot, ticks, x_label))
    if diagonal:
        out.append(
            f'<line class="diagonal" x1="{sx(0):.1f}" y1="{sy(0):.1f}" x2="{sx(hi):.1f}" y2="{sy(hi):.1f}" '
            f'stroke="#888" stroke-width="1.2" stroke-dasharray="4 4"/>'
        )
    for r in refs_x:
        out.append(_vref(r, sx(r.value), top - 14, bot))
    for r in refs_y:
        y = sy(r.value)
        out.append(
            f'<g class="{esc(r.css)}"><line x1="{x0:.1f}" y1="{y:.1f}" x2="{x1:.1f}" y2="{y:.1f}" '
            f'stroke="{r.colour}" stroke-width="1.8" stroke-dasharray="{r.dash}"/>'
            f'<text x="{x1 - 4:.1f}" y="{y - 5:.1f}" text-anchor="end" fill="{r.colour}" font-weight="600" '
            f'font-size="11" {HALO}>{esc(r.label)}</text></g>'
        )
    for s in series:
        out.append(f'<g class="points" fill="{s.colour}" fill-opacity="0.7">')
        for px, py, tip in s.points:
            out.append(
                f'<circle cx="{sx(px):.1f}" cy="{sy(py):.1f}" r="4"><title>{esc(tip)}</title></circle>'
            )
        out.append("</g>")
    if not xs:
        out.append(
            f'<text x="{(x0 + x1) / 2:.1f}" y="{(top + bot) / 2:.1f}" text-anchor="middle" '
            f'fill="{MUTED}">no turns with both a measurement and a prediction</text>'
        )
    out.append("</svg>")
    return "".join(out)
