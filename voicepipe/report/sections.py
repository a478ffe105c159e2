"""The HTML report's sections, each one ``<section>`` of the page (:func:`voicepipe.report.html.render_html`).

Findings, summary, what would fix the misses, per-turn waterfall, latency CDF, breakdown by stage, the
turns that missed the budget, and measured vs predicted (the pipeline tax).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial

from voicepipe.compare import fmt_usd
from voicepipe.records import Summary, TurnRecord, percentile, unmeasured
from voicepipe.report.advice import Advice, largest_part
from voicepipe.report.audio import Recordings, hear_it
from voicepipe.report.blocks import (
    FAST_MS,
    _cap_note,
    _charts,
    _fast_ref,
    _largest,
    _ms,
    _pct,
    _section,
    _shared_x,
    _stage_legend,
    _table,
    _turn_bar,
    _turn_label,
    _x_cap,
)
from voicepipe.report.svg import (
    Bar,
    LegendItem,
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
    text_width,
)

WATERFALL_MAX_BARS = 60
MISSED_MAX_ROWS = 25
MISSED_MAX_BARS = 30


def _findings(
    names: Sequence[str],
    sums: Sequence[Summary],
    budget_ms: float,
    runs: Sequence[Sequence[TurnRecord]] = (),
    notes: Sequence[Sequence[str]] = (),
) -> str:
    out = []
    for i, (name, s) in enumerate(zip(names, sums, strict=True)):
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
        untrusted = [r for r in runs[i] if not r.trusted] if i < len(runs) else []
        if untrusted:  # the run's own load may have made these turns' latency and tax (TurnRecord.trusted)
            kinds: dict[str, int] = {}
            for r in untrusted:
                for part in r.distrust.split("; "):
                    kinds[part.split(":", 1)[0]] = kinds.get(part.split(":", 1)[0], 0) + 1
            why = "; ".join(f"{n} {k}" for k, n in kinds.items())
            turns = ", ".join(f"{r.session} turn {r.turn}" for r in untrusted[:8])
            more = f" and {len(untrusted) - 8} more" if len(untrusted) > 8 else ""
            out.append(
                f'<div class="finding bad"><b>{esc(name)}</b>: numbers NOT TRUSTED for {len(untrusted)} turn{"" if len(untrusted) == 1 else "s"} '
                f"({esc(why)}): the run's own load may have made their latency and tax ({esc(turns + more)}).</div>"
            )
        for line in notes[i] if i < len(notes) else ():  # what the run counted beyond its records
            out.append(f'<div class="finding"><b>{esc(name)}</b>: {esc(line)}</div>')
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
    shown_recs: list[list[TurnRecord]] = []
    for i, (name, recs) in enumerate(zip(names, runs, strict=True)):
        if i * per >= WATERFALL_MAX_BARS:
            notes.append(f"{len(runs) - i} further configuration(s) not drawn; see the CDF and summary.")
            break
        shown = list(recs[:per])
        drawn.append((name, [_turn_bar(r, budget_ms) for r in shown]))
        shown_recs.append(shown)
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
    recordings = Recordings()
    for (name, bars), shown in zip(drawn, shown_recs, strict=True):
        if len(runs) > 1:
            parts.append(f"<h3>{esc(name)}</h3>")
        parts.append(_charts(partial(chart, name, bars)))
        label_w = lambda w: bar_label_width((b.label for b in every), label_max(w))  # noqa: E731
        parts.append(hear_it(shown, [b.label for b in bars], x_max, label_w, note_w, _charts, recordings))
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
