"""predict: the live stages, run on the in-memory bus and the virtual clock — the pipeline's own answer.

There is no second model of the pipeline here. :func:`predict` plays the scenarios through the same
stage code a live run uses (ASR endpointing, router, cache, council, agent, TTS, the client's stopwatch,
the backends' models including shared-device queueing), on :class:`voicepipe.bus.memory.MemoryBus` with zero
hops and :class:`voicepipe.clock.VirtualLoop`, so modelled seconds cost only CPU. Sessions start as the
live run starts them (``client.start_spread_ms``) and share devices as they do live.

Contract: for the same config, scenarios, sessions and seed, a live run's per-turn ``predicted_ms`` (the
time its modelled spans cover) and cost equal the prediction wherever the modelled timing does not depend
on when bus messages arrive. Where it does — a preemptive attempt overlapping the ASR, a speculative cache
render started on a partial, sessions that queue on one shared device, a premature endpoint whose cancel
lands mid-generation — live differs by the bus hops it paid (the measured tax), and ``exact`` is False.

A prediction reports what a run reports: :meth:`TurnPrediction.to_json` writes every field ``run --json``
writes for a turn (barge-in stop time, wasted tokens, false cache hits, ``talked_over_ms``...) except
:data:`LIVE_ONLY`, plus :data:`PREDICT_ONLY`. A turn on which the agent talked over the user is a miss
here as live (``within_budget`` False whatever ``predicted_ms``).

Where the turn's agent is a hardware backend, its held-out 80 % interval is carried into the turn
(:mod:`voicepipe.turnrange`): ``predicted_range_ms`` is the turn's range, and its ``verdict``
(:func:`voicepipe.records.verdict`) is ``pass`` only when the range's slow end is inside the budget,
``uncertain`` when only its fast end is; ``within_budget`` is True for a pass alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from voicepipe.config import PipelineConfig
from voicepipe.parallel import Executor, LocalExecutor, Report
from voicepipe.records import METRICS, BreakdownPart, TurnRecord, Verdict, verdict
from voicepipe.runner import simulate
from voicepipe.runresult import RunResult
from voicepipe.scenario import Scenario
from voicepipe.turnrange import Spread, spreads, turn_range

# TurnRecord fields a live run writes that a prediction leaves out, because only a live run has them: the
# measurement itself and the pipeline tax (``predicted_ms`` is the prediction's latency), the run id, the
# absolute instants of the live clock (spans, end of speech, first audio, clock offset), the broker's
# outages and a real endpoint's measured request metrics.
LIVE_ONLY = frozenset({
    "run", "measured_ms", "tax_ms", "spans", "end_of_speech_ns", "first_audio_ns", "clock_offset_ns",
    "broker_outage_ms", "endpoint",
})  # fmt: skip
# what a prediction adds: whether live must equal it (``exact``), and that it is modelled
PREDICT_ONLY = frozenset({"exact", "modelled", "verdict", "interval_level"})


@dataclass
class TurnPrediction:
    scenario: str
    session: str
    turn: int
    user_text: str
    path: str
    route: str
    backend: str
    predicted_ms: float
    budget_ms: float
    breakdown: list[BreakdownPart]
    cost_usd: float = 0.0
    quality: float | None = None
    premature_endpoint: bool = False
    exact: bool = True  # False where live timing can differ by bus hops (overlap, shared-device queueing)
    wasted_tokens: int = 0
    # the metric columns users know (ttft_ms, tpot_ms, ...), from the turn's modelled spans
    metrics: dict[str, float | None] = field(default_factory=dict)
    # the virtual run's own record (spans on the virtual clock, reply, tokens), for exports: export_record
    virtual: TurnRecord | None = field(default=None, repr=False, compare=False)
    talked_over_ms: float | None = None  # see TurnRecord.talked_over_ms
    # the virtual run's record (its spans dropped): every field a live record has, for to_json/as_record
    record: TurnRecord | None = field(default=None, repr=False, compare=False)
    # the hardware agent's 80 % interval carried into the turn (fast end, slow end); None: no range
    predicted_range_ms: tuple[float, float] | None = None
    interval_level: float | None = None

    @property
    def talked_over(self) -> bool:
        return self.talked_over_ms is not None

    @property
    def verdict(self) -> Verdict:
        """pass, uncertain (within budget only at the range's fast end) or miss (:func:`records.verdict`)."""
        return verdict(self.predicted_ms, self.predicted_range_ms, self.budget_ms, self.talked_over)

    @property
    def within_budget(self) -> bool:
        """A pass: inside the budget at the range's slow end, and the agent did not talk over the user (a
        miss at any latency). An uncertain turn is not within the budget."""
        return self.verdict == "pass"

    @classmethod
    def of(cls, r: TurnRecord, exact: bool, spread: Spread | None = None) -> TurnPrediction:
        if r.predicted_ms is None:
            raise ValueError(f"turn {r.turn} of {r.session} got no reply (timed out on virtual time)")
        return cls(
            scenario=r.scenario, session=r.session, turn=r.turn, user_text=r.user_text, path=r.path,
            route=r.route, backend=r.backend, predicted_ms=r.predicted_ms, budget_ms=r.budget_ms,
            breakdown=r.breakdown, cost_usd=r.cost_usd, quality=r.quality, premature_endpoint=r.premature_endpoint,
            exact=exact, wasted_tokens=r.wasted_tokens, metrics={k: getattr(r, k) for k in METRICS}, virtual=r,
            talked_over_ms=r.talked_over_ms, record=r.model_copy(update={"spans": []}),
            predicted_range_ms=turn_range(r.predicted_ms, r.breakdown, spread),
            interval_level=None if spread is None else spread.level,
        )  # fmt: skip

    def as_record(self, label: str = "") -> TurnRecord:
        """A turn record whose latency is the prediction (``measured_ms`` = ``predicted_ms``, tax 0), so the
        summaries and tables that read records can show predictions; never written as a measurement."""
        mine = {
            "run": "predict", "label": label, "measured_ms": self.predicted_ms, "predicted_ms": self.predicted_ms,
            "tax_ms": 0.0, "within_budget": self.within_budget, "predicted_range_ms": self.predicted_range_ms,
        }  # fmt: skip
        if self.record is not None:
            return self.record.model_copy(update={**mine, "end_of_speech_ns": None, "first_audio_ns": None})
        return TurnRecord(
            scenario=self.scenario, session=self.session, turn=self.turn,
            user_text=self.user_text, backend=self.backend, budget_ms=self.budget_ms,
            breakdown=self.breakdown, path=self.path, route=self.route, cost_usd=self.cost_usd, quality=self.quality,
            premature_endpoint=self.premature_endpoint, wasted_tokens=self.wasted_tokens,
            talked_over_ms=self.talked_over_ms, **mine, **self.metrics,
        )  # fmt: skip

    def export_record(self, label: str = "", clock_offset_ns: int = 0) -> TurnRecord:
        """:meth:`as_record` with the virtual run's spans, reply and token counts, for the exports (CSV, HTML,
        OTel traces): ``run`` is ``predict``, every span is the modelled one on the virtual clock, and
        ``clock_offset_ns`` places that clock's zero on the wall clock (traces need epoch times)."""
        rec = self.as_record(label)
        if self.virtual is None:
            return rec
        v = self.virtual
        keep = ("transcript", "reply_text", "spans", "end_of_speech_ns", "first_audio_ns", "input_tokens",
                "output_tokens", "false_hit", "barge_in_stop_ms", "status", "error")  # fmt: skip
        return rec.model_copy(update={**{k: getattr(v, k) for k in keep}, "clock_offset_ns": clock_offset_ns})

    def to_json(self) -> dict:
        """The fields ``run --json`` writes for a turn, less :data:`LIVE_ONLY`, plus :data:`PREDICT_ONLY`."""
        rec = self.as_record()
        out = {k: v for k, v in rec.model_dump(mode="json").items() if k not in LIVE_ONLY}
        return {**out, "within_budget": self.within_budget, "verdict": self.verdict,
                "interval_level": self.interval_level, "exact": self.exact, "modelled": True}  # fmt: skip


def shares_devices(cfg: PipelineConfig, sessions: int) -> bool:
    """Do concurrent sessions queue on one simulated device (hardware backends share one per spec)?"""
    specs = [*cfg.agent.backends().values(), *cfg.council.members]
    if cfg.council.judge is not None:
        specs.append(cfg.council.judge)
    return sessions > 1 and any(isinstance(s, dict) or "/" in str(s) for s in specs)


def exact_turn(r: TurnRecord, shared: bool) -> bool:
    """Is this turn's modelled timing and cost independent of bus hops (see the module docstring)?"""
    return not (
        shared
        or r.path == "preemptive"
        or r.premature_endpoint
        # a cancel's arrival decides how many tokens a dropped request made (a council decides on modelled
        # instants instead)
        or (r.wasted_tokens > 0 and r.path != "council")
        or any(b.what == "render (speculative)" for b in r.breakdown)
    )


def checked(result: RunResult) -> RunResult:
    """A virtual run's result, or ValueError naming the first stage failure (a config the stages reject)."""
    if result.first_error:
        raise ValueError(result.first_error)
    return result


def predict(cfg: PipelineConfig, scenarios: Sequence[Scenario], sessions: int = 1) -> list[TurnPrediction]:
    """Every turn of ``sessions`` concurrent copies of each scenario, on virtual time, in session order."""
    res = checked(simulate(cfg, list(scenarios), sessions))
    shared = shares_devices(cfg, sessions)
    agents = spreads(cfg, sessions)  # sessions share each hardware agent's device: its batch regime
    order = {sc.name: i for i, sc in enumerate(scenarios)}
    recs = sorted(res.records, key=lambda r: (order[r.scenario], int(r.session.rsplit("-", 1)[1]), r.turn))
    late = next((r for r in recs if r.predicted_ms is None), None)
    if late is not None:
        where = f"turn {late.turn} of {late.session}"
        dead = "; ".join(f"{n} {why}" for why, n in sorted(res.counters.dead.items()) if n)
        if late.status != "timeout":
            raise ValueError(f"{where} {late.status}: {late.error or 'no reason given'}")
        if dead:  # the run refused some of its own messages: that, not the clock, is why
            raise ValueError(f"{where} got no reply; messages were dead-lettered ({dead})")
        raise ValueError(
            f"{where} got no reply within client.turn_timeout_s "
            f"({cfg.client.turn_timeout_s:g} s of virtual time): a modelled wait or stage takes longer than that"
        )
    return [TurnPrediction.of(r, exact_turn(r, shared), agents.get(r.backend)) for r in recs]


def _predict_job(
    job: tuple[PipelineConfig, tuple[Scenario, ...], int], _report: Report
) -> list[TurnPrediction]:
    cfg, scenarios, sessions = job
    return predict(cfg, scenarios, sessions)


def predict_each(
    cfgs: Sequence[PipelineConfig],
    scenarios: Sequence[Scenario],
    sessions: int = 1,
    workers: int | None = None,
    executor: Executor | None = None,
) -> list[list[TurnPrediction]]:
    """:func:`predict` for every config on ``executor`` (default: up to ``workers`` local processes, default
    the CPUs); the same results as one by one (each run is independent and seeded). A config the stages
    reject raises :class:`voicepipe.parallel.ItemFailed` with its index."""
    jobs = [(cfg, tuple(scenarios), sessions) for cfg in cfgs]
    return (executor or LocalExecutor(workers)).map(_predict_job, jobs)
