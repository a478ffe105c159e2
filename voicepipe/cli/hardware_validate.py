"""``voicepipe hardware validate``: published measurements against the model, each predicted with its
publisher family held out (:mod:`voicepipe.hardware.validate`), the largest errors of the rows the filters
choose, the summary, the per-slice table and the cross-device ratios. Every "predicted" figure is MODELLED.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer

from voicepipe.cli.emit import JsonOpt, WideOpt, console, emit_json, fail, guard, num
from voicepipe.hardware import catalog
from voicepipe.report.term import Col, hyphenated, print_fitted

VALIDATE_ROWS = 6  # rows `hardware validate` shows by default: its largest errors (then the slice table)


def validate(
    fmt: str = typer.Option("table", "--format", help="table, json or markdown (the docs table)"),
    json_out: Path | None = JsonOpt,
    tier: int | None = typer.Option(None, "--tier", min=1, max=2, help="only rows of this tier"),
    match: str | None = typer.Option(
        None, "--match", help="only rows whose id, device, model, stack, source or group contains this text"
    ),
    worst: int | None = typer.Option(None, "--worst", min=1, help="only the N largest errors, largest first"),
    all_: bool = typer.Option(
        False, "--all", help=f"every row in the table (default: the {VALIDATE_ROWS} largest errors)"
    ),
    device: str | None = typer.Option(None, "--device", help="only rows of this device (exact key)"),
    model: str | None = typer.Option(None, "--model", help="only rows of this model (exact key)"),
    stack: str | None = typer.Option(None, "--stack", help="only rows of this stack profile (exact key)"),
    architecture: str | None = typer.Option(
        None, "--architecture", help="only rows of models of this architecture: dense, moe or mla"
    ),
    wide: bool = WideOpt,
) -> None:
    """Published measurements vs the model: residuals held out by publisher family, per slice.

    The filters choose the rows shown; the summary lines are always over every point. The table shows the
    largest errors of those rows unless --all (JSON always has every chosen row)."""
    from voicepipe.hardware import validate as val  # lazy: start-up time

    rep = guard(val.run)
    if fmt == "markdown":
        typer.echo(val.markdown(rep))
        return
    rows = [r for r in rep.rows if tier is None or r.point.tier == tier]
    if match:
        m = match.lower()
        rows = [r for r in rows if any(m in str(x).lower() for x in
                (r.point.id, r.point.device, r.point.model, r.point.stack, r.point.source,
                 r.point.group or ""))]  # fmt: skip
    stack = None if stack is None else val.stack_key(stack)  # tensorrt-llm is trtllm, as in the data
    for flag, want, known in (
        ("--device", device, {p.device for p in val.points()}),
        ("--model", model, {p.model for p in val.points()}),
        ("--stack", stack, {val.stack_key(p.stack) for p in val.points()}),
        ("--architecture", architecture, {val.architecture(catalog.model(p.model)) for p in val.points()}),
    ):
        if want is not None and want not in known:
            fail(f"{flag}: no published point has {want!r}; those that do: {', '.join(sorted(known))}")
    rows = [
        r
        for r in rows
        if (device is None or r.point.device == device)
        and (model is None or r.point.model == model)
        and (stack is None or val.stack_key(r.point.stack) == stack)
        and (architecture is None or val.architecture(catalog.model(r.point.model)) == architecture)
    ]
    matching = len(rows)  # the rows the filters chose, before --worst keeps the largest errors of them
    if worst is not None:
        rows = sorted((r for r in rows if r.error is not None), key=lambda r: -abs(r.error or 0.0))[:worst]
    payload = {
        "modelled": True,
        "fitted_on_all": rep.theta_all,
        "summary": val.summary_lines(rep),
        "held_out_by": "publisher family",
        "slices": [x.model_dump() for x in val.slice_table(val.residuals(rep.rows))],
        "coverage": [x.model_dump() for x in val.coverage(val.residuals(rep.rows))],
        "cross_device_ratios": val.ratio_report(rep.rows).model_dump(),
        "rows": [
            {"id": r.point.id, "tier": r.point.tier, "device": r.point.device, "model": r.point.model,
             "stack": r.point.stack, "metric": r.point.metric, "published": r.point.value,
             "predicted_held_out": r.predicted, "error": r.error, "reason": r.reason, "source": r.point.source,
             "held_out_with": r.point.family, "group": r.point.held_out_with,
             "publisher_family": r.point.publisher_family, "speculative": r.point.speculative}
            for r in rows
        ],
    }  # fmt: skip
    if emit_json(payload, fmt, json_out):
        return
    chosen = rows
    if worst is None and not all_ and len(rows) > VALIDATE_ROWS:
        rows = sorted(rows, key=lambda r: -abs(r.error) if r.error is not None else math.inf)[:VALIDATE_ROWS]
    cols = [Col("id", justify="left", text=True, min_width=12), Col("tier", 3), Col("metric", 2, "left"),
            Col("published"), Col("held out"), Col("error", text=True, min_width=6)]  # fmt: skip
    cells = [
        [hyphenated(r.point.id), str(r.point.tier), r.point.metric, f"{r.point.value:,.6g}",
         num(r.predicted) if r.predicted is not None else "—",
         (f"{r.error * 100:+.0f} %" + (" fit" if r.point.sram_fit else "")) if r.error is not None
         else f"n/a: {r.reason}"]
        for r in rows
    ]  # fmt: skip
    con = console()
    capped = len(rows) < len(chosen)
    shown = "" if matching == len(rep.rows) else f" — {matching} of {len(rep.rows)} rows"
    if worst is not None and len(chosen) < matching:
        shown = f"{shown or f' — {matching} rows'}, the {len(chosen)} largest errors"
    title = f"Published vs modelled (predicted with the point's publisher family held out){shown}"
    if capped:
        title = f"{title} — the {len(rows)} largest errors"
    print_fitted(con, cols, cells, wide=wide, title=title)
    if capped:
        con.print(
            f"{len(chosen) - len(rows)} more rows not shown: --all lists every row, --worst N the N largest",
            style="dim", highlight=False,
        )  # fmt: skip
    held = [r for r in chosen if r.error is not None and not r.point.sram_fit]  # a fit point is no evidence
    if shown and held:
        e = val.evidence(held)
        con.print(
            f"these {e.points} held-out rows: median error {e.median_error_pct:g} %, {e.within_30_pct} % within ±30 %, "
            f"median speed {e.speed_ratio:.2f}× the measured (> 1× reads fast; {e.faster_pct} % of them do)"
        )
    if any(r.point.sram_fit for r in rows):
        fitted = sum(r.point.sram_fit for r in rep.rows)
        con.print(f"fit: one of the {fitted} points an SRAM machine's constants were fitted to (devices.yaml): "
                  "not held out, and not in the errors below", style="dim", highlight=False)  # fmt: skip
    for line in val.summary_lines(rep):
        con.print(line)
    for line in val.slice_lines(val.residuals(rep.rows)) + val.ratio_lines(rep.rows, all_):
        con.print(line, highlight=False)
