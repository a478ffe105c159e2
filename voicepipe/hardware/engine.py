"""The serving simulation's event step: jobs, the piecewise-linear progress clock, the KV pool.

:class:`_State` is the engine state at one instant and the event step that moves it to its next event
(a prefill finishing, a sequence finishing, an admission, the KV pool filling: an eviction);
:class:`voicepipe.hardware.projection._Projection` runs a copy of it forward lazily, assuming no more
arrivals. :class:`voicepipe.hardware.serving.DeviceServer` (the contract is stated
there) owns one realised state and one projection.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from voicepipe.llm import LLMRequest

if TYPE_CHECKING:
    from voicepipe.hardware.serving import DeviceServer

INF = math.inf
# a step's end within this of the instant a request was taken in is the step starting then (its end comes
# a whole step later); far below any step, far above the clock's rounding
AHEAD_SLACK_NS = 1000.0


def token_v(v_join: float, i: int) -> float:
    """Progress-clock value at which the token ``i`` of a sequence that joined decode at ``v_join`` is out.

    The one place this sum is formed: the finish event and every token lookup must agree to the last bit,
    or the last token's target can round past the end of the curve (where the rate is 0) and never arrive.
    """
    return v_join + i


def prefill_split(req: LLMRequest, prompt_cache: bool = True) -> tuple[int, int]:
    """(tokens to prefill, cached tokens): cached prefix skips prefill; at least one token runs."""
    cached = min(req.cached_prompt_tokens, max(req.prompt_tokens - 1, 0)) if prompt_cache else 0
    return max(req.prompt_tokens - cached, 1), cached


@dataclass(eq=False)
class Job:
    """One request on the device; realised times (float ns) fill in as the device's past advances."""

    id: int
    req: LLMRequest
    arrive_ns: float
    prefill_tokens: int
    cached_tokens: int
    context: float
    outputs: int
    start_ns: float | None = None  # prefill started (left the queue)
    first_ns: float | None = None  # token 0 emitted (prefill done)
    v_join: float | None = None
    finish_ns: float | None = None
    cancelled: bool = False
    # prompt tokens (each at most the stack's step budget) of every request submitted before this one
    tokens_before: float = 0.0
    history: tuple[list[float], list[float], list[float]] | None = None  # own V breakpoints once done
    # evicted when the cache filled (recompute preemption, see _State): the output tokens out by each
    # eviction, and each later join as (progress offset, instant): after the k-th eviction, token
    # ``cuts[k-1]`` comes out of the re-prefill at ``joins[k-1][1]`` and token i at ``token_v(offset, i)``
    cuts: list[int] = field(default_factory=list)
    joins: list[tuple[float, float]] = field(default_factory=list)
    # where the stack forms its next batch while a step runs (Stack.schedule_ahead): the instant the
    # scheduler took the request in (_State.receive); None: its arrival, the batch formed between steps
    recv_ns: float | None = None


@dataclass
class _Curve:
    """Piecewise-linear progress clock: breakpoints (t, V) and the rate after each."""

    t: list[float] = field(default_factory=list)
    v: list[float] = field(default_factory=list)
    r: list[float] = field(default_factory=list)

    def add(self, t: float, v: float, r: float) -> None:
        if self.t and self.t[-1] == t:
            self.v[-1], self.r[-1] = v, r
        else:
            self.t.append(t)
            self.v.append(v)
            self.r.append(r)

    def time_at(self, target: float) -> float | None:
        """First time V reaches ``target`` along this curve (None if it never does)."""
        k = bisect_left(self.v, target)
        if k < len(self.v) and self.v[k] == target:
            while k > 0 and self.v[k - 1] == target:
                k -= 1
            return self.t[k]
        if k == 0:
            return None
        if self.r[k - 1] <= 0:
            # V stood still and then passed the target at the next breakpoint (events at one instant can
            # move V by a few ulps there): the target is reached at that instant
            return self.t[k] if k < len(self.v) else None
        t = self.t[k - 1] + (target - self.v[k - 1]) / self.r[k - 1]
        return min(t, self.t[k]) if k < len(self.v) else t


