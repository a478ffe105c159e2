"""A shared device on virtual time: continuous batching, FCFS queue, prefix cache, speculative decoding.

The device is a fluid model of a continuous-batching engine. Between membership changes (an admission, a
prefill finishing, a sequence finishing, a cancel) its state is constant, so every decoding sequence
advances at the same rate ``E / t_step`` tokens per second, where ``t_step`` is
:func:`voicepipe.hardware.model.mixed_step_s` of the current batch (``d`` decoders, their KV tokens,
and the prompts being prefilled, if any — prefill shares the step and slows every decoder, or, on a stack
that runs its prefill steps apart (``prefill_mixed: false``, SGLang), holds them for the step) and ``E``
the expected tokens per step (1, or ``(1 − α^(γ+1)) / (1 − α)`` with speculative decoding).

That shared rate gives a single progress clock ``V(t) = ∫ E / t_step dt``: a sequence that joined decode at
``V_join`` emits token ``i`` when ``V = V_join + i``. ``V`` is piecewise linear, so token times are closed
form. Arrivals and cancels change the future, so the server keeps:

* the *realised* past — the state at its last event and the breakpoints of ``V`` so far — which never
  changes;
* a *projection* of the future assuming no more arrivals, run lazily one event at a time as far as a lookup
  needs. A request that has to queue changes nothing before the first admission after its arrival, so it
  is added to the projection there (exactly; see :class:`~voicepipe.hardware.projection._Projection`); a request that starts at once, and a cancel, begin a new projection from the realised state.
  The realised past and the projection run the same event step from the same state, so they agree to the
  last bit. On a saturated device each arrival therefore costs a few events, not a re-run of the queue.

``DeviceStream.token_time(i)`` sleeps until the projected instant of token ``i`` and re-reads the
projection when it wakes (one timer per waiting token, no background tasks); a change wakes only the waits
whose token it moved earlier (a token moved later is re-read when its old timer fires). Only a cancel can
move a token earlier: more work on the device never speeds anyone up (the step time grows with decoders,
their KV and a prefill sharing the step; tested), so a queued arrival wakes nobody. A stream still in
the queue first sleeps until a lower bound of its first token that needs no projection
(:meth:`DeviceServer.earliest_first_ns`), so a cancel on a device with a long queue re-projects only the
near future that decoding streams wait for, not the whole queue.

Admission: FCFS, at once on an idle device, else when the running step ends
(:meth:`~voicepipe.hardware.engine._State.boundary_ns`), while fewer than ``max_batch`` sequences hold
slots (at most the engine's cap on running sequences, :func:`~voicepipe.hardware.sizing.seq_cap`): one
whole prompt per step, or, on a stack with a step token budget (``prefill_token_budget``: vLLM's
``max_num_batched_tokens``, SGLang's ``chunked_prefill_size``, TensorRT-LLM's ``max_num_tokens``), as many
waiting prompts as fit beside the decoders' tokens, a prompt that does not fit split over steps where the
stack chunks (``prefill_chunked``) or left for the next step (:meth:`~voicepipe.hardware.engine._State.admit`).
On a stack that grows its caches the server also tracks its KV pool: a waiting request is admitted only
while its prompt fits, and when the members' growing caches fill the pool the newest is evicted and
recomputed later (recompute preemption; :class:`~voicepipe.hardware.engine._State`).
A request alone on the device realises exactly
``t0 + prefill_s(prompt − cached) + i · t_step(1, ctx) / E`` = :meth:`HardwareBackend.predict`.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass

from voicepipe.clock import now_ns
from voicepipe.hardware.engine import INF, Job, _Curve, _Recorder, _State, prefill_split, token_v
from voicepipe.hardware.projection import _Projection
from voicepipe.hardware.sizing import kv_capacity_tokens, mean_context, prefill_budget, seq_cap
from voicepipe.hardware.step import mixed_step_s, request_overhead_s, tokens_per_step
from voicepipe.hardware.system import Speculative, System
from voicepipe.llm import LLMRequest
from voicepipe.spans import Span, modelled_span

__all__ = ["INF", "PROJECTION_KEEP", "DeviceServer", "DeviceStream", "Job", "LoadResult", "_Projection",
           "closed_loop", "prefill_split", "token_v"]

PROJECTION_KEEP = 16384  # breakpoints + records an amended projection may hold before it is started afresh


def _always_earlier() -> int:
    return -1  # a wait without a re-read wakes on every change


class DeviceServer:
    """One simulated serving instance shared by every stream started on it: ``max_batch`` sequence slots,
    at most the engine's cap on running sequences (:func:`~voicepipe.hardware.sizing.seq_cap`)."""

    def __init__(
        self,
        system: System,
        *,
        max_batch: int,
        spec: Speculative | None = None,
        prompt_cache: bool = True,
        stage: str = "agent",
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.system = system
        cap = seq_cap(system)  # no engine runs more sequences at once than its cap
        self.max_batch = max_batch if cap is None else min(max_batch, cap)
        self.spec = spec
        self.prompt_cache = prompt_cache
        self.stage = stage
        self.tokens_per_step = tokens_per_step(spec)
        stk = system.serving
        # a step's token budget, whether prompts split over steps (None: one whole prompt a step; SRAM: none)
        self.prefill_budget = prefill_budget(system)
        self.prefill_chunked = stk.prefill_chunked and self.prefill_budget is not None
        self.prefill_mixed = stk.prefill_mixed or system.device.kind != "hbm"  # False: decoders wait
        # _State.receive; not when speculating (finishes off the step grid; SGLang < 0.5 ran it without overlap)
        self.schedule_ahead = stk.schedule_ahead if system.device.kind == "hbm" and spec is None else 0
        self.decode_tokens = 1 if spec is None else spec.gamma + 1  # tokens a decoder puts in a step
        # the KV pool the engine fills and evicts from (engine._State): tracked on a stack that grows its caches;
        # one reserving a request's whole length at admission (and an SRAM machine) never outgrows its slots
        grow = system.device.kind == "hbm" and stk.kv_admission == "grow"
        self.kv_pool = kv_capacity_tokens(system) if grow else INF
        m = system.model
        windowed = grow and stk.window_kv and m.window is not None
        self.kv_linear = not windowed  # a cache that grows by one token per token (else held() bends)
        self.window = float(m.window) if windowed and m.window is not None else INF
        self.window_slope = 1.0 - m.local_layers / m.layers if windowed else 1.0
        self._tokens_in = 0.0  # capped prompt tokens of every request submitted so far (earliest_first_ns)
        self._tokens_cancelled = 0.0  # of those cancelled while queued
        self._state = _State(self)
        self._history = _Curve()
        self._real = _Recorder(self._history, on_done=self._finalise)
        self._proj = _Projection(self._state)
        self._ids = 0
        self._step_cache: dict[tuple[int, float, int, int, int, float], float] = {}
        # sleeping token waits: future -> (deadline, re-read of that token's instant)
        self._waiters: dict[asyncio.Future[None], tuple[int, Callable[[], int]]] = {}
        # queued streams sleeping until earliest_first_ns (it falls only when a queued or prefilling request is
        # cancelled, so only such a cancel re-reads them)
        self._bound_waiters: dict[asyncio.Future[None], tuple[int, Callable[[], int]]] = {}
        self._committed = -INF  # latest token instant handed out; the past before it is fixed
        self._changed_at = -INF  # latest arrival or cancel: a later call cannot change what came before it
        self._queue_cancels = 0  # requests cancelled while queued (for earliest_first_ns)
        # the shortest a prefill step can take: one prompt token on an idle device (never shorter with more work)
        self._min_prefill_ns = float(mixed_step_s(system, 0, 0, prefill_tokens=1, spec=spec)) * 1e9

    # ------------------------------------------------------------ model

    def kept(self, context: float) -> float:
        """Cache tokens (full-token equivalents) a sequence of ``context`` holds in the pool."""
        if self.kv_linear:
            return float(context)
        return context - (1.0 - self.window_slope) * max(context - self.window, 0.0)

    def step_ns(
        self, decoders: int, kv: float, prefill: int, cached: int, prompts: int = 1, span: float | None = None
    ) -> float:
        """One step of ``decoders`` (``kv`` tokens of cache) beside ``prefill`` prompt tokens from
        ``prompts`` prompts with ``cached`` tokens of context before them (mean attended ``span``)."""
        if span is None:
            span = (cached + prefill / 2.0) / max(prompts, 1)
        key = (decoders, kv, prefill, cached, prompts, span)
        got = self._step_cache.get(key)
        if got is None:
            s = mixed_step_s(
                self.system, decoders, kv, prefill_tokens=prefill, prefill_cached=cached, spec=self.spec,
                prefill_seqs=max(prompts, 1), prefill_span=span,
            )  # fmt: skip
            got = float(s) * 1e9
            if len(self._step_cache) > 65536:
                self._step_cache.clear()
            self._step_cache[key] = got
        return got

    # ------------------------------------------------------------ membership changes

    def submit(self, req: LLMRequest, t0_ns: float) -> Job:
        """A request arrives at ``t0_ns`` (clamped to the device's realised past)."""
        t = max(float(t0_ns), self._state.t, self._changed_at, self._committed)
        self._changed_at = t
        self._advance(t)
        n, m = prefill_split(req, self.prompt_cache)
        self._ids += 1
        job = Job(
            id=self._ids,
            req=req,
            arrive_ns=t,
            prefill_tokens=n,
            cached_tokens=m,
            context=mean_context(req.prompt_tokens, req.output_tokens),
            outputs=max(req.output_tokens, 1),
            tokens_before=self._tokens_in,
        )
        self._tokens_in += self._capped(n)
        s = self._state
        if not s.can_admit(job):
            # it waits: nothing before its start changes and nothing anywhere moves earlier (more work on
            # the device only slows it), so the projection is amended and no wait needs waking
            s.receive(job)
            s.queue.append(job)
            # on a device saturated for long (or one that evicts) the projection starts afresh (the same
            # schedule, tested) rather than keep every past event
            if self._proj.size() > PROJECTION_KEEP:
                self._proj = _Projection(s)
            elif not self._proj.add_queued(job):
                # an eviction foreseen: a newer request can spare an older one (the newest is evicted),
                # so a queued arrival may move a token earlier, and the waits must re-read
                self._proj = _Projection(s)
                self._wake_moved(self._waiters)
            return job
        s.move_to(t)
        s.queue.append(job)
        s.admit(self._real)
        self._changed()
        return job

    def cancel(self, job: Job, t_ns: float | None = None) -> None:
        """Free ``job``'s slot (or queue place) from ``t_ns`` (default: now) on."""
        if job.cancelled or self._done_by(job, max(self._state.t, self._changed_at)):
            return
        # never before a token already handed out (as for arrivals): the past before it is fixed
        t = max(float(now_ns() if t_ns is None else t_ns), self._state.t, self._changed_at, self._committed)
        self._changed_at = t
        self._advance(t)
        if job.finish_ns is not None:
            return
        job.cancelled = True
        s = self._state
        s.move_to(t)
        ahead_moved = job.start_ns is None or job in s.prefill  # queued bounds behind it may fall
        if job in s.queue:
            s.queue.remove(job)
            if s.redo.pop(job.id, None) is None:  # (an evicted job is not in earliest_first_ns's count)
                self._queue_cancels += 1
                self._tokens_cancelled += self._capped(job.prefill_tokens)
        elif job in s.prefill:  # its share of the running prefill step is not done
            s.release(job)
            s.redo.pop(job.id, None)
            i = s.prefill.index(job)
            left = s.prefill_left
            jobs, chunks = s.prefill[:i] + s.prefill[i + 1 :], s.chunks[:i] + s.chunks[i + 1 :]
            s.set_prefill(jobs, chunks, 0 if i == 0 else s.carry)
            if s.prefill:
                s.prefill_left = left
        elif job.id in s.members:
            s.drop(job)
        s.segment.pop(job.id, None)
        s.changed()
        self._finalise(job)
        if not s.members:  # (decoders running: the freed room is taken when their step ends)
            s.admit(self._real)
        self._changed(bounds=ahead_moved)

    def _capped(self, tokens: int) -> float:
        """A prompt's tokens as at most one step's budget (a step carries no more, or one whole prompt)."""
        return float(tokens if self.prefill_budget is None else min(tokens, self.prefill_budget))

    def _done_by(self, job: Job, t: float) -> bool:
        return job.finish_ns is not None and job.finish_ns <= t

    def _advance(self, t: float) -> None:
        self._state.run(t, self._real)
        self._prune()

    def record(self) -> list[tuple[float, float, float, int, float, int, int, int, float]]:
        """From now on, log every stretch of the realised past between events (see ``_State.trace``):
        what a run on virtual time (:mod:`voicepipe.hardware.workload`) reads its step mix from."""
        self._state.trace = []
        return self._state.trace

    def drain(self) -> None:
        """Realise the whole future (no more arrivals): every job submitted so far finishes."""
        self._advance(INF)

    def _changed(self, bounds: bool = False) -> None:
        """The realised state moved to a change's instant: mark it, project afresh, wake moved waits
        (``bounds``: the queued streams' lower bounds too)."""
        s = self._state
        self._history.add(s.t, s.v, s.rate())
        self._proj = _Projection(s)
        self._wake_moved(self._waiters)
        if bounds:
            self._wake_moved(self._bound_waiters)

    @staticmethod
    def _wake_moved(waiters: dict[asyncio.Future[None], tuple[int, Callable[[], int]]]) -> None:
        # a wait whose instant moved later keeps its timer (it re-reads when that fires); only one whose
        # instant moved earlier must wake now — the same instants as waking every wait, without B wake-ups
        for fut, (deadline, reread) in waiters.items():
            if fut.done():
                continue
            try:
                moved_earlier = reread() < deadline
            except Exception:  # let the wait itself raise it, in its own task
                moved_earlier = True
            if moved_earlier:
                fut.set_result(None)

    def _prune(self) -> None:
        """Forget realised breakpoints no live member can need (finished jobs keep their own copy)."""
        h = self._history
        if len(h.t) < 4096:
            return
        s = self._state
        live = (*s.members.values(), *s.prefill, *s.queue)  # an evicted job's earlier tokens stay readable
        joins = [j.v_join for j in live if j.v_join is not None]
        floor_v = min(joins) if joins else self._state.v
        k = max(0, bisect_left(h.v, floor_v) - 1)
        if k > 0:
            del h.t[:k], h.v[:k], h.r[:k]

    def _finalise(self, job: Job) -> None:
        """Keep a finished/cancelled job's own slice of the realised curve, up to the current instant.

        Called at the finish (or cancel) instant, before that instant's breakpoint is marked, so the slice
        gets it appended here, at the rate the job last saw: a finished job's last token then lands exactly
        on ``finish_ns``, and a cancelled job's unproduced tokens keep following its last decode rate.
        """
        if job.history is not None or job.v_join is None:
            return
        h, s = self._history, self._state
        k = max(0, bisect_left(h.v, job.v_join) - 1)
        t, v, r = h.t[k:], h.v[k:], h.r[k:]
        if not t or s.t > t[-1]:
            t.append(s.t)
            v.append(s.v)
            r.append(r[-1] if r else 0.0)
        job.history = (t, v, r)

    # ------------------------------------------------------------ lookups (realised, else projected)

    def first_ns(self, job: Job) -> float:
        if job.first_ns is not None:
            return job.first_ns
        got = self._proj.reach(self._proj.first_at, job.id)
        return INF if got is None else got

    def start_ns(self, job: Job) -> float:
        if job.start_ns is not None:
            return job.start_ns
        got = self._proj.reach(self._proj.start_at, job.id)
        return INF if got is None else got

    def token_ns(self, job: Job, i: int) -> float:
        """Projected (or realised) instant of output token ``i`` of ``job`` (float ns).

        INF only for a job that never joined decode (cancelled in the queue or in prefill). The last token
        is the finish itself; an earlier one lies on the progress clock before it, at the offset of the
        stretch of decoding it falls in (a job evicted and recomputed resumes at a new offset, and the
        token its re-prefill emits comes out when that ends: ``Job.cuts``, ``Job.joins``).
        """
        i = min(max(i, 0), job.outputs - 1)
        if i == 0:
            return self.first_ns(job)
        if job.history is not None:  # finished or cancelled: its own slice of the realised curve
            assert job.v_join is not None
            k = bisect_right(job.cuts, i)
            if k == 0:
                off = job.v_join
            elif k <= len(job.joins):
                off, t_join = job.joins[k - 1]
                if i == job.cuts[k - 1]:
                    return t_join
            else:  # cancelled while waiting to be recomputed: its remaining tokens resolve at the cancel
                return job.history[0][-1]
            return self._on(_Curve(*job.history), token_v(off, i), job.finish_ns)
        if job.finish_ns is not None and i == job.outputs - 1:
            return job.finish_ns
        proj = self._proj
        if i == job.outputs - 1:
            got = proj.reach(proj.finish_at, job.id)
            return INF if got is None else float(got)
        k, start = 0, 0  # the stretch of decoding (after k evictions) and its first token
        while True:
            real = k < len(job.cuts) or (job.v_join is not None and k == 0) or 0 < k <= len(job.joins)
            if k == 0:
                off = job.v_join if job.v_join is not None else proj.reach(proj.v_join, job.id)
            else:
                got = job.joins[k - 1] if k <= len(job.joins) else proj.reach(proj.rejoin_at, (job.id, k))
                if got is None:
                    return INF
                off, t_join = got
                if i == start:
                    return float(t_join)
            if off is None:
                return INF
            target = token_v(off, i)
            cut = job.cuts[k] if k < len(job.cuts) else None
            if cut is None:
                if real and target <= self._state.v:
                    t = self._history.time_at(target)
                    if t is not None:
                        return t
                proj.reach_v(target)
                cut = proj.cut_at.get((job.id, k + 1))  # its eviction, if the projection has it by now
            if cut is not None and i >= cut:
                k, start = k + 1, cut
                continue
            if real and target <= self._state.v:
                t = self._history.time_at(target)
                if t is not None:
                    return t
            t = proj.curve.time_at(target)
            return INF if t is None else t

    @staticmethod
    def _on(curve: _Curve, target: float, finish: float | None) -> float:
        """When ``curve`` reaches ``target``, capped at the sequence's ``finish`` (its last token)."""
        t = curve.time_at(target)
        if finish is None:
            return INF if t is None else t
        return finish if t is None else min(t, finish)

    def finish_ns(self, job: Job) -> float:
        if job.finish_ns is not None:
            return job.finish_ns
        return self.token_ns(job, job.outputs - 1)

    def earliest_first_ns(self, job: Job) -> int | None:
        """A lower bound on a still-queued job's first token, found without projecting (None once it left
        the queue). From the last change on, the prefill step running then ends first (no sooner than
        the latest start among its prompts plus the shortest step); then the requests ahead of the job and
        its own prefill take at least one step each without a step budget (one prompt a step), or at
        least their prompt tokens over the budget with one (each prompt counted at most at the budget, as
        one alone in a step may exceed it), each at least the shortest step. A stream deep in a long queue
        sleeps until this bound instead of projecting the whole queue ahead of it after every cancel; it
        projects once the bound is reached. The bound never rises above the true instant: more work, or
        a request arriving later, never starts anyone sooner."""
        s = self._state
        if job.start_ns is not None or job.cancelled or not s.queue or s.redo:
            return None  # (an evicted job ahead, started long ago, breaks the FCFS counts below)
        head = s.queue[0]
        # the realised state holds every event up to the last change; a prefill still running then ends
        # after it, and no sooner than its start plus the shortest prefill
        t = max(s.t, self._changed_at)
        starts = [pf.start_ns for pf in s.prefill if pf.start_ns is not None]
        if starts:
            t = max(t, max(starts) + self._min_prefill_ns)
        if self.prefill_budget is None:
            ahead = max(0, job.id - head.id - self._queue_cancels)  # ids rise along the FCFS queue
            steps = ahead + 1
        else:
            tokens = job.tokens_before + self._capped(job.prefill_tokens) - head.tokens_before
            steps = max(1, math.ceil((tokens - self._tokens_cancelled) / self.prefill_budget - 1e-9))
        return math.floor(t + steps * self._min_prefill_ns)

    # ------------------------------------------------------------ live streams

    def open(self, req: LLMRequest, t0_ns: int) -> DeviceStream:
        """Start ``req``: it reaches the engine after the stack's per-request cost (tokenise, admit)."""
        arrive = t0_ns + round(request_overhead_s(self.system) * 1e9)
        return DeviceStream(self, self.submit(req, arrive), int(t0_ns), arrive)

    async def wait_change_or(
        self, deadline_ns: int, reread: Callable[[], int] | None = None, *, bound: bool = False
    ) -> None:
        """Sleep until ``deadline_ns`` or until the schedule changes, whichever is first (with ``reread``,
        the instant waited for: until a change moves it earlier than ``deadline_ns``; ``bound``: a queued
        stream's :meth:`earliest_first_ns`)."""
        waiters = self._bound_waiters if bound else self._waiters
        delay = (deadline_ns - now_ns()) / 1e9
        if delay <= 0:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        handle = loop.call_later(delay, wake)
        waiters[fut] = (deadline_ns, reread or _always_earlier)
        try:
            await fut
        finally:
            handle.cancel()
            waiters.pop(fut, None)

    def commit(self, t_ns: int) -> None:
        self._committed = max(self._committed, float(t_ns))

    def load(self) -> dict[str, int]:
        s = self._state
        return {"decoding": len(s.members), "prefilling": len(s.prefill), "queued": len(s.queue)}


class DeviceStream:
    """A :class:`voicepipe.backends.base.TokenStream` on a shared :class:`DeviceServer`.

    After :meth:`cancel` the device no longer spends work on the request; tokens that had a realised
    decode rate keep following it (like ``ScheduledStream``), others resolve at once.
    """

    def __init__(self, server: DeviceServer, job: Job, t0_ns: int, ready_ns: int | None = None) -> None:
        self.server = server
        self.job = job
        self.t0_ns = t0_ns
        self.ready_ns = t0_ns if ready_ns is None else ready_ns  # after the stack's per-request cost
        self._got: dict[int, int] = {}

    def at_ns(self, i: int) -> int:
        """Best current knowledge of token ``i``'s instant (int ns; later arrivals may delay it)."""
        if i in self._got:
            return self._got[i]
        t = self.server.token_ns(self.job, i)
        if t == INF:
            if self.job.cancelled:
                return max(now_ns(), self.t0_ns)
            raise RuntimeError(f"token {i} of {self.job.req.session}/{self.job.req.turn} has no schedule")
        return round(t)

    async def token_time(self, i: int) -> int:
        if i in self._got:
            return self._got[i]
        server, job = self.server, self.job
        while True:
            bound = server.earliest_first_ns(job)
            if bound is not None and bound > now_ns():  # deep in a queue: no projection needed yet
                await server.wait_change_or(bound, lambda: server.earliest_first_ns(job) or -1, bound=True)
                continue
            t = self.at_ns(i)
            if now_ns() >= t:
                break

            def reread() -> int:
                return self.at_ns(i)

            await server.wait_change_or(t, reread)
        self._got[i] = t
        self.server.commit(t)
        return t

    def spans(self, upto_token: int) -> list[Span]:
        stage = self.server.stage
        first = self.at_ns(0)
        began = self.server.start_ns(self.job)
        start = first if began == INF else min(max(round(began), self.t0_ns), first)
        out: list[Span] = []
        if start > self.ready_ns:  # waited for a slot (the per-request cost alone is part of TTFT)
            out.append(modelled_span(stage, "queue", self.t0_ns, start - self.t0_ns))
        else:
            start = self.t0_ns
        out.append(modelled_span(stage, "ttft", start, first - start))
        end = self.at_ns(upto_token)
        if end > first:
            out.append(modelled_span(stage, "decode", first, end - first))
        return out

    def cancel(self) -> None:
        if self.job.outputs - 1 in self._got:
            # every token handed out: the request ends on its own (a reader that is done drops nothing);
            # token times are whole ns, so a cancel "now" would land under 1 ns before the job's finish
            # and re-project the whole device for nothing (~5 % of an H100 turn at 200 sessions)
            return
        self.server.cancel(self.job)


@dataclass(frozen=True)
class LoadResult:
    """Outcome of a closed-loop load run on virtual time (see :func:`closed_loop`)."""

    clients: int
    requests: int
    duration_s: float
    output_tokens: int
    mean_ttft_s: float
    mean_user_tokens_per_s: float  # decode rate one user sees (tokens 1.. over their decode time)

    @property
    def aggregate_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s


def closed_loop(
    server: DeviceServer,
    clients: int,
    requests_per_client: int,
    prompt_tokens: int,
    output_tokens: int,
    cached_prompt_tokens: int = 0,
) -> LoadResult:
    """``clients`` users each send a request as soon as their previous one finished (virtual time only),
    reaching the engine the per-request cost later (as :meth:`DeviceServer.open`); TTFT counts from the send.

    A finish is final once no arrival precedes it, so the run walks arrivals and finishes in time order.
    """
    lead = round(request_overhead_s(server.system) * 1e9)
    pending: list[tuple[float, int, int]] = [(float(lead), c, 0) for c in range(clients)]
    active: dict[int, tuple[Job, int]] = {}
    done: list[Job] = []
    while pending or active:
        fin = min(((server.finish_ns(j), c) for c, (j, _) in active.items()), default=(INF, -1))
        arrival = pending[0][0] if pending else INF
        if active and fin[0] <= arrival:
            job, k = active.pop(fin[1])
            done.append(job)
            if k + 1 < requests_per_client:
                heapq.heappush(pending, (fin[0] + lead, fin[1], k + 1))
            continue
        t, c, k = heapq.heappop(pending)
        req = LLMRequest(f"u{c}", k, prompt_tokens, output_tokens, cached_prompt_tokens)
        active[c] = (server.submit(req, t), k)
    end = max(server.finish_ns(j) for j in done)
    ttft = [server.first_ns(j) - j.arrive_ns + lead for j in done]
    rates = [
        (j.outputs - 1) / ((server.finish_ns(j) - server.first_ns(j)) / 1e9) for j in done if j.outputs > 1
    ]
    return LoadResult(
        clients=clients,
        requests=len(done),
        duration_s=end / 1e9,
        output_tokens=sum(j.outputs for j in done),
        mean_ttft_s=sum(ttft) / len(ttft) / 1e9,
        mean_user_tokens_per_s=sum(rates) / len(rates) if rates else INF,
    )

