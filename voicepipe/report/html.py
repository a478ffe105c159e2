"""A self-contained HTML report of one run or a comparison of configurations.

One file, inline CSS and SVG only: no scripts, stylesheets, fonts or images fetched from anywhere, so it
can be mailed, archived or opened offline. Sections: summary, per-turn waterfall, latency CDF, budget
breakdown, missed-budget turns, measured vs predicted, configuration (what differs between the
configurations, each one's full YAML folded).

Every chart is drawn twice, at the width of a wide page and of a narrow one (a half-screen window), and
CSS shows the one that fits, so that chart text is never scaled below ``MIN_FONT_PX``; wide tables reflow
into one card per row on a narrow page.

This module assembles the page; the sections are drawn by :mod:`voicepipe.report.sections` and
:mod:`voicepipe.report.configdiff` from the pieces in :mod:`voicepipe.report.blocks`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from voicepipe.compare import display_names
from voicepipe.incidents import Incidents
from voicepipe.records import TurnRecord, summarise
from voicepipe.report.advice import Advice
from voicepipe.report.configdiff import _config
from voicepipe.report.incidents import incidents_section
from voicepipe.report.sections import _breakdown, _cdf, _findings, _fixes, _missed, _summary, _tax, _waterfall
from voicepipe.report.svg import esc, fmt_num, stage_sort_key

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
.hear { margin:2px 0 8px; } .hear audio { height:28px; vertical-align:middle; margin-right:8px; }
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


def _stages(runs: Mapping[str, Sequence[TurnRecord]]) -> list[str]:
    seen = {p.stage for recs in runs.values() for r in recs for p in r.breakdown}
    return sorted(seen, key=stage_sort_key)


def render_html(
    runs: dict[str, list[TurnRecord]],
    configs: dict[str, dict],
    title: str = "voicepipe report",
    budget_ms: float = 800.0,
    fixes: Mapping[str, Advice | None] | None = None,
    incidents: Mapping[str, Incidents] | None = None,
    predicted: bool = False,
    notes: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """Render one self-contained HTML page; ``runs`` maps configuration label → its turn records;
    ``fixes`` (label → :func:`voicepipe.report.advice.advice`) adds predicted fixes to the misses panel;
    ``incidents`` (label → its run's outages, stage deaths, early end) adds an Incidents section;
    ``notes`` (label → lines) what a live run counted beyond its records (refused messages by reason).
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
        _findings(names, sums, budget_ms, recs, [list((notes or {}).get(k, ())) for k in labels]),
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
