"""``voicepipe calibrate`` / ``profile import`` and user profiles (files, inline, a ``backends:`` section),
against the fault-injection SSE server (a real socket; the llama.cpp runs are in test_endpoint_llamacpp.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from tests.sse_server import SSEServer
from voicepipe.backends import build_backend
from voicepipe.backends.base import LLMRequest
from voicepipe.backends.calibrate import Settings, against, calibrate
from voicepipe.backends.openai import config_from_spec
from voicepipe.backends.profile import load_profile
from voicepipe.cli import app
from voicepipe.config import load_config
from voicepipe.errors import UserError


@pytest.fixture
def server():
    s = SSEServer(ttft_ms=30.0, token_ms=4.0).start()
    yield s
    s.stop()


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def voicepipe(*args: str) -> Result:
    """The CLI in this process (a subprocess per call would cost seconds of imports each)."""
    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    if r.exception and not isinstance(r.exception, SystemExit):
        raise r.exception
    return Result(r.exit_code, r.stdout, r.stderr)


async def test_calibrate_measures_each_level_and_excludes_warm_up(server):
    cfg = config_from_spec({"endpoint": server.url, "model": "m"})
    done = []
    points = await calibrate(cfg, Settings(concurrency=(1, 3), requests=6, prompt_tokens=(40,), output_tokens=10),
                             lambda: done.append(1))  # fmt: skip
    assert len(done) == 12  # counted requests only
    assert len(server.seen) == 12 + 1 + 3  # plus one warm-up request per client per level
    p1, p3 = points
    assert (p1.concurrency, p3.concurrency) == (1, 3) and p1.requests == p3.requests == 6
    assert p1.output_tokens == 10 and p1.prompt_tokens == 17  # the server's usage counts
    assert p1.ttft_ms.median >= 25  # the server waits 30 ms before the first piece
    assert p1.ttft_ms.median <= p1.ttft_ms.p90 <= p1.ttft_ms.p99
    assert p1.tpot_ms.mean >= 3 and len({s.body["messages"][0]["content"][:12] for s in server.seen}) > 10
    assert p3.request_throughput > p1.request_throughput  # three clients in flight


def test_calibrate_cli_writes_a_loadable_profile_and_compares_with_the_model(server, tmp_path):
    out = tmp_path / "mine.yaml"
    p = voicepipe("calibrate", server.url, "--model", "m", "--concurrency", "1,2", "--requests", "4",
                  "--output-tokens", "8", "--out", str(out), "--against", "a100-40gb/llama-3.1-8b")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "P99 TTFT (ms)" in p.stdout and "Output token throughput (tok/s)" in p.stdout
    assert "MODELLED" in p.stdout and "a100-40gb/llama-3.1-8b" in p.stdout
    b = load_profile(str(out))
    assert b.name == "mine" and b.kind == "profile" and b.ttft_median_s > 0.02
    assert (
        b.profile.source["host"] == f"127.0.0.1:{server.port}"
        and b.profile.source["settings"]["requests"] == 4
    )
    cfg = load_config(None, [f"agent.backend={out}"])
    assert cfg.backend_label() == str(out)


def test_calibrate_bad_input_is_one_line_exit_2(server, tmp_path):
    for args, msg in [
        (["--concurrency", "0"], "--concurrency"),
        (["--against", "nope/nothing"], "--against"),
        (["--against", "sonnet-gpu"], "not a hardware model"),
    ]:
        p = voicepipe("calibrate", server.url, "--model", "m", "--out", str(tmp_path / "x.yaml"), *args)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr
    server.mode = "500"
    p = voicepipe("calibrate", server.url, "--model", "m", "--requests", "2", "--concurrency", "1",
                  "--out", str(tmp_path / "x.yaml"))  # fmt: skip
    assert p.returncode == 2 and "every request at concurrency 1 failed: HTTP 500: boom" in p.stderr


def vllm_result(**over) -> dict:
    """The fields `vllm bench serve --save-result` writes (vllm/benchmarks/serve.py: result_json)."""
    d = {
        "date": "20250101-120000", "endpoint_type": "openai-chat", "model_id": "meta-llama/Llama-3.1-8B-Instruct",
        "num_prompts": 100, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 4, "duration": 20.0,
        "completed": 100, "failed": 0, "total_input_tokens": 51200, "total_output_tokens": 12800,
        "request_throughput": 5.0, "output_throughput": 640.0, "total_token_throughput": 3200.0,
        "mean_ttft_ms": 60.0, "median_ttft_ms": 55.0, "std_ttft_ms": 9.0, "p99_ttft_ms": 95.0,
        "mean_tpot_ms": 6.0, "median_tpot_ms": 5.9, "std_tpot_ms": 0.3, "p99_tpot_ms": 7.0,
        "mean_itl_ms": 6.0, "median_itl_ms": 5.8, "std_itl_ms": 1.0, "p99_itl_ms": 9.0,
        "mean_e2el_ms": 820.0, "median_e2el_ms": 800.0, "std_e2el_ms": 40.0, "p99_e2el_ms": 950.0,
    }  # fmt: skip
    d.update(over)
    return d


def test_profile_import_of_a_vllm_bench_serve_result(tmp_path):
    res = tmp_path / "vllm.json"
    ttfts = list(np.linspace(0.04, 0.10, 100))  # seconds, as vLLM saves them
    res.write_text(json.dumps(vllm_result(ttfts=ttfts)))
    p = voicepipe("profile", "import", str(res), "--out", str(tmp_path / "v.yaml"))
    assert p.returncode == 0, p.stderr
    b = load_profile(str(tmp_path / "v.yaml"))
    assert b.ttft_median_s == pytest.approx(0.055)
    assert b.ttft_p90_s == pytest.approx(np.percentile(np.asarray(ttfts) * 1e3, 90) / 1e3)
    assert b.tokens_per_s == pytest.approx(1e3 / 5.9)
    pt = b.profile.points[0]
    assert (pt.concurrency, pt.prompt_tokens, pt.output_tokens) == (4, 512, 128)
    assert b.profile.source["model"] == "meta-llama/Llama-3.1-8B-Instruct"

    res.write_text(json.dumps(vllm_result()))  # no raw ttfts, no p90: p99 stands in, and says so
    p = voicepipe("profile", "import", str(res), "--out", str(tmp_path / "w.yaml"))
    assert p.returncode == 0 and "p99 used (conservative)" in p.stdout
    assert load_profile(str(tmp_path / "w.yaml")).ttft_p90_s == pytest.approx(0.095)

    bad = vllm_result()
    del bad["median_ttft_ms"]
    res.write_text(json.dumps(bad))
    p = voicepipe("profile", "import", str(res))
    assert p.returncode == 2 and f"{res}: median_ttft_ms: missing" in p.stderr


def test_profile_files_errors_name_the_file_and_field(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"ttft_ms": {"median": 300, "p90": 200}, "tokens_per_s": 50}))
    with pytest.raises(UserError, match=r"p\.yaml: ttft_ms: p90 must be >= median"):
        load_profile(str(f))
    f.write_text(yaml.safe_dump({"ttft_ms": {"median": 300, "p90": 400}, "tokens_per_sec": 50}))
    with pytest.raises(UserError, match="tokens_per_s"):
        load_config(None, [f"agent.backend={f}"])


def test_a_profile_interpolates_ttft_in_prompt_length(tmp_path):
    def point(prompt: float, ttft: float) -> dict:
        s = {"mean": ttft, "median": ttft, "p90": ttft, "p99": ttft}
        t = {"mean": 5.0, "median": 5.0, "p90": 5.0, "p99": 5.0}
        return {"concurrency": 1, "prompt_tokens": prompt, "output_tokens": 32, "requests": 8, "duration_s": 1.0,
                "ttft_ms": s, "tpot_ms": t, "itl_ms": t, "e2el_ms": s, "output_throughput": 100.0,
                "request_throughput": 3.0}  # fmt: skip

    prof = {
        "ttft_ms": {"median": 100, "p90": 100},
        "tokens_per_s": 200,
        "points": [point(100, 100), point(1100, 300)],
    }
    b = build_backend(prof)  # an inline profile mapping
    rng = np.random.default_rng(0)
    t = [b.predict(LLMRequest("s", 0, n, 10), rng).ttft_s for n in (50, 600, 5000)]
    assert t == pytest.approx([0.1, 0.2, 0.3])


def test_a_backends_section_names_reusable_specs(tmp_path, server):
    cfg_file = tmp_path / "pipe.yaml"
    cfg_file.write_text(yaml.safe_dump({
        "backends": {"my-vllm": {"endpoint": server.url, "model": "m", "timeout": 5}, "fast": "cerebras-llama-3.1-8b"},
        "agent": {"backend": "my-vllm", "extra": {"quick": "fast"}},
        "council": {"members": ["fast", "my-vllm"]},
    }))  # fmt: skip
    cfg = load_config(cfg_file)
    assert cfg.backend_label() == "my-vllm"
    assert build_backend(cfg.agent.backend).kind == "endpoint"
    assert (
        cfg.agent.extra["quick"] == "cerebras-llama-3.1-8b"
        and cfg.council.members[0] == "cerebras-llama-3.1-8b"
    )
    with pytest.raises(UserError, match=r"agent\.backend"):
        load_config(cfg_file, ["agent.backend=my-vlm"])


def test_against_runs_the_hardware_model_at_the_measured_settings():
    from voicepipe.backends.profile import Point, Stat

    s = Stat(mean=50.0, median=50.0, p90=60.0, p99=70.0)
    t = Stat(mean=8.0, median=8.0, p90=9.0, p99=10.0)
    pts = [Point(concurrency=c, prompt_tokens=256, output_tokens=64, requests=16, duration_s=5.0, ttft_ms=s,
                 tpot_ms=t, itl_ms=t, e2el_ms=s, output_throughput=100.0 * c, request_throughput=1.0)
           for c in (1, 8)]  # fmt: skip
    rows = against("h100-sxm/llama-3.1-8b", pts)
    assert [r.concurrency for r in rows] == [1, 8]
    assert rows[1].modelled_throughput > rows[0].modelled_throughput  # batching on the modelled device
    assert rows[0].modelled_tpot_ms < rows[1].modelled_tpot_ms  # and each user a little slower
