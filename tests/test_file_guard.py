"""The one file guard (voicepipe.files) for every file the tool reads, run-id validation, and control
characters escaped in everything printed.

Model config.json files, device YAML, profiles and ``profile import`` JSON get the hostile file set of
tests/hostile.py (JSON_FILES, FILE_LEVEL): each is one line naming the file, exit 2, no traceback. The real
entry point is run in subprocesses for the files that used to hang or crash it (/dev/zero, a FIFO, a
200k-deep JSON); their timeout is lazy (20 s) so a loaded box cannot flake them, the speed itself is
measured by bench/bad_files.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.hostile import FILE_LEVEL, JSON_FILES, Hostile
from voicepipe.cli import app
from voicepipe.config import PipelineConfig
from voicepipe.errors import UserError, check_run_id
from voicepipe.files import read_bytes, read_json
from voicepipe.limits import MAX_FILE_BYTES, MAX_RUN_ID
from voicepipe.safeprint import printable

runner = CliRunner()
NO_BROKER = {"VOICEPIPE_BROKER": "mqtt://127.0.0.1:9"}


def one_line(res_text: str) -> str:
    lines = [ln for ln in res_text.splitlines() if ln.strip()]
    assert len(lines) == 1, res_text
    assert "Traceback" not in res_text
    return lines[0]


def invoke(args: list[str]) -> str:
    res = runner.invoke(app, args, env=NO_BROKER)
    text = res.stdout + res.stderr
    assert res.exit_code == 2, f"{args}: exit {res.exit_code}\n{text}\n{res.exception!r}"
    return one_line(text)


def model_config(tmp_path: Path, model: Path) -> Path:
    c = tmp_path / "model-config.yaml"
    c.write_text(f"agent:\n  backend: {{hardware: h100-sxm, model: '{model}'}}\n")
    return c


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", *args],
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, **NO_BROKER},
    )


# --- hostile JSON: a model's config.json and a vLLM result --------------------------------------------


@pytest.mark.parametrize("h", JSON_FILES, ids=lambda h: h.name)
def test_hostile_model_config_json_is_one_line_exit_2(h: Hostile, tmp_path):
    path = h.write(tmp_path)
    line = invoke(["predict", "cafe-order", "--config", str(model_config(tmp_path, path))])
    assert str(path) in line and h.needle in line and "agent.backend" in line, line


@pytest.mark.parametrize("h", JSON_FILES, ids=lambda h: h.name)
def test_hostile_vllm_result_for_profile_import_is_one_line_exit_2(h: Hostile, tmp_path):
    path = h.write(tmp_path)
    out = tmp_path / "out.yaml"
    line = invoke(["profile", "import", str(path), "--out", str(out)])
    assert str(path) in line and h.needle in line, line
    assert not out.exists()


@pytest.mark.parametrize(
    "h", [h for h in FILE_LEVEL if h.name in {"fifo", "char-device", "sparse-1gb", "huge-10mb", "alias-bomb",
                                               "deep-nesting", "directory"}],
    ids=lambda h: h.name,
)  # fmt: skip
def test_hostile_device_yaml_and_profile_yaml_are_one_line_exit_2(h: Hostile, tmp_path):
    path = h.write(tmp_path)
    dev = tmp_path / "dev-config.yaml"
    dev.write_text(f"agent:\n  backend: {{hardware: '{path}', model: llama-3.1-8b}}\n")
    line = invoke(["predict", "cafe-order", "--config", str(dev)])
    assert str(path) in line and h.needle in line, line
    if str(path).endswith(".yaml"):  # a profile is a backend string ending in .yaml
        prof = tmp_path / "prof-config.yaml"
        prof.write_text(f"agent:\n  backend: '{path}'\n")
        line = invoke(["predict", "cafe-order", "--config", str(prof)])
        assert str(path) in line and h.needle in line, line


# --- the real entry point on the files that used to hang or crash it ---------------------------------


def _fifo(tmp_path: Path, name: str) -> Path:
    p = tmp_path / name
    os.mkfifo(p)
    return p


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "deep-json"])
def test_model_file_that_used_to_hang_or_crash_exits_2_with_one_line(kind, tmp_path):
    model = {
        "dev-zero": lambda: Path("/dev/zero"),
        "fifo": lambda: _fifo(tmp_path, "config.json"),
        "deep-json": lambda: _write(tmp_path / "config.json", "[" * 200_000 + "]" * 200_000),
    }[kind]()
    r = cli("predict", "cafe-order", "--config", str(model_config(tmp_path, model)))
    assert r.returncode == 2, r.stderr[-2000:]
    assert str(model) in one_line(r.stderr) and r.stdout == ""


@pytest.mark.parametrize("kind", ["fifo", "deep-json"])
def test_profile_import_that_used_to_hang_or_crash_exits_2_with_one_line(kind, tmp_path):
    results = (
        _fifo(tmp_path, "results.json")
        if kind == "fifo"
        else _write(tmp_path / "results.json", '{"a":' * 200_000 + "1" + "}" * 200_000)
    )
    r = cli("profile", "import", str(results), "--out", str(tmp_path / "p.yaml"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert str(results) in one_line(r.stderr)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_scenario_and_config_that_used_to_hang_exit_2_with_one_line(kind, tmp_path):
    path = Path("/dev/zero") if kind == "dev-zero" else _fifo(tmp_path, "s.yaml")
    for args in (["predict", str(path)], ["predict", "cafe-order", "--config", str(path)]):
        r = cli(*args)
        assert r.returncode == 2, r.stderr[-2000:]
        assert "not a regular file" in one_line(r.stderr)


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


# --- the guard itself ---------------------------------------------------------------------------------


def test_too_large_file_is_refused_before_it_is_opened(tmp_path, monkeypatch):
    big = tmp_path / "big.yaml"
    with big.open("wb") as fh:
        fh.truncate(MAX_FILE_BYTES + 1)
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **kw: opened.append(str(p)) or real_open(p, *a, **kw))
    with pytest.raises(UserError, match=r"big.yaml: 262,145 bytes: larger than 262,144 bytes"):
        read_bytes(big)
    assert str(big) not in opened


def test_a_file_with_more_content_than_its_size_says_is_cut_at_the_limit():
    """/proc files say size 0 and hold more: the read itself is bounded, as for a file that grows."""
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("needs /proc")
    assert status.stat().st_size == 0
    with pytest.raises(UserError, match="larger than 100 bytes"):
        read_bytes(status, limit=100)
    assert len(read_bytes(status, limit=1 << 20)) > 100


def test_legitimate_json_at_the_depth_bound_loads(tmp_path):
    from voicepipe.limits import MAX_JSON_DEPTH

    ok = _write(tmp_path / "ok.json", "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    assert read_json(ok, 1 << 20) is not None
    deep = _write(tmp_path / "deep.json", "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    with pytest.raises(UserError, match="nested deeper"):
        read_json(deep, 1 << 20)


def test_a_shipped_style_model_config_still_loads(tmp_path):
    cfg = _write(
        tmp_path / "config.json",
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32, '
        '"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, '
        '"intermediate_size": 14336, "torch_dtype": "bfloat16", "rope_scaling": {"factor": 8.0}}',
    )
    from voicepipe.hardware.byo import load_hf_config

    assert load_hf_config(str(cfg)).layers == 32


def test_unreadable_tls_file_kind_is_one_line(tmp_path):
    fifo = _fifo(tmp_path, "ca.pem")
    c = _write(tmp_path / "c.yaml", f"broker:\n  url: mqtts://example.org\n  ca_file: '{fifo}'\n")
    line = invoke(["predict", "cafe-order", "--config", str(c)])
    assert "broker.ca_file" in line and "not a regular file (a FIFO)" in line, line


# --- run ids ------------------------------------------------------------------------------------------

BAD_RUN_IDS = ["a+b", "a#b", "a/b", "$SYS", "x" * 70_000, "", "a b", "caf\u00e9", "a\x1b[2J"]


@pytest.mark.parametrize("run_id", BAD_RUN_IDS, ids=lambda r: repr(r[:12]))
def test_bad_run_id_is_one_line_exit_2_for_run_and_stage(run_id):
    for args in (["run", "cafe-order", "-q", "--run-id", run_id], ["stage", "asr", "--run-id", run_id]):
        line = invoke(args)
        assert line.startswith("error: --run-id:") and len(line) < 200, line
        assert "\x1b" not in line


def test_topic_safe_run_ids_are_accepted():
    for ok in ("abc123", "run-2024.06_01", "A" * MAX_RUN_ID):
        assert check_run_id(ok) == ok
    with pytest.raises(UserError, match="at most 64"):
        check_run_id("A" * (MAX_RUN_ID + 1))


def test_library_entry_points_check_the_run_id_too():
    from voicepipe.runner import run_pipeline
    from voicepipe.workers import serve_stages

    cfg = PipelineConfig()
    with pytest.raises(UserError, match="'/' is not allowed"):
        asyncio.run(serve_stages(cfg, ["asr"], "a/b"))
    with pytest.raises(UserError, match="'\\+' is not allowed"):
        asyncio.run(run_pipeline(cfg, [], run_id="a+b"))


# --- control characters never reach the terminal -----------------------------------------------------

HOSTILE_TEXT = "\x1b[2J\x1b]0;owned\x07\x9b31m\u202e\x08\r"


def test_printable_escapes_c0_c1_esc_and_bidi_and_keeps_clean_text():
    assert printable("plain ✓ text\n") == "plain ✓ text\n"
    shown = printable(HOSTILE_TEXT)
    assert shown == "\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\u202e\\x08\\r"
    assert printable("a\nb", newlines=False) == "a\\nb"


def test_control_characters_in_a_scenario_never_reach_stdout_or_stderr(tmp_path):
    s = tmp_path / "esc.yaml"
    s.write_text(  # YAML double-quoted escapes: \e is ESC, \x9b a C1 CSI, \u202e a bidi override
        'name: "evil\\e[2J"\n'
        'description: "d\\e]0;title\\a"\n'
        "turns:\n"
        '  - user: "hi \\e[2J there \\x9b31m \\u202e"\n'
        '    reply: "ok \\e[31mred\\x07 \\x08\\x08 done"\n'
        '    intent: "faq\\e[2J"\n'
    )
    for args in (["predict", str(s)], ["predict", str(s), "--wide"], ["-v", "predict", str(s)]):
        r = subprocess.run(
            [sys.executable, "-m", "voicepipe.cli", *args], capture_output=True, timeout=60,
            env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
        both = r.stdout + r.stderr
        for raw in (b"\x1b", b"\xc2\x9b", "\u202e".encode(), b"\x07", b"\x08"):
            assert raw not in both, (args, raw)
        assert b"\\x1b[2J" in r.stdout  # shown, escaped


def test_control_characters_in_an_error_line_are_escaped(tmp_path):
    c = tmp_path / "c.yaml"
    c.write_text('"k\\e[2J": 1\n')
    line = invoke(["predict", "cafe-order", "--config", str(c)])
    assert "\x1b" not in line and "k\\x1b[2J: unknown field" in line, line
