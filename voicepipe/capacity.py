"""Capacity planning: how many concurrent conversations (or call arrivals) a configuration carries inside
the turn budget — the live stages on the in-memory bus and the virtual clock, at each load level.

Load is given two ways:

* ``sessions`` N: N conversation *slots*, each playing conversations back to back (a new caller as soon as
  the last one hangs up), their first starts spread evenly over one conversation length ``D`` (the
  scenarios' mean length from a one-session run). Turns are counted in the window where every slot is in
  its conversations (from the last slot's start to the first slot's end), so N calls are in progress
  throughout the measurement. With N = 1 there is one conversation per scenario, started at 0: exactly
  what ``predict`` runs.
* ``arrivals`` λ per minute: a Poisson process of calls (seeded by ``seed``), each a conversation from the
  scenarios in turn, over ``minutes``; turns are counted after one conversation length of warm-up.

Per level: p50/p90/p99 voice-to-voice (first audio heard − end of speech, virtual time = the modelled
spans alone), the share within budget, and per LLM backend (a shared simulated device for hardware specs):
queue wait (the ``queue`` spans on the turns' chains), the decode rate each user sees (tokens 1.. of each
reply over its decode span, observed on the bus), busy share (the union of request intervals [first span,
last token] over the window) and mean requests in flight; and the cost per hour of the turns in the window
(modelled prices). Everything here is modelled: the pipeline tax of a real bus is not in it.

The limit is the largest tested load whose p90 is inside the budget, the next tested load (outside), and a
linear interpolation of the crossing between those two.

Where a turn's LLM is a hardware backend, its held-out 80 % interval is carried into the turn
(:mod:`voicepipe.turnrange`, at the level's concurrency: the sessions, or the requests in flight on the
device under arrivals): a turn counts within the budget only when its range's slow end is inside it;
one inside only at the fast end is *uncertain* (``uncertain``: their share), not a pass. The level's
``p90_range_ms`` is the p90 of the turns' fast ends and of their slow ends, and a level is inside the
budget for the limit only when the slow end's p90 is; a level whose p90 is inside only at the fast end is
named as uncertain in the answer line.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from voicepipe.clock import now_ns, run_virtual
from voicepipe.config import PipelineConfig
from voicepipe.errors import UserError
from voicepipe.messages import Envelope, ReplyText, carries
from voicepipe.parallel import Batch, Executor, LocalExecutor, Report
from voicepipe.records import TurnRecord, percentile, verdict
from voicepipe.runner import simulate_async
from voicepipe.runresult import RunResult
from voicepipe.scenario import Scenario, session_id
from voicepipe.sessions import Slot
from voicepipe.turnrange import spreads, turn_range

NS = 1e9


@dataclass(frozen=True)
class Load:
    kind: str  # "sessions" | "arrivals"
    value: float  # sessions, or calls per minute

    @property
    def label(self) -> str:
        if self.kind == "sessions":
            return f"{self.value:g} session{'s' if self.value != 1 else ''}"
        return f"{self.value:g}/min"


def parse_loads(sessions: str | None, arrivals: str | None) -> list[Load]:
    """``--sessions 10,50,100`` or ``--arrivals 30/min,60/min`` (``/h`` and ``/s`` too), sorted by load."""
    if (sessions is None) == (arrivals is None):
        raise UserError("--sessions/--arrivals", "give exactly one of them")
    out: list[Load] = []
    if sessions is not None:
        for part in sessions.split(","):
            if not part.strip().isdigit() or int(part) < 1:
                raise UserError("--sessions", f"{part.strip()!r} is not a whole number of sessions >= 1")
            out.append(Load("sessions", int(part)))
    else:
        per = {"s": 60.0, "sec": 60.0, "min": 1.0, "m": 1.0, "h": 1 / 60, "hour": 1 / 60}
        for part in str(arrivals).split(","):
            m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*/\s*([a-z]+)\s*", part)
            if not m or m.group(2) not in per or float(m.group(1)) <= 0:
                raise UserError("--arrivals", f"{part.strip()!r} is not a rate like 60/min (or /s, /h)")
            out.append(Load("arrivals", float(m.group(1)) * per[m.group(2)]))
    return sorted(set(out), key=lambda load: load.value)


@dataclass
class DeviceStats:
    """One LLM backend (one shared simulated device for a hardware spec) at one load level."""

    backend: str
    turns: int
    queue_mean_ms: float
    queue_p90_ms: float
    user_tok_s: float | None  # mean decode rate one user sees
    busy_share: float  # share of the window with at least one request on it
    in_flight: float  # mean requests on it


@dataclass
class Level:
    label: str  # the configuration
    load: Load
    conversations: int
    turns: int  # counted (in the window)
    answered: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    within_budget: float
    cost_per_hour_usd: float
    window_s: float
    devices: list[DeviceStats] = field(default_factory=list)
    wall_s: float = 0.0
    stage_errors: int = 0
    cpu_s: float = 0.0  # CPU seconds of the run (its process's, measured): steadier than wall on a busy box
    played_turns: int = 0  # every turn the run played (counted or not): what the CPU seconds bought
    hop_ms: float = 0.0  # modelled cost of each bus message (0: the modelled spans alone)
    # share of the turns within the budget only at their range's fast end (not in within_budget), and the
    # p90 of the turns' fast ends and slow ends (None: no turn has a range, see voicepipe.turnrange)
    uncertain: float = 0.0
    p90_range_ms: tuple[float, float] | None = None

    @property
    def p90_slow_ms(self) -> float | None:
        """The p90 at the ranges' slow end (the p90 itself where no turn has a range)."""
        return self.p90_ms if self.p90_range_ms is None else max(self.p90_range_ms[1], self.p90_ms or 0.0)

    def to_json(self) -> dict:
        return {
            "label": self.label, "load_kind": self.load.kind, "load": self.load.value,
            "load_label": self.load.label, "conversations": self.conversations, "turns": self.turns,
            "answered": self.answered, "p50_ms": self.p50_ms, "p90_ms": self.p90_ms, "p99_ms": self.p99_ms,
            "within_budget": self.within_budget, "uncertain": self.uncertain,
            "p90_range_ms": None if self.p90_range_ms is None else list(self.p90_range_ms),
            "cost_per_hour_usd": self.cost_per_hour_usd,
            "window_s": self.window_s, "wall_s": self.wall_s, "cpu_s": self.cpu_s,
            "played_turns": self.played_turns, "stage_errors": self.stage_errors, "hop_ms": self.hop_ms,
            "devices": [d.__dict__ for d in self.devices], "modelled": True,
        }  # fmt: skip


