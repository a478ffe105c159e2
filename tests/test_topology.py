"""Topology: replicas with session affinity, liveness (will + heartbeat), turn deadlines, bridged brokers.

The process tests spawn real worker processes against a spawned mosquitto and kill (SIGKILL) or hang
(SIGSTOP, tests/test_liveness_signed.py) one mid-run; margins are seconds where the contract is 2 s, so a loaded box does not flake them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest

from tests.conftest import fast_config, tiny_scenario
from voicepipe.bus.brokers import Bridge
from voicepipe.bus.liveness import alive_topic, holder, turn_deadline_ns
from voicepipe.bus.mqtt import BrokerAddress
from voicepipe.bus.partition import REPLICATED, Membership, PartitionedBus, kind_of, owner, plan_workers
from voicepipe.clock import now_ns
from voicepipe.runner import run_pipeline
from voicepipe.runresult import RunResult
from voicepipe.scenario import session_id
from voicepipe.stages.base import Stage
from voicepipe.stageset import needed_stages
from voicepipe.workers import serve_stages

DIED = ("stage asr died", "stage router died", "stage agent died", "stage tts died")


HW_AGENT = "agent.backend=h100-sxm/llama-3.1-8b"  # a modelled device: one queue every session shares


# -- pure: plans, ownership, holders --------------------------------------------------------------
def test_plan_replicates_per_session_stages_and_the_agent_and_keeps_shared_ones_single():
    plan = plan_workers(["asr", "router", "agent", "cache", "council", "tts", "client"], 2)
    assert plan == [
        ["asr.0", "router.0", "agent.0", "cache.0", "tts.0"],
        ["asr.1", "router.1", "agent.1", "council.0", "tts.1"],
    ]
    assert plan_workers(["asr", "agent"], 1) == [["asr.0", "agent.0"]]
    with pytest.raises(ValueError):
        plan_workers(["asr"], 0)


def test_rendezvous_owner_spreads_sessions_and_moves_only_the_dead_replicas():
    reps = ["asr.0", "asr.1", "asr.2"]
    sessions = [f"s{i}" for i in range(600)]
    before = {s: owner("asr", s, reps) for s in sessions}
    counts = Counter(before.values())
    assert set(counts) == set(reps) and min(counts.values()) > 120  # ~200 each
    members = Membership(reps)
    assert members.remove(["asr.1", "asr.9"]) == ["asr.1"]
    for s in sessions:
        after = members.owner("asr", s)
        assert after == before[s] if before[s] != "asr.1" else after in ("asr.0", "asr.2")
    members.remove(["asr.0", "asr.2"])
    assert members.owner("asr", "s1") is None and members.kinds_without_replica() == ["asr"]


def test_holder_is_the_stage_after_the_last_step_seen():
    assert holder("turn/script") == "asr"
    assert holder("asr/final") == "router"
    assert holder("route", "council") == "council"
    assert holder("route", "commit") == "agent"
    assert holder("reply/text") == "tts"
    assert turn_deadline_ns(5_000_000_000, 1.5) == 6_500_000_000


# -- replicas share sessions without splitting one ------------------------------------------------
async def test_two_replicas_twenty_sessions_each_served_by_exactly_one(mosquitto, monkeypatch):
    monkeypatch.setenv("VOICEPIPE_RUN_TOKEN", "a shared test secret")  # the run and its stages sign alike
    cfg = fast_config("client.start_spread_ms=400", HW_AGENT, broker=mosquitto.url)
    sc = tiny_scenario(turns=2)
    kinds = [n for n in needed_stages(cfg) if n != "client"]
    plan = plan_workers(kinds, 2)
    planned = [r for p in plan for r in p]
    built: dict[int, list[Stage]] = {}
    run = "replicas20"
    tasks = [
        asyncio.create_task(
            serve_stages(cfg, [kind_of(r) for r in reps], run, process=f"w{i}", replicas=reps, planned=planned,
                         on_stages=lambda st, i=i: built.__setitem__(i, st))
        )
        for i, reps in enumerate(plan)
    ]  # fmt: skip
    try:
        res = await run_pipeline(cfg, [sc], 20, run_id=run, plan=plan)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    assert len(res.records) == 40 and {r.status for r in res.records} == {"ok"}
    sessions = {session_id(sc, i) for i in range(20)}
    for kind in set(REPLICATED) & set(kinds):
        served = {}
        for i in (0, 1):
            bus = next(s.bus for s in built[i] if s.name == kind)
            assert isinstance(bus, PartitionedBus)
            served[bus.replica] = bus.served
        a, b = served.values()
        assert a and b, f"{kind}: one replica served nothing"
        assert not a & b, f"{kind}: sessions {sorted(a & b)} split between replicas"
        assert a | b == sessions
        for rep, ss in served.items():
            assert all(owner(kind, s, served) == rep for s in ss)
    # the agent replicas are shadows: each ran every session's requests on its own copy of the one device
    # (the same number of requests, the same modelled history), and published only for the sessions it owns
    agents = [next(s for s in built[i] if s.name == "agent") for i in (0, 1)]
    opened = [a.backends["main"].server._ids for a in agents]
    assert opened[0] == opened[1] >= 40, opened
    assert agents[0].shadowed + agents[1].shadowed == opened[0], (opened, [a.shadowed for a in agents])
    assert agents[0].shadowed and agents[1].shadowed


# -- liveness: a killed or hung worker --------------------------------------------------------------
def _kill_after(res: RunResult, delay_s: float, sig: signal.Signals, which: int, marks: list[int]) -> None:
    def go() -> None:
        marks.append(now_ns())
        os.kill(res.worker_pids[which], sig)

    asyncio.get_running_loop().call_later(delay_s, go)


@pytest.mark.broker
async def test_killed_replica_moves_its_sessions_and_fails_only_its_in_flight_turns(mosquitto):
    cfg = fast_config("client.start_spread_ms=1000", broker=mosquitto.url)
    sc = tiny_scenario(turns=5)
    killed: list[int] = []
    res = await run_pipeline(
        cfg, [sc], 20, workers=2, on_ready=lambda r: _kill_after(r, 2.5, signal.SIGKILL, 1, killed)
    )
    assert len(res.records) == 100  # every expected turn is accounted for
    assert len(res.deaths) == 1 and res.deaths[0].startswith("w1 ")
    assert (res.death_ns[0] - killed[0]) / 1e9 < 2.0  # the last will arrives at once
    w1 = set(plan_workers([n for n in needed_stages(cfg) if n != "client"], 2)[1])
    owned_by_w1 = {
        r.session
        for r in res.records
        if any(owner(k, r.session, [f"{k}.0", f"{k}.1"]) in w1 for k in REPLICATED)
    }
    bad = [r for r in res.records if r.status != "ok"]
    for r in bad:
        assert r.error in DIED, r.error
        assert r.session in owned_by_w1  # no turn of a session w0 alone served was lost
    for s in owned_by_w1:  # the moved sessions go on: their last turn is served by w0
        last = max((r for r in res.records if r.session == s), key=lambda r: r.turn)
        assert last.status == "ok", (s, last.error)
    # the SIGKILLed worker's last will cleared its retained marker: nothing stale for the next run
    async with BrokerAddress.parse(mosquitto.url).client(identifier="marker-check") as c:
        await c.subscribe(alive_topic(res.run, "+"), qos=1)
        seen = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.7):
                async for m in c.messages:
                    seen.append(str(m.topic))
    assert seen == []


@pytest.mark.broker
async def test_killing_the_agents_worker_loses_only_its_turns_in_flight(mosquitto):
    """Issue 27: the agent was one instance, so killing its worker failed every later turn (21 of 40). Now
    each worker holds an agent replica (a shadow of the one modelled device): a SIGKILL loses at most the
    turns in flight there, each reported, and those sessions' later turns complete on the survivor."""
    cfg = fast_config("client.start_spread_ms=1000", HW_AGENT, broker=mosquitto.url)
    sc = tiny_scenario(turns=4)
    sessions = 10
    killed: list[int] = []
    done_at_kill: list[int] = []

    def ready(r: RunResult) -> None:
        _kill_after(r, 2.5, signal.SIGKILL, 0, killed)  # w0: the worker that held the only agent before
        asyncio.get_running_loop().call_later(2.5, lambda: done_at_kill.append(len(r.records)))

    res = await run_pipeline(cfg, [sc], sessions, workers=2, on_ready=ready)
    assert killed and 0 < done_at_kill[0] < sessions * 4  # killed after the first turns, mid-run
    assert len(res.records) == sessions * 4  # every expected turn is accounted for
    assert len(res.deaths) == 1 and res.deaths[0].startswith("w0 ") and "agent.0" in res.deaths[0]
    bad = [r for r in res.records if r.status != "ok"]
    assert all(r.error in DIED for r in bad), [r.error for r in bad]
    per_session = Counter(r.session for r in bad)
    assert all(n == 1 for n in per_session.values()), per_session  # only the turn in flight, once
    assert len(bad) <= sessions  # at most one turn in flight per session
    agent0 = {r.session for r in res.records if owner("agent", r.session, ["agent.0", "agent.1"]) == "agent.0"}
    assert agent0, "no session was the killed agent replica's: the test shows nothing"
    for s in {r.session for r in res.records}:  # every turn after the kill's is served (by the survivors)
        failed = [r.turn for r in bad if r.session == s]
        later = [r for r in res.records if r.session == s and failed and r.turn > failed[0]]
        assert all(r.status == "ok" for r in later), (s, [(r.turn, r.error) for r in later])
    moved = [r for r in res.records if r.session in agent0 and r.turn == 3]
    assert moved and all(r.status == "ok" for r in moved)  # the dead replica's sessions' last turns


