"""What happened to a run besides its turns: broker outages and stalls, stage processes that died, and
what ended it early (a broker outage past its window, a signal, an internal error).

:class:`Incidents` is filled from a run's :class:`~voicepipe.runresult.RunResult` (the broker health its bus
clients recorded, the deaths its watch noticed) and its turn records (each carries ``broker_outage_ms``,
how long the broker was away within that turn, on the client's clock). The summary JSON
(``--summary-json``) carries :meth:`Incidents.to_json`; the HTML report shows it as a section
(:mod:`voicepipe.report.incidents`). A run with none of them has :attr:`Incidents.empty` true.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from voicepipe.records import TurnRecord


@dataclass
class Incidents:
    # the broker's absences the run's clients saw, merged across clients: (start, end) monotonic ns
    outages_ms: list[float] = field(default_factory=list)  # lost connections, longest first
    stalls_ms: list[float] = field(default_factory=list)  # connected, but nothing acknowledged for >= 1 s
    reconnects: int = 0
    # turns whose window overlapped an outage or stall (their latency and tax include it)
    turns_affected: int = 0
    turn_outage_max_ms: float | None = None
    deaths: list[str] = field(default_factory=list)  # stage processes that died: "process (replicas): why"
    ended_by: str | None = None  # why the run ended early ("broker outage: ...", "SIGTERM", ...); None: it ran out

    @property
    def empty(self) -> bool:
        return not (self.outages_ms or self.stalls_ms or self.turns_affected or self.deaths or self.ended_by)

    def add_turns(self, records: Iterable[TurnRecord]) -> Incidents:
        """Count the turns that carry ``broker_outage_ms``; returns self."""
        got = [r.broker_outage_ms for r in records if r.broker_outage_ms]
        self.turns_affected = len(got)
        self.turn_outage_max_ms = max(got) if got else None
        return self

    def to_json(self) -> dict[str, object]:
        return {
            "ended_by": self.ended_by,
            "broker": {
                "outages": len(self.outages_ms),
                "outage_longest_ms": max(self.outages_ms, default=None),
                "outages_ms": self.outages_ms,
                "stalls": len(self.stalls_ms),
                "stall_longest_ms": max(self.stalls_ms, default=None),
                "stalls_ms": self.stalls_ms,
                "reconnects": self.reconnects,
                "turns_affected": self.turns_affected,
                "turn_outage_max_ms": self.turn_outage_max_ms,
            },
            "stage_deaths": self.deaths,
        }


def spans_ms(spans: list[tuple[int, int]]) -> list[float]:
    """(start, end) ns intervals, overlapping ones joined (every client sees the same outage), as ms,
    longest first."""
    joined: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if joined and a <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(joined[-1][1], b))
        elif b > a:
            joined.append((a, b))
    return sorted(((b - a) / 1e6 for a, b in joined), reverse=True)
