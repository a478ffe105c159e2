"""The device's future as a projection: a copy of the engine state run forward lazily, assuming no more
arrivals, and amended in place for a queued arrival where that is exact (the contract is in the class).
:class:`voicepipe.hardware.serving.DeviceServer` owns one, beside its realised state.
"""

from __future__ import annotations

from typing import Any

from voicepipe.hardware.engine import Job, _Curve, _Recorder, _State


class _Projection(_Recorder):
    """The device's future from a realised state, assuming no more arrivals — extended lazily, one event
    at a time, as far as a lookup needs, and amended instead of recomputed where that is exact.

    A request that must queue (the device runs something: it waits at least for the running step's end)
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
        self.cut_at: dict[tuple[int, int], int] = {}  # (job, k): output tokens out at its k-th eviction
        self.rejoin_at: dict[tuple[int, int], tuple[float, float]] = {}  # (job, k): (offset, instant)
        self.evicted = False  # an eviction was projected: a queued arrival is not amended in (see add_queued)
        self._log: list[tuple[dict[Any, Any], Any]] = []
        self._drain: tuple[_State, int, int, tuple[float, float, float]] | None = None
        if not self.state.queue:
            self.draining(self.state)  # the realised state has admitted all it could
        self.complete = False  # no event left

    # recorder: the projection's own tables (logged for a restore)
    def _put(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        table[key] = value
        self._log.append((table, key))

    def start(self, job: Job, t: float) -> None:
        self._put(self.start_at, job.id, t)

    def first(self, job: Job, t: float, v: float) -> None:
        self._put(self.first_at, job.id, t)
        self._put(self.v_join, job.id, v)

    def finish(self, job: Job, t: float) -> None:
        self._put(self.finish_at, job.id, t)

    def evict(self, job: Job, k: int, done: int, t: float) -> None:
        self.evicted = True
        self._put(self.cut_at, (job.id, k), done)

    def rejoin(self, job: Job, k: int, t: float, off: float) -> None:
        self._put(self.rejoin_at, (job.id, k), (off, t))

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

    def reach(self, table: dict[Any, Any], key: Any) -> Any:
        """``table[key]``, running the projection until it is recorded (None if it never is)."""
        while key not in table:
            if not self.extend():
                return None
        return table[key]

    def reach_v(self, target: float) -> None:
        """Run until the progress clock reaches ``target`` (or nothing is left to run)."""
        while self.state.v < target and self.extend():
            pass

    def add_queued(self, job: Job) -> bool:
        """``job`` has arrived and must wait (see the class doc); False where the projection cannot be
        amended (it evicts: an evicted member refills an emptied queue, so the queue seen at a later
        instant no longer tells whether the job could have started sooner) and must be started afresh.

        It must wait, so no admission it could have joined happened since the last change: every one
        after its arrival is still ahead of the realised state, and the realised and projected pasts agree.
        """
        t_a = job.arrive_ns
        st = self.state
        if self.evicted:
            return False
        if not st.queue or st.t < t_a:
            st.run(t_a, self)  # a projection behind the arrival catches up to it (events ≤ t_a)
            if self.evicted:
                return False
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
                return True
            self.state.settle(self)
            self.state.run(t_a, self)
            if self.evicted:
                return False
        self.state.queue.append(job)
        self._drain = None  # nothing can drain again before the job is admitted
        self.complete = False
        return True
