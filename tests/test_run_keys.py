"""Keys per run instance (issue 27 item 1): a recorded run replayed into a later start of the same run id
and token changes no turn and is counted; a second concurrent start of a run id is refused with one line."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import aiomqtt
import pytest

from tests.conftest import fast_config, tiny_scenario
from voicepipe.bus.mqtt import BrokerAddress
from voicepipe.errors import UserError
from voicepipe.keys import TOKEN_ENV, Instance, body_verified, seal
from voicepipe.messages import Audio, Envelope, Path, TurnMeta
from voicepipe.runner import run_pipeline
from voicepipe.runresult import RunResult


def _audio(run: str = "r") -> Envelope:
    meta = TurnMeta(backend="b", path=Path.AGENT)
    env = Envelope.of(Audio(seq=0, text="x", duration_ms=10.0, last=True, words=1, segment=0, meta=meta), run, "s", 0)
    env.src, env.seq = "tts/1", 0
    return env


def test_two_starts_of_one_run_id_and_token_sign_with_different_keys():
    a, b = Instance.new(b"same token", "demo"), Instance.new(b"same token", "demo")
    assert a.nonce != b.nonce and a.key != b.key
    assert Instance.of(b"same token", "demo", a.nonce).key == a.key  # a stage that read the nonce joins it
    assert Instance.of(b"other token", "demo", a.nonce).key != a.key
    assert "key" not in repr(a) or a.key.hex() not in repr(a)
    env = _audio()
    body = seal(env, a.key)
    assert body_verified(body, env.auth, a.key) and not body_verified(body, env.auth, b.key)


async def _capture(url: str, into: list[tuple[str, bytes]], stop: asyncio.Event) -> None:
    """A client with no token that records everything under voicepipe/# (retained records too)."""
    async with aiomqtt.Client("127.0.0.1", BrokerAddress.parse(url).port, identifier="recorder") as c:
        await c.subscribe("voicepipe/#", qos=1)
        async for m in c.messages:
            if stop.is_set():
                return
            if isinstance(m.payload, bytes | bytearray) and m.payload:
                into.append((str(m.topic), bytes(m.payload)))


@pytest.mark.broker
async def test_a_recorded_run_replayed_into_the_next_start_falsifies_no_turn(mosquitto, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "the README's exported token")
    cfg = fast_config("client.turn_timeout_s=5", broker=mosquitto.url)
    sc, run = tiny_scenario(turns=2), "demo"
    recorded: list[tuple[str, bytes]] = []
    stop = asyncio.Event()
    rec = asyncio.create_task(_capture(mosquitto.url, recorded, stop))
    await asyncio.sleep(0.5)
    first = await run_pipeline(cfg, [sc], 2, run_id=run)
    await asyncio.sleep(0.3)
    stop.set()
    rec.cancel()
    with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
        await rec
    audio = [(t, b) for t, b in recorded if t.endswith("/tts/audio")]
    assert len(audio) >= 4 and {r.status for r in first.records} == {"ok"}

    replayed = 0

    async def replay(_r: RunResult) -> None:  # the whole recording, again and again, while run 2 plays
        nonlocal replayed
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="replayer") as c:
            for _ in range(12):
                for t, body in recorded:
                    if "/_" not in t:  # the messages (announcements too would only be stale)
                        await c.publish(t, body, qos=1)
                        replayed += 1
                await asyncio.sleep(0.25)

    tasks: list[asyncio.Task[None]] = []
    second = await run_pipeline(cfg, [sc], 2, run_id=run, on_ready=lambda r: tasks.append(asyncio.create_task(replay(r))))
    await asyncio.gather(*tasks, return_exceptions=True)
    clean = await run_pipeline(cfg, [sc], 2, run_id=run)
    assert replayed > 0
    key = lambda r: (r.session, r.turn)  # noqa: E731
    got, want = sorted(second.records, key=key), sorted(clean.records, key=key)
    assert [r.status for r in got] == ["ok"] * 4, [r.error for r in got]
    for g, w in zip(got, want, strict=True):
        assert (g.reply_text, g.backend) == (w.reply_text, w.backend)  # nothing of run 1's replies
        assert g.measured_ms > 300 and 0 <= g.tax_ms < 250  # the run's own reply, not a replayed one's time
    # every replayed message was refused by MAC (the first run's key) and counted
    assert second.counters.dead["unauthenticated"] >= len(audio)
    assert clean.counters.dead["unauthenticated"] == 0


@pytest.mark.broker
async def test_a_second_start_of_a_live_run_id_is_refused(mosquitto, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "shared")
    cfg = fast_config(broker=mosquitto.url)
    refused: list[BaseException] = []

    async def second(_r: RunResult) -> None:
        try:
            await run_pipeline(cfg, [tiny_scenario(turns=1)], 1, run_id="busy")
        except UserError as exc:
            refused.append(exc)

    tasks: list[asyncio.Task[None]] = []
    first = await run_pipeline(
        cfg, [tiny_scenario(turns=4)], 1, run_id="busy", on_ready=lambda r: tasks.append(asyncio.create_task(second(r)))
    )
    await asyncio.gather(*tasks)
    assert {r.status for r in first.records} == {"ok"}  # the first run never noticed
    assert len(refused) == 1 and "already running" in str(refused[0]) and "--run-id" in str(refused[0])
    # once it ended, the run id is free again
    again = await run_pipeline(cfg, [tiny_scenario(turns=1)], 1, run_id="busy")
    assert [r.status for r in again.records] == ["ok"]


@pytest.mark.broker
async def test_the_cli_refuses_a_second_start_with_one_line_exit_2(mosquitto, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "shared")
    cfg = fast_config(broker=mosquitto.url)
    got: list[subprocess.CompletedProcess[str]] = []

    async def cli(_r: RunResult) -> None:
        cmd = [sys.executable, "-m", "voicepipe.cli", "run", "cafe-order", "--run-id", "cli-busy",
               "--broker", mosquitto.url]  # fmt: skip
        got.append(await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=60))

    tasks: list[asyncio.Task[None]] = []
    await run_pipeline(
        cfg, [tiny_scenario(turns=9)], 1, run_id="cli-busy", on_ready=lambda r: tasks.append(asyncio.create_task(cli(r)))
    )
    await asyncio.gather(*tasks)
    (r,) = got
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and "--run-id" in lines[0] and "already running" in lines[0], lines
