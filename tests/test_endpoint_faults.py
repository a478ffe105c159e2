"""The endpoint backend against a real HTTP server that misbehaves on purpose (tests/sse_server.py):
real sockets and real SSE, no HTTP mocks. The llama.cpp server tests (marker ``endpoint``) are in
test_endpoint_llamacpp.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from tests.conftest import fast_config, tiny_scenario
from tests.sse_server import SSEServer
from voicepipe.backends import UnknownBackend, build_backend
from voicepipe.backends.base import LLMRequest
from voicepipe.config import load_config
from voicepipe.errors import UserError
from voicepipe.runner import run_pipeline
from voicepipe.text import tokens_of


@pytest.fixture
def server():
    s = SSEServer().start()
    yield s
    s.stop()


def endpoint(srv: SSEServer, **kw) -> str:
    spec = {"endpoint": srv.url, "model": "test-model", **kw}
    return "agent.backend=" + json.dumps(spec)


def req(turn: int = 0, out: int = 12) -> LLMRequest:
    return LLMRequest("s", turn, 50, out, 0, (("user", "hello"),))


async def test_scenario_streams_the_models_own_text_with_measured_spans(server):
    prices = {"input_per_mtok": 1.0, "output_per_mtok": 2.0, "source": "test"}
    cfg = fast_config(endpoint(server, prices=prices), "client.playout=full")  # counts come at the end
    res = await run_pipeline(cfg, [tiny_scenario(turns=1)], 1)
    assert len(res.records) == 1 and res.stage_errors == 0 and res.open_tasks_after == 0
    for r in res.records:
        assert r.status == "ok", r
        assert r.reply_text.startswith("Word0 w1")  # the server's words, not the scenario's reply
        agent = [s for s in r.spans if s.stage == "agent"]
        assert [s.what for s in agent] == ["ttft", "decode"]
        assert all(not s.modelled and s.predicted_ns is None for s in agent)
        assert agent[0].dur_ns >= 15e6  # the server waits 20 ms before its first piece
        assert r.input_tokens == 17  # the server's usage field, not the modelled prompt
        # max_tokens is the reference reply's length; the server streams min(30, max_tokens) pieces
        assert r.output_tokens == min(30, len(tokens_of(tiny_scenario().turns[r.turn].reply)))
        assert r.cost_usd == pytest.approx((17 * 1.0 + r.output_tokens * 2.0) / 1e6)
        m = r.endpoint  # the request's vLLM-style metrics, once the reply played out
        assert m is not None and m.usage_reported and m.completion_tokens == r.output_tokens
        assert m.ttft_ms == pytest.approx(agent[0].dur_ns / 1e6) and m.e2el_ms > m.ttft_ms
        assert m.itl_ms_mean > 0 and m.tpot_ms > 0
        # no profile: the LLM time is measured, not predicted, so it lands in the tax
        assert r.tax_ms >= agent[0].dur_ns / 1e6 - 1
    body = server.seen[0].body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"][-1] == {"role": "user", "content": "Hi, can I get a latte?"}


async def test_a_calibrated_profile_gives_the_prediction_so_the_tax_stays_pipeline_overhead(server, tmp_path):
    prof = tmp_path / "mine.yaml"
    prof.write_text(yaml.safe_dump({"ttft_ms": {"median": 25, "p90": 25}, "tokens_per_s": 180}))
    res = await run_pipeline(fast_config(endpoint(server, profile=str(prof))), [tiny_scenario()], 1)
    for r in res.records:
        assert r.status == "ok", r
        ttft = next(s for s in r.spans if s.stage == "agent" and s.what == "ttft")
        assert ttft.predicted_ns == 25_000_000 and not ttft.modelled
        # predicted covers the profile's 25 ms TTFT and 5.6 ms/token; the server takes 20 ms + HTTP and
        # 5 ms/token, so the tax is the pipeline's overhead give or take a few ms of LLM misprediction
        assert -20 < r.tax_ms < 250


async def test_cancel_closes_the_stream_at_once_and_counts_what_arrived(server):
    server.token_ms = 50.0
    b = build_backend(f"openai:{server.url}#m")
    s = b.start(req(out=40), time.monotonic_ns(), np.random.default_rng(0))
    await s.token_time(2)
    s.cancel()
    await s.wait_closed()
    assert server.wait_for(lambda: server.seen[-1].ended == "disconnected")
    assert server.seen[-1].pieces_sent < 40
    st = b.log[-1]
    assert st.cancelled and st.completion_tokens == len(s.pieces) >= 3 and not st.usage_reported


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("kill", "connection dropped"),
        ("429", "rate limited (HTTP 429, Retry-After: 7 s): slow down"),
        ("500", "HTTP 500: boom"),
        ("malformed", "malformed SSE"),
        ("slow", "timeout: no data for 0.5 s"),
    ],
)
async def test_failures_fail_the_turn_with_a_reason_and_the_run_goes_on(server, mode, reason):
    server.mode = mode
    res = await run_pipeline(fast_config(endpoint(server, timeout=0.5)), [tiny_scenario(turns=1)], 1)
    assert len(res.records) == 1 and res.open_tasks_after == 0
    for r in res.records:
        assert r.status == "failed" and reason in r.error, r


async def test_a_server_killed_mid_run_fails_only_the_turns_it_affected(server):
    cfg = fast_config(endpoint(server, timeout=2))
    recs = []

    def on_record(r):
        recs.append(r)
        server.mode = "kill" if len(recs) == 1 else "ok"  # dies during turn 2 only

    res = await run_pipeline(cfg, [tiny_scenario(turns=3)], 1, on_record=on_record)
    assert [r.status for r in res.records] == ["ok", "failed", "ok"]
    assert "connection dropped" in res.records[1].error


def test_the_api_key_is_sent_but_never_printed_logged_or_exported(server, tmp_path):
    secret = "sk-test-0123456789abcdef-SECRET"
    env = {**os.environ, "VP_TEST_KEY": secret}
    out = tmp_path / "turns.jsonl"
    sc = tmp_path / "one.yaml"
    sc.write_text(
        yaml.safe_dump(
            {"name": "one", "turns": [{"user": "Hi there, a latte?", "reply": "Sure, one latte."}]}
        )
    )
    spec = {"endpoint": server.url, "model": "m", "api_key_env": "VP_TEST_KEY"}
    cmd = [sys.executable, "-m", "voicepipe.cli", "run", str(sc), "--set", f"agent.backend={json.dumps(spec)}",
           "--set", "client.playout=first_audio", "--json", str(out)]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert server.seen and all(s.headers["authorization"] == f"Bearer {secret}" for s in server.seen)
    files = [f.read_text() for f in tmp_path.rglob("*") if f.is_file()]
    for text in (p.stdout, p.stderr, *files):
        assert secret not in text
    assert out.read_text().strip()  # records were written (and checked above)


def test_spec_errors_are_one_line_naming_the_field(monkeypatch):
    monkeypatch.delenv("VP_MISSING", raising=False)
    cases = {
        "openai:http://h/v1": "expected openai:URL#model",
        json.dumps({"endpoint": "ftp://x", "model": "m"}): "endpoint: 'ftp://x' is not an http(s) URL",
        json.dumps({"endpoint": "http://x/v1", "model": "m", "api_key_env": ""}): "api_key_env",
        json.dumps({"endpoint": "http://x/v1", "model": "m", "tmeout": 3}): "tmeout: unknown endpoint field",
        "./no-such.yaml": "no such profile file",
    }
    for spec, msg in cases.items():
        with pytest.raises(UserError, match=r"agent\.backend") as ei:
            load_config(None, [f"agent.backend={spec}"])
        assert msg in str(ei.value) and "\n" not in str(ei.value)


async def test_predict_without_a_profile_says_how_to_get_one():
    b = build_backend("openai:http://127.0.0.1:9/v1#m")
    with pytest.raises(UserError, match="voicepipe calibrate"):
        b.predict(req(), np.random.default_rng(0))
    with pytest.raises(UnknownBackend):
        build_backend({"endpoint": "http://127.0.0.1:9/v1"})


async def test_a_slow_consumer_still_gets_the_final_chunk(server):
    """The reply may finish while the agent is busy publishing a chunk: no wake-up may be lost."""
    from voicepipe.stages.agent import chunk_ends

    server.token_ms = 0.0
    b = build_backend(f"openai:{server.url}#m")
    s = b.start(req(out=30), time.monotonic_ns(), np.random.default_rng(0))
    got = []
    async with asyncio.timeout(20):  # a lost wake-up hangs here
        async for end, final in s.chunks(lambda toks: chunk_ends(toks, 4)):
            got.append((end, final))
            await asyncio.sleep(0.05)  # the stream ends meanwhile
    assert got[-1] == (29, True) and [e for e, _ in got] == sorted({e for e, _ in got})


@pytest.mark.parametrize("aggregation", ["first", "judge"])
async def test_council_members_and_judge_can_be_endpoints(server, aggregation):
    member = f"openai:{server.url}#m"
    cfg = fast_config("router.policy=rules", "router.default=council", f"council.aggregation={aggregation}",
                      f'council.members=["{member}", cerebras-llama-3.1-8b]', f"council.judge={member}")  # fmt: skip
    res = await run_pipeline(cfg, [tiny_scenario(turns=2)], 1)
    assert [r.status for r in res.records] == ["ok", "ok"] and res.stage_errors == 0
    if aggregation == "judge":  # the judge's own words are spoken
        assert all(r.reply_text.startswith("Word0") for r in res.records)
