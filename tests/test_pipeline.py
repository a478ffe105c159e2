"""End-to-end over real brokers: the embedded amqtt one and a mosquitto the test spawns."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import fast_config, tiny_scenario
from voicepipe.backends import BackendPool
from voicepipe.backends.base import LLMRequest
from voicepipe.bus.mqtt import BrokerAddress
from voicepipe.clock import rng_for
from voicepipe.messages import SCHEMA_VERSION
from voicepipe.runner import run_pipeline


def check_records(res, n_turns: int) -> None:
    assert len(res.records) == n_turns
    for r in res.records:
        assert r.status == "ok", r
        assert r.measured_ms is not None and r.predicted_ms is not None
        assert abs(sum(p.ms for p in r.breakdown) - r.measured_ms) < 0.1
        assert r.predicted_ms > 300  # uplink + endpointing + ttft + tts + downlink at the very least
        assert 0 <= r.tax_ms < 250  # bus + scheduling; generous so a loaded box cannot flake
        stages = {p.stage for p in r.breakdown}
        assert {"transport", "asr", "agent", "tts"} <= stages
    assert res.stage_errors == 0
    assert res.open_tasks_after == 0


async def test_scenario_over_embedded_broker():
    res = await run_pipeline(fast_config(), [tiny_scenario()], 1)
    assert res.broker.startswith("embedded amqtt")
    check_records(res, 2)


async def test_scenario_over_spawned_mosquitto_seen_by_external_subscriber(mosquitto):
    cfg = fast_config(broker=mosquitto.url)
    seen: list[str] = []
    ready = asyncio.Event()

    async def watch() -> None:
        async with BrokerAddress.parse(mosquitto.url).client() as c:
            await c.subscribe("voicepipe/#")
            ready.set()
            async for m in c.messages:
                seen.append(str(m.topic))

    watcher = asyncio.create_task(watch())
    await asyncio.wait_for(ready.wait(), 10)
    res = await run_pipeline(cfg, [tiny_scenario()], 1, run_id="ext1")
    await asyncio.sleep(0.2)
    watcher.cancel()
    check_records(res, 2)
    assert not any("set_tcp_nodelay" in w for w in res.warnings)
    channels = {t.split("/", 3)[3] for t in seen if t.startswith("voicepipe/ext1/tiny-0/")}
    assert {
        "user/utterance",
        "asr/partial",
        "asr/final",
        "route",
        "reply/text",
        "tts/audio",
        "turn/record",
    } <= channels


async def test_malformed_messages_are_dead_lettered_and_the_run_completes(mosquitto):
    cfg = fast_config(broker=mosquitto.url)
    addr = BrokerAddress.parse(mosquitto.url)
    dead: list[dict] = []

    async def inject(_result) -> None:
        async with addr.client() as c:
            await c.publish("voicepipe/dl1/tiny-0/asr/final", b"{not json", qos=1)
            await c.publish(
                "voicepipe/dl1/tiny-0/route",
                json.dumps({"v": SCHEMA_VERSION, "type": "route"}).encode(),
                qos=1,
            )
            wrong = {
                "v": SCHEMA_VERSION,
                "type": "control.cancel",
                "run": "dl1",
                "session": "tiny-0",
                "payload": {"reason": "heard"},
            }
            await c.publish("voicepipe/dl1/tiny-0/asr/final", json.dumps(wrong).encode(), qos=1)

    async def collect(ready: asyncio.Event) -> None:
        async with addr.client() as c:
            await c.subscribe("voicepipe/dl1/deadletter")
            ready.set()
            async for m in c.messages:
                dead.append(json.loads(m.payload))

    ready = asyncio.Event()
    collector = asyncio.create_task(collect(ready))
    await asyncio.wait_for(ready.wait(), 10)
    tasks: list[asyncio.Task] = []
    res = await run_pipeline(
        cfg,
        [tiny_scenario()],
        1,
        run_id="dl1",
        on_ready=lambda r: tasks.append(asyncio.create_task(inject(r))),
    )
    await asyncio.sleep(0.2)
    collector.cancel()
    check_records(res, 2)
    assert res.deadletters >= 3
    reasons = " | ".join(d["reason"] for d in dead)
    assert len(dead) >= 3, reasons
    assert "does not belong on channel" in reasons
    assert all(d["topic"].startswith("voicepipe/dl1/tiny-0/") for d in dead)


async def test_switching_backend_moves_the_llm_parts_by_the_ttft_difference():
    sc = tiny_scenario()
    slow = await run_pipeline(fast_config("agent.backend=sonnet-gpu"), [sc], 1)
    fast = await run_pipeline(fast_config("agent.backend=cerebras-llama-3.1-8b"), [sc], 1)
    pool = BackendPool()
    for rs, rf in zip(slow.records, fast.records, strict=True):
        agent_s = sum(p.ms for p in rs.breakdown if p.stage == "agent")
        agent_f = sum(p.ms for p in rf.breakdown if p.stage == "agent")
        ttft = {}
        for name in ("sonnet-gpu", "cerebras-llama-3.1-8b"):
            rng = rng_for(0, rs.session, rs.turn, 0, "agent", "main")
            ttft[name] = pool.get(name).predict(LLMRequest(rs.session, rs.turn, 1000, 10), rng).ttft_s * 1e3
        ttft_gap = ttft["sonnet-gpu"] - ttft["cerebras-llama-3.1-8b"]
        assert ttft_gap > 200
        # the agent's share moves by the TTFT gap plus the (slower) decode to the first clause
        assert ttft_gap <= agent_s - agent_f <= ttft_gap + 300
        other_s = rs.measured_ms - agent_s - sum(p.ms for p in rs.breakdown if p.stage == "bus")
        other_f = rf.measured_ms - agent_f - sum(p.ms for p in rf.breakdown if p.stage == "bus")
        assert abs(other_s - other_f) < 1.0  # same seed: ASR, TTS and transport identical


async def test_concurrent_sessions_share_stage_clients_and_leave_nothing_behind():
    res = await run_pipeline(fast_config(), [tiny_scenario()], 4)
    assert sorted({r.session for r in res.records}) == [f"tiny-{i}" for i in range(4)]
    check_records(res, 8)


async def test_nagle_broker_is_detected_with_the_fix(mosquitto_nagle):
    cfg = fast_config(broker=mosquitto_nagle.url)
    res = await run_pipeline(cfg, [tiny_scenario(turns=1)], 1)
    assert res.probe_ms is not None and res.probe_ms > cfg.broker.probe_warn_ms
    assert any("set_tcp_nodelay true" in w for w in res.warnings)
    check_records(res, 1)


def test_cli_json_records_sum_to_measured_on_mosquitto(mosquitto, tmp_path):
    sc = tmp_path / "tiny.yaml"
    sc.write_text(yaml.safe_dump(tiny_scenario().model_dump(mode="json")))
    out = tmp_path / "turns.jsonl"
    r = subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", "run", str(sc), "--broker", mosquitto.url, "--json", str(out),
         "--set", "client.playout=first_audio", "--set", "agent.backend=groq-llama-3.1-8b"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 2
    for rec in recs:
        for key in ("scenario", "session", "turn", "measured_ms", "predicted_ms", "tax_ms", "budget_ms",
                    "within_budget", "breakdown", "backend"):  # fmt: skip
            assert key in rec
        assert abs(sum(p["ms"] for p in rec["breakdown"]) - rec["measured_ms"]) < 0.1
        assert rec["backend"] == "groq-llama-3.1-8b"
    assert "p50" in r.stdout


async def test_two_sessions_sharing_one_device_are_slower_per_token():
    """Two conversations on one simulated A100 batch together: each decodes slower than alone."""
    sets = (
        "agent.backend=a100-40gb/llama-3.1-8b",
        "agent.prompt_tokens=4000",
        "asr.finalize_ms=100",
        "tts.ttfb_ms=188",
    )
    alone = await run_pipeline(fast_config(*sets), [tiny_scenario(turns=1)], 1)
    shared = await run_pipeline(fast_config(*sets), [tiny_scenario(turns=1)], 2)

    def agent_ms(res) -> float:
        recs = [r for r in res.records if r.measured_ms is not None]
        return sum(sum(p.ms for p in r.breakdown if p.stage == "agent") for r in recs) / len(recs)

    assert len(shared.records) == 2
    assert agent_ms(shared) > agent_ms(alone) * 1.01


def test_broker_with_credentials_and_a_wrong_password(make_mosquitto, tmp_path):
    """A real broker with a password file: the right credentials run, wrong ones are one line, exit 2."""
    m = make_mosquitto(users={"vp": "s3cret"})
    sc = tmp_path / "tiny.yaml"
    sc.write_text(yaml.safe_dump(tiny_scenario(turns=1).model_dump(mode="json")))
    ok = subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", "run", str(sc), "--broker", f"mqtt://vp:s3cret@127.0.0.1:{m.port}",
         "--set", "client.playout=first_audio", "--set", "agent.backend=groq-llama-3.1-8b", "-q"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", "run", str(sc), "--broker", f"mqtt://vp:wrong@127.0.0.1:{m.port}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "broker" in lines[0] and "wrong" not in lines[0]  # password not echoed


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_stage_process_stops_on_signal_even_if_started_ignoring_sigint(mosquitto, monkeypatch, sig):
    """`voicepipe stage` installs its own stop handlers: a process started with SIGINT ignored (nohup, some
    supervisors) still stops cleanly on Ctrl-C, and SIGTERM (what process managers send) stops it too."""
    import signal
    import time

    monkeypatch.setenv("VOICEPIPE_RUN_TOKEN", "a shared test secret")
    proc = subprocess.Popen(
        [sys.executable, "-m", "voicepipe.cli", "stage", "asr", "--run-id", "sig", "--broker", mosquitto.url],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    assert proc.stderr is not None
    line = proc.stderr.readline()  # printed once the config is read; the stage connects right after
    assert b"serving asr" in line, line
    time.sleep(1.0)
    proc.send_signal(getattr(signal, sig))
    try:
        _, rest = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"`voicepipe stage` did not stop on {sig} within 30 s") from None
    assert proc.returncode == 0, rest[-2000:]
    assert b"Traceback" not in rest, rest[-2000:]


async def test_stages_in_another_process(mosquitto, monkeypatch):
    """`voicepipe stage` serves asr/router/agent/tts in a second process; the run plays and measures."""
    import signal

    monkeypatch.setenv("VOICEPIPE_RUN_TOKEN", "a shared test secret")  # the run and its stages sign alike

    from voicepipe.predict import predict

    sets = ["agent.backend=groq-llama-3.1-8b", "client.playout=first_audio"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "voicepipe.cli", "stage", "asr", "router", "agent", "tts", "--run-id", "xproc",
         "--broker", mosquitto.url, *[x for s in sets for x in ("--set", s)]],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        cfg = fast_config(*sets, broker=mosquitto.url)
        sc = tiny_scenario()
        res = await run_pipeline(
            cfg, [sc], 1, run_id="xproc", external=frozenset({"asr", "router", "agent", "tts"})
        )
        check_records(res, 2)
        for rec, p in zip(res.records, predict(cfg, [sc]), strict=True):
            assert rec.predicted_ms == pytest.approx(p.predicted_ms, abs=0.01)  # one host clock, same draws
    finally:
        proc.send_signal(signal.SIGINT)
        try:  # communicate, not wait: a stage process blocked on a full stderr pipe would never exit
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
            raise AssertionError(
                f"stage process ignored SIGINT for 30 s; stderr tail: {stderr[-2000:]!r}"
            ) from None
    assert b"Traceback" not in stderr, stderr[-2000:]
