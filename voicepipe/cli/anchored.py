"""``voicepipe hardware predict --anchor PROFILE``: the user's measurement × the model's ratio target / anchor.

The figures are ANCHORED (:mod:`voicepipe.backends.anchor`): measured on the anchor device, scaled by the
modelled ratio; their 80 % ranges come from the cross-device ratio residuals of published sources that
measured two devices with one harness (:mod:`voicepipe.hardware.validate.ratios`), not from the model's
absolute error.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from voicepipe.backends.anchor import (
    anchor_line,
    anchored_prediction,
    check_anchor,
    describe_anchor,
    factors,
    read_anchor,
)
from voicepipe.backends.profile import Anchor
from voicepipe.cli.emit import emit_json
from voicepipe.cli.emit import fail as _fail
from voicepipe.errors import UserError
from voicepipe.hardware import catalog
from voicepipe.hardware.model import DoesNotFit, Speculative
from voicepipe.hardware.model import predict as model_predict
from voicepipe.hardware.validate import points, shipped_accuracy
from voicepipe.hardware.validate.ratios import anchored_intervals, ratio_accuracy, residual_pairs
from voicepipe.hardware.validate.slices import LEVEL
from voicepipe.report.term import SafeConsole

METRICS = ("ttft_ms", "step_ms", "tokens_per_second", "aggregate_tokens_per_second")


def load(path: Path, model: catalog.ModelSpec) -> Anchor:
    """The profile's anchor, checked against the target's model (one line, exit 2, when it does not match)."""
    try:
        a = read_anchor(path)
        check_anchor(a, str(path), model.key)
    except UserError as exc:
        _fail(str(exc))
    return a


def _range(lo: float, hi: float) -> str:
    def num(x: float) -> str:
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"

    return f"({num(lo)}–{num(hi)})"


def predict_anchored(
    path: Path, dev: catalog.Device, mdl: catalog.ModelSpec, batch: int, prompt_tokens: int, output_tokens: int,
    tp: int | None, precision: str | None, kv_precision: str | None, stack: str | None, spec: Speculative | None,
    fmt: str, json_out: Path | None,
) -> None:  # fmt: skip
    """`hardware predict --anchor`: precision, KV precision and stack default to the anchor's."""
    a = load(path, mdl)
    try:
        stk = catalog.stack(stack or a.stack)
        f = factors(a, str(path))
        p = model_predict(
            dev, mdl, precision=precision or a.precision, batch=batch, prompt_tokens=prompt_tokens,
            output_tokens=output_tokens, tp=tp, spec=spec, kv_precision=kv_precision or a.kv_precision, stack=stk,
            timing="client",  # a measured (client-side) TTFT times a ratio of client-side ones
        )  # fmt: skip
    except (UserError, DoesNotFit, ValueError) as exc:
        _fail(str(exc))
    values = anchored_prediction(p, dev, mdl, stk, spec, f)
    ratios = residual_pairs(points(), shipped_accuracy().residuals)
    intervals, basis = anchored_intervals(values, ratios)
    held = ratio_accuracy(ratios)
    differ = [f"{what} {x} here, {y} measured" for what, x, y in (
        ("device", f"{dev.key} x {p.chips}", f"{a.hardware} x {a.chips}"), ("batch", batch, a.concurrency),
        ("prompt tokens", prompt_tokens, a.prompt_tokens), ("output tokens", output_tokens, a.output_tokens),
        ("precision", p.precision, a.precision), ("stack", p.stack, a.stack)) if str(x) != str(y)]  # fmt: skip
    modelled = {m: getattr(p, m) for m in METRICS}
    out = {
        **p.as_dict(), **values, "modelled": True, "anchored": describe_anchor(a, str(path), f),
        "modelled_unanchored": modelled, "ratio_spans": differ, "intervals": {m: list(v) for m, v in intervals.items()},
        "interval_level": LEVEL, "interval_basis": {m: f"cross-device ratio residuals: {b}" for m, b in basis.items()},
        "validation_ratios": {**held, "held_out_by": "publisher family", "what": "cross-device ratio error on "
                              "published pairs: one source, two devices or chip counts (`voicepipe hardware validate`)"},
        "speculative": None if spec is None else spec.__dict__,
        "sources": {"device": dev.sources, "model": mdl.sources, "method": "docs/hardware-model.md; anchored: "
                    "measured on the anchor x (model on target / model on anchor)"},
    }  # fmt: skip
    if emit_json(out, fmt, json_out):
        return

    def show(metric: str, text: str) -> str:
        got = intervals.get(metric)
        return f"{text} {_range(*got)}" if got else f"{text} (no range: too few cross-device pairs)"

    t = Table(title=f"{dev.key}/{mdl.key} ANCHORED on {a.hardware}", title_justify="left",
              caption="ANCHORED: measured on the anchor x the modelled ratio target / anchor")  # fmt: skip
    t.add_column("quantity")
    t.add_column("value", justify="right", overflow="fold")
    for k, v in (
        ("chips", f"{p.chips}"), ("precision (weights / KV)", f"{p.weights_label()} / {p.kv_precision}"),
        ("stack", p.stack), ("batch", f"{p.batch}"), ("TTFT", show("ttft_ms", f"{values['ttft_ms']:.1f} ms")),
        ("decode step", show("step_ms", f"{values['step_ms']:.2f} ms")),
        ("tok/s per request", show("tokens_per_second", f"{values['tokens_per_second']:.1f}")),
        ("tok/s aggregate", show("aggregate_tokens_per_second", f"{values['aggregate_tokens_per_second']:.1f}")),
        ("model alone (unanchored)", f"TTFT {p.ttft_ms:.1f} ms, step {p.step_ms:.2f} ms"),
        ("anchor: measured / modelled", f"TTFT x{f.ttft:.3g}, TPOT x{f.step:.3g}"),
    ):  # fmt: skip
        t.add_row(k, v)
    con: Console = SafeConsole(file=sys.stdout)
    con.print(t)
    con.print(anchor_line(a, str(path)), highlight=False, markup=False)
    con.print(f"the model's cross-device ratio was off by a median {held['median_error_pct']:g} % on {held['pairs']} "
              "published pairs (one source, two devices or chip counts; held out by publisher family)",
              highlight=False, markup=False)  # fmt: skip
    spans = [d for d in differ if not d.startswith("device")]
    if spans:  # the published pairs validate a change of device only
        con.print(f"the model's ratio also spans {'; '.join(spans)}: anchor at the settings you predict for "
                  "where you can", highlight=False, markup=False)  # fmt: skip
    how = "; ".join(f"{m}: {b}" for m, b in basis.items()) or "none"
    con.print(f"(low–high): the {LEVEL:.0%} range of the cross-device ratio residuals, held out by publisher family "
              f"(`voicepipe hardware validate`; {how})", highlight=False, markup=False)  # fmt: skip
