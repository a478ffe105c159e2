"""Terminal tables (rich): per-turn results and per-configuration summaries, fitted to the terminal width
(see :mod:`voicepipe.report.term`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.console import Console
from rich.text import Text

from voicepipe.compare import Row as CompareRow
from voicepipe.compare import fmt_usd
from voicepipe.records import TurnRecord, summarise, unmeasured, verdict
from voicepipe.report.svg import stage_sort_key
from voicepipe.report.term import Cell, Col, Parts, print_fitted

SAID_LINES = 3  # a long utterance is cut to this many lines in a turn table (the JSON keeps it whole)
CAPTION = "measured on the client's clock over the real MQTT bus; predicted = modelled spans"


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}"


def _range(rng: tuple[float, float] | None) -> str:
    return "—" if rng is None else f"{rng[0]:,.0f}–{rng[1]:,.0f}"


def top_parts(r: TurnRecord, n: int = 2, width: int = 1000) -> str:
    """The turn's ``n`` largest breakdown parts, e.g. ``"agent ttft 812, tts first audio 140"``; one per
    line when they do not fit in ``width`` characters."""
    parts = [f"{p.stage} {p.what} {_ms(p.ms)}" for p in sorted(r.breakdown, key=lambda p: -p.ms)[:n]]
    one = ", ".join(parts)
    return (one if len(one) <= width else "\n".join(parts)) or "—"


def largest_parts(r: TurnRecord, n: int = 2) -> Parts:
    """The turn's ``n`` largest breakdown parts as a table cell that wraps only between parts."""
    return Parts(
        tuple(f"{p.stage} {p.what} {_ms(p.ms)}" for p in sorted(r.breakdown, key=lambda p: -p.ms)[:n])
    )


TALKED_OVER_MARK = "»"
UNCERTAIN_MARK = "?"
UNCERTAIN_NOTE = (
    f"{UNCERTAIN_MARK}: uncertain — within the budget only at the fast end of the turn's 80 % range (the "
    "hardware agent's held-out interval carried into the turn); not counted as within the budget"
)
TALKED_OVER_NOTE = f"✗{TALKED_OVER_MARK}: the agent talked over the user (a reply to part of the utterance was heard): a miss at any latency"


def _ok(value_ms: float | None, budget_ms: float, talked_over: bool = False,
        rng: tuple[float, float] | None = None) -> Text:  # fmt: skip
    """✓ within the budget (at the slow end of a modelled range ``rng``); ? within it only at the range's
    fast end (uncertain: not a pass); ✗ over it or unanswered; ✗» the agent talked over the user (a miss,
    however fast)."""
    if talked_over:
        return Text(f"✗{TALKED_OVER_MARK}", style="bold red")
    v = verdict(value_ms, rng, budget_ms)
    if v == "uncertain":
        return Text(UNCERTAIN_MARK, style="bold yellow")
    return Text("✓", style="bold green") if v == "pass" else Text("✗", style="bold red")


def print_talked_over(console: Console, records: Sequence[TurnRecord], name: str = "") -> None:
    """The one line saying on how many turns the agent talked over the user (nothing when it never did)."""
    line = summarise(records).talked_over_line()
    if line:
        over = sum(r.talked_over_ms or 0.0 for r in records)
        text = f"{name + ': ' if name else ''}{line} (✗{TALKED_OVER_MARK}), over their words for {over:,.0f} ms in all"
        console.print(Text(text, style="bold red"))


