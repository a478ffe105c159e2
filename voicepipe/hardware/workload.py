"""Whole runs of the serving simulation on virtual time: the one engine every modelled number comes from.

A run drives the event step of a :class:`~voicepipe.hardware.serving.DeviceServer` (its own engine state,
the server's step times, slots and speculative setting) through a whole workload; what it reports is read from the jobs' realised instants and from the log of
every stretch between events (decoders, their KV, the prompts being prefilled, and how many steps ran):

* :func:`static_batch` — ``B`` equal requests arriving together at t = 0 (a burst: MLPerf Offline, a
  throughput benchmark at infinite rate); every job is measured;
* :func:`steady` — ``N`` clients each holding one request in flight, sending the next as the last one
  finishes (a max-concurrency benchmark client), for ``rounds`` rounds; the rounds after the first are
  measured (the first is the burst that fills the device). One client for one round is a request alone.
* :func:`open_loop` — ``N`` requests sent at ``rate`` a second whatever the server does (a benchmark client
  at a request rate: Poisson arrivals from fixed seeds, or evenly spaced); every job is measured, and a
  queue grows where the rate outruns the device.

Requests are equal (``lengths="fixed"``) or draw their own prompt and output lengths around the stated
means (:func:`request_lengths`: ``uniform``, a benchmark client's random dataset at range ratio 0;
``exponential``, a dataset whose per-request lengths are not published), so the cache holds what such a
mix holds and a burst ends with its longest requests; the figures then use the stated mean output.

Every figure of a :class:`Run` is a weighted sum of the stretches' step times (:meth:`Run.weights`), so a
fit can re-time the same step mix under other constants without re-running (``validate.fit``); the run's
own figures use its own step times. Times include the stack's per-request cost (``request_s``), which the
server charges before a request reaches the engine.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from voicepipe.hardware.engine import INF, Job, _Curve, _Recorder, _State, prefill_split
from voicepipe.hardware.serving import DeviceServer
from voicepipe.hardware.sizing import mean_context
from voicepipe.hardware.step import request_overhead_s
from voicepipe.hardware.system import FArray
from voicepipe.llm import LLMRequest

Figure = Literal["ttft", "e2e", "tpot", "decode_step", "duration"]
Lengths = Literal["fixed", "uniform", "exponential"]
LENGTH_SEEDS = (1, 2)  # the fixed shuffles of the prompt and the output lengths (a run is deterministic)


def request_lengths(kind: Lengths, n: int, prompt_tokens: int, output_tokens: int) -> list[tuple[int, int]]:
    """``n`` requests' (prompt, output) lengths around the stated means.

    ``fixed``: every request the means. ``uniform``: each length uniform over 1 … 2·mean − 1, what a
    benchmark client's random dataset draws at range ratio 0 (SGLang ``bench_serving --dataset-name random``:
    ``np.random.randint(max(int(L · ratio), 1), L + 1)`` per request, mean ≈ L / 2). ``exponential``: the
    maximum-entropy distribution of a positive length with a known mean, for a dataset sampled per request
    whose per-request lengths the source does not publish (ShareGPT under ``vllm bench serve``): an
    assumption, not a measured shape (docs/hardware-model.md §3, "Lengths that vary"). Deterministic:
    stratified quantiles ``(i + ½) / n`` rescaled to the stated mean, prompt and output each shuffled with
    a fixed seed (so long prompts are not paired with long outputs)."""
    if kind == "fixed" or n < 1:
        return [(prompt_tokens, output_tokens)] * max(n, 0)
    u = (np.arange(n) + 0.5) / n

    def draw(mean: int, seed: int, floor: int) -> list[int]:
        if mean <= floor:
            return [mean] * n
        v = 1.0 + u * (2.0 * mean - 2.0) if kind == "uniform" else -np.log1p(-u)
        v = v * (mean / float(v.mean()))
        out = np.maximum(floor, np.rint(v)).astype(int)
        return [int(x) for x in np.random.default_rng(seed).permutation(out)]

    prompts = draw(prompt_tokens, LENGTH_SEEDS[0], 1)
    outputs = draw(output_tokens, LENGTH_SEEDS[1], 2)  # at least one token after the first
    return list(zip(prompts, outputs, strict=True))


@dataclass(frozen=True)
class Run:
    """A realised run: its measured jobs, and every stretch between events (arrays, one entry each)."""

    jobs: tuple[Job, ...]  # measured
    request_s: float  # the stack's per-request cost (charged before the engine)
    clients: int  # requests in flight (steady) or in the burst (static)
    output_tokens: int
    start: FArray  # stretch start (ns)
    length: FArray  # stretch length (ns)
    steps: FArray  # engine steps in the stretch
    decoders: FArray
    kv: FArray
    prefill: FArray  # prompt tokens the step prefills
    cached: FArray  # their context before the step (cached prefixes, earlier chunks)
    prompts: FArray  # prompts (or chunks) in the step
    span: FArray  # mean context a prefill token attends to
    waiting: FArray  # measured jobs arrived and still without their first token
    decoding: FArray  # measured jobs past their first token and not finished
    idle_s: float = 0.0  # time in the run with nothing on the device (an open loop's gaps between arrivals)
    draws: int = 1  # realisations read as one run (an open loop's Poisson draws): a duration is their mean

    def weights(self, figure: Figure) -> FArray:
        """Per-stretch weights ``w`` with ``figure = Σ w · t_step (+ request_s for ttft, e2e)`` (seconds)."""
        n = max(len(self.jobs), 1)
        if figure == "ttft":
            return self.steps * self.waiting / n
        if figure == "e2e":
            return self.steps * (self.waiting + self.decoding) / n
        if figure == "tpot":
            return self.steps * self.decoding / (n * max(self.output_tokens - 1, 1))
        if figure == "decode_step":  # the median gap between the measured jobs' tokens
            return self._median_gap()
        return self.steps / self.draws  # duration: the whole run (a realisation's, on the mean)

    def _median_gap(self) -> FArray:
        """Weights that pick the median inter-token gap of the measured jobs. Every step a measured job
        emits a token in is one gap of that step's length (a step that also prefills a chunk is a longer
        gap). A prefill step run apart (its decoders wait, ``decoders == 0``) emits nothing: it lengthens
        the gap its waiting jobs are in, to its own length plus an emitting step's (their mean), and that
        many of the plain gaps are gone. The median is the gap length at half the gaps' weight (``steps ×
        decoding``), as one-hot weights on its stretch (with a paused step's, the emitting stretches' mean
        beside it); a re-timed fit keeps the choice (the step mix is the run's)."""
        step = self.step_s()
        jobs = self.steps * self.decoding
        emit = jobs * (self.decoders > 0)
        paused = jobs * ((self.decoders == 0) & (self.prefill > 0))
        total_emit, total_paused = float(emit.sum()), float(paused.sum())
        if total_emit <= 0:  # no measured token after a first one: the mean of whatever the jobs saw
            return jobs / max(float(jobs.sum()), 1e-300)
        mean_emit = emit / total_emit  # weights of an emitting step's mean length
        lengthened = min(total_paused, total_emit)  # gaps a paused step lengthens (at most one each)
        length = np.concatenate([step, step + float((mean_emit * step).sum())])
        weight = np.concatenate([emit * (1.0 - lengthened / total_emit),
                                 paused * (lengthened / total_paused if total_paused > 0 else 0.0)])  # fmt: skip
        order = np.argsort(length, kind="stable")
        cum = np.cumsum(weight[order])
        pick = int(order[int(np.searchsorted(cum, 0.5 * cum[-1]))])
        n = len(step)
        out = np.zeros_like(step)
        if pick < n:
            out[pick] = 1.0
            return out
        out[pick - n] = 1.0
        return out + mean_emit

    def step_s(self) -> FArray:
        """The realised step time of each stretch (s)."""
        return self.length / np.maximum(self.steps, 1e-300) / 1e9

    def figure(self, figure: Figure) -> float:
        x = float((self.weights(figure) * self.step_s()).sum())
        return x + self.added_s(figure)

    def added_s(self, figure: Figure) -> float:
        """What a figure adds to its weighted steps: the per-request cost (TTFT, e2e, duration) and, for
        the whole run's duration, the time nothing ran."""
        if figure == "duration":
            return self.request_s + self.idle_s / self.draws
        return self.request_s if figure in ("ttft", "e2e") else 0.0

    @property
    def ttft_s(self) -> float:
        return self.figure("ttft")

    @property
    def tpot_s(self) -> float:
        return self.figure("tpot")

    @property
    def e2e_s(self) -> float:
        return self.figure("e2e")


class _Driver(_Recorder):
    """Realises a whole run on an engine state of its own, no projections: a client sends its next request
    the instant its last one finishes, and the request reaches the engine the stack's per-request cost
    later, as through :meth:`DeviceServer.open`; there it is taken as :meth:`DeviceServer.submit` takes
    it (at once on a device that runs nothing, else at the end of the running step or later)."""

    def __init__(self, server: DeviceServer, rounds: int) -> None:
        super().__init__(_Curve())
        self.server = server
        self.state = _State(server)
        self.state.trace = []
        self.rounds = rounds
        self.jobs: list[tuple[Job, int]] = []  # (job, round)
        self.prompt = self.output = self.cached = 0
        self.lengths: list[tuple[int, int]] = []  # per request in submission order (empty: all equal)
        self.request_ns = request_overhead_s(server.system) * 1e9
        self.sent: list[tuple[float, int, int, int]] = []  # heap: (reaches the engine, order, client, round)

    def mark(self, t: float, v: float, r: float) -> None:
        pass  # the run reads its stretches from the trace, not the curve

    def add(self, client: int, k: int, t: float) -> None:
        p, o = self.lengths[len(self.jobs) % len(self.lengths)] if self.lengths else (self.prompt, self.output)
        req = LLMRequest(f"u{client}", k, p, o, self.cached)
        n, m = prefill_split(req, self.server.prompt_cache)
        job = Job(id=len(self.jobs) + 1, req=req, arrive_ns=t, prefill_tokens=n, cached_tokens=m,
                  context=mean_context(p, o), outputs=max(o, 1))  # fmt: skip
        self.jobs.append((job, k))
        self.state.queue.append(job)

    def finish(self, job: Job, t: float) -> None:
        job.finish_ns = t
        k = job.req.turn
        if k + 1 < self.rounds:
            heapq.heappush(self.sent, (t + self.request_ns, len(self.sent) + len(self.jobs), int(job.req.session[1:]), k + 1))

    def arrive(self, t: float, client: int, k: int) -> None:
        """A request reaches the engine at ``t``: it starts at once or waits in the queue."""
        s = self.state
        s.move_to(t)  # a stretch starts at every arrival (the run counts a job as arrived from a stretch's start)
        self.add(client, k, t)
        job = s.queue.pop()
        admit = s.can_admit(job)
        if not admit:
            s.receive(job)
        s.queue.append(job)
        if admit:
            s.admit(self)

    def drive(self) -> None:
        """Every event and every sent request in time order, until nothing is left."""
        s, sent = self.state, self.sent
        while True:
            until = sent[0][0] if sent else INF
            if s.step(self, until):
                continue
            if not sent:
                return
            t, _, client, k = heapq.heappop(sent)
            self.arrive(t, client, k)

    def run(self, clients: int, prompt_tokens: int, output_tokens: int, measure_from: int, cached: int = 0,
            lengths: Lengths = "fixed") -> Run:  # fmt: skip
        self.prompt, self.output, self.cached = prompt_tokens, output_tokens, cached
        if lengths != "fixed":  # every request this run submits (a steady run's rounds too) has its own
            self.lengths = request_lengths(lengths, clients * self.rounds, prompt_tokens, output_tokens)
        for c in range(clients):
            self.add(c, 0, 0.0)
        self.state.admit(self)
        self.drive()
        measured = [j for j, k in self.jobs if k >= measure_from]
        if lengths != "fixed" and self.rounds > 1:
            # varied lengths fall out of step: once the first client has sent its last request the load
            # drains and the long requests left run alone, faster. Only requests done while every client
            # still had one in flight count (equal requests stay in step: they all end together)
            end = min(float(j.finish_ns or 0.0) for j, k in self.jobs if k == self.rounds - 1)
            measured = [j for j in measured if float(j.finish_ns or 0.0) <= end] or measured
        return _run(self.server, self.state.trace or [], measured, clients, output_tokens)


class _Arrivals(_Driver):
    """Realises an open loop: requests arrive at the given instants whatever the server does, and each is
    taken as :meth:`DeviceServer.submit` would take it (admitted at once on an idle device, else queued
    for the running step's end or a free slot)."""

    def __init__(self, server: DeviceServer) -> None:
        super().__init__(server, rounds=1)

    def arrivals(self, times_s: Sequence[float], prompt_tokens: int, output_tokens: int,
                 lengths: Lengths = "fixed") -> Run:  # fmt: skip
        self.prompt, self.output = prompt_tokens, output_tokens
        if lengths != "fixed":
            self.lengths = request_lengths(lengths, len(times_s), prompt_tokens, output_tokens)
        s = self.state
        for i, at in enumerate(times_s):
            t = float(at) * 1e9
            s.run(t, self)
            self.arrive(t, i, 0)
        s.run(INF, self)
        measured = [j for j, _ in self.jobs]
        run = _run(self.server, s.trace or [], measured, len(measured), output_tokens)
        wall = max((float(j.finish_ns or 0.0) for j in measured), default=0.0) / 1e9
        busy = float(run.length.sum()) / 1e9
        return replace(run, idle_s=max(0.0, wall - busy))


def _run(server: DeviceServer, trace: list[tuple[float, float, float, int, float, int, int, int, float]],
         measured: list[Job], clients: int, output_tokens: int) -> Run:  # fmt: skip
    cols = np.array(trace, dtype=float).reshape(-1, 9).T
    start = cols[0]
    first = np.sort([float(j.first_ns or 0.0) for j in measured])
    arrive = np.sort([j.arrive_ns for j in measured])
    finish = np.sort([float(j.finish_ns or 0.0) for j in measured])
    # a stretch lies between events, so a job's state is constant over it: count at its start
    arrived = np.searchsorted(arrive, start, side="right")
    firsted = np.searchsorted(first, start, side="right")
    finished = np.searchsorted(finish, start, side="right")
    return Run(
        jobs=tuple(measured), request_s=request_overhead_s(server.system), clients=clients,
        output_tokens=output_tokens, start=start, length=cols[1], steps=cols[2], decoders=cols[3],
        kv=cols[4], prefill=cols[5], cached=cols[6], prompts=cols[7], span=cols[8],
        waiting=(arrived - firsted).astype(float), decoding=(firsted - finished).astype(float),
    )  # fmt: skip


def static_batch(server: DeviceServer, batch: int, prompt_tokens: int, output_tokens: int,
                 lengths: Lengths = "fixed") -> Run:  # fmt: skip
    """``batch`` requests (equal, or of ``lengths`` around the means) arriving together at t = 0; the server
    admits what its slots allow."""
    return _Driver(server, rounds=1).run(batch, prompt_tokens, output_tokens, measure_from=0, lengths=lengths)


# a steady run of varied lengths: at least this many rounds and requests, the first quarter of the rounds
# not measured (the clients leave the burst's lock-step only over several requests each)
VARIED_ROUNDS, VARIED_REQUESTS = 32, 2000


def steady(
    server: DeviceServer, clients: int, prompt_tokens: int, output_tokens: int, rounds: int = 2,
    lengths: Lengths = "fixed",
) -> Run:
    """``clients`` users each send a request as soon as their previous one finished, ``rounds`` times;
    with more than one round the first (the burst that fills the device) is not measured. Requests of
    varied lengths run at least VARIED_ROUNDS rounds and VARIED_REQUESTS requests, the first quarter of
    the rounds unmeasured, and count while every client is still sending (:meth:`_Driver.run`): the load
    a benchmark client holds, not the burst's lock-step nor the drain at its end."""
    warm = min(1, rounds - 1)
    if lengths != "fixed" and rounds > 1:
        rounds = max(rounds, VARIED_ROUNDS, math.ceil(VARIED_REQUESTS / max(clients, 1)))
        warm = rounds // 4
    return _Driver(server, rounds).run(clients, prompt_tokens, output_tokens, measure_from=warm,
                                       lengths=lengths)  # fmt: skip


POISSON_REQUESTS = 2000  # an open loop's Poisson draws: realisations enough for this many requests ...
POISSON_DRAWS = 16  # ... but at most this many


def open_loop(server: DeviceServer, requests: int, rate: float, prompt_tokens: int, output_tokens: int,
              poisson: bool = True, lengths: Lengths = "fixed") -> Run:  # fmt: skip
    """``requests`` equal requests sent at ``rate`` a second from t = 0 whatever the server does (an
    open-loop benchmark client), all measured. ``poisson``: exponential gaps of mean ``1 / rate`` (what
    bench_serving, genai-perf and Triton's perf_analyzer send), drawn from fixed seeds 0, 1, ... — as many
    realisations as give POISSON_REQUESTS requests (at most POISSON_DRAWS), each run on its own and read as
    one run: TTFT, end-to-end, time per token and a realisation's duration are means over them, the
    median gap is over all their gaps pooled (the clumping's queueing included, a single draw's luck not);
    else one arrival every ``1 / rate`` seconds."""
    if requests < 1 or rate <= 0:
        raise ValueError(f"an open loop needs requests >= 1 and a rate > 0, not {requests} at {rate}")
    if not poisson:
        return _Arrivals(server).arrivals([i / rate for i in range(requests)], prompt_tokens, output_tokens,
                                          lengths)  # fmt: skip
    draws = max(1, min(POISSON_DRAWS, math.ceil(POISSON_REQUESTS / requests)))
    runs = []
    for seed in range(draws):
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=requests)
        times = np.concatenate([[0.0], np.cumsum(gaps[:-1])])  # the first request goes at once
        runs.append(_Arrivals(server).arrivals(times.tolist(), prompt_tokens, output_tokens, lengths))
    return _joined(runs)


