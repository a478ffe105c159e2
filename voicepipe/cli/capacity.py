"""``voicepipe capacity``: how many concurrent conversations each configuration carries inside the budget.

The engine is :mod:`voicepipe.capacity` (the live stages on virtual time); this module is the command:
options, progress, the table, the answer line per configuration, and ``--json`` (JSON lines: one per load
level, then one per limit), ``--csv`` (one row per level) and ``--report`` (self-contained HTML with a
chart of p90 against load and the budget line).
"""

import csv as csvlib
import json
import math
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from voicepipe.capacity import Level, LevelJob, Limit, conversation_s, level_batch, limit, parse_loads
from voicepipe.cli.common import (
    Writes,
    check_variants_speech,
    fail,
    load_scenarios,
    out,
    progress_bar,
    user_errors,
    virtual_variants,
)
from voicepipe.cli.options import ConfigsOpt, ScenariosArg, SetOpt, VaryOpt, WideOpt, writable
from voicepipe.compare import display_names, plan_variants
from voicepipe.config import load_config
from voicepipe.executors import EXECUTOR_HELP, executor_for
from voicepipe.exitcodes import ExitCode
from voicepipe.parallel import ItemFailed
from voicepipe.report.svg import (
    HALO,
    MUTED,
    budget_ref,
    esc,
    fit_middle,
    fmt_num,
    nice_ticks,
    series_colour,
    text_width,
)  # fmt: skip
from voicepipe.report.term import Cell, Col, print_fitted

COST_NOTE = (
    "token $ per hour: the turns' tokens at each backend's per-token price (a hardware backend's: the "
    "provider's public price where one is listed, else its chip-hours over its modelled throughput), not "
    "what renting the devices costs"
)


RANGE_NOTE = (
    "p90 (low–high): the p90 of the turns' 80 % ranges (each hardware agent's held-out interval carried into "
    "the turn); within the budget counts a turn only at its range's slow end, +N%? is the share inside only "
    "at the fast end (uncertain, not a pass), and a load is inside for the answer only at the slow end"
)


def modelled_caption(hop_ms: float) -> str:
    """What the table's numbers are: modelled, how the bus was charged, and what the cost column counts."""
    if not hop_ms:
        return (
            "MODELLED on virtual time: the live stages on an in-memory bus with zero hops; a real bus adds "
            f"its pipeline tax (see `voicepipe run`; --hop-ms charges a hop per message). {COST_NOTE}"
        )
    return (
        f"MODELLED on virtual time: the live stages on an in-memory bus, {hop_ms:g} ms per message (--hop-ms); "
        f"a real bus's hops vary and its stages' own CPU time adds to them (see `voicepipe run`). {COST_NOTE}"
    )


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f}"


def _within(lv: Level) -> str:
    """The share within budget, and the uncertain share beside it: ``40% +20%?``."""
    return f"{lv.within_budget * 100:.0f}%" + (f" +{lv.uncertain * 100:.0f}%?" if lv.uncertain else "")


def _p90(lv: Level) -> str:
    """The p90, with the p90 of the turns' 80 % ranges where they have one: ``780 (740–830)``."""
    rng = lv.p90_range_ms
    return _ms(lv.p90_ms) + ("" if rng is None else f" ({rng[0]:,.0f}–{rng[1]:,.0f})")


def _devices_cell(lv: Level, attr: str, fmt: str) -> str:
    vals = [(d.backend, getattr(d, attr)) for d in lv.devices]
    if len(vals) == 1:
        v = vals[0][1]
        return "–" if v is None else format(v, fmt)
    return " · ".join(f"{b.split('/')[0]} {'–' if v is None else format(v, fmt)}" for b, v in vals)


def capacity_rows(levels: Sequence[Level], budget_ms: float) -> tuple[list[Col], list[list[Cell]]]:
    """The capacity table as fitted-table columns (voicepipe.report.term): numbers whole, names wrap."""
    labels = list(dict.fromkeys(lv.label for lv in levels))
    several = len(labels) > 1
    heading, names = display_names(labels)
    short = dict(zip(labels, names, strict=True))
    cols = [
        *([Col(heading, justify="left", text=True, min_width=12)] if several else []),
        Col("load", justify="left", text=True, min_width=8, max_width=14),
        Col("turns", priority=3),
        Col("p50\nms"),
        Col("p90\nms"),
        Col("p99\nms", priority=2),
        Col(f"≤{budget_ms:g}\nms"),
        Col("queue\nms", priority=1),
        Col("tok/s\nper user", priority=4),
        Col("busy", priority=1),
        Col("token $\nper hour", priority=2),
    ]
    rows: list[list[Cell]] = []
    for lv in levels:
        over = lv.p90_ms is None or lv.p90_ms > budget_ms
        unsure = not over and (lv.p90_slow_ms or 0.0) > budget_ms  # inside only at the ranges' fast end
        rows.append([
            *([short[lv.label]] if several else []), lv.load.label, f"{lv.turns:,}", _ms(lv.p50_ms),
            Text(_p90(lv), style="bold red" if over else "yellow" if unsure else "green"), _ms(lv.p99_ms),
            _within(lv), _devices_cell(lv, "queue_mean_ms", ",.1f"),
            _devices_cell(lv, "user_tok_s", ".0f"), _devices_cell(lv, "busy_share", ".0%"),
            f"{lv.cost_per_hour_usd:.3g}",
        ])  # fmt: skip
    return cols, rows