@dataclass
class Plan:
    slots: list[Slot]
    conversations: int
    window_ns: tuple[float, float]  # counted: end of speech inside [lo, hi) (relative to the run's start)


def plan(load: Load, scenarios: Sequence[Scenario], conv_s: float, seed: int, minutes: float) -> Plan:
    """Who calls when (see the module docstring)."""
    scs = list(scenarios)
    if load.kind == "sessions":
        n = int(load.value)
        if n == 1:  # what predict runs: each scenario once, from 0
            return Plan([(0.0, [(sc, session_id(sc, 0))]) for sc in scs], len(scs), (0.0, math.inf))
        slots: list[Slot] = []
        for j in range(n):
            convs = [
                (scs[(j + r) % len(scs)], session_id(scs[(j + r) % len(scs)], r * n + j)) for r in range(2)
            ]
            slots.append((j * conv_s / n, convs))
        # every slot is in a call from the last slot's start until the first slot's second call ends
        return Plan(slots, 2 * n, ((n - 1) * conv_s / n * NS, 2 * conv_s * NS))
    rng = np.random.default_rng([seed & 0xFFFFFFFF, 0xCA9AC1])
    horizon = max(minutes * 60.0, 4 * conv_s)
    rate = load.value / 60.0
    starts: list[float] = []
    t = float(rng.exponential(1 / rate))
    while t < horizon:
        starts.append(t)
        t += float(rng.exponential(1 / rate))
    slots = [(at, [(scs[k % len(scs)], session_id(scs[k % len(scs)], k))]) for k, at in enumerate(starts)]
    return Plan(slots, len(slots), (conv_s * NS, horizon * NS))