async def test_a_turn_past_its_deadline_fails_naming_the_stage_that_held_it():
    slow = "agent.backend={ttft_ms: {median: 60000, p90: 61000}, tokens_per_s: 80}"
    cfg = fast_config(slow, "client.turn_timeout_s=1")
    res = await run_pipeline(cfg, [tiny_scenario(turns=1)], 1)
    (rec,) = res.records
    assert rec.status == "failed"
    assert rec.error is not None and rec.error.startswith("timeout: stage agent held the turn"), rec.error


def test_workers_need_a_real_broker_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", "run", "cafe-order", "--workers", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--workers:" in lines[0] and "amqtt" in lines[0]


# -- bridged brokers ---------------------------------------------------------------------------------
@pytest.mark.broker
async def test_stages_on_a_second_broker_joined_by_a_mosquitto_bridge(make_mosquitto, monkeypatch):
    monkeypatch.setenv("VOICEPIPE_RUN_TOKEN", "a shared test secret")  # the run and its stages sign alike
    """The client on broker A, every stage on broker B, B bridged to A (mosquitto's bridge, spawned here)."""
    a = make_mosquitto()
    b = make_mosquitto(bridge=Bridge(address=f"127.0.0.1:{a.port}"))
    await asyncio.sleep(0.5)  # let the bridge connect
    sc = tiny_scenario(turns=2)
    cfg_a = fast_config(broker=a.url)
    cfg_b = fast_config(broker=b.url)
    kinds = [n for n in needed_stages(cfg_a) if n != "client"]
    plan = plan_workers(kinds, 1)
    run = "bridged"
    task = asyncio.create_task(serve_stages(cfg_b, kinds, run, process="far"))
    try:
        res = await run_pipeline(cfg_a, [sc], 3, run_id=run, plan=plan)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert len(res.records) == 6 and {r.status for r in res.records} == {"ok"}, [r.error for r in res.records]
    assert all(r.tax_ms is not None and r.tax_ms < 1000 for r in res.records)


