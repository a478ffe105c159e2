"""Signed liveness (issue 27 item 2): a forged clear kills nothing and is counted; a paused stage process
resumes within its grace, and is dead (its sessions move on) only past it. Real worker processes on a
spawned mosquitto; margins in seconds."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiomqtt
import pytest

from tests.conftest import fast_config, tiny_scenario
from voicepipe.bus.liveness import PAUSE_GRACE_S, alive_topic, heartbeat_topic, keepalive_for
from voicepipe.clock import now_ns
from voicepipe.runner import run_pipeline
from voicepipe.runresult import RunResult


def test_the_default_grace_is_the_brokers_will_on_silence():
    assert keepalive_for(PAUSE_GRACE_S) * 1.5 == PAUSE_GRACE_S  # 5 s keep-alive: will at 7.5 s
    assert keepalive_for(3.0) == 2


@pytest.mark.broker
async def test_a_forged_unsigned_clear_fails_no_turn_and_is_counted(mosquitto):
    cfg = fast_config("client.start_spread_ms=200", broker=mosquitto.url)
    forged = 0

    async def attack(r: RunResult) -> None:
        nonlocal forged
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="forger") as c:
            await asyncio.sleep(0.5)  # turns in flight
            await c.publish(alive_topic(r.run, "w0"), b"", qos=1, retain=True)  # the attack
            off = json.dumps({"replicas": [], "srcs": [], "state": "off", "n": 2**53}).encode()
            await c.publish(alive_topic(r.run, "w0"), b"0" * 32 + b" " + off, qos=1, retain=True)
            await c.publish(heartbeat_topic(r.run, "w0"), b'{"cpu_s": 0, "published": 0, "received": 0}')
            forged += 3

    tasks: list[asyncio.Task[None]] = []
    res = await run_pipeline(cfg, [tiny_scenario(turns=3)], 3, workers=1,
                             on_ready=lambda r: tasks.append(asyncio.create_task(attack(r))))  # fmt: skip
    await asyncio.gather(*tasks)
    assert forged == 3
    assert len(res.records) == 9 and {r.status for r in res.records} == {"ok"}, [r.error for r in res.records]
    assert res.deaths == []
    assert res.counters.dead["liveness unsigned or invalid"] >= 3  # each ignored, each counted


def _pause(res: RunResult, at_s: float, for_s: float, marks: list[int]) -> None:
    loop = asyncio.get_running_loop()
    pid = res.worker_pids[0]

    def stop() -> None:
        marks.append(now_ns())
        os.kill(pid, signal.SIGSTOP)

    loop.call_later(at_s, stop)
    loop.call_later(at_s + for_s, os.kill, pid, signal.SIGCONT)


@pytest.mark.broker
async def test_a_paused_worker_that_returns_within_its_grace_resumes_its_sessions(mosquitto):
    cfg = fast_config("client.start_spread_ms=200", "client.turn_timeout_s=20", broker=mosquitto.url)
    stopped: list[int] = []
    res = await run_pipeline(cfg, [tiny_scenario(turns=4)], 3, workers=1,
                             on_ready=lambda r: _pause(r, 1.0, 3.0, stopped))  # fmt: skip
    assert stopped and len(res.records) == 12
    assert res.deaths == []  # 3 s silent: paused, not dead (the old verdict came at 1.5 s, with no way back)
    assert any("resumed within the grace" in w for w in res.warnings), res.warnings
    assert {r.status for r in res.records} == {"ok"}, [r.error for r in res.records]  # late, not lost


@pytest.mark.broker
async def test_a_worker_paused_past_its_grace_is_dead_and_its_turns_fail_with_the_reason(mosquitto):
    cfg = fast_config("client.start_spread_ms=200", "broker.stage_grace_s=2", broker=mosquitto.url)
    stopped: list[int] = []
    res = await run_pipeline(cfg, [tiny_scenario(turns=4)], 3, workers=1,
                             on_ready=lambda r: _pause(r, 1.0, 6.0, stopped))  # fmt: skip
    assert len(res.records) == 12
    # the heartbeat verdict at the grace; the broker's will (keep-alive 2 s: at 3 s) would be the backstop
    assert len(res.deaths) == 1 and ("paused past its grace" in res.deaths[0] or "off" in res.deaths[0]), res.deaths
    noticed_s = (res.death_ns[0] - stopped[0]) / 1e9
    # 2 s of silence since its last beat (which came up to a beat period, 0.5 s, before the stop) + checks
    assert 1.3 < noticed_s < 4.5, noticed_s
    failed = [r for r in res.records if r.status != "ok"]
    assert failed and all(r.error and r.error.startswith("stage ") and r.error.endswith(" died") for r in failed)
