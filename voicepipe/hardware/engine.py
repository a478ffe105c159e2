"""The serving simulation's event step: jobs, the piecewise-linear progress clock, and projections.

:class:`_State` is the engine state at one instant and the event step that moves it to its next event
(a prefill finishing, a sequence finishing, an admission); :class:`_Projection` runs a copy of it forward
lazily, assuming no more arrivals. :class:`voicepipe.hardware.serving.DeviceServer` (the contract is stated
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
            return None
        return self.t[k - 1] + (target - self.v[k - 1]) / self.r[k - 1]


class _State:
    """The engine state at time ``t`` and the event step that moves it to its next event.

    A prefill step carries ``prefill`` (the prompts, or chunks of them, of one engine step: ``chunks``
    tokens each; the first may continue a prompt of which ``carry`` tokens ran in earlier steps) beside the
    decoders; ``prefill_left`` is the share of that step still to run. Which prompts share a step is the
    stack's ``prefill_token_budget`` (see :meth:`admit`).
    """

    def __init__(self, server: DeviceServer) -> None:
        self.server = server
        self.t = 0.0
        self.v = 0.0
        self.heap: list[tuple[float, int]] = []  # (V at which the member finishes, job id)
        self.members: dict[int, Job] = {}
        self.kv = 0.0
        self.prefill: tuple[Job, ...] = ()
        self.chunks: tuple[int, ...] = ()
        self.carry = 0  # tokens of prefill[0]'s prompt run in earlier steps (chunked prefill)
        self.pending: tuple[Job, int] | None = None  # at a step's end: a split prompt and its tokens run
        self.prefill_left = 0.0  # share of the current prefill step still to run
        self.queue: deque[Job] = deque()
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

    def can_admit(self) -> bool:
        """Whether a request arriving now would start its prefill at once (nothing ahead, a slot free)."""
        return not self.prefill and not self.queue and len(self.members) + 1 <= self.server.max_batch

    def admit(self, on: _Recorder) -> None:
        """Start the next prefill step, if none runs: ``pending`` (a split prompt, whose rest comes
        first), then queued prompts in arrival order while slots and the stack's token budget
        allow. Without a budget a step prefills one whole prompt. With one, the decoders' tokens come first
        (as the schedulers count them) and prompts fill the rest; a prompt that does not fit is split
        (``prefill_chunked``) or waits for the next step; the step's first prompt always runs (a chunk of
        at most the budget, or a whole prompt that exceeds it). Before an admission that empties the queue
        the recorder is told (:meth:`_Recorder.draining`): a projection's checkpoint."""
        if self.prefill or not (self.queue or self.pending):
            return
        srv, queue, pending = self.server, self.queue, self.pending
        slots = srv.max_batch - len(self.members)
        budget = srv.prefill_budget
        if budget is None:
            if queue and slots >= 1:
                if len(queue) == 1:
                    on.draining(self)
                job = queue.popleft()  # one prefill at a time: at most one admission per instant
                n, c = job.prefill_tokens, job.cached_tokens
                self.prefill, self.chunks, self.carry, self.prefill_left = (job,), (n,), 0, 1.0
                self._pf, self._step = (n, c, 1, c + n / 2.0), -1.0
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
            left = job.prefill_tokens - carry
            take = min(left, room if room > 0 else budget)
            jobs.append(job)
            chunks.append(take)
            room -= take
            slots -= 1
        k = 0
        while k < len(queue) and slots >= 1 and (room > 0 or not jobs):
            job = queue[k]
            n = job.prefill_tokens
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
            if take < n:
                break
        if not jobs:
            return
        if k and k == len(queue):
            on.draining(self)
        self.pending = None
        for _ in range(k):
            on.start(queue.popleft(), self.t)
        self.set_prefill(tuple(jobs), tuple(chunks), carry)

    def step(self, on: _Recorder, until: float = INF) -> bool:
        """Process the next event if it falls at or before ``until``; False when there is none.

        The state stays on event instants (see :meth:`move_to`), so the realised past and every projection
        taken from it run the same float operations and agree to the last bit.
        """
        heap, members = self.heap, self.members
        while heap and heap[0][1] not in members:
            heapq.heappop(heap)  # lazily drop cancelled members
        step = self.step_ns()
        r = self.server.tokens_per_step / step if members and not self.paused() else 0.0
        t_pf = self.t + self.prefill_left * step if self.prefill else INF
        t_fin = self.t + (heap[0][0] - self.v) / r if heap and r > 0 else INF
        t_ev = min(t_pf, t_fin)
        if t_ev > until or t_ev == INF:
            return False
        if t_pf <= t_fin:
            self._move(t_ev, r, step)
            jobs, chunks, carry = self.prefill, self.chunks, self.carry
            last = len(jobs) - 1
            done = chunks[last] + (carry if last == 0 else 0)
            if done < jobs[last].prefill_tokens:  # a chunk: the rest of its prompt leads the next step
                self.pending = (jobs[last], done)
                jobs = jobs[:last]
            self.prefill, self.chunks, self.carry, self.prefill_left = (), (), 0, 0.0
            self._pf = (0, 0, 0, 0.0)
            for job in jobs:
                on.first(job, self.t, self.v)
                if job.outputs <= 1:
                    on.finish(job, self.t)
                else:
                    members[job.id] = job
                    self.kv += job.context
                    heapq.heappush(heap, (token_v(self.v, job.outputs - 1), job.id))
        else:
            target, jid = heapq.heappop(heap)
            self._move(t_ev, r, step)
            self.v = target
            job = members.pop(jid)
            self.kv -= job.context
            on.finish(job, self.t)
        if not members:
            self.kv = 0.0
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
            while heap and heap[0][1] not in self.members:
                heapq.heappop(heap)
            if heap and self.v > heap[0][0]:
                # rounding carried V past the next finish: that finish is due now (dt = 0), not in the past
                # (V and t stepping back would unsort the curve)
                self.v = heap[0][0]
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

    def mark(self, t: float, v: float, r: float) -> None:
        self.curve.add(t, v, r)

    def draining(self, state: _State) -> None:
        """``state`` is about to admit the last queued request (a projection's checkpoint)."""