def test_bridge_config_has_the_settings_that_matter(tmp_path):
    from voicepipe.bus.brokers import Mosquitto

    text = Mosquitto(port=1, bridge=Bridge(address="10.0.0.2:1883")).config_text(tmp_path)
    for line in ("connection voicepipe-bridge", "address 10.0.0.2:1883", "topic voicepipe/# both 1",
                 "try_private true", "set_tcp_nodelay true", "max_queued_messages 100000"):  # fmt: skip
        assert line in text
    assert text.index("connection ") > text.index("max_queued_messages")  # bridge options come last


@pytest.mark.broker
async def test_a_stale_retained_marker_without_heartbeat_does_not_start_a_run(mosquitto, monkeypatch):
    monkeypatch.setenv("VOICEPIPE_RUN_TOKEN", "a shared test secret")  # the run and its stages sign alike
    """A marker left behind (a broker that never fired a hung client's will) is not "ready": no beat."""
    from voicepipe.bus.liveness import Marker
    from voicepipe.runner import StagesMissing

    run = "stale"
    async with BrokerAddress.parse(mosquitto.url).client(identifier="ghost") as c:
        marker = Marker(replicas=["asr.0"]).model_dump_json().encode()
        await c.publish(alive_topic(run, "ghost"), marker, qos=1, retain=True)
    cfg = fast_config(broker=mosquitto.url)
    with pytest.raises(StagesMissing, match="asr"):
        await run_pipeline(
            cfg, [tiny_scenario(turns=1)], 1, run_id=run, external=frozenset({"asr"}), ready_timeout_s=2
        )


async def test_a_replica_drops_foreign_sessions_by_topic_before_parsing():
    """The MQTT bus asks the replica's filter on the topic alone; other replicas' sessions are never parsed."""
    from voicepipe.bus.mqtt import BrokerAddress, MqttBus

    members = Membership(["asr.0", "asr.1"])
    inner = MqttBus(BrokerAddress.parse("mqtt://127.0.0.1:1"), "r", "asr.0")  # never connected
    bus = PartitionedBus(inner, "asr.0", members)
    assert inner.accept is not None
    sessions = [f"s-{i}" for i in range(40)]
    mine = [s for s in sessions if members.owner("asr", s) == "asr.0"]
    assert 0 < len(mine) < len(sessions)
    assert [s for s in sessions if inner.accept(s, "user/utterance")] == mine
    assert bus.skipped == len(sessions) - len(mine)
    assert all(inner.accept(s, "session/end") for s in sessions)  # every replica forgets every session
