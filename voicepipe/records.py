"""Turn records: what one measured turn looks like, and run summaries.

A :class:`TurnRecord` is the unit every report, export and comparison works on. ``--json`` writes one
per line. Fields added by later features (path, cost, quality...) have defaults so older records load.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, model_validator

from voicepipe.spans import Span
from voicepipe.text import count_tokens

Path = Literal["agent", "cache", "council", "preemptive"]
Verdict = Literal["pass", "uncertain", "miss"]


def verdict(latency_ms: float | None, rng: tuple[float, float] | None, budget_ms: float,
            talked_over: bool = False) -> Verdict:  # fmt: skip
    """A modelled turn against its budget: ``pass`` when its range's slow end (the latency itself without
    a range) is inside the budget, ``uncertain`` when only the fast end is, ``miss`` otherwise — and a miss
    whenever the agent talked over the user or the turn got no answer. An uncertain turn is not a pass."""
    if latency_ms is None or talked_over:
        return "miss"
    lo, hi = rng if rng is not None else (latency_ms, latency_ms)
    lo, hi = min(lo, latency_ms), max(hi, latency_ms)
    return "pass" if hi <= budget_ms else "uncertain" if lo <= budget_ms else "miss"


class BreakdownPart(BaseModel):
    stage: str  # transport, asr, router, agent, council, cache, tts, bus
    what: str  # e.g. "uplink", "endpoint wait", "ttft", "decode to first clause", "hop"
    ms: float
    modelled: bool = True  # False for the measured rest (bus hops, scheduling)


class EndpointMetrics(BaseModel):
    """A real endpoint's request for this turn, measured on the client (vLLM's metric names)."""

    ttft_ms: float | None = None  # request sent -> first text
    tpot_ms: float | None = None  # (E2EL - TTFT) / (pieces - 1)
    itl_ms_mean: float | None = None  # mean gap between streamed pieces
    itl_ms_max: float | None = None
    e2el_ms: float | None = None  # request sent -> last text
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_reported: bool = False  # counts from the server's usage field (else: pieces received)


class TurnRecord(BaseModel):
    run: str
    label: str = ""  # configuration label (compare); "" for a plain run
    scenario: str
    session: str
    turn: int
    user_text: str = ""
    transcript: str = ""
    reply_text: str = ""
    backend: str = ""
    status: Literal["ok", "timeout", "failed", "lost"] = "ok"
    # why a "failed" or "lost" turn failed (a real endpoint's timeout, HTTP error, dropped stream, messages
    # the broker dropped...)
    error: str = ""
    measured_ms: float | None = None  # client clock: first reply audio heard - end of user speech
    predicted_ms: float | None = None  # sum of modelled spans on the causal chain after end of speech
    tax_ms: float | None = None  # measured - predicted: the pipeline's own cost
    budget_ms: float = 800.0
    within_budget: bool = False
    breakdown: list[BreakdownPart] = Field(default_factory=list)
    spans: list[Span] = Field(default_factory=list)  # causal chain, absolute monotonic ns
    end_of_speech_ns: int | None = None
    first_audio_ns: int | None = None
    clock_offset_ns: int = 0  # add to a monotonic ns value to get Unix epoch ns (for trace exports)
    # strategy fields (issue 4); defaults mean "plain single-agent turn"
    path: Path = "agent"
    route: str = "single"
    input_tokens: int = 0
    output_tokens: int = 0
    wasted_tokens: int = 0
    cost_usd: float = 0.0
    quality: float | None = None  # modelled accuracy in [0, 1]; None when unknown
    premature_endpoint: bool = False
    false_hit: bool = False  # cache answered with something other than the scenario's reply
    barge_in_stop_ms: float | None = None
    # The agent talked over the user (issue 26): audio of a reply to part of the utterance (a premature
    # endpoint) reached the user's ear. Heard from each chunk's arrival plus the downlink until the ASR's
    # withdrawal (cancel "user resumed", sent when it hears the user resume) reaches the client plus
    # ``transport.stop_ms``, as a barge-in by the user stops it. ``talked_over_ms`` is how long that audio
    # overlapped the user's own words (their media intervals on the client's clock: audio heard during the
    # pause and still playing once the user resumes counts from the resumption). Any early audio heard at
    # all makes the turn talked over, even with 0 ms of overlap (the agent answered mid-sentence): such a
    # turn is a miss (``within_budget`` False) whatever its latency, which is still measured from the real
    # end of speech. None = the agent said nothing before the user was done.
    talked_over_ms: float | None = None
    # audio (ms at the speaking rate) the TTS synthesised for withdrawn segments, heard or not: TTS work
    # thrown away (the LLM tokens thrown away are in ``wasted_tokens``)
    wasted_audio_ms: float = 0.0
    # a modelled turn's 80 % range of ``predicted_ms`` (fast end, slow end) where its LLM is a hardware
    # backend: the backend's held-out interval carried into the turn (voicepipe.turnrange); None elsewhere
    # (a live run, a profile or empirical backend, a cache hit)
    predicted_range_ms: tuple[float, float] | None = None
    # the broker was unreachable or stalled this long within the turn (measured on the client's clock): the
    # turn's latency and tax include it; None when the broker was there throughout
    broker_outage_ms: float | None = None
    # False when this process's own load may have made the turn's numbers: its event loop stalled while the
    # turn was in flight, or a burst of refused messages arrived meanwhile (voicepipe.measure.LagProbe.distrust);
    # ``distrust`` says which and how much ("" when trusted)
    trusted: bool = True
    distrust: str = ""
    # metric names users know (issue 13), derived from ``spans`` by :func:`span_metrics`; None = not on
    # this turn's path (e.g. no LLM on a cache hit)
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None
    e2el_ms: float | None = None
    tts_ttfb_ms: float | None = None
    asr_final_ms: float | None = None
    endpoint_delay_ms: float | None = None
    # real audio (issue 25): which speech stages (client, vad, asr, tts) ran real engines and which were
    # modelled, the ASR's word error rate against the scripted text (a real ASR only), and where the turn's
    # end of speech lies in the session's recording (``--record``)
    real_stages: list[str] = Field(default_factory=list)
    modelled_stages: list[str] = Field(default_factory=list)
    wer: float | None = None
    recording: str | None = None
    recording_eos_ms: float | None = None
    recording_stop_ms: float | None = None  # where the reply stopped for the barge-in in the recording

    @model_validator(mode="after")
    def _derive_metrics(self) -> TurnRecord:
        if self.spans:
            # plain field writes (as setattr would, without its per-call checks: the values are computed here)
            metrics = span_metrics(self.spans, self.reply_text, self.output_tokens)
            self.__dict__.update(metrics)
            self.__pydantic_fields_set__.update(metrics)
        return self

    endpoint: EndpointMetrics | None = None  # set when a real endpoint answered and the reply played out

    @property
    def talked_over(self) -> bool:
        """Did the agent speak while the user still had words to say (see ``talked_over_ms``)?"""
        return self.talked_over_ms is not None

    @property
    def uncertain(self) -> bool:
        """A modelled turn within budget only at the fast end of its range (:func:`verdict`): not a pass."""
        rng = self.predicted_range_ms
        return rng is not None and verdict(self.predicted_ms, rng, self.budget_ms, self.talked_over) == "uncertain"

    def stage_ms(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self.breakdown:
            out[p.stage] = out.get(p.stage, 0.0) + p.ms
        return out


LLM_STAGES = ("agent", "council")
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "tts_ttfb_ms", "asr_final_ms", "endpoint_delay_ms")


def span_metrics(
    spans: Sequence[Span], first_clause: str = "", output_tokens: int = 0
) -> dict[str, float | None]:
    """Per-turn metrics under the names serving and voice frameworks use, from the spans' ``what`` names.

    * ``ttft_ms`` — LLM queue + prefill to the first token (vLLM's TTFT is measured from the request, so it
      includes queueing): the ``queue`` and ``ttft`` spans of the LLM whose answer was spoken (the last
      agent/council ``ttft`` span on the chain).
    * ``tpot_ms`` / ``itl_ms`` — the ``decode`` span divided by the gaps it covers. The decode span runs from
      the first token to the last token of the first spoken clause (``first_clause`` = the record's
      ``reply_text``), so it covers ``count_tokens(first_clause) - 1`` gaps. Spans hold no per-token
      instants, so ``itl_ms`` is that mean gap too — the p50 inter-token latency whenever the decode rate is
      steady within the clause (empirical profiles; a device whose batch does not change meanwhile).
    * ``e2el_ms`` — vLLM's end-to-end request latency: ``ttft_ms`` + (``output_tokens`` - 1) × ``tpot_ms``,
      i.e. the whole reply at this turn's decode rate (the chain stops at the first clause).
    * ``tts_ttfb_ms`` — the TTS ``time to first audio`` span; ``asr_final_ms`` — the ASR ``finalise`` span;
      ``endpoint_delay_ms`` — ``endpoint wait`` + ``turn detector``: end of speech to the end-of-turn call.
    """
    by: dict[tuple[str, str], list[Span]] = {}
    for s in spans:
        by.setdefault((s.stage, s.what), []).append(s)

    def ms(*keys: tuple[str, str]) -> float | None:
        got = [s for k in keys for s in by.get(k, [])]
        return sum(s.dur_ns for s in got) / 1e6 if got else None

    llm = next((s.stage for s in reversed(spans) if s.stage in LLM_STAGES and s.what == "ttft"), None)
    ttft = tpot = e2el = None
    if llm is not None:
        first = [s for s in spans if s.stage == llm and s.what == "ttft"][-1]
        queue = [s for s in spans if s.stage == llm and s.what == "queue" and s.end_ns <= first.start_ns]
        ttft = (first.dur_ns + (queue[-1].dur_ns if queue else 0)) / 1e6
        decode = [s for s in spans if s.stage == llm and s.what == "decode" and s.start_ns >= first.start_ns]
        gaps = count_tokens(first_clause) - 1
        if decode and gaps > 0:
            tpot = decode[-1].dur_ns / 1e6 / gaps
        if tpot is not None and output_tokens > 0:
            e2el = ttft + (output_tokens - 1) * tpot
    return {
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "itl_ms": tpot,
        "e2el_ms": e2el,
        "tts_ttfb_ms": ms(("tts", "time to first audio")),
        "asr_final_ms": ms(("asr", "finalise")),
        "endpoint_delay_ms": ms(("asr", "endpoint wait"), ("asr", "turn detector")),
    }


class Summary(BaseModel):
    turns: int
    answered: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    within_budget: float  # share of all turns (timeouts count as misses)
    under_200ms: float
    tax_p50_ms: float | None
    mean_cost_usd: float
    mean_stage_ms: dict[str, float]
    mean_quality: float | None = None  # modelled; over turns whose quality is known
    talked_over: int = 0  # turns on which the agent talked over the user (each a miss)
    uncertain: int = 0  # modelled turns within budget only at their range's fast end (not counted within)

    def talked_over_line(self) -> str:
        """"talked over the user on 3 of 8 turns", or "" when it never did."""
        return f"talked over the user on {self.talked_over} of {self.turns} turns" if self.talked_over else ""


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def summarise(records: Iterable[TurnRecord]) -> Summary:
    recs = list(records)
    ok = [r for r in recs if r.measured_ms is not None]
    m = [r.measured_ms for r in ok if r.measured_ms is not None]
    tax = [r.tax_ms for r in ok if r.tax_ms is not None]
    stages: dict[str, float] = {}
    for r in ok:
        for k, v in r.stage_ms().items():
            stages[k] = stages.get(k, 0.0) + v
    n = len(recs)
    return Summary(
        turns=n,
        answered=len(ok),
        p50_ms=percentile(m, 50),
        p90_ms=percentile(m, 90),
        p99_ms=percentile(m, 99),
        within_budget=(sum(r.within_budget for r in recs) / n) if n else 0.0,
        under_200ms=(sum(1 for v in m if v < 200.0) / n) if n else 0.0,
        tax_p50_ms=percentile(tax, 50),
        mean_cost_usd=(sum(r.cost_usd for r in recs) / n) if n else 0.0,
        mean_stage_ms={k: v / len(ok) for k, v in stages.items()} if ok else {},
        mean_quality=(sum(qs) / len(qs))
        if (qs := [r.quality for r in recs if r.quality is not None])
        else None,
        talked_over=sum(r.talked_over for r in recs),
        uncertain=sum(r.uncertain for r in recs),
    )


class Accounting(BaseModel):
    """Every turn a run was asked to play, accounted for: completed, failed (with reasons) or lost (with
    reasons). ``expected`` = sessions x turns; turns with no record at all (a run cut short) are lost."""

    expected: int
    completed: int
    failed: dict[str, int] = Field(default_factory=dict)  # reason -> turns (timeouts: "timeout")
    lost: dict[str, int] = Field(default_factory=dict)  # reason -> turns

    @property
    def balanced(self) -> bool:
        return self.completed + sum(self.failed.values()) + sum(self.lost.values()) == self.expected

    def line(self) -> str:
        def why(d: dict[str, int]) -> str:
            return " (" + "; ".join(f"{n} {r}" for r, n in sorted(d.items())) + ")" if d else ""

        return (
            f"turns: {self.expected} expected, {self.completed} completed, "
            f"{sum(self.failed.values())} failed{why(self.failed)}, {sum(self.lost.values())} lost{why(self.lost)}"
        )


def unmeasured(r: TurnRecord) -> str:
    """What a turn with no latency shows in its place: its status — ``timeout`` (no reply in time),
    ``failed`` (a stage or endpoint failed it: ``error`` says why) or ``lost`` (messages dropped)."""
    return r.status if r.status != "ok" else "timeout"


def reason_of(r: TurnRecord) -> str:
    """A turn's failure reason, short enough to group by (the first clause of its error)."""
    if r.status == "timeout":
        return "timeout"
    return (r.error or r.status).split(" (", 1)[0][:120]