@dataclass
class _Reply:
    backend: str
    busy: tuple[int, int]
    tok_s: float | None


def _observe(replies: list[_Reply]) -> Callable[[str, Envelope], None]:
    """A bus tap: each reply's final text chunk carries its request's spans up to its last token."""

    def tap(channel: str, env: Envelope) -> None:
        if channel != "reply/text" or not carries(env, ReplyText):
            return
        p = env.payload
        if not p.final:
            return
        own = [s for s in env.spans[-3:] if s.what in ("queue", "ttft", "decode")]
        if not own:
            return
        decode = next((s for s in own if s.what == "decode"), None)
        tok_s = (
            (p.meta.output_tokens - 1) / (decode.dur_ns / NS) if decode and p.meta.output_tokens > 1 else None
        )
        replies.append(_Reply(p.meta.backend, (own[0].start_ns, own[-1].end_ns), tok_s))

    return tap


def _union_ns(intervals: list[tuple[int, int]], lo: float, hi: float) -> float:
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        a, b = max(start, lo), min(stop, hi)
        if b <= a:
            continue
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _devices(records: list[TurnRecord], replies: list[_Reply], lo: float, hi: float) -> list[DeviceStats]:
    out = []
    for name in sorted({r.backend for r in records} | {r.backend for r in replies}):
        mine = [r for r in records if r.backend == name]
        queue = [sum(s.dur_ns for s in r.spans if s.what == "queue") / 1e6 for r in mine]
        reps = [r for r in replies if r.backend == name and r.busy[1] > lo and r.busy[0] < hi]
        rates = [r.tok_s for r in reps if r.tok_s is not None]
        span = max(hi - lo, 1.0)
        inside = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in (r.busy for r in reps))
        out.append(
            DeviceStats(
                backend=name,
                turns=len(mine),
                queue_mean_ms=float(np.mean(queue)) if queue else 0.0,
                queue_p90_ms=percentile(queue, 90) or 0.0,
                user_tok_s=float(np.mean(rates)) if rates else None,
                busy_share=_union_ns([r.busy for r in reps], lo, hi) / span,
                in_flight=inside / span,
            )
        )
    return out


async def _level_async(
    cfg: PipelineConfig,
    scenarios: Sequence[Scenario],
    p: Plan,
    on_record: Callable[[TurnRecord], None] | None,
    hop_ns: int = 0,
) -> tuple[RunResult, list[_Reply], int]:
    replies: list[_Reply] = []
    t0 = now_ns()
    res = await simulate_async(
        cfg, list(scenarios), slots=p.slots, hop_ns=hop_ns, tap=_observe(replies), on_record=on_record
    )
    return res, replies, t0


def conversation_s(cfg: PipelineConfig, scenarios: Sequence[Scenario]) -> float:
    """Mean length of one conversation (one session alone, virtual time), in seconds."""

    async def one(sc: Scenario) -> float:
        t0 = now_ns()
        await simulate_async(cfg, [sc], 1)
        return (now_ns() - t0) / NS

    return float(np.mean([run_virtual(one(sc)) for sc in scenarios]))