def print_turns(
    console: Console, records: Sequence[TurnRecord], budget_ms: float = 800.0, wide: bool = False
) -> None:
    """One row per turn: measured/predicted/tax (ms), within budget, and where the time went.

    Records of several configurations print as one table per configuration label. Columns follow
    :mod:`voicepipe.report.term`: the latency numbers first, text wrapped, extras hidden when narrow."""
    by_label: dict[str, list[TurnRecord]] = {}
    for r in records:
        by_label.setdefault(r.label, []).append(r)
    # the path column also carries the premature-endpoint (!) and false-hit (✗) marks
    show_path = any(r.path != "agent" or r.premature_endpoint or r.false_hit for r in records)
    cols = [
        Col("session", priority=5, justify="left", text=True, min_width=6, max_width=24),
        Col("#"),
        Col("user said", priority=6, justify="left", text=True, min_width=10, max_width=48,
            max_lines=SAID_LINES),
        Col("meas\nms"),
        Col("pred\nms", priority=2),
        Col("tax\nms", priority=3),
        Col("ok", justify="center"),
    ]
    if show_path:
        cols += [
            Col("path", priority=4, justify="left", text=True, min_width=5),
            Col("waste\ntok", priority=8),
            Col("q\n(mod)", priority=7),
        ]
    cols.append(Col("largest parts (ms)", priority=1, justify="left", text=True, min_width=14))
    for label, recs in by_label.items():
        rows = []
        for r in recs:
            meas: Cell = Text(unmeasured(r), style="red") if r.measured_ms is None else _ms(r.measured_ms)
            row: list[Cell] = [r.session, str(r.turn), r.user_text, meas]
            row += [_ms(r.predicted_ms), _ms(r.tax_ms), _ok(r.measured_ms, budget_ms, r.talked_over)]
            if show_path:
                path = r.path + ("!" if r.premature_endpoint else "") + ("✗" if r.false_hit else "")
                row += [path, str(r.wasted_tokens), "–" if r.quality is None else f"{r.quality:.2f}"]
            row.append(r.error if r.error and not r.breakdown else largest_parts(r, 2))  # failed: why
            rows.append(row)
        title = f"Turns{f' — {label}' if label else ''} (budget {budget_ms:.0f} ms)"
        c, rw, t = _one_session(cols, rows, recs, title)
        print_fitted(console, c, rw, wide=wide, title=t)
    console.print(Text(CAPTION, style="dim"))
    if any(r.talked_over for r in records):
        console.print(Text(TALKED_OVER_NOTE, style="dim"))


def _one_session(
    cols: list[Col], rows: list[list[Cell]], records: Sequence[TurnRecord], title: str
) -> tuple[list[Col], list[list[Cell]], str]:
    """With a single session the session column (the first) says the same thing on every row: name it
    once in the title instead, and give its width to the numbers and text."""
    sessions = {r.session for r in records}
    if len(sessions) != 1:
        return cols, rows, title
    return cols[1:], [row[1:] for row in rows], f"{title} · session {sessions.pop()}"


def print_summary(
    console: Console,
    records_by_label: Mapping[str, Sequence[TurnRecord]],
    wide: bool = False,
    caption: bool = True,
) -> None:
    """Percentiles and budget shares per configuration, then mean ms per stage (stages as rows); the
    caption saying how the numbers were taken unless the turns table above already said it."""
    budget = next((recs[0].budget_ms for recs in records_by_label.values() if recs), 800.0)
    sums = {label or "run": summarise(recs) for label, recs in records_by_label.items()}
    cols = [
        Col("config", justify="left", text=True, min_width=24, max_width=30),
        Col("turns", priority=4),
        Col("p50\nms"),
        Col("p90\nms", priority=2),
        Col("p99\nms", priority=3),
        Col(f"≤{budget:.0f}\nms"),
        Col("<200\nms", priority=5),
        Col("tax\np50", priority=6),
        Col("$/turn", priority=1),
    ]
    rows: list[list[Cell]] = []
    for name, s in sums.items():
        share = f"{s.within_budget * 100:.0f}%"
        style = "green" if s.within_budget >= 0.9 else "red" if s.within_budget < 0.5 else "yellow"
        turns = f"{s.turns}" if s.answered == s.turns else f"{s.answered}/{s.turns}"
        rows.append(
            [
                name,
                turns,
                _ms(s.p50_ms),
                _ms(s.p90_ms),
                _ms(s.p99_ms),
                Text(share, style=style),
                f"{s.under_200ms * 100:.0f}%",
                _ms(s.tax_p50_ms),
                fmt_usd(s.mean_cost_usd),
            ]
        )
    print_fitted(console, cols, rows, wide=wide, title="Summary")
    for label, recs in records_by_label.items():
        print_talked_over(console, recs, (label or "run") if len(records_by_label) > 1 else "")
    if caption:
        console.print(Text(CAPTION, style="dim"))
    stages = sorted({st for s in sums.values() for st in s.mean_stage_ms}, key=stage_sort_key)
    if not stages:
        return
    st_cols = [Col("stage", justify="left", text=True, min_width=7)]
    st_cols += [Col(_wrap_header(name), priority=i + 1) for i, name in enumerate(sums)]
    st_rows: list[list[Cell]] = [
        [st, *(_ms(s.mean_stage_ms.get(st)) for s in sums.values())] for st in stages
    ]
    st_rows.append(
        [Text("total", style="bold"), *(_ms(sum(s.mean_stage_ms.values()) or None) for s in sums.values())]
    )
    print_fitted(console, st_cols, st_rows, wide=wide, title="Mean ms per stage")


