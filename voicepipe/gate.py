"""Requirements a run must meet (``--require``): a gate for CI on the measured (or predicted) turns.

A requirement is ``NAME OP NUMBER``: NAME one of :data:`METRICS` — ``p50``, ``p90``, ``p99`` (voice-to-voice
ms over the answered turns), ``within`` (share of all turns inside the budget, 0–1; timeouts count as
misses; ``within>=90%`` is refused with the 0–1 form to write), ``ok`` (share of turns that completed), ``tax_p50`` (ms of pipeline tax),
``talked_over`` (the number of turns on which the agent talked over the user: audio of a reply to part of
the utterance was heard, see ``TurnRecord.talked_over_ms``; ``talked_over<=0`` asks that it never did), ``uncertain`` (the number of modelled turns within the budget only
at the fast end of their 80 % range, the hardware agent's held-out interval carried into the turn:
``voicepipe.turnrange``; ``uncertain<=0`` asks that every pass is certain) — and OP one of ``<=``,
``>=``, ``<``, ``>``. Several are given comma-separated or by repeating the option: ``--require
'p90<=800,within>=0.9'``. The command prints and writes everything as usual, then names each requirement
that was missed and exits 1 (a metric with no value, e.g. p90 with no answered turn, is a miss).

An uncertain turn is never a pass: ``within`` counts the turns within the budget at their range's slow end
(a turn without a range: at its latency), so an uncertain turn counts against ``within`` as a miss does;
``p50``/``p90``/``p99`` are of the latencies themselves (the point estimates).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from voicepipe.errors import UserError, did_you_mean
from voicepipe.records import TurnRecord, summarise

# name -> (what it is, unit, how it is read off the turns)
METRICS: dict[str, tuple[str, str]] = {
    "p50": ("voice-to-voice p50", "ms"),
    "p90": ("voice-to-voice p90", "ms"),
    "p99": ("voice-to-voice p99", "ms"),
    "within": ("share of turns within the budget", ""),
    "ok": ("share of turns completed", ""),
    "tax_p50": ("pipeline tax p50", "ms"),
    "talked_over": ("turns on which the agent talked over the user", "turns"),
    "uncertain": ("turns within the budget only at their modelled range's fast end", "turns"),
}
OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}
_FORM = re.compile(r"^\s*([a-z_0-9]+)\s*(<=|>=|<|>)\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*(%?)\s*$")


@dataclass(frozen=True)
class Requirement:
    name: str
    op: str
    value: float

    def __str__(self) -> str:
        unit = METRICS[self.name][1]
        return f"{self.name} {self.op} {self.value:g}{' ' + unit if unit else ''}"


def parse(raw: Iterable[str] | None, where: str = "--require") -> list[Requirement]:
    """The requirements in ``raw`` (each item may hold several, comma-separated); a malformed one is a
    one-line :class:`UserError` naming it."""
    out: list[Requirement] = []
    for item in raw or []:
        for part in item.split(","):
            if not part.strip():
                continue
            m = _FORM.match(part)
            if m is None:
                # a bare metric: an unquoted `--require within>=0.5` lost `>=0.5` to the shell's redirect
                quote = " (quote it: the shell reads an unquoted > or < as a redirect)" if part.strip() in METRICS else ""
                raise UserError(where, f"{part.strip()!r} is not NAME<=NUMBER (or >=, <, >), e.g. p90<=800{quote}")
            name, op, value, pct = m.group(1), m.group(2), float(m.group(3)), m.group(4)
            if name not in METRICS:
                hint = did_you_mean(name, METRICS)
                raise UserError(
                    where, f"unknown metric {name!r}{hint} in {part.strip()!r} (metrics: {', '.join(METRICS)})"
                )
            if name in ("within", "ok") and (pct or not 0.0 <= value <= 1.0):
                fix = f"write {name}{op}{value / 100:g} for {value:g}%" if 0 <= value <= 100 else f"e.g. {name}>=0.9"
                raise UserError(where, f"{name} is a share from 0 to 1, not {value:g}{pct} ({fix})")
            if pct:
                raise UserError(where, f"{part.strip()!r}: {name} takes no % ({METRICS[name][0]})")
            out.append(Requirement(name, op, value))
    return out


def values(records: Iterable[TurnRecord]) -> dict[str, float | None]:
    """Every metric of :data:`METRICS` over ``records`` (None where there is nothing to measure)."""
    recs = list(records)
    s = summarise(recs)
    return {
        "p50": s.p50_ms,
        "p90": s.p90_ms,
        "p99": s.p99_ms,
        "within": s.within_budget if recs else None,
        "ok": sum(r.status == "ok" for r in recs) / len(recs) if recs else None,
        "tax_p50": s.tax_p50_ms,
        "talked_over": float(s.talked_over) if recs else None,
        "uncertain": float(s.uncertain) if recs else None,
    }


def missed(reqs: list[Requirement], records: Iterable[TurnRecord]) -> list[str]:
    """One line per requirement the turns miss (empty when all are met)."""
    if not reqs:
        return []
    recs = list(records)
    got = values(recs)
    lines = []
    for r in reqs:
        v = got[r.name]
        if v is None:
            lines.append(f"requirement {r} not met: no value ({METRICS[r.name][0]} of no turn)")
        elif not OPS[r.op](v, r.value):
            unit = METRICS[r.name][1]
            counted = r.name in ("talked_over", "uncertain")
            shown = f"{v:g} of {len(recs)}" if counted else f"{v:,.1f} {unit}" if unit else f"{v:.3g}"
            lines.append(f"requirement {r} not met: {METRICS[r.name][0]} is {shown}")
    return lines
