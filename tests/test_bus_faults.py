"""The MQTT bus under broker faults (a spawned mosquitto): crash and restart, a paused broker, an outage
past the window, redelivered duplicates, the MQTT version setting, the lean client's message path."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import fast_config, tiny_scenario
from voicepipe.bus import BrokerHealth
from voicepipe.bus.mqtt import BrokerAddress, MqttBus, negotiate_protocol
from voicepipe.messages import Envelope, UserUtterance, UserWord, topic
from voicepipe.runner import run_pipeline

pytestmark = pytest.mark.broker

TURNS = 4


def outage_config(url: str, *sets: str):
    # 2 sessions so the fault lands while turns are in flight; the timeout bounds a test that loses a turn
    return fast_config("client.turn_timeout_s=8", "broker.probe=false", *sets, broker=url)


async def _fault_after_first_turn(fault) -> tuple[asyncio.Event, object]:
    first = asyncio.Event()

    async def inject() -> None:
        await first.wait()
        await fault()

    return first, asyncio.create_task(inject())


async def test_broker_crash_and_restart_on_the_same_port_loses_no_turn(make_mosquitto):
    mq = make_mosquitto(persistence=True)
    cfg = outage_config(mq.url)

    async def crash_and_restart() -> None:
        await asyncio.sleep(0.3)  # mid-turn: the second turns' words are on the bus
        mq.kill()
        await asyncio.sleep(1.0)
        await asyncio.to_thread(mq.start)

    first, task = await _fault_after_first_turn(crash_and_restart)
    res = await run_pipeline(cfg, [tiny_scenario(turns=TURNS)], 2, on_record=lambda r: first.set())
    await task
    assert len(res.records) == 2 * TURNS  # none missing
    assert all(r.status == "ok" or r.error == "broker outage" for r in res.records), [
        (r.status, r.error) for r in res.records
    ]
    assert sum(r.status == "ok" for r in res.records) >= 2 * TURNS - 1
    hit = [r for r in res.records if r.broker_outage_ms]
    assert hit and max(r.broker_outage_ms for r in hit) >= 900  # the 1 s outage is marked on its turns
    assert any("connection lost" in w for w in res.warnings)
    assert res.stage_errors == 0


async def test_paused_broker_is_survived_with_a_warning_that_the_stall_is_in_the_tax(make_mosquitto):
    mq = make_mosquitto()
    cfg = outage_config(mq.url, "client.turn_timeout_s=12")

    async def pause() -> None:
        await asyncio.sleep(0.2)
        mq.pause()
        await asyncio.sleep(5.0)
        mq.resume()

    first, task = await _fault_after_first_turn(pause)
    res = await run_pipeline(cfg, [tiny_scenario(turns=3)], 2, on_record=lambda r: first.set())
    await task
    assert len(res.records) == 6 and all(r.status == "ok" for r in res.records)
    assert any("stalled" in w and "tax" in w for w in res.warnings), res.warnings
    stalled = [r for r in res.records if r.broker_outage_ms]
    assert stalled and max(r.broker_outage_ms for r in stalled) > 3000
    # the stall shows as tax on the turns it hit (measured, not modelled)
    assert max(r.tax_ms for r in stalled) > 3000


def test_outage_longer_than_the_window_exits_4_with_what_was_measured_written(make_mosquitto, tmp_path):
    mq = make_mosquitto()
    sc = tmp_path / "tiny.yaml"
    sc.write_text(yaml.safe_dump(tiny_scenario(turns=6).model_dump(mode="json")))
    out, csv, html = tmp_path / "turns.jsonl", tmp_path / "turns.csv", tmp_path / "report.html"
    proc = subprocess.Popen(
        [sys.executable, "-m", "voicepipe.cli", "run", str(sc), "--broker", mq.url, "--json", str(out),
         "--csv", str(csv), "--report", str(html), "--set", "client.playout=first_audio",
         "--set", "agent.backend=cerebras-llama-3.1-8b", "--set", "broker.outage_window_s=2",
         "--set", "broker.probe=false"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text().strip()):  # the first turn is measured
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    mq.kill()
    t0 = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 4, stderr
    assert time.monotonic() - t0 < 20  # the window (2 s) and the backoff, not a turn timeout per turn
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "outage_window_s" in errors[0] and "Traceback" not in stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert 1 <= len(recs) < 6 and all(r["status"] == "ok" for r in recs)
    assert len(csv.read_text().splitlines()) == len(recs) + 1  # header + every measured turn
    assert html.stat().st_size > 1000


async def test_a_redelivered_message_is_dropped_by_its_id(mosquitto):
    addr = BrokerAddress.parse(mosquitto.url)
    word = UserUtterance(words=[UserWord(text="hi", dur_ns=1, index=0, pause_before=False, last_word=True)])
    env = Envelope.of(word, "r1", "s1", 0)
    other = Envelope.of(word, "r1", "s1", 0)
    async with MqttBus(addr, "r1", "asr") as bus, addr.client() as raw:
        await bus.subscribe("user/utterance")
        for e in (env, env, other, env):  # the broker redelivering `env` after a reconnect looks like this
            await raw.publish(topic("r1", "s1", "user/utterance"), e.to_bytes(), qos=1)
        got = []

        async def take() -> None:
            async for _ch, e in bus.messages():
                got.append(e.id)

        reader = asyncio.create_task(take())
        await asyncio.sleep(0.5)
        reader.cancel()
    assert got == [env.id, other.id]
    assert bus.duplicates == 2 and bus.received == 4


async def test_lean_bus_round_trip_keeps_order_and_counts(mosquitto):
    """Many publishes in one event-loop batch leave in one write and arrive complete and in order."""
    addr = BrokerAddress.parse(mosquitto.url)
    async with MqttBus(addr, "r2", "client") as pub, MqttBus(addr, "r2", "asr") as sub:
        await sub.subscribe("user/utterance")
        for i in range(500):
            word = UserUtterance(
                words=[UserWord(text=f"w{i}", dur_ns=1, index=i, pause_before=False, last_word=False)]
            )
            await pub.publish(Envelope.of(word, "r2", "s1", 0))
        got: list[int] = []
        async with asyncio.timeout(10):
            async for _ch, e in sub.messages():
                got.append(e.payload.words[0].index)
                if len(got) == 500:
                    break
        assert got == list(range(500))
        deadline = time.monotonic() + 5
        while pub.client.unacked and time.monotonic() < deadline:  # every QoS 1 publish acknowledged
            await asyncio.sleep(0.05)
        assert not pub.client.unacked and pub.published == 500


async def test_protocol_setting_speaks_mqtt5_to_mosquitto(mosquitto):
    addr = BrokerAddress.parse(mosquitto.url)
    assert await negotiate_protocol(addr, "auto") == "5"
    assert await negotiate_protocol(addr, "3.1.1") == "3.1.1"
    async with MqttBus(addr, "r3", "asr", protocol="5", outage_window_s=7) as bus:
        assert bus.client._client.protocol == 5
    cfg = fast_config("broker.protocol=5", "broker.probe=false", broker=mosquitto.url)
    assert cfg.broker.protocol == "5"  # YAML's number 5 is read as the version "5"
    res = await run_pipeline(cfg, [tiny_scenario(turns=1)], 1)
    assert "MQTT 5" in res.broker and [r.status for r in res.records] == ["ok"]


def test_health_overlap_merges_outages_and_stalls():
    h = BrokerHealth(outages=[(100, 300)], stalls=[(200, 400), (900, 1000)])
    assert h.overlap_ns(0, 2000) == 300 + 100
    assert h.overlap_ns(250, 950) == 150 + 50
    assert h.overlap_ns(500, 800) == 0
    # five clients losing the same broker are one outage in the summary
    five = BrokerHealth(outages=[(0, 1_000_000_000 + i) for i in range(5)], reconnects=5)
    assert five.summary()[0].startswith("broker connection lost 1 time(s) (longest 1.0 s, 5 client")
