"""The virtual clock and the in-memory bus: exact sleeps, deadlock detection, QoS-1 delivery."""

from __future__ import annotations

import asyncio

import pytest

from voicepipe.bus.memory import MemoryBroker
from voicepipe.clock import Latch, VirtualDeadlock, now_ns, run_virtual, sleep_until_ns, wait_within
from voicepipe.messages import Cancel, CancelReason, Envelope, SessionEnd


def test_sleeps_end_exactly_at_their_deadlines_and_cost_no_wall_time():
    async def main() -> list[int]:
        woke: list[int] = []

        async def sleeper(d: int) -> None:
            await sleep_until_ns(d)
            woke.append(now_ns())

        deadlines = [3_600_000_000_000 + 1, 5, 6, 7_123_456_789, 1_000_000_000_000_000]
        await asyncio.gather(*(sleeper(d) for d in deadlines))
        await asyncio.sleep(2.5)  # asyncio's own timers run on the same virtual time
        woke.append(now_ns())
        return woke

    woke = run_virtual(main())
    assert woke == [5, 6, 7_123_456_789, 3_600_000_000_001, 1_000_000_000_000_000, 1_000_002_500_000_000]


def test_a_deadlock_raises_instead_of_hanging():
    async def stuck() -> None:
        await asyncio.Event().wait()

    with pytest.raises(VirtualDeadlock, match="no timer"):
        run_virtual(stuck())
    with pytest.raises(TimeoutError):  # a timeout is a timer: it fires at once on virtual time
        run_virtual(asyncio.wait_for(stuck(), 30))


def test_wait_within_returns_what_the_future_brings_or_times_out_at_the_limit_on_virtual_time():
    async def main() -> list[object]:
        loop = asyncio.get_running_loop()
        got: list[object] = []
        fut: asyncio.Future[str] = loop.create_future()
        loop.call_later(2.0, fut.set_result, "reply")
        got += [await wait_within(fut, 3.0), now_ns()]
        failing: asyncio.Future[str] = loop.create_future()
        loop.call_later(1.0, failing.set_exception, ValueError("failed turn"))
        with pytest.raises(ValueError, match="failed turn"):
            await wait_within(failing, 3.0)
        got.append(now_ns())
        never: asyncio.Future[str] = loop.create_future()
        with pytest.raises(TimeoutError):
            await wait_within(never, 0.5)
        got += [now_ns(), never.cancelled()]  # cancelled on a timeout, as asyncio.wait_for does
        latch = Latch()
        with pytest.raises(TimeoutError):
            await wait_within(latch.future(), 0.25, cancel=False)
        got.append(latch.is_set())  # a latch outlives a timed-out wait on it
        loop.call_later(1.0, latch.set)
        await wait_within(latch.future(), 5.0, cancel=False)
        got += [now_ns(), latch.is_set()]
        await wait_within(latch.future(), 5.0, cancel=False)  # already set: no wait
        got.append(now_ns())
        return got

    assert run_virtual(main()) == [
        "reply", 2_000_000_000, 3_000_000_000, 3_500_000_000, True, False, 4_750_000_000, True, 4_750_000_000
    ]


def test_a_task_cancelled_in_wait_within_cancels_the_future_unless_told_not_to():
    async def main() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        latch = Latch()
        waits = [loop.create_task(wait_within(fut, 10)), loop.create_task(wait_within(latch.future(), 10, cancel=False))]
        await asyncio.sleep(1)
        for t in waits:
            t.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        return fut.cancelled(), latch.future().cancelled()

    assert run_virtual(main()) == (True, False)


def test_memory_bus_delivers_each_message_once_in_order_to_every_subscriber():
    async def main() -> tuple[list, list, int]:
        broker = MemoryBroker("r1", hop_ns=2_000_000)
        a, b = broker.connect("a"), broker.connect("b")
        await a.subscribe("control/cancel", "session/end")
        await b.subscribe("control/cancel")
        got: dict[str, list] = {"a": [], "b": []}

        async def read(bus, n: int) -> None:
            async for ch, env in bus.messages():
                got[bus.name].append((ch, env.turn, now_ns()))
                if len(got[bus.name]) == n:
                    return

        readers = [asyncio.create_task(read(a, 4)), asyncio.create_task(read(b, 3))]
        for k in range(3):
            await a.publish(Envelope.of(Cancel(reason=CancelReason.HEARD), "r1", "s-0", k))
        await b.publish(Envelope.of(SessionEnd(), "r1", "s-0"))
        await asyncio.gather(*readers)
        return got["a"], got["b"], a.published

    got_a, got_b, published = run_virtual(main())
    assert [(ch, t) for ch, t, _ in got_a] == [("control/cancel", k) for k in range(3)] + [
        ("session/end", -1)
    ]
    assert [t for _, t, _ in got_b] == [0, 1, 2]  # the publisher's own subscription gets it too
    assert {at for _, _, at in got_a} == {2_000_000}  # one modelled hop each
    assert published == 3


