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
        # a modelled wait past the client's patience: the turn would time out; predict says which and why
        (
            ["predict", "barge-in", "--set", "asr.silence_ms=60000"],
            "config (with --set): turn 0 of barge-in-0 got no reply within client.turn_timeout_s (20 s",
        ),
        # the command line itself: an unknown command or option, a bad or missing option value
        (["predict", "cafe-order", "--format", "yaml"], "'--format'"),
        (["no-such-command"], "No such command 'no-such-command'"),
        (["hardware", "validate", "--tier", "3"], "'--tier'"),
        (["hardware", "predict", "-H", "h100-sxm"], "Missing option '--model'"),
        # a global option after the command: the error says where it goes
        (["run", "cafe-order", "-v"], "it goes before the command (`voicepipe -v run ...`)"),
        (["hardware", "validate", "--log-format", "json"], "(`voicepipe --log-format"),
        # --external NAME:N: a count without its stage, or a stage named twice
        (["run", "cafe-order", "--external", ":2"], "a stage name comes before the replica count"),
        (["run", "cafe-order", "--external", "asr:2,asr:3"], "'asr' is named twice"),
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


def test_two_scenarios_with_one_name_exit_2(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for f in (a, b):
        f.write_text("name: same\nturns:\n  - user: hi\n    reply: hello\n")
    r = vp("run", str(a), str(b))
    assert r.returncode == 2 and f"{b}: name: 'same'" in r.stderr and "Traceback" not in r.stderr


def test_binary_config_exits_2(tmp_path):
    f = tmp_path / "bin.yaml"
    f.write_bytes(b"\xff\xfe\x00\x01")
    r = vp("predict", "cafe-order", "--config", str(f))
    assert r.returncode == 2 and "not UTF-8 text" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["agent.name=big", "router.agent=main"], "router.agent: 'main' is not an agent"),
        (["router.policy=rules", "router.default=council"], "council.members is empty"),
        (["router.policy=rules", "router.rules=[{to: 'agent:nope'}]"], "router.rules.0.to"),
    ],
)
def test_routes_that_lead_nowhere_exit_2(sets, needle):
    r = vp("predict", "cafe-order", *[x for s in sets for x in ("--set", s)])
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "args", [["hardware", "list"], ["hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--format", "json"]]
)
def test_a_stdout_the_disk_refuses_is_one_line_naming_stdout_exit_2_not_an_internal_error(args):
    """``> /dev/full`` refuses every write as a full disk does: an output not written (2), not a bug (5),
    and no second complaint from the interpreter's flush at exit (120)."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "voicepipe.cli", *args], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "error: stdout: could not be written (No space left on device)"