def write_csv(path: Path, levels: Sequence[Level]) -> None:
    cols = ["label", "load_kind", "load", "conversations", "turns", "answered", "p50_ms", "p90_ms", "p99_ms",
            "within_budget", "uncertain", "cost_per_hour_usd", "window_s", "wall_s", "hop_ms"]  # fmt: skip
    with path.open("w", newline="") as f:
        w = csvlib.writer(f)
        w.writerow(
            [*cols, "backend", "queue_mean_ms", "queue_p90_ms", "user_tok_s", "busy_share", "in_flight"]
        )
        for lv in levels:
            row = lv.to_json()
            if not lv.devices:  # no shared device: the level's row alone
                w.writerow([row[c] for c in cols])
            for d in lv.devices:
                dev = [d.backend, d.queue_mean_ms, d.queue_p90_ms, d.user_tok_s, d.busy_share, d.in_flight]
                w.writerow([row[c] for c in cols] + dev)


def p90_chart(levels: Sequence[Level], budget_ms: float, width: float = 640, height: float = 400) -> str:
    """p90 voice-to-voice against load, one line per configuration labelled at its end, with the budget
    line (SVG; 640 px wide, so that a half-screen window shows it unscaled)."""
    labels = list(dict.fromkeys(lv.label for lv in levels))
    loads = sorted({lv.load.value for lv in levels})
    log_x = len(loads) > 1 and loads[-1] / loads[0] >= 20
    room = min(width * 0.3, max([0.0, *(text_width(lb) for lb in labels)]) + 14)
    x0, x1, top, bot = 60.0, width - 16 - room, 24.0, height - 50
    lo, hi = (math.log10(loads[0]), math.log10(loads[-1])) if log_x else (0.0, loads[-1])
    hi = hi if hi > lo else lo + 1

    def sx(v: float) -> float:
        return x0 + (x1 - x0) * ((math.log10(v) if log_x else v) - lo) / (hi - lo)

    yt = nice_ticks(max([budget_ms * 1.1, *(lv.p90_ms or 0 for lv in levels)]))

    def sy(v: float) -> float:
        return bot - (bot - top) * min(v, yt[-1]) / yt[-1]

    kind = levels[0].load.kind if levels else "sessions"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
        f'height="{height:.0f}" role="img" aria-label="p90 against load" font-family="system-ui, sans-serif" '
        f'font-size="12" style="max-width:100%;height:auto"><title>p90 voice-to-voice against load</title>'
    ]
    for t in yt:
        out.append(f'<line x1="{x0}" x2="{x1}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#e6e6e6"/>'
                   f'<text x="{x0 - 6}" y="{sy(t) + 4:.1f}" text-anchor="end" fill="{MUTED}">{fmt_num(t)}</text>')  # fmt: skip
    for v in loads:
        out.append(
            f'<text x="{sx(v):.1f}" y="{bot + 16}" text-anchor="middle" fill="{MUTED}">{fmt_num(v)}</text>'
        )
    xl = ("concurrent conversations" if kind == "sessions" else "calls per minute") + (
        " (log scale)" if log_x else ""
    )
    out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{height - 12}" text-anchor="middle">{esc(xl)}</text>'
               f'<text x="16" y="{(top + bot) / 2:.1f}" transform="rotate(-90 16 {(top + bot) / 2:.1f})" '
               f'text-anchor="middle">p90 voice-to-voice, ms (modelled)</text>')  # fmt: skip
    ref = budget_ref(budget_ms)
    out.append(f'<line class="budget-line" x1="{x0}" x2="{x1}" y1="{sy(budget_ms):.1f}" y2="{sy(budget_ms):.1f}" '
               f'stroke="{ref.colour}" stroke-width="1.8" stroke-dasharray="{ref.dash}"/>'
               f'<text class="budget-label" x="{x0 + 4}" y="{sy(budget_ms) - 5:.1f}" fill="{ref.colour}" '
               f'font-weight="600" {HALO}>{esc(ref.label)}</text>')  # fmt: skip
    ends: list[tuple[float, str, str]] = []  # (y of the line's last point, label, colour)
    for i, label in enumerate(labels):
        c = series_colour(i)
        mine = [lv for lv in levels if lv.label == label and lv.p90_ms is not None]
        pts = [(sx(lv.load.value), sy(lv.p90_ms or 0.0)) for lv in mine]
        dash = ("", ' stroke-dasharray="7 3"', ' stroke-dasharray="2 3"')[i % 3]
        out.append(f'<polyline class="series" fill="none" stroke="{c}" stroke-width="2"{dash} '
                   f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in pts)}"/>')  # fmt: skip
        for (x, y), lv in zip(pts, mine, strict=True):
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{c}"><title>{esc(label)} · '
                       f"{esc(lv.load.label)}: p90 {lv.p90_ms:.0f} ms</title></circle>")  # fmt: skip
        ends.append((pts[-1][1] if pts else top, label if pts else f"{label} (no answers)", c))
    for y, label, c in end_label_ys(ends, 15.0, top, bot):
        out.append(f'<text class="end-label" x="{x1 + 8:.1f}" y="{y + 4:.1f}" fill="{c}" font-weight="600" '
                   f'{HALO}>{esc(fit_middle(label, room - 10))}</text>')  # fmt: skip
    out.append("</svg>")
    return "".join(out)


