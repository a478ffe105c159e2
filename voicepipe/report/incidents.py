"""The report's "Incidents" section: broker outages and stalls, stage processes that died, and what ended
a run early (:class:`voicepipe.incidents.Incidents`). Shown only when some run had one; the turns'
own ``broker_outage_ms`` is counted even when no run result came with the records (a report of a
JSON lines file).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

from voicepipe.incidents import Incidents
from voicepipe.records import TurnRecord

CAPTION = (
    "What happened to the run besides its turns. A turn during a broker outage or stall is measured with "
    "the outage in its latency and tax (broker_outage_ms in its record); a stage process that died fails "
    "the turns it held; a run ended early (broker away past broker.outage_window_s, a signal) has fewer "
    "turns than it was asked to play."
)


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f} ms"


def _lines(inc: Incidents) -> list[str]:
    out = []
    if inc.ended_by:
        out.append(f"<b>run ended early</b>: {escape(inc.ended_by)}")
    if inc.outages_ms:
        out.append(
            f"broker connection lost {len(inc.outages_ms)} time(s), longest {_ms(inc.outages_ms[0])} "
            f"({inc.reconnects} client reconnect(s))"
        )
    if inc.stalls_ms:
        out.append(
            f"broker stalled {len(inc.stalls_ms)} time(s) (no QoS 1 acknowledgement), longest "
            f"{_ms(inc.stalls_ms[0])}"
        )
    if inc.turns_affected:
        out.append(
            f"{inc.turns_affected} turn(s) overlapped a broker outage or stall (up to "
            f"{_ms(inc.turn_outage_max_ms)} of one turn): their latency and tax include it"
        )
    out += [f"stage process died: {escape(d)}" for d in inc.deaths]
    return out


def incidents_section(
    names: Sequence[str],
    labels: Sequence[str],
    runs: Mapping[str, Sequence[TurnRecord]],
    incidents: Mapping[str, Incidents],
) -> str:
    """The section's HTML ('' when no run had an incident)."""
    parts = []
    for name, label in zip(names, labels, strict=True):
        inc = incidents.get(label) or Incidents()
        if not inc.turns_affected:
            inc.add_turns(runs.get(label, ()))
        lines = _lines(inc)
        if not lines:
            continue
        head = f"<h3>{escape(name)}</h3>" if len(names) > 1 else ""
        parts.append(head + '<ul class="incidents">' + "".join(f"<li>{x}</li>" for x in lines) + "</ul>")
    if not parts:
        return ""
    return (
        f'<section id="incidents"><h2>Incidents</h2><p class="caption">{escape(CAPTION)}</p>'
        + "".join(parts)
        + "</section>"
    )