def account(records: Iterable[TurnRecord], expected: int, dropped: int = 0) -> Accounting:
    """``dropped``: messages the stages saw the broker drop in this run (sequence gaps). A turn that timed
    out in such a run is counted lost (its own missing messages may have left no gap anyone could see)."""
    recs = list(records)
    failed: dict[str, int] = {}
    lost: dict[str, int] = {}
    for r in recs:
        # a turn that ran out of time: the client's own timeout, or the run's deadline watch naming the stage
        # that held it (voicepipe.bus.liveness)
        timed_out = r.status == "timeout" or (r.status == "failed" and r.error.startswith("timeout"))
        if timed_out and dropped:
            why = f"timeout while the broker dropped {dropped} message(s) in this run (a queue limit?)"
            lost[why] = lost.get(why, 0) + 1
        elif r.status in ("failed", "timeout"):
            failed[reason_of(r)] = failed.get(reason_of(r), 0) + 1
        elif r.status == "lost":
            lost[reason_of(r)] = lost.get(reason_of(r), 0) + 1
    if len(recs) < expected:
        lost["never played (run cut short)"] = expected - len(recs)
    return Accounting(
        expected=max(expected, len(recs)),
        completed=sum(r.status == "ok" for r in recs),
        failed=failed,
        lost=lost,
    )
