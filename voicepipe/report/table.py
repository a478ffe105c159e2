"""Terminal tables (rich): per-turn results and per-configuration summaries, compact for ~100 columns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from voicepipe.compare import fmt_usd
from voicepipe.records import TurnRecord, summarise
from voicepipe.report.svg import stage_sort_key

CAPTION = "measured on the client's clock over the real MQTT bus; predicted = modelled spans"


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}"


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def top_parts(r: TurnRecord, n: int = 2, width: int = 1000) -> str:
    """The turn's ``n`` largest breakdown parts, e.g. ``"agent ttft 812, tts first audio 140"``; one per
    line when they do not fit in ``width`` characters."""
    parts = [f"{p.stage} {p.what} {p.ms:.0f}" for p in sorted(r.breakdown, key=lambda p: -p.ms)[:n]]
    one = ", ".join(parts)
    return (one if len(one) <= width else "\n".join(parts)) or "—"


def print_turns(console: Console, records: Sequence[TurnRecord], budget_ms: float = 800.0) -> None:
    """One row per turn: measured/predicted/tax (ms), within budget, and where the time went.

    Records of several configurations print as one table per configuration label."""
    by_label: dict[str, list[TurnRecord]] = {}
    for r in records:
        by_label.setdefault(r.label, []).append(r)
    show_path = any(r.path != "agent" for r in records)
    for label, recs in by_label.items():
        title = f"Turns{f' — {label}' if label else ''} (budget {budget_ms:.0f} ms)"
        parts_w = console.width - (88 if show_path else 65)
        console.print(_turn_table(recs, title, show_path, budget_ms, parts_w))
    console.print(Text(CAPTION, style="dim"))


def _turn_table(
    records: Sequence[TurnRecord], title: str, show_path: bool, budget_ms: float, parts_w: int
) -> Table:
    narrow = parts_w < 26  # room for one part only: show the largest, cut with an ellipsis
    user_w = 12 if narrow else 20
    t = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0))
    t.add_column("session", no_wrap=True, max_width=10, overflow="ellipsis")
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("user said", no_wrap=True, max_width=user_w, overflow="ellipsis")
    t.add_column("meas ms", justify="right", no_wrap=True)
    t.add_column("pred ms", justify="right", no_wrap=True)
    t.add_column("tax", justify="right", no_wrap=True)
    t.add_column("ok", justify="center", no_wrap=True, min_width=2)
    if show_path:
        t.add_column("path", no_wrap=True, max_width=10, overflow="ellipsis")
        t.add_column("waste tok", justify="right", no_wrap=True)
        t.add_column("q (mod)", justify="right", no_wrap=True)
    t.add_column(
        "largest (ms)" if narrow else "largest parts (ms)",
        min_width=14,
        no_wrap=narrow,
        overflow="ellipsis" if narrow else "fold",
    )
    for r in records:
        if r.measured_ms is None:
            meas: str | Text = Text("timeout", style="red")
            ok = Text("✗", style="bold red")
        else:
            meas = _ms(r.measured_ms)
            over = r.measured_ms > budget_ms
            ok = Text("✗", style="bold red") if over else Text("✓", style="bold green")
        row: list[str | Text] = [r.session, str(r.turn), _short(r.user_text, user_w), meas]
        row += [_ms(r.predicted_ms), _ms(r.tax_ms), ok]
        if show_path:
            path = r.path + ("!" if r.premature_endpoint else "") + ("✗" if r.false_hit else "")
            row += [path, str(r.wasted_tokens), "–" if r.quality is None else f"{r.quality:.2f}"]
        row.append(top_parts(r, 1 if narrow else 2, parts_w))
        t.add_row(*row)
    return t


def print_summary(console: Console, records_by_label: Mapping[str, Sequence[TurnRecord]]) -> None:
    """Percentiles and budget shares per configuration, then mean ms per stage (stages as rows)."""
    budget = next((recs[0].budget_ms for recs in records_by_label.values() if recs), 800.0)
    sums = {label or "run": summarise(recs) for label, recs in records_by_label.items()}
    t = Table(title="Summary", header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0))
    t.add_column("config", no_wrap=True, max_width=16, overflow="ellipsis")
    t.add_column("turns", justify="right")
    for h in ("p50 ms", "p90 ms", "p99 ms", f"≤{budget:.0f}ms", "<200ms", "tax p50", "$/turn"):
        t.add_column(h, justify="right")
    for name, s in sums.items():
        share = f"{s.within_budget * 100:.0f}%"
        style = "green" if s.within_budget >= 0.9 else "red" if s.within_budget < 0.5 else "yellow"
        turns = f"{s.turns}" if s.answered == s.turns else f"{s.answered}/{s.turns}"
        t.add_row(
            name,
            turns,
            _ms(s.p50_ms),
            _ms(s.p90_ms),
            _ms(s.p99_ms),
            Text(share, style=style),
            f"{s.under_200ms * 100:.0f}%",
            _ms(s.tax_p50_ms),
            fmt_usd(s.mean_cost_usd),
        )
    console.print(t)
    console.print(Text(CAPTION, style="dim"))
    stages = sorted({st for s in sums.values() for st in s.mean_stage_ms}, key=stage_sort_key)
    if not stages:
        return
    st_t = Table(title="Mean ms per stage", header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0))
    st_t.add_column("stage", no_wrap=True)
    for name in sums:
        st_t.add_column(name, justify="right", max_width=16, overflow="ellipsis")
    for st in stages:
        st_t.add_row(st, *(_ms(s.mean_stage_ms.get(st)) for s in sums.values()))
    st_t.add_row(
        Text("total", style="bold"), *(_ms(sum(s.mean_stage_ms.values()) or None) for s in sums.values())
    )
    console.print(st_t)


def print_paths(console: Console, records: Sequence[TurnRecord]) -> None:
    """Per-path summary: which strategy served how many turns, how fast, at what waste, cost, quality."""
    by_path: dict[str, list[TurnRecord]] = {}
    for r in records:
        by_path.setdefault(r.path, []).append(r)
    if len(by_path) <= 1 and not any(
        r.wasted_tokens or r.premature_endpoint or r.barge_in_stop_ms is not None for r in records
    ):
        return
    t = Table(title="By path", header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0))
    for h in ("path", "turns", "p50 ms", "wasted tok", "$/turn", "quality (modelled)", "premature", "false hits",
              "barge-in stop ms"):  # fmt: skip
        t.add_column(h, justify="left" if h == "path" else "right", no_wrap=True)
    for path, recs in sorted(by_path.items()):
        s = summarise(recs)
        stops = [r.barge_in_stop_ms for r in recs if r.barge_in_stop_ms is not None]
        t.add_row(
            path,
            str(len(recs)),
            _ms(s.p50_ms),
            str(sum(r.wasted_tokens for r in recs)),
            fmt_usd(s.mean_cost_usd),
            "–" if s.mean_quality is None else f"{s.mean_quality:.2f}",
            str(sum(r.premature_endpoint for r in recs)),
            str(sum(r.false_hit for r in recs)),
            _ms(sum(stops) / len(stops)) if stops else "–",
        )
    console.print(t)
    hits = [r for r in records if r.path == "cache"]
    lookups = len(hits) + sum(1 for r in records if r.route.endswith("(cache miss)"))
    if lookups:
        hit_p50 = summarise(hits).p50_ms if hits else None
        console.print(
            f"cache: {lookups} lookups, {len(hits)} hits ({len(hits) / lookups:.0%}), "
            f"{sum(r.false_hit for r in hits)} false hits, hit p50 {_ms(hit_p50)} ms voice-to-voice",
            highlight=False,
        )
    console.print(
        Text(
            "path!: premature endpoint (user was not done); ✗: cache false hit; quality is modelled from benchmarks",
            style="dim",
        )
    )


PREDICTED = (
    "PREDICTED by the analytic model: the live pipeline's modelled spans with zero bus hops; nothing was run"
)


def print_predictions(console: Console, records: Sequence[TurnRecord], budget_ms: float = 800.0) -> None:
    """Predicted turns (records built by TurnPrediction.as_record): latency, path and the largest parts."""
    t = Table(title=f"Predicted turns (budget {budget_ms:.0f} ms)", header_style="bold", box=box.SIMPLE_HEAD,
              padding=(0, 1, 0, 0))  # fmt: skip
    for h in (
        "session",
        "#",
        "user said",
        "pred ms",
        "ok",
        "path",
        "q (mod)",
        "$/turn",
        "largest parts (ms)",
    ):
        t.add_column(h, justify="right" if h in ("#", "pred ms", "q (mod)", "$/turn") else "left", no_wrap=True,
                     max_width=20 if h in ("user said", "session") else None, overflow="ellipsis")  # fmt: skip
    for r in records:
        over = (r.predicted_ms or 0) > budget_ms
        t.add_row(
            r.session, str(r.turn), r.user_text, _ms(r.predicted_ms),
            Text("✗", style="bold red") if over else Text("✓", style="bold green"),
            r.path + ("!" if r.premature_endpoint else ""),
            "–" if r.quality is None else f"{r.quality:.2f}", f"{r.cost_usd:.5f}", top_parts(r, 2),
        )  # fmt: skip
    console.print(t)
    s = summarise(records)
    console.print(
        f"p50 {_ms(s.p50_ms)} ms · p90 {_ms(s.p90_ms)} · p99 {_ms(s.p99_ms)} · within {budget_ms:.0f} ms "
        f"{s.within_budget * 100:.0f}% · under 200 ms {s.under_200ms * 100:.0f}% · ${s.mean_cost_usd:.5f}/turn"
        + ("" if s.mean_quality is None else f" · quality {s.mean_quality:.2f} (modelled)"),
        highlight=False,
    )
    console.print(Text(PREDICTED, style="dim"))