def end_label_ys(
    ends: Sequence[tuple[float, str, str]], gap: float, top: float, bot: float
) -> list[tuple[float, str, str]]:
    """The end labels' heights: each at its line's last point, pushed apart to ``gap`` px, inside the plot."""
    placed = sorted(ends)
    ys = [y for y, _, _ in placed]
    for i in range(1, len(ys)):
        ys[i] = max(ys[i], ys[i - 1] + gap)
    if ys and ys[-1] > bot:  # pushed off the bottom: shift the stack up
        ys[-1] = bot
        for i in range(len(ys) - 2, -1, -1):
            ys[i] = min(ys[i], ys[i + 1] - gap)
    return [(max(y, top), lb, c) for y, (_, lb, c) in zip(ys, placed, strict=True)]


def report_html(levels: Sequence[Level], limits: Sequence[Limit], budget_ms: float, title: str) -> str:
    rows = "".join(
        "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in (
            lv.label, lv.load.label, lv.turns, _ms(lv.p50_ms), _p90(lv), _ms(lv.p99_ms),
            _within(lv), _devices_cell(lv, "queue_mean_ms", ",.1f"),
            _devices_cell(lv, "user_tok_s", ".0f"), _devices_cell(lv, "busy_share", ".0%"),
            f"{lv.cost_per_hour_usd:.3g}")) + "</tr>"
        for lv in levels
    )  # fmt: skip
    head = "".join(f"<th>{h}</th>" for h in ("config", "load", "turns", "p50 ms", "p90 ms", "p99 ms",
                   f"within {budget_ms:g} ms", "queue ms", "tok/s per user", "busy", "token $/hour"))  # fmt: skip
    answers = "".join(f"<li>{esc(lim.sentence())}</li>" for lim in limits)
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{esc(title)}</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2rem;color:#222;max-width:1000px}"
        "table{border-collapse:collapse;font-size:13px}td,th{padding:3px 8px;border-bottom:1px solid #ddd;"
        "text-align:right}td:first-child,th:first-child,td:nth-child(2){text-align:left}"
        f".note{{color:{MUTED}}}</style></head><body><h1>{esc(title)}</h1><ul>{answers}</ul>"
        f"{p90_chart(levels, budget_ms)}<div style='overflow-x:auto'><table><thead><tr>{head}</tr></thead>"
        f"<tbody>{rows}</tbody></table></div>"
        f"<p class='note'>{esc(modelled_caption(levels[0].hop_ms if levels else 0.0))}.</p></body></html>"
    )


