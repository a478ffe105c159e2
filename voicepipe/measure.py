"""Turning a turn's causal chain of spans into measured / predicted / tax and a breakdown.

The breakdown partitions the interval [end of speech, first audio heard] exactly: each instant goes to
the span covering it that started last (the most recent cause); instants no span covers are the bus's
(hops, scheduling, sleep overshoot). So the parts always sum to the measured total.

Clock-free (issue 10): the spans come from stages whose clocks need not agree. Each stage moves the spans it
receives onto its own clock as if the message had arrived when it was sent (voicepipe.stages.base.rebase), so
at the client every span keeps its duration and its place within its stage, the chain ends where the reply
arrived on the client's clock, and the hops are left uncovered: the bus part. Only the client's clock
measures (end of speech, heard); no stage's timestamp is compared with another host's.

The run also measures its own load (:class:`LagProbe`): how late the event loop runs its timers, and says
when that is too high for the numbers to be trusted (:data:`LAG_TRUST_P99_MS`, over the run). A run's p99
hides a few long stalls, so each turn is also judged on its own: a turn whose tax is an outlier (over
:data:`TAX_OUTLIER_MS`) while the loop stalled past :data:`TURN_LAG_TRUST_MS`, or while the stages refused
at least :data:`BURST_REFUSED` messages (a hostile or broken publisher's burst), is marked not trusted,
with why (:meth:`LagProbe.distrust`). A stall alone proves nothing: the stages sleep to absolute deadlines,
so a loop that stalls in the middle of a long modelled span and recovers before its end delays no one
(measured: 23-54 ms stalls on a shared 2-core box left turns with 7-11 ms of tax).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from voicepipe.clock import now_ns
from voicepipe.construct import built
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
        (max(s.start_ns, t0_ns), min(s.end_ns, t1_ns), s.start_ns, order, s)
        for order, s in enumerate(spans)
        if s.end_ns > t0_ns and s.start_ns < t1_ns and s.dur_ns > 0
    ]
    cuts = sorted({t0_ns, t1_ns, *(c[0] for c in clipped), *(c[1] for c in clipped)})
    totals: dict[tuple[str, str], int] = {}
    modelled: dict[tuple[str, str], bool] = {}
    predicted: float = 0  # exact (an int) until a pro-rata prediction adds a fraction
    for a, b in itertools.pairwise(cuts):
        # the covering span that started last (ties: the later on the chain, i.e. the last in the list)
        best = None
        best_start = 0
        for lo, hi, start, _, s in clipped:
            if lo <= a and hi >= b and (best is None or start >= best_start):
                best, best_start = s, start
        if best is not None:
            s = best
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
    # the parts hold what was just computed (str, str, float, bool): built without validating them again
    parts = [
        built(
            BreakdownPart,
            {"stage": st, "what": wh, "ms": ns / 1e6, "modelled": modelled[(st, wh)]},
            {"stage", "what", "ms", "modelled"},
        )
        for (st, wh), ns in totals.items()
    ]
    return Measurement(measured_ns=t1_ns - t0_ns, predicted_ns=round(predicted), parts=parts)


# -- the run's own load ----------------------------------------------------------------------------------
# Every modelled duration is realised by a sleep on the event loop, and every hop is a callback on it. A loop
# that runs callbacks L ms late delays each of the ~5-6 sequential steps of a turn's chain that run in this
# process, so a p99 lag of 5 ms can put ~25-30 ms of the tool's own delay on a turn — the whole tax budget
# the scale-out goal allows (issue 10: tax p99 <= 25 ms). Past that the measured tax is mostly the tool.
LAG_TRUST_P99_MS = 5.0
LAG_PERIOD_S = 0.01  # one probe every 10 ms: ~100 wake-ups a second, negligible next to the pipeline
# Per turn: one stall this long on the loop is, alone, most of the ~25 ms tax allowance (issue 10), so the
# turn's tax is the tool's as much as the pipeline's. (Unattacked turns on a 2-core box show tax up to
# ~26 ms; under bursts of heavy hostile messages 67-393 ms: issue 27.)
TURN_LAG_TRUST_MS = 20.0
# A turn's tax is an outlier past the scale-out goal's tax p99 (issue 10: 25 ms): unattacked turns on a quiet
# 2-core box stay under it (max 26 ms in issue 27's runs); only such a turn's numbers are in question.
TAX_OUTLIER_MS = 25.0
# Per turn: this many refused messages (dead-lettered or dropped as duplicates) while it was in flight is a
# burst: each costs the loop parsing and checking (~0.05 ms for a small one, far more for a large body),
# enough together to move a turn's tax even when no single probe caught a long stall. A chosen bound, not
# a measured one: a run with nobody attacking it refuses none.
BURST_REFUSED = 50


@dataclass(frozen=True)
class LoopLag:
    """How late this process's event loop ran a timer that should have fired at once (ms), over a run."""

    samples: int
    p99_ms: float
    max_ms: float

    @property
    def overloaded(self) -> bool:
        return self.p99_ms > LAG_TRUST_P99_MS

    def verdict(self) -> str:
        """One plain line for the summary."""
        head = f"event-loop lag p99 {self.p99_ms:.1f} ms, max {self.max_ms:.1f} ms ({self.samples} probes)"
        if self.overloaded:
            return (
                f"{head}: LOAD TOO HIGH — timers ran late past the {LAG_TRUST_P99_MS:g} ms p99 this tool "
                "trusts (this run, or other processes, kept the CPU busy): the measured latency and tax "
                "include that delay; use fewer sessions, stages in other processes, or a quieter machine"
            )
        return f"{head}: within the {LAG_TRUST_P99_MS:g} ms p99 at which the numbers are trusted"


