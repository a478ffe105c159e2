"""Bad input: one line naming the file and field, exit code 2, no traceback (as a user runs it)."""

import subprocess
import sys

import pytest


def vp(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "no-such-scenario.yaml"], "no-such-scenario.yaml"),
        (["run", "cafe-order", "--set", "agent.backend=warp-drive"], "agent.backend"),
        (["run", "cafe-order", "--set", "asr.silence_ms=fast"], "asr.silence_ms"),
        (["run", "cafe-order", "--config", "missing.yaml"], "missing.yaml: no such file"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needle):
    r = vp(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]


def test_bad_scenario_field_exits_2(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("name: x\nturns:\n  - user: hi\n    reply: ''\n")
    r = vp("run", str(f))
    assert r.returncode == 2
    assert f"{f}: turns.0.reply" in r.stderr
    assert "Traceback" not in r.stderr


def test_scenarios_lists_shipped():
    r = vp("scenarios")
    assert r.returncode == 0
    for name in ("cafe-order", "support-call", "hesitant-speaker", "rapid-fire"):
        assert name in r.stdout
