"""Playing sessions through a set of stages (:func:`play_sessions`), live and on virtual time alike.

A :data:`Slot` is a start offset and the conversations played back to back from it; :func:`spread_slots` is the
live default (every scenario and session once, spread over ``client.start_spread_ms``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from voicepipe.clock import is_virtual
from voicepipe.config import PipelineConfig, check_speech
from voicepipe.measure import LagProbe
from voicepipe.runresult import RunResult
from voicepipe.scenario import Scenario, session_id
from voicepipe.stages.base import NOTED_PER_REASON, Stage, cancel_and_wait
from voicepipe.stages.client import Client
from voicepipe.stageset import start_stages, stop_stages
from voicepipe.stopping import current as current_stop

Slot = tuple[float, list[tuple[Scenario, str]]]  # start offset (s), conversations played back to back


async def _slot(client: Client, start_s: float, conversations: list[tuple[Scenario, str]]) -> None:
    await asyncio.sleep(start_s)
    for sc, sid in conversations:
        await client.play(sc, sid)


def spread_slots(cfg: PipelineConfig, scenarios: list[Scenario], sessions: int) -> list[Slot]:
    """Every (scenario, session) once, started ``client.start_spread_ms`` apart in all (the live default)."""
    pairs = session_ids(scenarios, sessions)
    spread = cfg.client.start_spread_ms / 1e3 / max(1, len(pairs))
    return [(i * spread, [pair]) for i, pair in enumerate(pairs)]


def session_ids(scenarios: list[Scenario], sessions: int) -> list[tuple[Scenario, str]]:
    pairs = [(sc, session_id(sc, i)) for sc in scenarios for i in range(sessions)]
    if len({sid for _, sid in pairs}) != len(pairs):
        raise ValueError("scenario names must differ: two scenarios would share session ids")
    return pairs


async def play_sessions(
    stack: contextlib.AsyncExitStack,
    stages: list[Stage],
    slots: list[Slot],
    result: RunResult,
    *,
    before: Callable[[], Awaitable[None]] | None = None,
    probe: LagProbe | None = None,
) -> None:
    """Start the stages, play every slot's conversations, stop the stages. Every scenario is first checked
    against the run's config (:func:`voicepipe.config.check_speech`: a UserError), on every path in.
    ``probe``: the run's own lag probe (a live run's default: a new one; a virtual run has none)."""
    tasks: list[asyncio.Task[None]] = []
    raised: BaseException | None = None  # a stage loop's failure this raises (not counted twice)
    if stages:
        played = {id(sc): sc for _, convs in slots for sc, _ in convs}
        check_speech(stages[0].cfg, list(played.values()))
    result.expected_turns = sum(len(sc.turns) for _, convs in slots for sc, _ in convs)
    probe = None if is_virtual() else probe or LagProbe()
    probing = asyncio.create_task(probe.run()) if probe else None
    stop = current_stop()  # a live run under voicepipe.stopping: a signal stops the sessions, not the run
    stopping: asyncio.Task[bool] | None = None
    try:
        tasks = await start_stages(stack, stages)
        if before is not None:
            await before()
        client = next(s for s in stages if isinstance(s, Client))
        play = asyncio.ensure_future(asyncio.gather(*(_slot(client, at, convs) for at, convs in slots)))
        # a stage's receive loop ends only when its bus gave up (the broker away past the outage window)
        waiting: list[asyncio.Future[Any]] = [play, *tasks]
        if stop is not None:
            stopping = asyncio.create_task(stop.event.wait(), name="stop-on-signal")
            waiting.append(stopping)
            stop.watch()
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if stop is not None and stop.signum is not None and not play.done():  # the turns in flight stay unrecorded
            for name, exc in await cancel_and_wait(play, what="the sessions"):
                result.task_failed(name, exc)
            return
        if not play.done():
            for name, exc in await cancel_and_wait(play, what="the sessions"):
                result.task_failed(name, exc)
            dead = next(t for t in tasks if t.done())
            raised = None if dead.cancelled() else dead.exception()
            raise raised or RuntimeError(f"{dead.get_name()} stopped during the run")
        await play
        await asyncio.sleep(0.05)  # let session.end reach every stage
        result.open_tasks_after = sum(s.open_tasks() for s in stages)
    finally:
        if stopping is not None:
            stopping.cancel()
        if probing is not None:
            probing.cancel()
            result.lag = probe.result() if probe else None
        stopped = await stop_stages(stages, tasks)
        result.deadletters = sum(s.bus.deadletters for s in stages)
        result.stage_errors += sum(s.errors for s in stages)
        result.first_error = result.first_error or next((s.first_error for s in stages if s.first_error), None)
        for name, exc in stopped:  # a stage loop that failed is a failure of the run, whenever it happened
            if exc is not raised:
                result.task_failed(name, exc)
        for s in stages:
            result.counters.add(s.guard.counters)
        result.counters.received = sum(s.bus.received for s in stages)
        result.counters.duplicates = sum(getattr(s.bus, "duplicates", 0) for s in stages)
        malformed = result.deadletters - sum(
            min(n, NOTED_PER_REASON) for s in stages for n in s.noted.values()
        )
        if malformed > 0:  # refused by the bus before any stage saw them (not JSON, wrong schema...)
            result.counters.dead["malformed"] += malformed
