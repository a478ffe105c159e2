"""Structured shutdown: a task of the run that failed before it was stopped is reported, never swallowed."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from structlog.testing import capture_logs

from tests.conftest import fast_config, tiny_scenario
from voicepipe import stageset
from voicepipe.bus.memory import MemoryBroker
from voicepipe.clock import run_virtual
from voicepipe.messages import Envelope
from voicepipe.runner import simulate
from voicepipe.stages.base import RunContext, cancel_and_wait
from voicepipe.stages.tts import TTS
from voicepipe.stageset import build_stages, start_stages, stop_stages


class BreaksAtSessionEnd(TTS):
    """A TTS whose receive loop itself (not a handler) fails a little after the session ends: the moment
    between the last turn and the run's shutdown, where a failed loop used to be cancelled and forgotten."""

    async def receive(self, env: Envelope) -> None:
        if env.type == "session.end":
            await asyncio.sleep(0.01)  # virtual time: the client has finished playing by then
            raise RuntimeError("tts loop broke after the session ended")
        await super().receive(env)


def test_a_stage_loop_that_fails_after_the_last_turn_is_the_runs_first_error(monkeypatch):
    monkeypatch.setitem(stageset.STAGES, "tts", BreaksAtSessionEnd)
    with capture_logs() as logs:
        res = simulate(fast_config(), [tiny_scenario(turns=2)], sessions=1)
    assert [r.status for r in res.records] == ["ok", "ok"]  # the turns themselves were answered
    assert res.stage_errors == 1
    assert res.first_error is not None and "tts loop broke after the session ended" in res.first_error
    assert res.first_error.startswith("stage-tts")
    failed = [e for e in logs if e["log_level"] == "error" and "tts loop broke" in e.get("error", "")]
    assert len(failed) == 1 and failed[0]["task"] == "stage-tts"


def test_a_healthy_run_stops_with_no_task_failures():
    with capture_logs() as logs:
        res = simulate(fast_config(), [tiny_scenario(turns=1)], sessions=1)
    assert res.stage_errors == 0 and res.first_error is None
    assert [e for e in logs if e["log_level"] == "error"] == []


def test_stop_stages_returns_every_loop_that_had_failed_and_cancels_the_rest():
    async def main() -> tuple[list[tuple[str, BaseException]], list[bool]]:
        ctx = RunContext(run="r", cfg=fast_config())
        stages = build_stages(MemoryBroker("r", trusted=True).connect, ctx, ["asr", "router", "tts"])
        async with contextlib.AsyncExitStack() as stack:
            tasks = await start_stages(stack, stages)
            broken = asyncio.create_task(_fails(), name="stage-extra")
            await asyncio.sleep(0.001)  # it has failed before the shutdown begins
            assert broken.done()
            stopped = await stop_stages(stages, [*tasks, broken])
            return stopped, [t.cancelled() for t in tasks]

    with capture_logs() as logs:
        stopped, cancelled = run_virtual(main())
    assert [(name, str(exc)) for name, exc in stopped] == [("stage-extra", "boom")]
    assert cancelled == [True, True, True]  # the healthy loops ended by their cancel, reported as nothing
    assert [e["task"] for e in logs if e["log_level"] == "error"] == ["stage-extra"]


async def _fails() -> None:
    raise ValueError("boom")


def test_cancel_and_wait_lets_a_cancel_of_the_caller_through():
    async def main() -> bool:
        forever = asyncio.create_task(asyncio.Event().wait())
        stopper = asyncio.create_task(cancel_and_wait(forever, _stubborn()))
        await asyncio.sleep(0.001)
        stopper.cancel()  # the caller is cancelled while it waits for a task that ignores cancels
        with pytest.raises(asyncio.CancelledError):
            await stopper
        return forever.cancelled()

    assert run_virtual(main()) is True


def _stubborn() -> asyncio.Task[None]:
    async def ignores_first_cancel() -> None:
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            await asyncio.sleep(1)  # keeps the stopper waiting past its own cancel

    return asyncio.ensure_future(ignores_first_cancel())
