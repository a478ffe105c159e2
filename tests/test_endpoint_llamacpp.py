"""The endpoint backend and ``voicepipe calibrate`` against a real llama.cpp server (llama-cpp-python)
serving a tiny random-weight Llama the test writes (tests/llamacpp_server.py). No HTTP mocks.

Marker ``endpoint``: skipped unless the server package is installed (``pip install -e '.[endpoint]'``,
which builds llama.cpp from source: ~5 min on 2 cores, once); .ci/run installs it and runs these.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from tests.conftest import UNDER_CI, fast_config, tiny_scenario
from tests.llamacpp_server import LlamaServer, available, write_tiny_gguf
from voicepipe.backends import build_backend
from voicepipe.backends.base import LLMRequest
from voicepipe.runner import run_pipeline

pytestmark = pytest.mark.endpoint


def wait_for(pred, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    why = available()
    if why:
        if UNDER_CI or os.environ.get("VOICEPIPE_REQUIRE_ENDPOINT"):
            pytest.fail(f"endpoint tests are required here: {why}")
        pytest.skip(why)
    d = tmp_path_factory.mktemp("llama")
    srv = LlamaServer(write_tiny_gguf(d / "tiny.gguf"), d / "server.log").start()
    yield srv
    srv.stop()


def spec(srv: LlamaServer, **kw) -> str:
    return "agent.backend=" + json.dumps({"endpoint": srv.url, "model": srv.model_name, **kw})


def voicepipe(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )


async def test_a_scenario_runs_end_to_end_with_measured_ttft_and_itl(llama):
    res = await run_pipeline(fast_config(spec(llama)), [tiny_scenario(turns=2)], 1)
    assert len(res.records) == 2 and res.stage_errors == 0 and res.open_tasks_after == 0
    for r in res.records:
        assert r.status == "ok", r
        agent = {s.what: s for s in r.spans if s.stage == "agent"}
        assert set(agent) == {"ttft", "decode"} and not any(s.modelled for s in agent.values())
        assert agent["ttft"].dur_ns > 0 and agent["decode"].dur_ns > 0
        # llama-cpp-python 0.3 streams no usage chunk: output tokens are the pieces received
        assert r.output_tokens >= 1
        assert r.reply_text and r.reply_text != tiny_scenario(turns=2).turns[r.turn].reply
    b = build_backend(json.loads(spec(llama).split("=", 1)[1]))
    assert b.kind == "endpoint"


def test_calibrate_writes_a_profile_that_run_then_uses(llama, tmp_path):
    prof = tmp_path / "tiny.yaml"
    p = voicepipe("calibrate", llama.url, "--model", llama.model_name, "--concurrency", "1,2", "--requests", "6",
                  "--prompt-tokens", "64", "--output-tokens", "24", "--ignore-eos", "--out", str(prof),
                  "--against", "h100-sxm/llama-3.1-8b")  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Median TTFT (ms)" in p.stdout and "MODELLED" in p.stdout and "MEASURED" in p.stdout
    data = yaml.safe_load(prof.read_text())
    assert (
        data["source"]["host"] == f"127.0.0.1:{llama.port}"
        and data["source"]["tool"] == "voicepipe calibrate"
    )
    assert [pt["concurrency"] for pt in data["points"]] == [1, 2]
    assert all(pt["requests"] == 6 and pt["failed"] == 0 for pt in data["points"])
    assert all(pt["output_tokens"] == 24 for pt in data["points"])  # ignore_eos: exact lengths
    assert 0 < data["ttft_ms"]["median"] <= data["ttft_ms"]["p90"] and data["tokens_per_s"] > 0

    # the profile as a modelled backend: run and predict use its numbers
    sc = tmp_path / "one.yaml"
    sc.write_text(
        yaml.safe_dump({"name": "one", "turns": [{"user": "A latte please.", "reply": "Sure, one latte."}]})
    )
    out = tmp_path / "r.jsonl"
    p = voicepipe("run", str(sc), "--set", f"agent.backend={prof}", "--set", "client.playout=first_audio",
                  "--json", str(out))  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads(out.read_text().splitlines()[0])
    ttft = next(s for s in rec["spans"] if s["stage"] == "agent" and s["what"] == "ttft")
    assert rec["status"] == "ok" and ttft["modelled"] and rec["backend"] == "tiny"

    # and as the endpoint's calibration: measured spans carry the profile's prediction
    p = voicepipe("run", str(sc), "--set", spec(llama, profile=str(prof)), "--set", "client.playout=first_audio",
                  "--json", str(out))  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads(out.read_text().splitlines()[0])
    ttft = next(s for s in rec["spans"] if s["stage"] == "agent" and s["what"] == "ttft")
    assert rec["status"] == "ok" and not ttft["modelled"] and ttft["predicted_ns"] > 0


async def test_cancel_stops_the_servers_generation(llama):
    """llama.cpp serves one request at a time: if a cancelled request kept generating its 1,600 tokens,
    the next request would wait for them. It must not (the server saw the disconnect). The generation is
    long (~2 s) so that the server's own disconnect latency (up to ~0.4 s seen on a loaded box) stays far
    from the threshold."""
    b = build_backend(json.loads(spec(llama, extra={"ignore_eos": True}).split("=", 1)[1]))
    rng = np.random.default_rng(0)

    def req(n: int) -> LLMRequest:
        return LLMRequest("s", n, 20, 1600, 0, (("user", "hello"),))

    full = b.start(req(0), time.monotonic_ns(), rng)
    await full.wait_closed()
    full_s = b.log[-1].e2el_ms / 1e3
    assert b.log[-1].completion_tokens >= 1500  # pieces; a few byte tokens decode to nothing

    s = b.start(req(1), time.monotonic_ns(), rng)
    await s.token_time(3)
    s.cancel()
    await s.wait_closed()
    assert b.log[-1].cancelled and 4 <= b.log[-1].completion_tokens < 1500
    # uvicorn/sse-starlette log the client going away
    assert wait_for(lambda: "Disconnected from client" in llama.log_path.read_text())
    nxt = b.start(LLMRequest("s", 2, 20, 4, 0, (("user", "hi"),)), time.monotonic_ns(), rng)
    await nxt.wait_closed()
    assert not b.log[-1].error
    assert b.log[-1].ttft_ms / 1e3 < full_s / 2, (b.log[-1].ttft_ms, full_s)


async def test_a_killed_server_fails_the_affected_turns_and_the_run_completes(tmp_path):
    why = available()
    if why:
        pytest.skip(why)
    srv = LlamaServer(write_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "server.log").start()
    recs = []

    def on_record(r):
        recs.append(r)
        if len(recs) == 1:
            srv.kill()

    try:
        res = await run_pipeline(
            fast_config(spec(srv, timeout=5)), [tiny_scenario(turns=3)], 1, on_record=on_record
        )
    finally:
        srv.stop()
    assert [r.status for r in res.records] == ["ok", "failed", "failed"]
    assert all("cannot connect" in r.error or "connection dropped" in r.error for r in res.records[1:])
    assert res.open_tasks_after == 0