def capacity(
    scenario: ScenariosArg,
    config: ConfigsOpt = None,
    vary: VaryOpt = None,
    set_: SetOpt = None,
    sessions: Annotated[
        str | None, typer.Option("--sessions", help="Concurrent conversations to try, e.g. 10,100,1000.")
    ] = None,
    arrivals: Annotated[
        str | None,
        typer.Option("--arrivals", help="Poisson call arrival rates to try, e.g. 30/min,60/min."),
    ] = None,
    minutes: Annotated[
        float, typer.Option("--minutes", min=0.1, help="Arrival horizon (with --arrivals).")
    ] = 10.0,
    hop_ms: Annotated[
        float,
        typer.Option(
            "--hop-ms",
            min=0.0,
            max=1000.0,
            help="Charge every bus message this one-way hop (e.g. a broker's measured median: "
            "half the round trip `voicepipe run` probes; ~0.4 ms for mosquitto on loopback). Default 0: "
            "the modelled spans alone, as predict.",
        ),
    ] = 0.0,
    json_out: Annotated[
        Path | None,
        typer.Option(
            "--json", metavar="FILE", help="JSON lines: one per load level, then limits.", callback=writable
        ),
    ] = None,
    csv: Annotated[
        Path | None, typer.Option(
            "--csv", metavar="FILE", help="One row per load level (and device).", callback=writable
        )
    ] = None,
    report: Annotated[
        Path | None, typer.Option(
            "--report", metavar="FILE", help="HTML: table and p90-vs-load chart.", callback=writable
        )
    ] = None,
    wide: WideOpt = False,
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            min=1,
            help="Worker processes for the independent runs (load levels x configurations); default: "
            "this machine's CPUs. Results are the same for any value.",
        ),
    ] = None,
    executor: Annotated[str | None, typer.Option("--executor", help=EXECUTOR_HELP)] = None,
) -> None:
    """How many concurrent conversations (or calls per minute) keep p90 inside the budget, per configuration.

    Runs the pipeline's own stages on virtual time at each load level: p50/p90/p99, share within budget, queue wait and busy share of each shared device, decode rate per user, cost per hour; then the answer line per configuration. Modelled: no bus tax unless --hop-ms charges one.
    """
    with user_errors():
        loads = parse_loads(sessions, arrivals)
        if vary or len(config or []) > 1:
            variants = plan_variants(config or [], vary or [], set_ or [], None)
        else:  # one configuration is enough here
            one = load_config(config[0] if config else None, set_ or [])
            variants = [(config[0].stem if config else one.backend_label(), one)]
        variants = virtual_variants(variants, str(config[0]) if config else "")
        scs = load_scenarios(scenario)
        check_variants_speech(variants, scs)
        ex = executor_for(executor, jobs)
    levels: list[Level] = []
    limits: list[Limit] = []
    budget = variants[0][1].budget_ms
    lengths = {}
    for label, cfg in variants:
        try:
            lengths[label] = conversation_s(cfg, scs)
        except ValueError as exc:
            raise fail(f"configuration {label!r}: {exc}") from None
    level_jobs = [
        LevelJob(label, cfg, tuple(scs), ld, lengths[label], minutes, hop_ms)
        for label, cfg in variants
        for ld in loads
    ]
    total = round(sum(j.turns() for j in level_jobs))
    # a local pool forks its workers before the progress bar starts its refresh thread
    with (
        closing(ex),
        level_batch(level_jobs, ex) as pool,
        progress_bar(total, "capacity") as prog,
    ):
        task = prog.task_ids[0]
        try:
            levels = pool.results(lambda n: prog.advance(task, n))
        except ItemFailed as failed:
            if not isinstance(failed.error, ValueError):
                raise failed.error from None
            raise fail(f"configuration {level_jobs[failed.index].label!r}: {failed.error}") from None
    for label, cfg in variants:
        limits.append(limit(label, [lv for lv in levels if lv.label == label], cfg.budget_ms))
    title = f"capacity: {', '.join(s.name for s in scs)} · budget {budget:g} ms"
    if len(variants) == 1:
        title += f" · {variants[0][0]}"
    cols, rows = capacity_rows(levels, budget)
    print_fitted(out, cols, rows, wide=wide, title=title, caption=modelled_caption(hop_ms))
    if any(lv.p90_range_ms for lv in levels):
        out.print(RANGE_NOTE, style="dim", highlight=False, markup=False)
    for lim in limits:
        out.print(lim.sentence(), highlight=False, markup=False)
    writes = Writes()  # each output attempted; one that fails is a line and exit 2
    if json_out:
        lines = [json.dumps({"kind": "level", **lv.to_json()}) for lv in levels]
        lines += [json.dumps({"kind": "limit", "label": lim.label, "budget_ms": lim.budget_ms,
                              "largest_ok": lim.largest_ok.load.value if lim.largest_ok else None,
                              "first_over": lim.first_over.load.value if lim.first_over else None,
                              "crossing": lim.crossing, "uncertain": [lv.load.value for lv in lim.uncertain],
                              "answer": lim.sentence()}) for lim in limits]  # fmt: skip
        writes("--json", json_out, lambda: json_out.write_text("\n".join(lines) + "\n"))
    if csv:
        writes("--csv", csv, lambda: write_csv(csv, levels))
    if report:
        html = report_html(levels, limits, budget, title)
        writes("--report", report, lambda: report.write_text(html))
    if writes.failed:
        raise typer.Exit(ExitCode.USAGE)
