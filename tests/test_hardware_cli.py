"""`voicepipe hardware` commands through typer's CliRunner."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from voicepipe.cli.hardware import app
from voicepipe.hardware import catalog as cat

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_list_shows_devices_models_and_empirical_profiles():
    r = run("list")
    assert r.exit_code == 0, r.output
    for name in ("h200-sxm", "groq-lpu", "kimi-k2", "sonnet-gpu", "cerebras-llama-3.1-8b"):
        assert name in r.output


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("h100-sxm", "3.35 TB/s"),
        ("llama-3.1-8b", "config.json"),
        ("sonnet-gpu", "Artificial Analysis"),
        ("claude-3.5-sonnet", "88.7"),
        ("cerebras-wse3/llama-3.1-8b", "MODELLED"),
        ("vllm-v0", "vLLM PR #8310"),  # a stack with engine memory and an AMD build with its sources
    ],
)
def test_show_prints_sources(name, needle):
    r = run("show", name)
    assert r.exit_code == 0, r.output
    assert needle in r.output


def test_show_prints_a_whole_number_as_one():
    r = run("show", "h100-sxm")
    row = next(line for line in r.output.splitlines() if "memory_gb" in line)
    assert " 80 " in row and "80.0" not in row
    assert "3.35" in next(line for line in r.output.splitlines() if "mem_bw_tbs" in line)


def test_show_unknown_is_a_one_line_error():
    r = run("show", "warp-drive")
    assert r.exit_code == 2
    assert "warp-drive" in r.output and "Traceback" not in r.output


def test_predict_json_keys_and_values():
    r = run("predict", "--hardware", "a100-40gb", "--model", "llama-3.1-8b", "--prompt-tokens", "1024",
            "--output-tokens", "128", "--format", "json")  # fmt: skip
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    for key in ("tokens_per_second", "ttft_ms", "step_ms", "chips", "fits", "bound", "aggregate_tokens_per_second",
                "weights_gb", "kv_gb", "sources"):  # fmt: skip
        assert key in out
    assert out["fits"] is True and out["bound"] == "memory" and out["chips"] == 1
    # the published 75 tok/s (vLLM on A100); the HBM constants are fitted elsewhere, so out of sample
    assert out["tokens_per_second"] == pytest.approx(75, rel=0.3)
    assert out["step_ms"] == pytest.approx(1000 / out["tokens_per_second"], rel=1e-9)


def test_predict_labels_a_batched_ttft_as_a_mean_with_queueing_not_as_idle():
    """At batch 1 the TTFT is a request alone; among 300 clients (past vLLM's 256 running at once) the
    mean TTFT is seconds of queueing, which an "idle, no queue" label would misstate."""
    wide = {"COLUMNS": "200"}
    alone = runner.invoke(app, ["predict", "-H", "h100-sxm", "-m", "llama-3.1-8b"], env=wide)
    many = runner.invoke(app, ["predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--batch", "300"], env=wide)
    assert alone.exit_code == 0 and many.exit_code == 0, many.output
    assert "TTFT (client-side, idle, no queue)" in alone.output
    assert "TTFT (client-side, mean over 300 clients, queueing included)" in many.output
    assert "idle, no queue" not in many.output
    q = json.loads(run("predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--batch", "300", "--format", "json").output)
    assert q["ttft_ms"] > 10 * json.loads(run("predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--format",
                                              "json").output)["ttft_ms"]  # fmt: skip


def test_predict_batch_tp_precision_change_the_answer():
    base = json.loads(
        run("predict", "-H", "h100-sxm", "-m", "llama-3.1-70b", "--tp", "4", "--format", "json").output
    )
    wide = json.loads(
        run("predict", "-H", "h100-sxm", "-m", "llama-3.1-70b", "--tp", "8", "--format", "json").output
    )
    fp8 = json.loads(
        run(
            "predict",
            "-H",
            "h100-sxm",
            "-m",
            "llama-3.1-70b",
            "--tp",
            "4",
            "--precision",
            "fp8",
            "--format",
            "json",
        ).output
    )
    big = json.loads(run("predict", "-H", "h100-sxm", "-m", "llama-3.1-70b", "--tp", "4", "--batch", "64",
                         "--format", "json").output)  # fmt: skip
    assert wide["chips"] == 8 and wide["tokens_per_second"] > base["tokens_per_second"]
    # fp8 halves every weight but the embedding and output head, which stay 16-bit (2 x 128,256 x 8,192)
    head_gb = 2 * 128_256 * 8_192 * 2 / 1e9
    assert fp8["weights_gb"] == pytest.approx((base["weights_gb"] - head_gb) / 2 + head_gb)
    assert fp8["tokens_per_second"] > base["tokens_per_second"]
    assert big["tokens_per_second"] < base["tokens_per_second"]
    assert big["aggregate_tokens_per_second"] > 30 * base["aggregate_tokens_per_second"]


def test_predict_answers_for_sampled_fitting_pairs():
    for d in cat.devices():
        for m in ("llama-3.2-1b", "qwen3-8b", "gpt-oss-20b"):
            r = run("predict", "-H", d, "-m", m, "--format", "json")
            assert r.exit_code == 0, (d, m, r.output)
            assert json.loads(r.output)["fits"] is True


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-H", "nope", "-m", "llama-3.1-8b"], "--hardware"),
        (["-H", "h100-sxm", "-m", "nope"], "--model"),
        (["-H", "h100-sxm", "-m", "llama-3.1-8b", "--precision", "fp6"], "--precision"),
        (["-H", "h100-sxm", "-m", "llama-3.1-8b", "--tp", "16"], "tp"),
        (["-H", "h100-sxm", "-m", "llama-3.1-8b", "--speculative", "0.8"], "--speculative"),
        (["-H", "a100-40gb", "-m", "llama-3.1-405b"], "does not fit"),
    ],
)
def test_predict_bad_input_exits_2_with_one_line(args, needle):
    r = run("predict", *args)
    assert r.exit_code == 2
    assert needle in r.output and "Traceback" not in r.output


def test_predict_not_fitting_json_says_fits_false():
    r = run("predict", "-H", "a100-40gb", "-m", "llama-3.1-405b", "--format", "json")
    assert r.exit_code == 2
    first = r.output.splitlines()[0]
    assert json.loads(first)["fits"] is False


def test_sweep_shows_the_fast_mode_trade_off():
    r = run("sweep", "-H", "h100-sxm", "-m", "llama-3.1-70b", "--format", "json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    rows = {row["batch"]: row for row in out["rows"]}
    fast, default = rows[out["fast_max_batch"]], rows[out["default_max_batch"]]
    assert "fast" in fast["mode"] and "default" in default["mode"]
    assert fast["per_user_tps"] > default["per_user_tps"]
    assert fast["aggregate_tps"] < default["aggregate_tps"]
    assert fast["usd_per_mtok_out"] > default["usd_per_mtok_out"]
    fitting = [row for row in out["rows"] if row["fits"]]
    steps = [row["step_ms"] for row in fitting]
    assert steps == sorted(steps)


def test_a_value_and_its_range_share_thousands_separators_in_sweep_and_predict():
    """`11040 (7,585–17,558)` read as two kinds of number; both sides of a cell are written alike."""
    import re

    wide = {"COLUMNS": "200"}
    r = runner.invoke(app, ["sweep", "-H", "h100-sxm", "-m", "llama-3.1-70b", "--batches", "256"], env=wide)
    assert r.exit_code == 0, r.output
    p = runner.invoke(app, ["predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--batch", "1000"], env=wide)
    assert p.exit_code == 0, p.output
    cells = re.findall(r"(\d[\d,.]*) \((\d[\d,.]*)–(\d[\d,.]*)\)", r.output + p.output)
    big = [c for c in cells if float(c[0].replace(",", "")) >= 1000]
    assert len(big) >= 3, cells  # sweep's TTFT and total tok/s, predict's TTFT and aggregate tok/s
    assert all("," in c[0] for c in big), big


def test_sweep_table_and_bad_batches():
    r = run("sweep", "-H", "cerebras-wse3", "-m", "llama-3.1-8b", "--batches", "1,8,64")
    assert r.exit_code == 0, r.output
    assert "MODELLED" in r.output and "fast" in r.output
    bad = run("sweep", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--batches", "1,x")
    assert bad.exit_code == 2 and "--batches" in bad.output
