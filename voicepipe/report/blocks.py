"""The HTML report's building blocks: sections, tables, each chart at two widths, per-turn bars, axis caps.

Shared by the section renderers (:mod:`voicepipe.report.sections`) and the page (:mod:`voicepipe.report.html`):
a chart drawn by :func:`_charts` comes at ``WIDE_W`` and ``NARROW_W`` and CSS shows the one that fits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from voicepipe.records import BreakdownPart, TurnRecord, percentile, unmeasured
from voicepipe.report.svg import Bar, LegendItem, RefLine, Segment, esc, fmt_num, stage_colour

FAST_MS = 200.0


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f} ms"


def _pct(v: float) -> str:
    return f"{v * 100:.0f}%"


def _largest(r: TurnRecord) -> BreakdownPart | None:
    return max(r.breakdown, key=lambda p: p.ms) if r.breakdown else None



def _stage_legend(stages: Sequence[str], faded_note: bool) -> list[LegendItem]:
    items = [LegendItem(s, stage_colour(s)) for s in stages]
    if faded_note:
        items.append(LegendItem("paler = measured, not modelled", "#999", "box", faded=True))
    return items


def _turn_label(r: TurnRecord) -> str:
    return f"{r.session} · t{r.turn}"


def _section(sid: str, title: str, caption: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{esc(title)}</h2><p class="caption">{esc(caption)}</p>{body}</section>'


def _table(head: Sequence[tuple[str, bool]], rows: Sequence[Sequence[str]], reflow: bool = False) -> str:
    """``head`` is (title, numeric); cells are already-escaped HTML. ``reflow``: on a narrow page each row
    becomes a card of "title: value" lines instead of a table that scrolls sideways."""
    th = "".join(f'<th class="num">{esc(h)}</th>' if num else f"<th>{esc(h)}</th>" for h, num in head)
    body = []
    for row in rows:
        tds = "".join(
            "<td" + (' class="num"' if num else "") + (f' data-label="{esc(h)}"><span>{c}</span></td>' if reflow
                                                          else f">{c}</td>")
            for c, (h, num) in zip(row, head, strict=True)
        )
        body.append(f"<tr>{tds}</tr>")
    cls = ' class="reflow"' if reflow else ""
    return (
        f'<div class="scroll"><table{cls}><thead><tr>{th}</tr></thead><tbody>{"".join(body)}</tbody></table>'
        "</div>"
    )


WIDE_W = 940.0  # fits the page's widest content box (1040 px less padding) unscaled
NARROW_W = 640.0  # fits a 700 px window's content box unscaled


def _charts(draw: Callable[[float], str]) -> str:
    """The chart drawn at both widths; CSS shows the one that fits the page (see the module docstring)."""
    return f'<div class="chart-wide">{draw(WIDE_W)}</div><div class="chart-narrow">{draw(NARROW_W)}</div>'


def _x_cap(runs: Sequence[Sequence[TurnRecord]], budget_ms: float) -> float | None:
    """An x-axis limit that keeps a few extreme turns from squashing the rest (``None``: no cap).
    Bars past it are clipped at the edge; their notes still give the true number."""
    vals = [r.measured_ms for recs in runs for r in recs if r.measured_ms is not None]
    p95 = percentile(vals, 95)
    if p95 is None:
        return None
    top = max(vals)
    cap = max(2.0 * p95, 1.5 * budget_ms)
    return cap if top > cap else None


def _cap_note(runs: Sequence[Sequence[TurnRecord]], x_max: float | None) -> list[str]:
    if x_max is None:
        return []
    n = sum(1 for recs in runs for r in recs if r.measured_ms is not None and r.measured_ms > x_max)
    return [f"The axis is cut at {x_max:,.0f} ms; {n} slower turn(s) are drawn at its edge."]


def _fast_ref() -> RefLine:
    return RefLine(FAST_MS, f"{fmt_num(FAST_MS)} ms", "ref-line", "#1b7f3b", "3 3")


def _turn_bar(r: TurnRecord, budget_ms: float, suffix: str = "") -> Bar:
    segs = [
        Segment(
            p.ms,
            stage_colour(p.stage),
            p.what,
            f"{p.stage} · {p.what}: {p.ms:.0f} ms ({'modelled' if p.modelled else 'measured'})",
            faded=not p.modelled,
            short=p.stage,
        )
        for p in r.breakdown
    ]
    if r.measured_ms is None:
        note, colour = f"{unmeasured(r)} — no reply", "#b00020"
    else:
        over = r.measured_ms > budget_ms or r.talked_over
        note = f"{r.measured_ms:.0f} ms{' ✗' if over else ''}{' talked over the user' if r.talked_over else ''}"
        colour = "#b00020" if over else "#444"
    text = (r.user_text[:80] + "…") if len(r.user_text) > 80 else r.user_text
    tip = f"{r.scenario} / {r.session} turn {r.turn}: {text!r}"
    return Bar(_turn_label(r) + suffix, segs, note, colour, tip)


def _shared_x(runs: Sequence[Sequence[TurnRecord]], budget_ms: float) -> float:
    """One x limit for every chart of per-turn bars: the outlier cap, else the slowest turn (and the budget
    line), so that a millisecond is the same length in every configuration's chart."""
    cap = _x_cap(runs, budget_ms)
    if cap is not None:
        return cap
    totals = [sum(p.ms for p in r.breakdown) for recs in runs for r in recs]
    return max([budget_ms * 1.08, *totals, 1.0])
