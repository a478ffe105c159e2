"""Turning a turn's causal chain of spans into measured / predicted / tax and a breakdown.

The breakdown partitions the interval [end of speech, first audio heard] exactly: each instant goes to
the span covering it that started last (the most recent cause); instants no span covers are the bus's
(hops, scheduling, sleep overshoot). So the parts always sum to the measured total.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from voicepipe.messages import Span
from voicepipe.records import BreakdownPart

BUS = ("bus", "hops + scheduling")


@dataclass(frozen=True)
class Measurement:
    measured_ns: int
    predicted_ns: int
    parts: list[BreakdownPart]

    @property
    def tax_ns(self) -> int:
        return self.measured_ns - self.predicted_ns


def measure(spans: Iterable[Span], t0_ns: int, t1_ns: int) -> Measurement:
    """Breakdown of [t0, t1] by the spans; predicted = time covered by modelled spans, plus, for measured
    spans that carry a calibrated ``predicted_ns``, that prediction pro rata for the part they cover."""
    if t1_ns < t0_ns:
        raise ValueError("first audio before end of speech")
    clipped = [
        (max(s.start_ns, t0_ns), min(s.end_ns, t1_ns), order, s)
        for order, s in enumerate(spans)
        if s.end_ns > t0_ns and s.start_ns < t1_ns and s.dur_ns > 0
    ]
    cuts = sorted({t0_ns, t1_ns, *(a for a, _, _, _ in clipped), *(b for _, b, _, _ in clipped)})
    totals: dict[tuple[str, str], int] = {}
    modelled: dict[tuple[str, str], bool] = {}
    predicted = 0
    for a, b in itertools.pairwise(cuts):
        covering = [(s.start_ns, order, s) for lo, hi, order, s in clipped if lo <= a and hi >= b]
        if covering:
            _, _, s = max(covering, key=lambda c: (c[0], c[1]))
            key = (s.stage, s.what)
            modelled[key] = s.modelled
            if s.modelled:
                predicted += b - a
            elif s.predicted_ns is not None:  # measured, with a calibrated prediction: pro rata
                predicted += (b - a) * s.predicted_ns / s.dur_ns
        else:
            key = BUS
            modelled[key] = False
        totals[key] = totals.get(key, 0) + (b - a)
    parts = [
        BreakdownPart(stage=st, what=wh, ms=ns / 1e6, modelled=modelled[(st, wh)])
        for (st, wh), ns in totals.items()
    ]
    return Measurement(measured_ns=t1_ns - t0_ns, predicted_ns=round(predicted), parts=parts)
