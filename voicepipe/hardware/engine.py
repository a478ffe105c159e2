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
    """The engine state at time ``t`` and the event step that moves it to its next event."""

    def __init__(self, server: DeviceServer) -> None:
        self.server = server
        self.t = 0.0
        self.v = 0.0
        self.heap: list[tuple[float, int]] = []  # (V at which the member finishes, job id)
        self.members: dict[int, Job] = {}
        self.kv = 0.0
        self.prefill: Job | None = None
        self.prefill_left = 0.0  # fraction of the current prefill still to run
        self.queue: deque[Job] = deque()
        self._step = -1.0  # step_ns() of the current batch; < 0 once the batch changed
        # where set (a whole run on virtual time, voicepipe.hardware.workload): every stretch between
        # events as (start ns, length ns, steps, decoders, their KV tokens, prefill tokens, cached tokens)
        self.trace: list[tuple[float, float, float, int, float, int, int]] | None = None

    def changed(self) -> None:
        """The batch (decoders, their KV or the prefill) changed: its step time must be looked up again."""
        self._step = -1.0

    def copy(self) -> _State:
        s = _State(self.server)
        s.t, s.v, s.kv = self.t, self.v, self.kv
        s.heap = list(self.heap)
        s.members = dict(self.members)
        s.prefill, s.prefill_left = self.prefill, self.prefill_left
        s.queue = deque(self.queue)
        s._step = self._step
        return s

    def step_ns(self) -> float:
        if self._step < 0:
            pf = self.prefill
            self._step = self.server.step_ns(
                len(self.members), self.kv, pf.prefill_tokens if pf else 0, pf.cached_tokens if pf else 0
            )
        return self._step

    def rate(self) -> float:
        """Decode progress per ns (0 when nobody decodes)."""
        return self.server.tokens_per_step / self.step_ns() if self.members else 0.0

    def can_admit(self) -> bool:
        """Whether a request arriving now would start its prefill at once (nothing ahead, a slot free)."""
        return self.prefill is None and not self.queue and len(self.members) + 1 <= self.server.max_batch

    def admit(self, on: _Recorder) -> bool:
        """Start the queue head's prefill if it may; True when that emptied the queue."""
        if self.prefill is None and self.queue and len(self.members) + 1 <= self.server.max_batch:
            job = self.queue.popleft()  # one prefill at a time: at most one admission per instant
            self.prefill, self.prefill_left = job, 1.0
            self._step = -1.0
            on.start(job, self.t)
            return not self.queue
        return False

    def step(self, on: _Recorder, until: float = INF) -> bool:
        """Process the next event if it falls at or before ``until``; False when there is none.

        The state stays on event instants (see :meth:`move_to`), so the realised past and every projection
        taken from it run the same float operations and agree to the last bit.
        """
        heap, members = self.heap, self.members
        while heap and heap[0][1] not in members:
            heapq.heappop(heap)  # lazily drop cancelled members
        step = self.step_ns()
        r = self.server.tokens_per_step / step if members else 0.0
        t_pf = self.t + self.prefill_left * step if self.prefill is not None else INF
        t_fin = self.t + (heap[0][0] - self.v) / r if heap else INF
        t_ev = min(t_pf, t_fin)
        if t_ev > until or t_ev == INF:
            return False
        if t_pf <= t_fin:
            self._move(t_ev, r, step)
            job = self.prefill
            assert job is not None
            self.prefill, self.prefill_left = None, 0.0
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
        drained = self.admit(on)
        on.mark(self.t, self.v, self.rate())
        if drained:
            on.drained(self)
        return True

    def run(self, until: float, on: _Recorder) -> None:
        """Process every event up to ``until`` (inclusive); the state stays at the last of them."""
        while self.step(on, until):
            pass

    def move_to(self, t: float) -> None:
        """Move the state between events to ``t`` (only where a change happens at ``t``)."""
        if t > self.t:
            step = self.step_ns()
            self._move(t, self.server.tokens_per_step / step if self.members else 0.0, step)

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
        if self.prefill is not None:
            self.prefill_left = max(0.0, self.prefill_left - dt / step)
        if self.trace is not None and dt > 0 and (self.members or self.prefill is not None):
            pf = self.prefill
            self.trace.append((self.t, dt, dt / step, len(self.members), self.kv,
                               pf.prefill_tokens if pf else 0, pf.cached_tokens if pf else 0))  # fmt: skip
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

    def drained(self, state: _State) -> None:
        pass


class _Projection(_Recorder):
    """The device's future from a realised state, assuming no more arrivals — extended lazily, one event
    at a time, as far as a lookup needs, and amended instead of recomputed where that is exact.

    A request that must queue (something is ahead of it, or every slot or the prefill is busy) changes
    nothing until it would start: it is appended to the projection's queue as it stands (or, where the
    projection has already emptied its queue, at the instant it did so: the ``drained`` checkpoint, from
    which the rest is re-run). Every other change (a request that starts at once, a cancel) begins a new
    projection from the realised state. Records made after a checkpoint are logged so it can be restored.
    One amended for long (past ``PROJECTION_KEEP`` entries, a device that never idles) is started afresh
    from the realised state instead: the same schedule (tested), without every past event.
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
            self.drained(self.state)
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

    def drained(self, state: _State) -> None:
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

        It must wait, so no start was possible since the last change (a free slot with no prefill is
        taken at once by the queue head, or else stays free until an arrival, and such an arrival starts
        at once and projects afresh). So wherever the projection now stands, the job joins the queue
        there; if the projection has already emptied its queue, the job joins where it did so.
        """
        if not self.state.queue:
            assert self._drain is not None, "an emptied queue leaves a checkpoint"
            state, n_curve, n_log, last = self._drain
            self.state, self._drain = state, None  # nothing can drain again before the job is added
            c = self.curve
            del c.t[n_curve:], c.v[n_curve:], c.r[n_curve:]
            c.t[-1], c.v[-1], c.r[-1] = last
            for table, key in self._log[n_log:]:
                del table[key]
            del self._log[n_log:]
        self.state.queue.append(job)
        self.complete = False

