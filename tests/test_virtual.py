"""The virtual clock and the in-memory bus: exact sleeps, deadlock detection, QoS-1 delivery."""

from __future__ import annotations

import asyncio

import pytest

from voicepipe.clock import VirtualDeadlock, now_ns, run_virtual, sleep_until_ns
from voicepipe.membus import MemoryBroker
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