class LagProbe:
    """Measures event-loop lag while it runs: sleeps ``LAG_PERIOD_S`` at a time and records how much later
    than asked it woke (on ``time.perf_counter``; asyncio's own timers round to ~1 ms, so ~1 ms is the floor).

    ``refused`` (optional) reads a running count of the messages this process's stages refused; each wake-up
    notes it with the instant (``now_ns``, the clock turn records use), so :meth:`distrust` can tell how many
    arrived during a turn."""

    def __init__(self, refused: Callable[[], int] | None = None) -> None:
        self.lags_ms: list[float] = []
        self.refused = refused
        self.woke_ns: list[int] = []  # now_ns() of each wake-up (same order as lags_ms)
        self.refused_at: list[int] = []  # the refused count at each wake-up (when ``refused`` is given)

    async def run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(LAG_PERIOD_S)
            self.lags_ms.append(max(0.0, (time.perf_counter() - t0 - LAG_PERIOD_S) * 1e3))
            self.woke_ns.append(now_ns())
            if self.refused is not None:
                self.refused_at.append(self.refused())

    def distrust(self, start_ns: int, end_ns: int) -> str:
        """Why a turn measured over [start_ns, end_ns] (its end of speech to first audio) is not to be trusted,
        "" when nothing says so: the loop stalled past :data:`TURN_LAG_TRUST_MS` while it was in flight (a
        wake-up late by that much whose wait overlapped the turn, or a wait begun before its end and still
        going on now), or its stages refused :data:`BURST_REFUSED` messages or more meanwhile (counted up to
        now: a turn is judged when it is recorded, just after its end)."""
        woke, lags = self.woke_ns, self.lags_ms
        lo = bisect.bisect_left(woke, start_ns)  # first wake-up at or after the turn's start
        period_ns = LAG_PERIOD_S * 1e9
        worst = 0.0
        for i in range(lo, len(woke)):
            if woke[i] - lags[i] * 1e6 - period_ns > end_ns:  # this wait began after the turn ended
                break
            worst = max(worst, lags[i])
        now = now_ns()
        if woke and woke[-1] <= end_ns:  # a wait begun before the end, going on now: as late as it is overdue
            worst = max(worst, (now - woke[-1] - period_ns) / 1e6)
        why = []
        if worst > TURN_LAG_TRUST_MS:
            why.append(f"event-loop stall: timers ran {worst:.0f} ms late while the turn was in flight "
                       f"(trusted up to {TURN_LAG_TRUST_MS:g} ms)")  # fmt: skip
        if self.refused is not None:
            before = self.refused_at[lo - 1] if 0 < lo <= len(self.refused_at) else 0
            burst = self.refused() - before
            if burst >= BURST_REFUSED:
                why.append(f"message burst: {burst} refused messages arrived while the turn was in flight")
        return "; ".join(why)

    def result(self) -> LoopLag | None:
        if not self.lags_ms:
            return None
        return LoopLag(
            samples=len(self.lags_ms),
            p99_ms=float(np.percentile(self.lags_ms, 99)),
            max_ms=max(self.lags_ms),
        )
