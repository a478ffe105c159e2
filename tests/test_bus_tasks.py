"""Stopping the bus's background tasks (voicepipe.bus.base.stop_task): a task that had failed is reported,
never swallowed; being cancelled is the normal end; the stopper's own cancellation still goes through; a task
that loses its cancel is cancelled again. And what a stopped call leaves behind: its late acknowledgement is
one warning line."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
import structlog

from voicepipe.bus import base
from voicepipe.bus.base import stop_task
from voicepipe.bus.mqtt.address import BrokerAddress


async def test_a_task_that_had_failed_is_logged_as_a_warning_when_stopped():
    async def broken() -> None:
        raise ValueError("reader fell over")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with structlog.testing.capture_logs() as logs:
        await stop_task(task, "bus-reader")
    assert [(e["log_level"], e["task"]) for e in logs] == [("warning", "bus-reader")]
    assert "ValueError: reader fell over" in logs[0]["error"]


async def test_a_running_task_is_cancelled_quietly_and_an_expected_failure_at_debug():
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(asyncio.sleep(60))
        await stop_task(task, "bus-watch")
        assert task.cancelled()

        async def outage() -> None:
            raise TimeoutError("gone")

        failed = asyncio.create_task(outage())
        await asyncio.sleep(0)
        await stop_task(failed, "bus-reconnect", quiet=(TimeoutError,))
        await stop_task(None, "nothing")
    # a cancelled task says nothing; the expected failure is at most a debug line (the level may be filtered)
    assert [(e["log_level"], e["task"]) for e in logs] in ([], [("debug", "bus-reconnect")])


async def test_the_stoppers_own_cancellation_is_not_swallowed():
    async def stubborn() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.2)  # takes a while to wind down

    inner = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    outer = asyncio.create_task(stop_task(inner, "slow"))
    await asyncio.sleep(0.05)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer


async def test_a_task_that_loses_its_cancel_is_cancelled_again_until_it_ends(monkeypatch):
    # Python 3.11's asyncio.wait_for (inside aiomqtt's publish) can return a result that arrived with the
    # cancel and drop the cancel: the task goes back to waiting for a message that never comes. Stopping
    # it must not hang on that (it did: a replica's liveness watch, once in a few runs on a loaded box).
    never = asyncio.Event()
    swallowed = 0

    async def reader() -> None:
        nonlocal swallowed
        while True:
            try:
                await never.wait()
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # the lost cancel: back to waiting, as the wait_for race leaves it
                asyncio.current_task().uncancel()  # type: ignore[union-attr]

    monkeypatch.setattr(base, "RECANCEL_S", 0.2)
    task = asyncio.create_task(reader())
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_task(task, "liveness-watch-read"), 10)
    assert task.cancelled() and swallowed == 1


async def test_an_acknowledgement_nobody_waits_for_is_one_warning_line_not_a_traceback(caplog):
    # a subscribe cancelled at shutdown (or timed out) whose SUBACK still arrives: aiomqtt logs the unknown
    # message id with logger.exception; on a user's terminal that was a KeyError traceback
    client = BrokerAddress.parse("mqtt://127.0.0.1:1883").client("late-ack-test")
    with caplog.at_level(logging.DEBUG, logger="voicepipe.mqtt"):
        client._on_subscribe(client._client, None, 4242, [])  # type: ignore[arg-type]
        client._on_unsubscribe(client._client, None, 4243, [])  # type: ignore[arg-type]
    late = [r for r in caplog.records if "Unexpected message ID" in r.getMessage()]
    assert len(late) == 2
    assert all(r.levelno == logging.WARNING and r.exc_info is None and r.exc_text is None for r in late)
    assert "Traceback" not in caplog.text and "KeyError" not in caplog.text


@pytest.mark.parametrize("factory", ["Client", "LeanClient", "PlainClient"])
def test_a_cancel_mid_connect_leaves_no_connection_or_keepalive_task_behind(mosquitto, factory, capfd):
    """A signal at start-up cancels a client while aiomqtt connects in its executor thread: the connect must
    not outlive the cancel (an open socket, a keep-alive task destroyed pending when the loop closes)."""
    import gc

    from voicepipe.bus import mqtt
    from voicepipe.bus.mqtt import address

    make = getattr(address, factory, None) or getattr(mqtt, factory)
    addr = BrokerAddress.parse(mosquitto.url)
    loop_errors: list[str] = []
    left: list[str] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: loop_errors.append(ctx["message"]))
        for i in range(16):
            client = addr.client(f"vp-cancel-{factory}-{i}", factory=make)
            entering = asyncio.create_task(client.__aenter__())
            for _ in range(i % 4):  # cancel at different points of the connect
                await asyncio.sleep(0)
            entering.cancel()
            if i % 2:  # a second cancel (a stopper that cancels again) must not stop the unwinding
                await asyncio.sleep(0)
                entering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await entering
        for _ in range(100):  # a keep-alive task started late, or a disconnect under way, ends by now
            if all(t is asyncio.current_task() or t.done() for t in asyncio.all_tasks()):
                break
            await asyncio.sleep(0.05)
        left.extend(t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task())

    asyncio.run(main())
    gc.collect()
    assert left == []
    assert loop_errors == []
    assert "Traceback" not in capfd.readouterr().err