def _wrap_header(name: str, width: int = 14) -> str:
    """A configuration label as a column header of at most ``width`` characters a line."""
    import textwrap

    return "\n".join(textwrap.wrap(name, width, break_on_hyphens=False)) or name


def print_paths(console: Console, records: Sequence[TurnRecord], wide: bool = False) -> None:
    """Per-path summary: which strategy served how many turns, how fast, at what waste, cost, quality."""
    by_path: dict[str, list[TurnRecord]] = {}
    for r in records:
        by_path.setdefault(r.path, []).append(r)
    if len(by_path) <= 1 and not any(
        r.wasted_tokens or r.premature_endpoint or r.talked_over or r.barge_in_stop_ms is not None
        for r in records
    ):
        return
    cols = [
        Col("path", justify="left", text=True, min_width=5),
        Col("turns"),
        Col("p50\nms"),
        Col("wasted\ntok", priority=3),
        Col("$/turn", priority=2),
        Col("quality\n(mod)", priority=4),
        Col("prema-\nture", priority=5),
        Col("talked\nover", priority=5),
        Col("false\nhits", priority=6),
        Col("barge-in\nstop ms", priority=1),
    ]
    rows: list[list[Cell]] = []
    for path, recs in sorted(by_path.items()):
        s = summarise(recs)
        stops = [r.barge_in_stop_ms for r in recs if r.barge_in_stop_ms is not None]
        rows.append(
            [
                path,
                str(len(recs)),
                _ms(s.p50_ms),
                str(sum(r.wasted_tokens for r in recs)),
                fmt_usd(s.mean_cost_usd),
                "–" if s.mean_quality is None else f"{s.mean_quality:.2f}",
                str(sum(r.premature_endpoint for r in recs)),
                str(sum(r.talked_over for r in recs)),
                str(sum(r.false_hit for r in recs)),
                _ms(sum(stops) / len(stops)) if stops else "–",
            ]
        )
    print_fitted(console, cols, rows, wide=wide, title="By path")
    hits = [r for r in records if r.path == "cache"]
    lookups = len(hits) + sum(1 for r in records if r.route.endswith("(cache miss)"))
    if lookups:
        p50 = f", hit p50 {_ms(summarise(hits).p50_ms)} ms voice-to-voice" if hits else ""
        console.print(
            f"cache: {lookups} lookups, {len(hits)} hits ({len(hits) / lookups:.0%}), "
            f"{sum(r.false_hit for r in hits)} false hits{p50}",
            highlight=False,
        )
    console.print(
        Text(
            "path!: premature endpoint (user was not done); ✗: cache false hit; quality is modelled from benchmarks",
            style="dim",
        )
    )


PREDICTED = "PREDICTED: the pipeline's own stages on virtual time, zero bus hops; nothing was run live"