def _joined(runs: list[Run]) -> Run:
    """Equal runs read as one: their jobs and stretches together, their idle time summed, ``draws`` the
    count (a duration is a realisation's on the mean; ``clients`` one realisation's)."""
    if len(runs) == 1:
        return runs[0]
    cat = {f: np.concatenate([getattr(r, f) for r in runs]) for f in
           ("start", "length", "steps", "decoders", "kv", "prefill", "cached", "prompts", "span", "waiting", "decoding")}  # fmt: skip
    first = runs[0]
    return Run(jobs=tuple(j for r in runs for j in r.jobs), request_s=first.request_s, clients=first.clients,
               output_tokens=first.output_tokens, idle_s=sum(r.idle_s for r in runs), draws=len(runs), **cat)  # fmt: skip


def alone(server: DeviceServer, req: LLMRequest) -> Run:
    """``req`` alone on the device (its cached prefix honoured as the server's ``prompt_cache`` says)."""
    return _Driver(server, rounds=1).run(1, req.prompt_tokens, req.output_tokens, 0, req.cached_prompt_tokens)


def throughput(run: Run, static: bool) -> float:
    """Output tokens per second of the whole device: a burst's tokens over its length; a steady run's
    ``clients · O`` per request lifetime (Little's law: N in flight, each for e2e)."""
    if static:
        return run.clients * run.output_tokens / run.figure("duration")
    return run.clients * run.output_tokens / run.e2e_s