class _State:
    """The engine state at time ``t`` and the event step that moves it to its next event.

    A prefill step carries ``prefill`` (the prompts, or chunks of them, of one engine step: ``chunks``
    tokens each; the first may continue a prompt of which ``carry`` tokens ran in earlier steps) beside the
    decoders; ``prefill_left`` is the share of that step still to run. Which prompts share a step is the
    stack's ``prefill_token_budget`` (see :meth:`admit`).

    The KV pool (``server.kv_pool`` tokens; INF where the stack reserves a request's whole length at
    admission, or on an SRAM machine: nothing to track). A member holds its prompt and the tokens it has
    emitted, so the pool's use grows with the progress clock; a prompt in prefill holds its cache from its
    admission. A request is admitted only while its prompt fits beside that use and one more token for
    every member; when the growing caches fill the pool, the newest member is evicted (recompute
    preemption: vLLM's default, SGLang's retraction): it goes back to the head of the queue and, once it
    fits again, prefills its prompt and the tokens it had emitted, and resumes. A member alone is never
    evicted (the engine would have nothing to run; the stacks fail such a request instead).
    """

    def __init__(self, server: DeviceServer) -> None:
        self.server = server
        self.t = 0.0
        self.v = 0.0
        self.heap: list[tuple[float, int, int]] = []  # (V at which the member finishes, job id, segment)
        self.members: dict[int, Job] = {}
        self.kv = 0.0
        self.prefill: tuple[Job, ...] = ()
        self.chunks: tuple[int, ...] = ()
        self.carry = 0  # tokens of prefill[0]'s prompt run in earlier steps (chunked prefill)
        self.pending: tuple[Job, int] | None = None  # at a step's end: a split prompt and its tokens run
        self.prefill_left = 0.0  # share of the current prefill step still to run
        self.queue: deque[Job] = deque()
        # member -> (progress offset: its token i is out at token_v(off, i); its cache's context at V = 0,
        # prompt − offset; its admission count, the newest evicted first), where a pool is tracked
        self.book: dict[int, tuple[float, float, int]] = {}
        self.admitted = 0
        self.kv_base = 0.0  # Σ base over members: their caches hold kv_base + len(members)·V tokens
        self.reserved = 0.0  # cache held by the prompts in prefill (admitted, not yet decoding)
        self.redo: dict[int, int] = {}  # an evicted job -> output tokens its next prefill recomputes
        self.segment: dict[int, int] = {}  # job -> times evicted
        # the progress clock's value at the last prefill step's end: the decoders' steps end where V is
        # v0 plus whole steps' tokens (the step lattice a queued arrival waits for; see boundary_ns)
        self.v0 = 0.0
        self._step = -1.0  # step_ns() of the current batch; < 0 once the batch changed
        self._pf: tuple[int, int, int, float] = (0, 0, 0, 0.0)  # (tokens, context before, prompts, span)
        # where set (a whole run on virtual time, voicepipe.hardware.workload): every stretch between
        # events as (start ns, length ns, steps, decoders, their KV tokens, prefill tokens, their context
        # before the step, prompts in the step, mean span a prefill token attends to)
        self.trace: list[tuple[float, float, float, int, float, int, int, int, float]] | None = None

    def changed(self) -> None:
        """The batch (decoders, their KV or the prefill) changed: its step time must be looked up again."""
        self._step = -1.0

    def copy(self) -> _State:
        s = _State(self.server)
        s.t, s.v, s.kv = self.t, self.v, self.kv
        s.heap = list(self.heap)
        s.members = dict(self.members)
        s.prefill, s.chunks, s.carry = self.prefill, self.chunks, self.carry
        s.prefill_left, s._pf, s.pending = self.prefill_left, self._pf, self.pending
        s.queue = deque(self.queue)
        s.book, s.admitted, s.v0 = dict(self.book), self.admitted, self.v0
        s.kv_base, s.reserved, s.redo, s.segment = self.kv_base, self.reserved, dict(self.redo), dict(self.segment)
        s._step = self._step
        return s

    def set_prefill(self, jobs: tuple[Job, ...], chunks: tuple[int, ...], carry: int) -> None:
        """Start a prefill step of ``jobs`` (``chunks`` tokens each; ``carry`` done of the first's)."""
        self.prefill, self.chunks, self.carry = jobs, chunks, carry
        self.prefill_left = 1.0 if jobs else 0.0
        n = c = 0
        pairs = 0.0
        for i, (job, k) in enumerate(zip(jobs, chunks, strict=True)):
            before = job.cached_tokens + (carry if i == 0 else 0)
            n += k
            c += before
            pairs += k * (before + k / 2.0)
        self._pf = (n, c, len(jobs), pairs / n if n else 0.0)
        self._step = -1.0

    def paused(self) -> bool:
        """Whether the decoders wait: a prefill step runs on a stack that does not mix decodes into it."""
        return bool(self.prefill) and not self.server.prefill_mixed

    def step_ns(self) -> float:
        if self._step < 0:
            n, c, ps, span = self._pf
            if self.paused():
                self._step = self.server.step_ns(0, 0.0, n, c, ps, span)
            else:
                self._step = self.server.step_ns(len(self.members), self.kv, n, c, ps, span)
        return self._step

    def rate(self) -> float:
        """Decode progress per ns (0 when nobody decodes, or while a prefill step holds them)."""
        if not self.members or (self.prefill and not self.server.prefill_mixed):
            return 0.0
        return self.server.tokens_per_step / self.step_ns()

    def can_admit(self, job: Job) -> bool:
        """Whether ``job``, arriving now, would start its prefill at once: only on a device that runs and
        queues nothing (an engine mid-step takes a new request when that step ends: :meth:`boundary_ns`)."""
        return not (self.members or self.prefill or self.queue)  # (anything fits a device that runs nothing)

    def receive(self, job: Job) -> None:
        """Note when the scheduler takes in ``job``, which arrived while the device runs, on a stack that
        forms its next batch while a step runs (``Stack.schedule_ahead``: SGLang's overlap scheduler "runs
        one batch ahead", its event loop forming batch n + 1 and launching it before it processes batch n's
        result). Such a loop takes in new requests as each step starts; one that arrives mid-step is taken
        in when the step ends, the next step's batch is formed by then, and it starts with the batch after:
        at the end of the step that starts when it was taken in (:meth:`ready`). Else nothing to note."""
        if not self.server.schedule_ahead:
            return
        t = job.arrive_ns
        if self.prefill:  # a prefill step runs: the next starts at its end (or now, if it starts now)
            starts_now = self.prefill_left >= 1.0 and self.t >= t
            job.recv_ns = t if starts_now else max(t, self.t + self.prefill_left * self.step_ns())
        elif self.members and self.rate() > 0:  # the decoders' next step starts where the running one ends
            job.recv_ns = self.step_end(t, self.rate())[0]
        else:
            job.recv_ns = t

    def ready(self, job: Job, idle: bool) -> bool:
        """Whether ``job`` may start now: always, unless it was taken in mid-step on a stack that forms
        batches ahead (:meth:`receive`); then at a step's end after it was taken in, or at once on a device
        that runs nothing (``idle``: no batch was formed ahead of it; also where the step it waited for was
        cancelled away)."""
        recv = job.recv_ns
        return recv is None or self.t >= recv + AHEAD_SLACK_NS or (idle and self.t >= job.arrive_ns)

    def step_end(self, t_ref: float, r: float) -> tuple[float, float]:
        """(instant, V) of the decoders' first step end at or after ``t_ref`` (a step end a rounding error
        before it is that step's end): the progress clock's first ``v0 + k·E`` there (:meth:`boundary_ns`)."""
        e = self.server.tokens_per_step
        v_ref = self.v + (t_ref - self.t) * r
        steps = math.ceil((v_ref - self.v0) / e - 1e-9 * max(1.0, abs(v_ref) * 1e-3))
        v_b = max(self.v0 + e * max(steps, 0), self.v)
        return max(self.t + (v_b - self.v) / r, t_ref), v_b

    def boundary_ns(self, r: float) -> tuple[float, float]:
        """(instant, V) of the decode step's end at which the queue's head, waiting for it, starts; (INF, 0)
        where it is not waiting for a step to end (nothing queued, a prefill step running, the decoders
        paused, no slot free or its prompt does not fit: those end at events of their own).

        An engine runs in steps: the scheduler admits new requests between them (Orca's iteration-level
        scheduling, Yu et al., OSDI '22; vLLM's engine core loop, SGLang's and TensorRT-LLM's executors),
        so a request that arrives while the decoders' step runs starts with the next one. Every decode
        step advances the progress clock by the tokens a step emits, from ``v0`` (a prefill step's end),
        so the next step's end is the first such V at or after the head's arrival."""
        q = self.queue
        if not q or r <= 0 or self.prefill or len(self.members) >= self.server.max_batch or not self.fits(q[0], 0.0):
            return INF, 0.0
        recv = q[0].recv_ns  # taken in at a step's start on a stack that forms batches ahead: the next end
        return self.step_end(max(self.t, q[0].arrive_ns if recv is None else recv + AHEAD_SLACK_NS), r)

    def need(self, job: Job) -> int:
        """Prompt tokens ``job``'s prefill runs: its own, and the output it recomputes after an eviction."""
        return job.prefill_tokens + self.redo.get(job.id, 0)

    def cache(self, job: Job) -> float:
        """Cache ``job`` holds from its admission: its whole prompt (and recomputed output)."""
        return self.server.kept(job.req.prompt_tokens + self.redo.get(job.id, 0))

    def kv_used(self) -> float:
        """Cache tokens held now: the members' (prompt and output so far) and the prompts in prefill."""
        srv = self.server
        if srv.kv_pool == INF:
            return 0.0
        if srv.kv_linear:
            return self.kv_base + len(self.members) * self.v + self.reserved
        return sum(srv.kept(b + self.v) for _, b, _ in self.book.values()) + self.reserved

    def fits(self, job: Job, extra: float) -> bool:
        """Whether ``job``'s prompt fits the pool beside what is held (and ``extra`` admitted with it), with
        room for what the members emit while it prefills (their tokens per step over its steps: one, or
        one per budget's worth of a prompt split over steps); anything fits a device that runs nothing."""
        srv = self.server
        if srv.kv_pool == INF or not (self.members or self.prefill or self.pending or extra):
            return True
        steps = math.ceil(self.need(job) / srv.prefill_budget) if srv.prefill_chunked and srv.prefill_budget else 1
        spare = len(self.members) * srv.tokens_per_step * steps
        return self.kv_used() + extra + self.cache(job) + spare <= srv.kv_pool

    def full_v(self) -> float:
        """Progress-clock value at which the members' growing caches fill the pool, on a model whose local
        layers keep a window (INF: never). The use is piecewise linear in V: a member's growth slows where
        its context crosses the window, so the fill point is found walking those crossings in order. (The
        linear case, every other model, is one division: :meth:`step` does it inline, once per event.)"""
        srv = self.server
        room = srv.kv_pool - self.reserved
        v, used, slope = self.v, 0.0, 0.0
        crossings = []
        for _, b, _ in self.book.values():
            used += srv.kept(b + v)
            if v < srv.window - b:  # still inside the window: one token per token until it crosses
                slope += 1.0
                crossings.append(srv.window - b)
            else:
                slope += srv.window_slope
        for c in sorted(crossings):
            at = used + slope * (c - v)
            if at >= room:
                break
            used, v, slope = at, c, slope - (1.0 - srv.window_slope)
        if slope <= 0:
            return INF
        return max(self.v, v + (room - used) / slope)

    def join(self, job: Job, off: float) -> None:
        """``job`` decodes from here with progress offset ``off``."""
        jid = job.id
        self.members[jid] = job
        self.kv += job.context
        if self.server.kv_pool < INF:  # the pool's books (kv_used, full_v, evict)
            b = job.req.prompt_tokens - off
            self.kv_base += b
            self.admitted += 1
            self.book[jid] = (off, b, self.admitted)
        heapq.heappush(self.heap, (token_v(off, job.outputs - 1), jid, self.segment.get(jid, 0)))

    def drop(self, job: Job) -> None:
        """``job`` stops decoding (finished, cancelled or evicted)."""
        jid = job.id
        del self.members[jid]
        self.kv -= job.context
        booked = self.book.pop(jid, None)
        if booked is not None:
            self.kv_base -= booked[1]
        if not self.members:
            self.kv = self.kv_base = 0.0
        self._step = -1.0

    def release(self, job: Job) -> None:
        """``job``'s prompt leaves prefill (done or cancelled): its reservation moves to it as a member."""
        if self.reserved:
            self.reserved = max(0.0, self.reserved - self.cache(job))

    def evict(self, on: _Recorder) -> None:
        """The pool is full: the newest member goes back to the head of the queue to be recomputed."""
        book = self.book
        jid = max(book, key=lambda j: book[j][2])
        job = self.members[jid]
        # tokens out so far; a token due at this very V counts as out (a rounding tie must not decide it)
        done = min(max(math.floor(self.v - book[jid][0] + 1e-6) + 1, 1), job.outputs - 1)
        self.drop(job)
        k = self.segment.get(jid, 0) + 1
        self.segment[jid] = k
        self.redo[jid] = done
        self.queue.appendleft(job)
        on.evict(job, k, done, self.t)

    def top(self) -> tuple[float, int, int] | None:
        """The next finish on the heap (entries of members that left, or were evicted since, dropped)."""
        heap, members, segment = self.heap, self.members, self.segment
        while heap and (heap[0][1] not in members or (segment and heap[0][2] != segment.get(heap[0][1], 0))):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def admit(self, on: _Recorder) -> None:
        """Start the next prefill step, if none runs: ``pending`` (a split prompt, whose rest comes
        first), then queued prompts in arrival order while slots, the KV pool (:meth:`fits`) and the
        stack's token budget allow. Without a budget a step prefills one whole prompt. With one, the decoders' tokens come first
        (as the schedulers count them) and prompts fill the rest; a prompt that does not fit is split
        (``prefill_chunked``) or waits for the next step; the step's first prompt always runs (a chunk of
        at most the budget, or a whole prompt that exceeds it). Before an admission that empties the queue
        the recorder is told (:meth:`_Recorder.draining`): a projection's checkpoint."""
        if self.prefill or not (self.queue or self.pending):
            return
        srv, queue, pending = self.server, self.queue, self.pending
        slots = srv.max_batch - len(self.members)
        budget = srv.prefill_budget
        idle = not (self.members or pending)  # nothing runs (a batch formed ahead would hold the queue back)
        if budget is None:
            if queue and slots >= 1 and self.fits(queue[0], 0.0) and self.ready(queue[0], idle):
                if len(queue) == 1:
                    on.draining(self)
                job = queue.popleft()  # one prefill at a time: at most one admission per instant
                if srv.kv_pool < INF:
                    self.reserved += self.cache(job)
                n, c = self.need(job), job.cached_tokens
                self.prefill, self.chunks, self.carry, self.prefill_left = (job,), (n,), 0, 1.0
                self._pf, self._step = (n, c, 1, c + n / 2.0), -1.0
                if job.id not in self.redo:
                    on.start(job, self.t)
            return
        chunked = srv.prefill_chunked
        # the decoders' tokens count against the budget where they share the step
        room = budget - (len(self.members) * srv.decode_tokens if srv.prefill_mixed else 0)
        jobs: list[Job] = []
        chunks: list[int] = []
        carry = 0
        if pending is not None:
            job, carry = pending
            left = self.need(job) - carry
            take = min(left, room if room > 0 else budget)
            jobs.append(job)
            chunks.append(take)
            room -= take
            slots -= 1
        k = 0
        extra = 0.0  # cache of the prompts this step admits
        while k < len(queue) and slots >= 1 and (room > 0 or not jobs):
            job = queue[k]
            if not self.fits(job, extra) or not self.ready(job, idle):
                break
            n = self.need(job)
            if not jobs:  # the step's first prompt always runs
                take = min(n, room if room > 0 else budget) if chunked else n
            elif n <= room:
                take = n
            elif chunked:
                take = room
            else:
                break
            jobs.append(job)
            chunks.append(take)
            room -= take
            slots -= 1
            k += 1
            if srv.kv_pool < INF:
                extra += self.cache(job)
            if take < n:
                break
        if not jobs:
            return
        if k and k == len(queue):
            on.draining(self)
        self.pending = None
        self.reserved += extra
        for _ in range(k):
            job = queue.popleft()
            if job.id not in self.redo:  # a recomputed job started long ago
                on.start(job, self.t)
        self.set_prefill(tuple(jobs), tuple(chunks), carry)

    def step(self, on: _Recorder, until: float = INF) -> bool:
        """Process the next event if it falls at or before ``until``; False when there is none.

        The state stays on event instants (see :meth:`move_to`), so the realised past and every projection
        taken from it run the same float operations and agree to the last bit.
        """
        members, heap = self.members, self.heap
        top = heap[0] if heap and heap[0][1] in members and not self.segment else self.top()
        step = self.step_ns()
        r = self.server.tokens_per_step / step if members and not self.paused() else 0.0
        t_pf = self.t + self.prefill_left * step if self.prefill else INF
        if top is not None and top[0] <= self.v:
            t_fin = self.t  # due now, whatever the rate (a prefill that pauses the decoders starts after it)
        else:
            t_fin = self.t + (top[0] - self.v) / r if top is not None and r > 0 else INF
        t_kv = v_full = INF
        srv = self.server
        if r > 0 and srv.kv_pool < INF and len(members) > 1:
            if srv.kv_linear:  # the members' caches hold kv_base + n·V: full at one division
                v_full = (srv.kv_pool - self.reserved - self.kv_base) / len(members)
                if v_full < self.v:
                    v_full = self.v
            else:
                v_full = self.full_v()
            if v_full < INF:
                t_kv = self.t + (v_full - self.v) / r
        t_ev = t_pf if t_pf < t_fin else t_fin
        if t_kv < t_ev:
            t_ev = t_kv
        t_b, v_b = self.boundary_ns(r) if self.queue else (INF, 0.0)
        if t_b < t_ev:
            t_ev = t_b
        if t_ev > until or t_ev == INF:
            return False
        if t_b == t_ev and t_b < t_fin and t_b < t_kv:  # a decode step ends: the queue's head starts
            self._move(t_ev, r, step)
            if v_b > self.v:
                self.v = v_b  # the step's end itself (rounding of t may leave V a few ulps short)
            top = self.top()
            if top is not None and self.v > top[0]:
                self.v = top[0]
        elif t_kv < t_pf and t_kv < t_fin:  # the growing caches fill the pool
            self._move(t_ev, r, step)
            self.v = max(self.v, v_full)  # the fill point itself (rounding of t may leave V a few ulps short)
            top = self.top()
            if top is not None and self.v > top[0]:
                self.v = top[0]
            self.evict(on)
        elif t_pf <= t_fin:
            self._move(t_ev, r, step)
            jobs, chunks, carry = self.prefill, self.chunks, self.carry
            last = len(jobs) - 1
            done = chunks[last] + (carry if last == 0 else 0)
            if done < self.need(jobs[last]):  # a chunk: the rest of its prompt leads the next step
                self.pending = (jobs[last], done)
                jobs = jobs[:last]
            self.prefill, self.chunks, self.carry, self.prefill_left = (), (), 0, 0.0
            self._pf = (0, 0, 0, 0.0)
            self.v0 = self.v  # a step ends here: the decoders' later steps end a step's tokens apart
            for job in jobs:
                self.release(job)
                redo = self.redo.pop(job.id, None) if self.redo else None
                if redo is None:
                    on.first(job, self.t, self.v)
                    off = self.v
                else:  # an evicted job resumes: the re-prefill emits its next token
                    off = self.v - redo
                    on.rejoin(job, self.segment[job.id], self.t, off)
                if job.outputs <= 1 or (redo is not None and redo >= job.outputs - 1):
                    self.segment.pop(job.id, None)
                    on.finish(job, self.t)
                else:
                    self.join(job, off)
        else:
            assert top is not None
            target, jid, _ = heapq.heappop(self.heap)
            self._move(t_ev, r, step)
            self.v = target
            job = members[jid]
            self.drop(job)
            if self.segment:
                self.segment.pop(jid, None)
            on.finish(job, self.t)
        self._step = -1.0
        self.settle(on)
        return True

    def settle(self, on: _Recorder) -> None:
        """After an event (or a restore to one): admit what may start, and mark the instant."""
        self.admit(on)
        on.mark(self.t, self.v, self.rate())

    def run(self, until: float, on: _Recorder) -> None:
        """Process every event up to ``until`` (inclusive); the state stays at the last of them."""
        while self.step(on, until):
            pass

    def move_to(self, t: float) -> None:
        """Move the state between events to ``t`` (only where a change happens at ``t``)."""
        if t > self.t:
            step = self.step_ns()
            self._move(t, self.rate(), step)

    def _move(self, t: float, r: float, step: float) -> None:
        dt = t - self.t
        if self.members:
            self.v += r * dt
            heap = self.heap
            top = heap[0] if heap and heap[0][1] in self.members and not self.segment else self.top()
            if top is not None and self.v > top[0]:
                # rounding carried V past the next finish: that finish is due now (dt = 0), not in the past
                # (V and t stepping back would unsort the curve)
                self.v = top[0]
        if self.prefill:
            self.prefill_left = max(0.0, self.prefill_left - dt / step)
        if self.trace is not None and dt > 0 and (self.members or self.prefill):
            d, kv = (0, 0.0) if self.paused() else (len(self.members), self.kv)  # the step's own decoders
            self.trace.append((self.t, dt, dt / step, d, kv, *self._pf))
        self.t = t


class _Recorder:
    """Where the event step writes what happened: into the jobs (the realised past, with ``on_done``)."""

    def __init__(self, curve: _Curve, on_done: Callable[[Job], None] | None = None) -> None:
        self.curve = curve
        self.on_done = on_done

    def start(self, job: Job, t: float) -> None:
        job.start_ns = t

    def first(self, job: Job, t: float, v: float) -> None:
        job.first_ns, job.v_join = t, v

    def finish(self, job: Job, t: float) -> None:
        job.finish_ns = t
        if self.on_done is not None:
            self.on_done(job)

    def evict(self, job: Job, k: int, done: int, t: float) -> None:
        """``job`` was evicted for the ``k``-th time at ``t`` with ``done`` output tokens out."""
        job.cuts.append(done)

    def rejoin(self, job: Job, k: int, t: float, off: float) -> None:
        """``job`` resumes after its ``k``-th eviction: its recomputing prefill ended at ``t``."""
        job.joins.append((off, t))

    def mark(self, t: float, v: float, r: float) -> None:
        self.curve.add(t, v, r)

    def draining(self, state: _State) -> None:
        """``state`` is about to admit the last queued request (a projection's checkpoint)."""
