"""The engine pool hands back every listener it opens: one whose opener is cancelled while it loads (the
turn ended: a new turn, the session's end, a cancel) goes to the idle list once its host has it, and the
next opener takes it without loading another decoder; one that never opened is not counted on its host.
A fake host whose start or open waits on a gate: no real engines, no processes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from voicepipe.audio.hosts import EngineFailed, EnginePool


class GatedHost:
    """An engine host whose start (``ready``) and ``open`` answer only when the test says."""

    def __init__(self) -> None:
        self.dead: str | None = None
        self.listeners = 0
        self.started = asyncio.Event()
        self.opens: list[asyncio.Future[Any]] = []  # one per "open" sent, answered by the test
        self.ops: list[str] = []

    async def ready(self) -> None:
        await self.started.wait()

    def call(self, op: str, eid: int, arg: object = None) -> asyncio.Future[Any]:
        self.ops.append(op)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if op == "open":
            self.opens.append(fut)
        else:
            fut.set_result(None)
        return fut


def _pool(host: GatedHost) -> EnginePool:
    pool = EnginePool(("silero", 0.5, 2), with_rec=True, size=1)
    pool.hosts.append(host)  # type: ignore[arg-type]  # the pool places its listeners on this host
    return pool


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize("cancelled_while", ["the host starts", "the host opens it"])
async def test_a_listener_whose_opener_is_cancelled_while_it_loads_is_handed_back_to_the_pool(
    cancelled_while,
):
    host = GatedHost()
    pool = _pool(host)
    opener = asyncio.create_task(pool.open())
    if cancelled_while == "the host opens it":
        host.started.set()
    await _settle()
    assert not opener.done()
    opener.cancel()  # the turn ends between the start of the open and its end
    with pytest.raises(asyncio.CancelledError):
        await opener
    host.started.set()
    await _settle()
    assert len(host.opens) == 1  # the open went on to the host all the same...
    host.opens[0].set_result(None)
    await _settle()
    assert len(pool.idle) == 1 and host.listeners == 1  # ...and its listener is the pool's again
    again = await asyncio.wait_for(pool.open(), 1)
    assert again is not None and host.ops == ["open"]  # the next opener takes it: no second decoder
    pool.release(again)
    assert pool.idle == [again]


async def test_a_listener_that_never_opened_is_not_counted_on_its_host():
    host = GatedHost()
    host.started.set()
    pool = _pool(host)
    opener = asyncio.create_task(pool.open())
    await _settle()
    opener.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opener
    host.opens[0].set_exception(EngineFailed("asr engine process exited (code 1)"))
    await _settle()
    assert pool.idle == [] and host.listeners == 0
    # and an opener that is not cancelled meets the failure itself
    failing = asyncio.create_task(pool.open())
    await _settle()
    host.opens[1].set_exception(EngineFailed("asr engine process exited (code 1)"))
    with pytest.raises(EngineFailed):
        await failing
    assert host.listeners == 0


async def test_an_opener_that_is_not_cancelled_gets_its_listener_and_the_pool_keeps_no_copy():
    host = GatedHost()
    host.started.set()
    pool = _pool(host)
    opener = asyncio.create_task(pool.open())
    await _settle()
    host.opens[0].set_result(None)
    lis = await asyncio.wait_for(opener, 1)
    assert pool.idle == [] and host.listeners == 1
    pool.release(lis)
    assert pool.idle == [lis]