def print_predictions(
    console: Console, records: Sequence[TurnRecord], budget_ms: float = 800.0, wide: bool = False
) -> None:
    """Predicted turns (records built by TurnPrediction.as_record): latency, path and the largest parts."""
    cols = [
        Col("session", priority=5, justify="left", text=True, min_width=6, max_width=24),
        Col("#"),
        Col("user said", priority=6, justify="left", text=True, min_width=10, max_width=48,
            max_lines=SAID_LINES),
        Col("pred\nms"),
        *([Col("80 %\nrange", priority=2)] if (ranged := any(r.predicted_range_ms for r in records)) else []),
        Col("ok", justify="center"),
        Col("path", priority=3, justify="left", text=True, min_width=5),
        Col("q\n(mod)", priority=4),
        Col("$/turn", priority=2),
        Col("largest parts (ms)", priority=1, justify="left", text=True, min_width=14),
    ]
    rows: list[list[Cell]] = [
        [
            r.session,
            str(r.turn),
            r.user_text,
            _ms(r.predicted_ms),
            *([_range(r.predicted_range_ms)] if ranged else []),
            _ok(r.predicted_ms, budget_ms, r.talked_over, r.predicted_range_ms),
            r.path + ("!" if r.premature_endpoint else ""),
            "–" if r.quality is None else f"{r.quality:.2f}",
            fmt_usd(r.cost_usd),
            largest_parts(r, 2),
        ]
        for r in records
    ]
    title = f"Predicted turns (budget {budget_ms:.0f} ms)"
    c, rw, t = _one_session(cols, rows, records, title)
    print_fitted(console, c, rw, wide=wide, title=t)
    s = summarise(records)
    console.print(
        f"p50 {_ms(s.p50_ms)} ms · p90 {_ms(s.p90_ms)} · p99 {_ms(s.p99_ms)} · within {budget_ms:.0f} ms "
        f"{s.within_budget * 100:.0f}%"
        + (f" (+{s.uncertain} uncertain)" if s.uncertain else "")
        + f" · under 200 ms {s.under_200ms * 100:.0f}% · ${s.mean_cost_usd:.5f}/turn"
        + ("" if s.mean_quality is None else f" · quality {s.mean_quality:.2f} (modelled)"),
        highlight=False,
    )
    if s.uncertain:
        console.print(Text(UNCERTAIN_NOTE, style="dim"))
    print_talked_over(console, records)
    if s.talked_over:
        console.print(Text(TALKED_OVER_NOTE, style="dim"))
    console.print(Text(PREDICTED, style="dim"))


COMPARE_CAPTION = (
    "latency measured on the client clock over MQTT; cost and quality modelled from catalog prices/benchmarks"
)


def print_compare(
    console: Console,
    rows: Sequence[CompareRow],
    names: Sequence[str],
    heading: str,
    title: str,
    *,
    expected: int | None = None,
    caption: str = COMPARE_CAPTION,
    wide: bool = False,
) -> None:
    """One row per configuration: percentiles, budget shares, modelled cost and quality, the largest stages."""
    budgets = {r.budget_ms for r in rows}
    budget = budgets.pop() if len(budgets) == 1 else None
    cols = [
        Col(heading, justify="left", text=True, min_width=24, max_width=30),
        Col("p50\nms"),
        Col("p90\nms", priority=2),
        Col("p99\nms", priority=4),
        Col(f"≤{budget:.0f}\nms" if budget else "in\nbudget"),
        Col("<200\nms", priority=6),
        Col("$ per\n1k turns", priority=1),
        Col("quality\nmodelled", priority=5),
        Col("largest stages\n(mean ms)", priority=3, justify="left", text=True, min_width=12),
    ]
    out: list[list[Cell]] = []
    for name, r in zip(names, rows, strict=True):
        share_style = "green" if r.within_budget >= 0.9 else "red" if r.within_budget < 0.5 else "yellow"
        planned = max(r.turns, expected or 0)
        out.append(
            [
                name + (f" ({r.answered}/{planned})" if r.answered < planned else ""),
                Text(_ms(r.p50_ms), style=("green" if r.fits else "red") + (" bold" if r.best_p50 else "")),
                _ms(r.p90_ms),
                _ms(r.p99_ms),
                Text(f"{r.within_budget * 100:.0f}%" + (f" +{r.uncertain}?" if r.uncertain else ""), style=share_style),
                f"{r.under_200ms * 100:.0f}%",
                Text(fmt_usd(r.cost_per_1k_usd), style="bold cyan" if r.cheapest else ""),
                Text(
                    "—" if r.quality is None else f"{r.quality * 100:.0f}%",
                    style="bold cyan" if r.best_quality else "",
                ),
                Parts(tuple(f"{st} {v:,.0f}" for st, v in r.top_stages(3))),
            ]
        )
    print_fitted(console, cols, out, wide=wide, title=title, caption=caption)
    if any(r.uncertain for r in rows):
        console.print(Text(f"+N{UNCERTAIN_MARK}: N more turns {UNCERTAIN_NOTE.split(' — ', 1)[1]}", style="dim"))