def run_level(
    label: str,
    cfg: PipelineConfig,
    scenarios: Sequence[Scenario],
    load: Load,
    *,
    conv_s: float,
    minutes: float = 10.0,
    on_record: Callable[[TurnRecord], None] | None = None,
    hop_ms: float = 0.0,
) -> Level:
    """One load level on virtual time. ``hop_ms``: what each bus message costs (a broker's one-way hop);
    0 = the modelled spans alone, as ``predict``."""
    p = plan(load, scenarios, conv_s, cfg.seed, minutes)
    wall, cpu = time.perf_counter(), time.process_time()
    res, replies, t0 = run_virtual(_level_async(cfg, scenarios, p, on_record, round(hop_ms * 1e6)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if res.first_error:
        raise ValueError(res.first_error)
    lv = level_of(label, cfg, load, p, res, t0, replies, wall)
    lv.cpu_s, lv.played_turns, lv.hop_ms = cpu, len(res.records), hop_ms
    return lv


@dataclass(frozen=True)
class LevelJob:
    """One configuration at one load level: an independent virtual run (see :mod:`voicepipe.parallel`)."""

    label: str
    cfg: PipelineConfig
    scenarios: tuple[Scenario, ...]
    load: Load
    conv_s: float
    minutes: float = 10.0
    hop_ms: float = 0.0

    def plan(self) -> Plan:
        return plan(self.load, self.scenarios, self.conv_s, self.cfg.seed, self.minutes)

    def turns(self) -> float:
        """Turns the run plays (its conversations times the scenarios' mean turns)."""
        per_conv = sum(len(s.turns) for s in self.scenarios) / len(self.scenarios)
        return self.plan().conversations * per_conv

    def run(self, report: Report | None = None) -> Level:
        tell = report or (lambda _n: None)
        return run_level(self.label, self.cfg, self.scenarios, self.load, conv_s=self.conv_s,
                         minutes=self.minutes, on_record=lambda _r: tell(1), hop_ms=self.hop_ms)  # fmt: skip


def _run_job(job: LevelJob, report: Report) -> Level:
    return job.run(report)


def level_batch(jobs: Sequence[LevelJob], executor: Executor) -> Batch[Level]:
    """The jobs' levels on ``executor`` (local processes or a Ray cluster), heaviest first; results in job
    order, equal to running them here one by one (each is its own seeded run on its own virtual clock)."""
    return executor.start(_run_job, jobs, [j.turns() for j in jobs])


def level_pool(jobs: Sequence[LevelJob], workers: int) -> Batch[Level]:
    """:func:`level_batch` in up to ``workers`` local processes."""
    return level_batch(jobs, LocalExecutor(workers))


def level_of(
    label: str, cfg: PipelineConfig, load: Load, p: Plan, res: RunResult, t0: int,
    replies: list[_Reply] | None = None, wall_s: float = 0.0, latency: str = "measured_ms",
) -> Level:  # fmt: skip
    """A load level's statistics from a run of plan ``p`` started at ``t0`` (virtual or live): the turns
    whose end of speech is in the plan's window. ``latency``: the record field summarised (a live run's
    ``predicted_ms`` is its modelled part)."""
    lo_rel, hi_rel = p.window_ns
    last = max((r.end_of_speech_ns or 0) for r in res.records) if res.records else t0
    lo, hi = t0 + lo_rel, min(t0 + hi_rel, last + 1)
    counted = [r for r in res.records if r.end_of_speech_ns is not None and lo <= r.end_of_speech_ns < hi]
    if not counted:  # a window too short for a single turn: use them all
        counted, lo, hi = res.records, t0, last + 1
    answered = [(r, v) for r in counted if (v := getattr(r, latency)) is not None]
    ms = [v for _, v in answered]
    window_s = max(hi - lo, 1.0) / NS
    budget = cfg.budget_ms
    devices = _devices(counted, replies or [], lo, hi)
    busiest = max((d.in_flight for d in devices), default=1.0)
    agents = spreads(cfg, int(load.value) if load.kind == "sessions" else max(1, round(busiest)))
    rngs = [turn_range(v, r.breakdown, agents.get(r.backend)) for r, v in answered]
    verdicts = [verdict(v, rg, budget) for (_, v), rg in zip(answered, rngs, strict=True)]
    ranged = [rg for rg in rngs if rg is not None]
    ends = [rg or (v, v) for (_, v), rg in zip(answered, rngs, strict=True)]
    p90_range = None
    if ranged:
        p90_range = (percentile([a for a, _ in ends], 90) or 0.0, percentile([b for _, b in ends], 90) or 0.0)
    return Level(
        label=label,
        load=load,
        conversations=p.conversations,
        turns=len(counted),
        answered=len(ms),
        p50_ms=percentile(ms, 50),
        p90_ms=percentile(ms, 90),
        p99_ms=percentile(ms, 99),
        within_budget=verdicts.count("pass") / len(counted) if counted else 0.0,
        uncertain=verdicts.count("uncertain") / len(counted) if counted else 0.0,
        p90_range_ms=p90_range,
        cost_per_hour_usd=sum(r.cost_usd for r in counted) / window_s * 3600,
        window_s=window_s,
        devices=devices,
        wall_s=wall_s,
        stage_errors=res.stage_errors,
    )


@dataclass(frozen=True)
class Limit:
    label: str
    budget_ms: float
    largest_ok: Level | None  # the largest level inside the budget
    first_over: Level | None
    crossing: float | None  # load where p90 crosses the budget, linear between the two (None: not bracketed)
    # the tested levels whose p90 is inside the budget only at its range's fast end (not inside for the limit)
    uncertain: tuple[Level, ...] = ()

    def sentence(self) -> str:
        """The answer line: how much load keeps p90 inside the budget (at the slow end of the turns' ranges
        where they have them), and which loads are inside only at the fast end (uncertain)."""
        some = self.largest_ok or self.first_over
        kind = "sessions" if some is None else some.load.kind

        def unit(n: float) -> str:
            if kind != "sessions":
                return "calls/min"
            return "concurrent conversation" if n == 1 else "concurrent conversations"

        def p90(lv: Level) -> str:
            slow = "" if lv.p90_range_ms is None else f", {_ms(lv.p90_slow_ms)} at the range's slow end"
            return f"p90 {_ms(lv.p90_ms)} ms{slow}"

        unsure = ", ".join(f"{lv.load.value:g} {unit(lv.load.value)} ({p90(lv)})" for lv in self.uncertain)
        tail = f"; uncertain at {unsure}: inside only at the 80 % range's fast end" if unsure else ""
        b = f"{self.budget_ms:g} ms"
        if self.largest_ok is None:
            over = self.first_over
            at = f"{over.load.value:g} {unit(over.load.value)} ({p90(over)})" if over else "every tested load"
            return f"{self.label}: p90 is over {b} already at {at} — no tested load fits{tail}"
        ok = f"{self.largest_ok.load.value:g} {unit(self.largest_ok.load.value)}"
        if self.first_over is None:
            return f"{self.label}: {ok}, the largest load tested, keep p90 inside {b} ({p90(self.largest_ok)}){tail}"
        est = f" (≈ {self.crossing:,.0f} by linear interpolation)" if self.crossing is not None else ""
        return (
            f"{self.label}: up to {ok} keep p90 inside {b} ({p90(self.largest_ok)}); "
            f"{self.first_over.load.value:g} do not ({p90(self.first_over)}){est}{tail}"
        )


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f}"


def limit(label: str, levels: Sequence[Level], budget_ms: float) -> Limit:
    """The largest tested load whose p90 is inside the budget (at its range's slow end: ``p90_slow_ms``),
    the next tested load (outside), and a linear interpolation of the crossing between them. A missing p90
    (no answers) counts as outside; a level inside only at the range's fast end is outside and uncertain."""
    ordered = sorted(levels, key=lambda lv: lv.load.value)
    unsure = tuple(lv for lv in ordered if lv.p90_ms is not None and lv.p90_ms <= budget_ms
                   and (lv.p90_slow_ms or 0.0) > budget_ms)  # fmt: skip
    inside = [i for i, lv in enumerate(ordered) if lv.p90_slow_ms is not None and lv.p90_slow_ms <= budget_ms]
    if not inside:
        return Limit(label, budget_ms, None, ordered[0] if ordered else None, None, unsure)
    k = inside[-1]
    ok = ordered[k]
    over = ordered[k + 1] if k + 1 < len(ordered) else None
    crossing = None
    a, b = ok.p90_slow_ms, None if over is None else over.p90_slow_ms
    if over is not None and a is not None and b is not None and b > a:
        crossing = ok.load.value + (budget_ms - a) / (b - a) * (over.load.value - ok.load.value)
    return Limit(label, budget_ms, ok, over, crossing, unsure)