def test_asyncio_primitives_run_on_the_virtual_loop():
    async def main() -> list:
        loop = asyncio.get_running_loop()
        seen: list = []
        loop.call_later(0.002, seen.append, "b")
        loop.call_later(0.002, seen.append, "c")  # equal deadlines keep their scheduling order
        loop.call_later(0.001, seen.append, "a")
        dropped = loop.call_later(0.0015, seen.append, "never")
        dropped.cancel()
        q: asyncio.Queue[int] = asyncio.Queue()
        loop.call_later(0.003, q.put_nowait, 7)
        seen.append(await q.get())
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await asyncio.Event().wait()
        seen.append(now_ns())
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10), 1)
        seen.append(now_ns())

        async def boom() -> None:
            await asyncio.sleep(0.1)
            raise KeyError("x")

        with pytest.raises(KeyError):
            await asyncio.create_task(boom())
        return seen

    assert run_virtual(main()) == ["a", "b", "c", 7, 503_000_000, 1_503_000_000]


def test_a_failing_callback_goes_to_the_exception_handler_and_the_run_goes_on():
    async def main() -> list:
        loop = asyncio.get_running_loop()
        caught: list = []
        loop.set_exception_handler(lambda _loop, ctx: caught.append(type(ctx["exception"])))
        loop.call_soon(lambda: 1 / 0)
        await asyncio.sleep(1)
        return caught

    assert run_virtual(main()) == [ZeroDivisionError]


def test_a_stage_receive_that_waits_holds_its_later_messages_back_in_order():
    """serve() without a queue task: a receive that waits continues as a task; the next messages wait."""

    async def main() -> list[tuple[int, int, str]]:
        broker = MemoryBroker("r1")
        a, b = broker.connect("a"), broker.connect("b")
        await b.subscribe("control/cancel")
        log: list[tuple[int, int, str]] = []

        async def receive(env: Envelope) -> None:
            log.append((env.turn, now_ns(), "start"))
            if env.turn == 1:
                await asyncio.sleep(0.005)  # this one waits
            log.append((env.turn, now_ns(), "end"))

        server = asyncio.create_task(b.serve(receive))
        for k in range(3):
            await a.publish(Envelope.of(Cancel(reason=CancelReason.HEARD), "r1", "s-0", k))
        await asyncio.sleep(0.01)
        server.cancel()
        return log

    ms = 1_000_000
    assert run_virtual(main()) == [
        (0, 0, "start"), (0, 0, "end"), (1, 0, "start"), (1, 5 * ms, "end"), (2, 5 * ms, "start"), (2, 5 * ms, "end"),
    ]  # fmt: skip


@pytest.fixture
def tuned_runs():
    """Runs in this test tune the collector, as under the CLI (the process's choice is restored after)."""
    from voicepipe.clock import gc as vgc

    was = vgc.tuning_for_runs()
    vgc.tune_for_runs()
    yield
    vgc.tune_for_runs(was)


def test_the_collector_is_off_during_a_tuned_virtual_run_unless_a_live_run_overlaps_and_comes_back_after(
    tuned_runs,
):
    import gc

    from voicepipe.clock.gc import GC_THRESHOLD, lean_gc

    before = gc.get_threshold()
    assert gc.isenabled()

    async def state() -> tuple[bool, tuple[int, int, int]]:
        return gc.isenabled(), gc.get_threshold()

    assert run_virtual(state()) == (False, GC_THRESHOLD)
    assert gc.isenabled() and gc.get_threshold() == before
    with lean_gc():  # a live run in progress: its loop must keep collecting
        assert run_virtual(state()) == (True, GC_THRESHOLD)
        assert gc.isenabled()
    assert gc.isenabled() and gc.get_threshold() == before
    gc.disable()  # a caller that switched the collector off keeps it off
    try:
        assert run_virtual(state())[0] is False
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_virtual_run_leaves_the_collector_alone_unless_the_program_opted_in():
    import gc

    from voicepipe.clock import gc as vgc

    if vgc.tuning_for_runs():
        pytest.skip("an earlier test in this process opted in")  # (the fixture restores it: not expected)
    before = gc.get_threshold()

    async def state() -> tuple[bool, tuple[int, int, int], int]:
        return gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()

    frozen = gc.get_freeze_count()
    assert run_virtual(state()) == (True, before, frozen)
    assert gc.isenabled() and gc.get_threshold() == before


def test_cyclic_garbage_of_a_tuned_virtual_run_is_freed_when_it_ends(tuned_runs):
    import gc

    class Node:
        def __init__(self) -> None:
            self.me = self

    async def churn() -> None:
        for _ in range(5_000):
            Node()  # a cycle: only the collector frees it

    gc.collect()
    for _ in range(3):  # back to back, as a worker process runs its levels
        run_virtual(churn())
        assert sum(isinstance(o, Node) for o in gc.get_objects()) == 0
