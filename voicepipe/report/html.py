"""A self-contained HTML report of one run or a comparison of configurations.

One file, inline CSS and SVG only: no scripts, stylesheets, fonts or images fetched from anywhere, so it
can be mailed, archived or opened offline. Sections: summary, per-turn waterfall, latency CDF, budget
breakdown, missed-budget turns, measured vs predicted, configuration (what differs between the
configurations, each one's full YAML folded).

Every chart is drawn twice, at the width of a wide page and of a narrow one (a half-screen window), and
CSS shows the one that fits, so that chart text is never scaled below ``MIN_FONT_PX``; wide tables reflow
into one card per row on a narrow page.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import yaml

from voicepipe.compare import display_names, fmt_usd
from voicepipe.incidents import Incidents
from voicepipe.records import BreakdownPart, Summary, TurnRecord, percentile, summarise, unmeasured
from voicepipe.report.advice import Advice, largest_part
from voicepipe.report.incidents import incidents_section
from voicepipe.report.svg import (
    Bar,
    LegendItem,
    RefLine,
    Segment,
    Series,
    bar_label_width,
    budget_ref,
    cdf_chart,
    esc,
    fit_middle,
    fmt_num,
    hbar_chart,
    label_max,
    note_width,
    scatter_chart,
    series_colour,
    stage_colour,
    stage_sort_key,
    text_width,
)

WATERFALL_MAX_BARS = 60
MISSED_MAX_ROWS = 25
MISSED_MAX_BARS = 30
FAST_MS = 200.0

CSS = """
:root { --ink:#222; --muted:#666; --line:#e3e3e3; --bad:#b00020; --good:#1b7f3b; }
* { box-sizing: border-box; }
body { margin:0; background:#f6f7f9; color:var(--ink);
  font:15px/1.5 system-ui,-apple-system,'Segoe UI',Roboto,'Helvetica Neue',Arial,sans-serif; }
main { max-width:1040px; margin:0 auto; padding:28px 24px 60px; }
@media (max-width: 760px) { main { padding:16px 10px 40px; } section { padding:14px 12px; } }
header h1 { margin:0 0 4px; font-size:28px; }
header .sub { color:var(--muted); margin:0 0 14px; }
.finding { background:#fff; border-left:4px solid #1f5fa8; padding:10px 14px; margin:6px 0;
  border-radius:4px; }
.finding.bad { border-left-color:var(--bad); }
.finding.good { border-left-color:var(--good); }
section { background:#fff; border:1px solid var(--line); border-radius:8px; padding:18px 22px;
  margin:22px 0; min-width:0; }
p.caption, .finding, .fix, header .sub { overflow-wrap:anywhere; }
.fix { background:#fff8e6; border-left:4px solid #e08e0b; padding:10px 14px; margin:8px 0; border-radius:4px; }
.fix code { background:#f3f4f6; padding:1px 4px; border-radius:3px; font-size:13px; overflow-wrap:anywhere; }
section h2 { margin:0 0 4px; font-size:20px; }
section h3 { margin:16px 0 4px; font-size:15px; color:#333; }
p.caption { color:var(--muted); margin:0 0 12px; font-size:14px; }
p.note { color:var(--muted); font-size:13px; font-style:italic; }
.scroll { overflow-x:auto; max-width:100%; }
table { border-collapse:collapse; width:100%; font-size:13.5px; margin:8px 0 4px; }
th, td { padding:5px 8px; border-bottom:1px solid var(--line); text-align:left; vertical-align:top; }
th { background:#fafafa; font-weight:600; }
td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; }
td.num { white-space:nowrap; }
.ok { color:var(--good); font-weight:600; } .miss { color:var(--bad); font-weight:600; }
.said { display:inline-block; max-width:240px; overflow:hidden; text-overflow:ellipsis; white-space:nowrap;
  vertical-align:bottom; }
.nowrap { white-space:nowrap; }
.swatch { display:inline-block; width:10px; height:10px; border-radius:2px; margin-right:6px; }
pre { background:#f3f4f6; padding:12px 14px; border-radius:6px; overflow:auto; font-size:12.5px;
  line-height:1.4; }
svg.chart { display:block; margin:6px 0; }
.chart-narrow { display:none; }
@media (max-width: 1040px) { .chart-wide { display:none; } .chart-narrow { display:block; } }
@media (max-width: 760px) {
  table.reflow thead { display:none; }
  table.reflow, table.reflow tbody, table.reflow tr, table.reflow td { display:block; width:100%; }
  table.reflow tr { border:1px solid var(--line); border-radius:6px; margin:0 0 10px; padding:4px 0; }
  table.reflow td { display:flex; justify-content:space-between; gap:12px; border:none; padding:2px 10px;
    text-align:right; white-space:normal; overflow-wrap:anywhere; }
  table.reflow td::before { content:attr(data-label); color:var(--muted); text-align:left; flex:none; }
  table.reflow td:first-child { font-weight:600; }
  table.reflow .said { max-width:60vw; }
}
details { margin:8px 0; } details summary { cursor:pointer; color:#1f5fa8; }
table.diff td { overflow-wrap:anywhere; } table.diff td:first-child { overflow-wrap:normal; }
.absent { color:var(--muted); }
footer { color:var(--muted); font-size:12.5px; text-align:center; }
"""


def _name(label: str, records: Sequence[TurnRecord]) -> str:
    """A configuration is named by its label (``run`` passes its config file's name); never a run id."""
    return label or "this run"


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f} ms"


def _pct(v: float) -> str:
    return f"{v * 100:.0f}%"


def _largest(r: TurnRecord) -> BreakdownPart | None:
    return max(r.breakdown, key=lambda p: p.ms) if r.breakdown else None


def _stages(runs: Mapping[str, Sequence[TurnRecord]]) -> list[str]:
    seen = {p.stage for recs in runs.values() for r in recs for p in r.breakdown}
    return sorted(seen, key=stage_sort_key)


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


# --- sections --------------------------------------------------------------------------------------------


def _findings(names: Sequence[str], sums: Sequence[Summary], budget_ms: float) -> str:
    out = []
    for name, s in zip(names, sums, strict=True):
        cls = "good" if s.within_budget >= 0.9 else "bad" if s.within_budget < 0.5 else ""
        timeouts = s.turns - s.answered
        extra = f", {timeouts} not answered (timed out, failed or lost)" if timeouts else ""
        over = (
            f" The agent {esc(s.talked_over_line())}: a reply to part of the utterance was heard, so "
            "those turns are misses whatever their latency."
            if s.talked_over
            else ""
        )
        out.append(
            f'<div class="finding {cls}"><b>{esc(name)}</b>: {_pct(s.within_budget)} of {s.turns} turns '
            f"answered within the {fmt_num(budget_ms)} ms budget (median {esc(_ms(s.p50_ms))}, "
            f"p90 {esc(_ms(s.p90_ms))}{esc(extra)}).{over}</div>"
        )
    return "".join(out)


def _summary(
    names: Sequence[str],
    runs: Sequence[Sequence[TurnRecord]],
    sums: Sequence[Summary],
    budget_ms: float,
    predicted: bool = False,
) -> str:
    has_quality = any(r.quality is not None for recs in runs for r in recs)
    head: list[tuple[str, bool]] = [
        ("configuration", False),
        ("turns", True),
        ("answered", True),
        ("p50", True),
        ("p90", True),
        ("p99", True),
        (f"within {fmt_num(budget_ms)} ms", True),
        (f"under {fmt_num(FAST_MS)} ms", True),
        ("tax p50", True),
        ("mean cost / turn", True),
    ]
    if has_quality:
        head.append(("quality (modelled)", True))
    rows = []
    for i, (name, s) in enumerate(zip(names, sums, strict=True)):
        cls = "ok" if s.within_budget >= 0.9 else "miss" if s.within_budget < 0.5 else ""
        row = [
            f'<span class="swatch" style="background:{series_colour(i)}"></span>{esc(name)}',
            str(s.turns),
            str(s.answered),
            esc(_ms(s.p50_ms)),
            esc(_ms(s.p90_ms)),
            esc(_ms(s.p99_ms)),
            f'<span class="{cls}">{_pct(s.within_budget)}</span>',
            _pct(s.under_200ms),
            "—" if predicted else esc(_ms(s.tax_p50_ms)),  # a prediction pays no tax: none was measured
            fmt_usd(s.mean_cost_usd),
        ]
        if has_quality:
            row.append("—" if s.mean_quality is None else f"{s.mean_quality:.2f}")
        rows.append(row)
    bars = []
    for i, (name, s) in enumerate(zip(names, sums, strict=True)):
        c = series_colour(i)
        if s.p50_ms is None or s.p90_ms is None or s.p99_ms is None:
            bars.append(Bar(name, (), "no answered turns", "#b00020"))
            continue
        segs = (
            Segment(s.p50_ms, c, "", f"p50 {s.p50_ms:.0f} ms"),
            Segment(s.p90_ms - s.p50_ms, c, "", f"p90 {s.p90_ms:.0f} ms", faded=True),
            Segment(s.p99_ms - s.p90_ms, "#bbb", "", f"p99 {s.p99_ms:.0f} ms"),
        )
        note = f"p50 {s.p50_ms:.0f} · p90 {s.p90_ms:.0f} · p99 {s.p99_ms:.0f} ms"
        bars.append(Bar(name, segs, note, "#b00020" if s.p90_ms > budget_ms else "#444"))
    chart = _charts(lambda width: hbar_chart(
        bars,
        width=width,
        x_label="voice-to-voice latency, ms (end of user speech → first reply audio)",
        refs=[budget_ref(budget_ms), _fast_ref()],
        legend_items=[
            *(LegendItem(name, series_colour(i)) for i, name in enumerate(names) if len(names) > 1),
            LegendItem("0 → p50 (half the turns)", series_colour(0)),
            LegendItem("p50 → p90 (paler)", series_colour(0), faded=True),
            LegendItem("p90 → p99 (the slow tail)", "#bbb"),
        ],
        aria="latency percentiles per configuration against the budget",
        x_max=_x_cap(runs, budget_ms),
        bar_h=22,
        gap=10,
    ))  # fmt: skip
    return _section(
        "summary",
        "Summary",
        "Voice-to-voice latency per configuration: each bar runs to the p99, shaded at the median and p90; "
        "the red dashed line is the turn budget. Percentiles are over answered turns; shares are over all "
        "turns (a timeout counts as a miss).",
        _table(head, rows, reflow=True) + chart,
    )


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


def _waterfall(
    names: Sequence[str],
    runs: Sequence[Sequence[TurnRecord]],
    stages: Sequence[str],
    budget_ms: float,
    seen: str = "measured",
) -> str:
    per = max(10, WATERFALL_MAX_BARS // max(1, len(runs)))
    x_max = _shared_x(runs, budget_ms)
    any_measured = any(not p.modelled for recs in runs for r in recs for p in r.breakdown)
    notes: list[str] = []
    cut: list[str] = []
    drawn: list[tuple[str, list[Bar]]] = []
    for i, (name, recs) in enumerate(zip(names, runs, strict=True)):
        if i * per >= WATERFALL_MAX_BARS:
            notes.append(f"{len(runs) - i} further configuration(s) not drawn; see the CDF and summary.")
            break
        shown = list(recs[:per])
        drawn.append((name, [_turn_bar(r, budget_ms) for r in shown]))
        if len(recs) > len(shown):
            cut.append(f"{name} {len(shown)} of {len(recs)}")
    every = [b for _, bars in drawn for b in bars]
    note_w = note_width(b.note for b in every)

    def chart(name: str, bars: list[Bar], width: float) -> str:
        return hbar_chart(
            bars,
            width=width,
            x_label="ms after the end of the user's speech",
            refs=[budget_ref(budget_ms)],
            legend_items=_stage_legend(stages, any_measured),
            aria=f"per-turn latency waterfall for {name}",
            x_max=x_max,
            label_w=bar_label_width((b.label for b in every), label_max(width)),
            note_w=note_w,
        )

    parts: list[str] = []
    for name, bars in drawn:
        if len(runs) > 1:
            parts.append(f"<h3>{esc(name)}</h3>")
        parts.append(_charts(partial(chart, name, bars)))
    if len(drawn) > 1:
        notes.insert(0, "All configurations are drawn on one x scale, so bar lengths compare directly.")
    if cut:
        notes.insert(0, f"Showing the first turns only ({'; '.join(cut)}); the CDF covers every turn.")
    notes += _cap_note(runs, _x_cap(runs, budget_ms))
    note_html = "".join(f'<p class="note">{esc(n)}</p>' for n in notes)
    return _section(
        "waterfall",
        "Per-turn waterfall",
        "Each bar is one turn, from the end of the user's speech (left) to the first reply audio heard "
        f"(right end), split into the stages that held it in time order; the number is the {seen} latency, "
        "✗ marks a turn over the budget. Hover a segment for its exact part.",
        "".join(parts) + note_html,
    )


def _cdf(
    names: Sequence[str], runs: Sequence[Sequence[TurnRecord]], sums: Sequence[Summary], budget_ms: float
) -> str:
    x_max = _x_cap(runs, budget_ms)
    series = [
        Series(
            f"{name} ({_pct(s.within_budget)} ≤ {fmt_num(budget_ms)} ms)",
            series_colour(i),
            [r.measured_ms for r in recs],
        )
        for i, (name, recs, s) in enumerate(zip(names, runs, sums, strict=True))
    ]
    chart = _charts(lambda width: cdf_chart(
        series,
        width=width,
        x_label="voice-to-voice latency, ms",
        refs=[budget_ref(budget_ms), _fast_ref()],
        aria="cumulative distribution of voice-to-voice latency per configuration",
        x_max=x_max,
    ))  # fmt: skip
    return _section(
        "cdf",
        "Latency distribution (CDF)",
        "For any latency on the x axis, the share of turns that had heard their reply by then; a line "
        "further left is faster, and the height where it crosses the red budget line is the share "
        "answered in time (timeouts never arrive, so their line stops short of 100%).",
        chart + "".join(f'<p class="note">{esc(n)}</p>' for n in _cap_note(runs, x_max)),
    )


def _breakdown(
    names: Sequence[str], sums: Sequence[Summary], stages: Sequence[str], budget_ms: float, seen: str = "measured"
) -> str:
    bars = []
    rows = []
    for name, s in zip(names, sums, strict=True):
        segs = [
            Segment(s.mean_stage_ms[st], stage_colour(st), st, f"{st}: {s.mean_stage_ms[st]:.0f} ms mean")
            for st in stages
            if st in s.mean_stage_ms
        ]
        total = sum(s.mean_stage_ms.values())
        bars.append(Bar(name, segs, f"{total:.0f} ms mean" if s.answered else "no answered turns"))
        rows.append(
            [esc(name)]
            + [f"{s.mean_stage_ms[st]:.0f}" if st in s.mean_stage_ms else "—" for st in stages]
            + [f"{total:.0f}"]
        )
    chart = _charts(lambda width: hbar_chart(
        bars,
        width=width,
        x_label="mean ms per answered turn",
        refs=[budget_ref(budget_ms)],
        legend_items=_stage_legend(stages, False),
        aria="mean latency per stage per configuration",
        bar_h=24,
        gap=10,
    ))  # fmt: skip
    head = [("configuration", False), *((f"{st} ms", True) for st in stages), ("total ms", True)]
    return _section(
        "breakdown",
        "Where the milliseconds go",
        "Mean time each stage held an answered turn, stacked in pipeline order; the bar's length is the mean "
        f"{seen} latency, so the stage that crowds the budget line is the one to work on.",
        chart + _table(head, rows),
    )


def _fixes(
    names: Sequence[str], labels: Sequence[str], runs: Sequence[Sequence[TurnRecord]],
    fixes: Mapping[str, Advice | None], budget_ms: float,
) -> str:  # fmt: skip
    """What would fix the misses: per configuration, the largest part of its missed turns (from the
    breakdown) and, where the caller predicted one, the change that shrinks it with its predicted effect."""
    items = []
    for name, label, recs in zip(names, labels, runs, strict=True):
        missed = [r for r in recs if not r.within_budget]
        if not missed:
            continue
        found = largest_part(missed)
        if found is None:
            items.append(
                f'<div class="fix"><b>{esc(name)}</b>: {len(missed)} missed turn(s) timed out.</div>'
            )
            continue
        (st, wh), part_ms, total = found
        a = fixes.get(label)
        if a is not None and a.talked_over:  # the advice's finding: the endpoint, not the largest part
            (st, wh), part_ms = a.part, a.part_ms
            text = (
                f"<b>{esc(name)}</b>: {len(missed)} of {len(recs)} turns missed; on {a.talked_over} of them the "
                "agent talked over the user (the endpoint came mid-sentence: "
                f'<span class="swatch" style="background:{stage_colour(st)}"></span>{esc(st)} · {esc(wh)}, '
                f"{part_ms:,.0f} ms)."
            )
        else:
            text = (
                f"<b>{esc(name)}</b>: {len(missed)} of {len(recs)} turns missed {fmt_num(budget_ms)} ms; the "
                f'largest part of them is <span class="swatch" style="background:{stage_colour(st)}"></span>'
                f"{esc(st)} · {esc(wh)}, {part_ms:,.0f} ms of {total:,.0f} ms on average."
            )
        if a is not None and a.fix is not None and a.command:
            text += (
                f" Try {esc(a.fix.what)}: <code>{esc(a.command)}</code> — predicted p50 "
                f"{a.fix_p50_ms or 0:,.0f} ms, {_pct(a.fix_within or 0.0)} within budget (modelled)."
            )
        elif a is not None:
            text += " No shipped change to it predicts fewer misses."
        items.append(f'<div class="fix">{text}</div>')
    if not items:
        return ""
    return _section(
        "fixes",
        "What would fix the misses",
        "From the breakdown of the turns that missed: the part that held them longest, and the change to it "
        "that the virtual-time predictor says helps most (try it with the command shown).",
        "".join(items),
    )


def _missed_label(r: TurnRecord, config: str, width: float) -> str:
    """``session · tN`` (`` · config`` with several): the session and configuration names each cut in the
    middle so that the whole label fits ``width`` px and the turn number is never cut off."""
    turn = f" · t{r.turn}"
    rest = width - text_width(turn + (" · " if config else ""))
    if not config:
        return fit_middle(r.session, rest) + turn
    # share the room, giving what one name does not need to the other
    half = rest / 2
    cw, sw = text_width(config), text_width(r.session)
    s_room = max(half, rest - cw) if cw < half else (rest - min(half, cw) if sw > half else sw)
    c_room = rest - min(sw, s_room)
    return f"{fit_middle(r.session, s_room)}{turn} · {fit_middle(config, c_room)}"


def _missed(
    names: Sequence[str],
    runs: Sequence[Sequence[TurnRecord]],
    stages: Sequence[str],
    budget_ms: float,
    seen: str = "measured",
) -> str:
    multi = len(runs) > 1
    missed = [(n, r) for n, recs in zip(names, runs, strict=True) for r in recs if not r.within_budget]
    total = sum(len(recs) for recs in runs)
    if not missed:
        body = f'<p class="ok">All {total} turns answered within the {fmt_num(budget_ms)} ms budget.</p>'
        return _section("missed", "Turns that missed the budget", "None this time.", body)
    missed.sort(key=lambda nr: (nr[1].measured_ms is not None, -(nr[1].measured_ms or 0.0)))
    x_max = _shared_x(runs, budget_ms)
    head: list[tuple[str, bool]] = [("configuration", False)] if multi else []
    head += [
        ("session", False),
        ("turn", True),
        ("user said", False),
        (seen, True),
        ("over by", True),
        ("largest part", False),
        ("part ms", True),
    ]
    rows = []
    for name, r in missed[:MISSED_MAX_ROWS]:
        big = _largest(r)
        said = (r.user_text[:38] + "…") if len(r.user_text) > 40 else r.user_text
        row = [esc(name)] if multi else []
        row += [
            f'<span class="nowrap">{esc(r.session)}</span>',
            str(r.turn),
            f'<span class="said" title="{esc(r.user_text)}">{esc(said)}</span>',
            f'<span class="miss">{esc(unmeasured(r))}</span>' if r.measured_ms is None else esc(_ms(r.measured_ms)),
            _over_by(r, budget_ms),
            "—"
            if big is None
            else f'<span class="nowrap"><span class="swatch" style="background:{stage_colour(big.stage)}">'
            f"</span>{esc(big.stage)} · {esc(big.what)}</span>",
            "—" if big is None else f"{big.ms:,.0f}",
        ]
        rows.append(row)
    any_measured = any(not p.modelled for _, r in missed for p in r.breakdown)

    def chart(width: float) -> str:
        label_w = label_max(width)
        bars = [
            replace(_turn_bar(r, budget_ms), label=_missed_label(r, n if multi else "", label_w - 12))
            for n, r in missed[:MISSED_MAX_BARS]
        ]
        return hbar_chart(
            bars,
            width=width,
            x_label="ms after the end of the user's speech",
            refs=[budget_ref(budget_ms)],
            legend_items=_stage_legend(stages, any_measured),
            aria="waterfall of the turns that missed the budget",
            x_max=x_max,
            label_w=bar_label_width((b.label for b in bars), label_w),
        )

    notes = []
    if len(missed) > MISSED_MAX_ROWS:
        notes.append(f"Table shows the {MISSED_MAX_ROWS} slowest of {len(missed)} missed turns.")
    if len(missed) > MISSED_MAX_BARS:
        notes.append(f"Chart shows the {MISSED_MAX_BARS} slowest of {len(missed)} missed turns.")
    return _section(
        "missed",
        "Turns that missed the budget",
        f"{len(missed)} of {total} turns went past {fmt_num(budget_ms)} ms, timed out or talked over the user "
        "(a reply to part of the utterance was heard: a miss at any latency), slowest first; "
        "the largest part is the single stretch of work that held the turn longest.",
        _charts(chart) + _table(head, rows, reflow=True) + "".join(f'<p class="note">{esc(n)}</p>' for n in notes),
    )


def _over_by(r: TurnRecord, budget_ms: float) -> str:
    """The "over by" cell: ms past the budget, or that the agent talked over the user (a miss at any
    latency), with how long its audio overlapped the user's words."""
    if r.talked_over:
        return f'<span class="miss">talked over ({esc(_ms(r.talked_over_ms))})</span>'
    return "—" if r.measured_ms is None else esc(_ms(r.measured_ms - budget_ms))


def _tax(names: Sequence[str], runs: Sequence[Sequence[TurnRecord]], budget_ms: float) -> str:
    series = []
    rows = []
    for i, (name, recs) in enumerate(zip(names, runs, strict=True)):
        pts = [
            (
                r.predicted_ms,
                r.measured_ms,
                f"{_turn_label(r)}: predicted {r.predicted_ms:.0f} ms, measured {r.measured_ms:.0f} ms",
            )
            for r in recs
            if r.predicted_ms is not None and r.measured_ms is not None
        ]
        series.append(Series(name, series_colour(i), points=pts))
        tax = [r.tax_ms for r in recs if r.tax_ms is not None]
        rows.append(
            [
                esc(name),
                str(len(tax)),
                esc(_ms(percentile(tax, 50))),
                esc(_ms(percentile(tax, 99))),
                esc(_ms(max(tax) if tax else None)),
            ]
        )
    chart = _charts(lambda width: scatter_chart(
        series,
        width=width,
        x_label="predicted ms (sum of modelled spans after end of speech)",
        y_label="measured ms (client clock)",
        refs_y=[budget_ref(budget_ms)],
        diagonal="measured = predicted (no tax)",
        aria="measured versus predicted latency per turn",
    ))  # fmt: skip
    tax_bars = []
    for i, (name, recs) in enumerate(zip(names, runs, strict=True)):
        tax = [r.tax_ms for r in recs if r.tax_ms is not None]
        p50, p99 = percentile(tax, 50), percentile(tax, 99)
        if p50 is None or p99 is None:
            tax_bars.append(Bar(name, (), "no measured turns"))
            continue
        c = series_colour(i)
        segs = (
            Segment(max(p50, 0.0), c, "", f"tax p50 {p50:.1f} ms"),
            Segment(max(p99 - max(p50, 0.0), 0.0), c, "", f"tax p99 {p99:.1f} ms", faded=True),
        )
        note = f"p50 {p50:.1f} · p99 {p99:.1f} ms ({p50 / budget_ms:.1%} of the budget at p50)"
        tax_bars.append(Bar(name, segs, note))
    tax_chart = _charts(lambda width: hbar_chart(
        tax_bars,
        width=width,
        x_label="pipeline tax per turn, ms (measured − predicted)",
        legend_items=[LegendItem("0 → tax p50", "#555"), LegendItem("p50 → p99", "#555", faded=True)],
        aria="pipeline tax per configuration",
        bar_h=20,
        gap=8,
    ))  # fmt: skip
    head = [
        ("configuration", False),
        ("turns", True),
        ("tax p50", True),
        ("tax p99", True),
        ("tax max", True),
    ]
    return _section(
        "tax",
        "Measured vs predicted (the pipeline tax)",
        "Measured = first reply audio minus end of speech on the client's clock over the real MQTT bus; "
        "predicted = the modelled spans alone. Points above the grey diagonal paid a tax (bus hops, "
        "scheduling); points above the red line missed the budget. The bars below zoom in on the tax alone.",
        chart + tax_chart + _table(head, rows),
    )


def _config_dump(cfg: Mapping[str, Any]) -> str:
    try:
        return yaml.safe_dump(dict(cfg), sort_keys=False, allow_unicode=True, default_flow_style=False)
    except yaml.YAMLError:
        return json.dumps(cfg, indent=2, default=str)


def flat_settings(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested configuration as dotted keys → leaf values (``{"asr": {"model": "x"}}`` → ``asr.model``)."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flat_settings(v, f"{key}."))
        else:
            out[key] = v
    return out


_ABSENT = object()


def _setting(v: Any) -> str:
    if v is _ABSENT:
        return '<span class="absent">not set</span>'
    return esc(v if isinstance(v, str) else json.dumps(v, default=str))


def _key(k: str) -> str:
    """A dotted setting that may break after a dot, never inside a name."""
    return "<code>" + ".<wbr>".join(esc(p) for p in k.split(".")) + "</code>"


def config_diff(configs: Sequence[Mapping[str, Any]]) -> tuple[list[str], int]:
    """The dotted settings whose values differ between ``configs`` (in first-seen order), and how many
    settings are the same in all of them."""
    flats = [flat_settings(c) for c in configs]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    differ = [
        k for k in keys if len({json.dumps(f[k], sort_keys=True, default=str) if k in f else None for f in flats}) > 1
    ]
    return differ, len(keys) - len(differ)


def _config(names: Sequence[str], labels: Sequence[str], configs: Mapping[str, Mapping[str, Any]]) -> str:
    recorded = [(n, configs[lb]) for n, lb in zip(names, labels, strict=True) if configs.get(lb)]
    missing = [n for n, lb in zip(names, labels, strict=True) if not configs.get(lb)]
    parts = []
    if len(recorded) > 1:
        differ, same = config_diff([c for _, c in recorded])
        flats = [flat_settings(c) for _, c in recorded]
        if differ:
            head = [("setting", False), *((n, False) for n, _ in recorded)]
            rows = [[_key(k), *(_setting(f.get(k, _ABSENT)) for f in flats)] for k in differ]
            parts.append(
                f'<p>{len(differ)} setting{"s" if len(differ) != 1 else ""} differ between the configurations; '
                f"the other {same} are the same in all of them.</p>"
            )
            parts.append(_table(head, rows).replace("<table>", '<table class="diff">', 1))
        else:
            parts.append(f"<p>The configurations are the same in all {same} settings.</p>")
    for name, cfg in recorded:
        what = f"full configuration: {name}" if len(names) > 1 else "full configuration (YAML)"
        parts.append(f"<details><summary>{esc(what)}</summary><pre>{esc(_config_dump(cfg))}</pre></details>")
    if missing:
        parts.append(f'<p class="note">not recorded: {esc(", ".join(missing))}</p>')
    return _section(
        "config",
        "Configuration",
        "What differs between the configurations (after overrides); each one's full configuration folds "
        "out below."
        if len(recorded) > 1
        else "The pipeline configuration the run used, after overrides (click to unfold).",
        "".join(parts),
    )


def render_html(
    runs: dict[str, list[TurnRecord]],
    configs: dict[str, dict],
    title: str = "voicepipe report",
    budget_ms: float = 800.0,
    fixes: Mapping[str, Advice | None] | None = None,
    incidents: Mapping[str, Incidents] | None = None,
    predicted: bool = False,
) -> str:
    """Render one self-contained HTML page; ``runs`` maps configuration label → its turn records;
    ``fixes`` (label → :func:`voicepipe.report.advice.advice`) adds predicted fixes to the misses panel;
    ``incidents`` (label → its run's outages, stage deaths, early end) adds an Incidents section.
    ``predicted``: the records are predictions on virtual time (``compare --predict``), nothing was run
    live: the page says so, and has no measured-vs-predicted panel (there is no measurement)."""
    labels = list(runs)
    seen = "predicted" if predicted else "measured"  # what the latencies on the page are
    recs = [list(runs[k]) for k in labels]
    heading, short = display_names(labels) if len(labels) > 1 else ("config", labels)
    names = [_name(k, r) for k, r in zip(short, recs, strict=True)]
    sums = [summarise(r) for r in recs]
    stages = _stages(runs)
    run_ids = sorted({r.run for rs in recs for r in rs if r.run})
    total = sum(len(r) for r in recs)
    sub = (
        f"{total} turns · {len(labels)} configuration{'s' if len(labels) != 1 else ''}"
        + (f" ({heading} varied)" if heading != "config" else "")
        + " · "
        f"budget {fmt_num(budget_ms)} ms from the end of the user's speech to the first sound of the reply"
        + (f" · run {', '.join(run_ids)}" if run_ids else "")
        + (" · PREDICTED on virtual time: the pipeline's own stages, zero bus hops; nothing was run live"
           if predicted else "")
    )  # fmt: skip
    body = [
        f'<header><h1>{esc(title)}</h1><p class="sub">{esc(sub)}</p>',
        _findings(names, sums, budget_ms),
        "</header>",
        _summary(names, recs, sums, budget_ms, predicted),
        incidents_section(names, labels, runs, incidents or {}),
        _fixes(names, labels, recs, fixes or {}, budget_ms),
        _waterfall(names, recs, stages, budget_ms, seen),
        _cdf(names, recs, sums, budget_ms),
        _breakdown(names, sums, stages, budget_ms, seen),
        _missed(names, recs, stages, budget_ms, seen),
        "" if predicted else _tax(names, recs, budget_ms),
        _config(names, labels, configs),
        "<footer>Generated by voicepipe. Latency is predicted on virtual time from the hardware and service "
        "models; nothing was measured.</footer>"
        if predicted
        else "<footer>Generated by voicepipe. Latency is measured on the client's monotonic clock over a real "
        "MQTT broker; modelled parts come from the hardware and service models.</footer>",
    ]
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body><main>"
        + "".join(body)
        + "</main></body></html>\n"
    )