class _Projection(_Recorder):
    """The device's future from a realised state, assuming no more arrivals — extended lazily, one event
    at a time, as far as a lookup needs, and amended instead of recomputed where that is exact.

    A request that must queue (something is ahead of it, or every slot or the prefill step is busy)
    changes nothing before the first admission after its arrival. It joins the projection's queue as it
    stands at its arrival (the projection run up to that instant); where the projection has already run
    past the arrival and emptied its queue, it is re-run from the ``draining`` checkpoint (the state just
    before the admission that emptied the queue): with the request in the queue if that admission came
    after its arrival (it may share that step), else up to the arrival and the request added there. Every
    other change (a request that starts at once, a cancel) begins a new projection from the realised
    state. Records made after a checkpoint are logged so it can be restored. One amended for long (past
    ``PROJECTION_KEEP`` entries, a device that never idles) is started afresh from the realised state
    instead: the same schedule (tested), without every past event.
    """

    def __init__(self, base: _State) -> None:
        super().__init__(_Curve())
        self.state = base.copy()
        self.curve.add(self.state.t, self.state.v, self.state.rate())
        self.start_at: dict[int, float] = {}
        self.first_at: dict[int, float] = {}
        self.v_join: dict[int, float] = {}
        self.finish_at: dict[int, float] = {}
        self._log: list[tuple[dict[int, float], int]] = []
        self._drain: tuple[_State, int, int, tuple[float, float, float]] | None = None
        if not self.state.queue:
            self.draining(self.state)  # the realised state has admitted all it could
        self.complete = False  # no event left

    # recorder: the projection's own tables (logged for a restore)
    def _put(self, table: dict[int, float], key: int, value: float) -> None:
        table[key] = value
        self._log.append((table, key))

    def start(self, job: Job, t: float) -> None:
        self._put(self.start_at, job.id, t)

    def first(self, job: Job, t: float, v: float) -> None:
        self._put(self.first_at, job.id, t)
        self._put(self.v_join, job.id, v)

    def finish(self, job: Job, t: float) -> None:
        self._put(self.finish_at, job.id, t)

    def draining(self, state: _State) -> None:
        c = self.curve  # its last breakpoint too: a later event at the same instant overwrites it
        self._drain = (state.copy(), len(c.t), len(self._log), (c.t[-1], c.v[-1], c.r[-1]))

    def size(self) -> int:
        """Breakpoints and records held (a projection amended for long is replaced; see submit)."""
        return len(self.curve.t) + len(self._log)

    # lazy extension
    def extend(self) -> bool:
        """One more event; False once there is none."""
        if self.complete:
            return False
        if not self.state.step(self):
            self.complete = True
        return not self.complete

    def reach(self, table: dict[int, float], key: int) -> float | None:
        """``table[key]``, running the projection until it is recorded (None if it never is)."""
        while key not in table:
            if not self.extend():
                return None
        return table[key]

    def reach_v(self, target: float) -> None:
        """Run until the progress clock reaches ``target`` (or nothing is left to run)."""
        while self.state.v < target and self.extend():
            pass

    def add_queued(self, job: Job) -> None:
        """``job`` has arrived and must wait (see the class doc).

        It must wait, so no admission it could have joined happened since the last change: every one
        after its arrival is still ahead of the realised state, and the realised and projected pasts agree.
        """
        t_a = job.arrive_ns
        st = self.state
        if not st.queue or st.t < t_a:
            st.run(t_a, self)  # a projection behind the arrival catches up to it (events ≤ t_a)
        if not self.state.queue and self.state.t > t_a:
            assert self._drain is not None, "an emptied queue leaves a checkpoint"
            saved, n_curve, n_log, last = self._drain
            c = self.curve
            del c.t[n_curve:], c.v[n_curve:], c.r[n_curve:]
            c.t[-1], c.v[-1], c.r[-1] = last
            for table, key in self._log[n_log:]:
                del table[key]
            del self._log[n_log:]
            self.state = saved.copy()  # the checkpoint stays valid until the job is in the queue
            if saved.t > t_a:  # the admission that emptied the queue came after the arrival
                self.state.queue.append(job)
                self._drain = None
                self.state.settle(self)
                self.complete = False
                return
            self.state.settle(self)
            self.state.run(t_a, self)
        self.state.queue.append(job)
        self._drain = None  # nothing can drain again before the job is admitted
        self.complete = False
