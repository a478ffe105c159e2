"""What one run measured and counted (:class:`RunResult`), and how it ended early (:class:`RunAborted`).

Filled by :func:`voicepipe.sessions.play_sessions` and the live run (:func:`voicepipe.runner.run_pipeline`);
its summary (:meth:`RunResult.summary_json`) is the last line of ``--json`` and never carries the run's token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from voicepipe.bus import BrokerOutage
from voicepipe.exitcodes import signal_name
from voicepipe.incidents import Incidents, spans_ms
from voicepipe.measure import BURST_REFUSED, LAG_TRUST_P99_MS, TAX_OUTLIER_MS, TURN_LAG_TRUST_MS, LoopLag
from voicepipe.records import Accounting, TurnRecord, account
from voicepipe.stages.guard import Counters


@dataclass
class RunResult:
    run: str
    broker: str
    records: list[TurnRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    probe_ms: float | None = None
    deadletters: int = 0
    stage_errors: int = 0
    first_error: str | None = None
    open_tasks_after: int = 0
    duplicates: int = 0  # redelivered bus messages dropped by envelope id (after reconnects)
    outage: str | None = None  # the run ended early: the broker stayed away longer than the window
    signalled: int | None = None  # the run ended early: this signal stopped it (voicepipe.stopping)
    ended: str | None = None  # the run ended early for another reason (an internal error)
    # the broker's absences this process's clients saw, (start, end) monotonic ns, and their reconnects
    broker_outages: list[tuple[int, int]] = field(default_factory=list)
    broker_stalls: list[tuple[int, int]] = field(default_factory=list)
    reconnects: int = 0
    # what the stages did with what they received (received, dead-lettered by reason, late, lost in
    # transit, handler errors), the turns the run was asked to play, and its own event-loop lag (live only)
    counters: Counters = field(default_factory=Counters)
    expected_turns: int = 0
    lag: LoopLag | None = None

    def task_failed(self, name: str, exc: BaseException) -> None:
        """A task of the run (a stage's receive loop, the deadline watch) had ended with ``exc``: counted
        with the stage errors, and the run's first error if it has none yet."""
        self.stage_errors += 1
        if self.first_error is None:
            self.first_error = f"{name}: {exc!r}"

    def accounting(self) -> Accounting:
        return account(self.records, self.expected_turns, self.counters.lost)

    def incidents(self) -> Incidents:
        """Outages, stalls, stage deaths and what ended the run early (:mod:`voicepipe.incidents`)."""
        ended = f"broker outage: {self.outage}" if self.outage else self.ended
        if self.signalled is not None:
            ended = signal_name(self.signalled)
        return Incidents(
            outages_ms=spans_ms(self.broker_outages), stalls_ms=spans_ms(self.broker_stalls),
            reconnects=self.reconnects, deaths=list(self.deaths), ended_by=ended,
        ).add_turns(self.records)  # fmt: skip

    def summary_json(self) -> dict[str, object]:
        """The run's counters as one JSON object (the last line of ``--json``); never the run's token."""
        c = self.counters
        return {
            "type": "run.summary",
            "run": self.run,
            "turns": self.accounting().model_dump(),
            "incidents": self.incidents().to_json(),
            "bus": {
                "received": c.received,
                "dead_lettered": dict(c.dead),
                "duplicates": c.duplicates,
                # every message refused, by reason (dead letters and the bus's duplicate drops), per delivery
                "refused": refused_by_reason(c),
                "late": c.late,
                "lost_in_transit": c.lost,
                "handler_errors": c.handler_errors,
            },
            "loop_lag": None
            if self.lag is None
            else {"p99_ms": self.lag.p99_ms, "max_ms": self.lag.max_ms, "samples": self.lag.samples,
                  "overloaded": self.lag.overloaded, "trust_p99_ms": LAG_TRUST_P99_MS},
            "trust": untrusted_turns(self.records),
        }  # fmt: skip

    workers: int = 0
    deaths: list[str] = field(default_factory=list)  # stage processes that died: "process (replicas): why"
    death_ns: list[int] = field(default_factory=list)  # when the run noticed each (monotonic ns)
    worker_pids: list[int] = field(default_factory=list)
    # bus counters: this process's stages, and (from their last heartbeats) the stage processes'
    local_published: int = 0
    local_received: int = 0
    remote_cpu_s: float = 0.0
    remote_published: int = 0
    remote_received: int = 0
    remote_skipped: int = 0  # messages a replica received for a session another replica owns


def refused_by_reason(c: Counters) -> dict[str, int]:
    """Every refused delivery by reason: the dead letters' reasons, and the bus's drops of an envelope id it
    had already seen (``duplicate envelope id``: redelivered, replayed or tampered copies keeping the id)."""
    out = dict(c.dead)
    if c.duplicates:
        out["duplicate envelope id"] = out.get("duplicate envelope id", 0) + c.duplicates
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def distrust_reasons(records: list[TurnRecord]) -> dict[str, int]:
    """The measured turns whose numbers this process's load may have made (``TurnRecord.trusted``), by kind
    of reason (the text before its first colon); a turn with two reasons counts under both."""
    why: dict[str, int] = {}
    for r in records:
        if not r.trusted:
            for part in r.distrust.split("; "):
                head = part.split(":", 1)[0]
                why[head] = why.get(head, 0) + 1
    return why


def untrusted_turns(records: list[TurnRecord]) -> dict[str, object]:
    """The summary's ``trust``: untrusted turns, their reasons, and the bounds they were judged by."""
    return {
        "untrusted_turns": sum(not r.trusted for r in records),
        "reasons": distrust_reasons(records),
        "tax_outlier_ms": TAX_OUTLIER_MS,
        "turn_lag_trust_ms": TURN_LAG_TRUST_MS,
        "burst_refused": BURST_REFUSED,
    }


class RunAborted(BrokerOutage):
    """The broker stayed away past ``broker.outage_window_s``; ``result`` holds what was measured."""

    def __init__(self, msg: str, result: RunResult) -> None:
        super().__init__(msg)
        self.result = result
