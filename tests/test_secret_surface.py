"""An endpoint's API key never reaches any output, and no command prints a traceback (issue 26 item 4).

Every command runs in its own process (the real entry point, as a user runs it) with a fresh secret in the
environment variable an endpoint spec names (``api_key_env``), against an endpoint nobody listens on; its
stdout, stderr and every file it wrote (--json, --csv, --report, --otel, --summary-json, profiles) are
searched for the key and for a traceback. Virtual-time commands (predict, capacity, compare --predict)
refuse an endpoint without a profile in one line with the calibrate command, exit 2, and run one with a
profile as that profile.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import secrets
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
import yaml

import voicepipe.cli as cli_pkg

KEY_ENV = "VOICEPIPE_TEST_SECRET_KEY"
DEAD = "http://127.0.0.1:9/v1"  # the discard port: nothing answers there
TRACEBACK = "Traceback (most recent call last)"

SCENARIO = {
    "name": "tiny",
    "turns": [{"user": "Hi, can I get a latte?", "reply": "Sure, one latte. Anything else?", "gap_ms": 50}],
}
PROFILE = {"name": "measured", "ttft_ms": {"median": 120, "p90": 180}, "tokens_per_s": 90}


@dataclass
class Ran:
    args: tuple[str, ...]
    rc: int
    stdout: str
    stderr: str
    files: dict[str, str]


def _config(tmp: Path, name: str, profile: bool) -> Path:
    backend = {"endpoint": DEAD, "model": "m", "api_key_env": KEY_ENV, "timeout": 1}
    if profile:
        backend["profile"] = str(tmp / "profile.yaml")
    path = tmp / name
    path.write_text(yaml.safe_dump({"client": {"playout": "first_audio", "turn_timeout_s": 3}, "agent": {"backend": backend}}))
    return path


COMMANDS: dict[str, list[str]] = {
    # live, against the dead endpoint (embedded broker, one turn): every export flag it has
    "run": ["run", "{sc}", "-c", "{bare}", "--json", "{out}/run.json", "--csv", "{out}/run.csv",
            "--report", "{out}/run.html", "--otel", "{out}/run.otel", "--summary-json", "{out}/run.sum.json"],
    "compare-live": ["compare", "{sc}", "-c", "{bare}", "--vary", "client.playout=first_audio",
                     "--json", "{out}/cl.json", "--csv", "{out}/cl.csv", "--report", "{out}/cl.html",
                     "--otel", "{out}/cl.otel"],
    # virtual time, no profile: refused in one line
    "predict-bare": ["predict", "{sc}", "-c", "{bare}", "--json", "{out}/pb.json"],
    "capacity-bare": ["capacity", "{sc}", "-c", "{bare}", "--sessions", "1", "--json", "{out}/kb.json"],
    "compare-predict-bare": ["compare", "--predict", "{sc}", "-c", "{bare}", "--vary", "agent.prompt_tokens=100,200",
                             "--json", "{out}/cpb.json", "--report", "{out}/cpb.html"],
    "predict-set-shorthand": ["predict", "{sc}", "--set", f"agent.backend=openai:{DEAD}#m"],
    # virtual time with the endpoint's profile
    "predict-profile": ["predict", "{sc}", "-c", "{prof}", "--json", "{out}/pp.json"],
    "capacity-profile": ["capacity", "{sc}", "-c", "{prof}", "--sessions", "1,2", "--json", "{out}/kp.json",
                         "--csv", "{out}/kp.csv", "--report", "{out}/kp.html"],
    "compare-predict-profile": ["compare", "--predict", "{sc}", "-c", "{prof}", "--vary", "agent.prompt_tokens=100,200",
                                "--json", "{out}/cpp.json", "--csv", "{out}/cpp.csv", "--report", "{out}/cpp.html",
                                "--otel", "{out}/cpp.otel"],
    # the rest of the surface
    "calibrate": ["calibrate", DEAD, "--model", "m", "--out", "{out}/cal.yaml", "--api-key-env", KEY_ENV,
                  "--timeout", "1", "--requests", "1", "--concurrency", "1"],
    "hardware-predict": ["hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--json", "{out}/hw.json"],
    "stage-help": ["stage", "--help"],
}  # fmt: skip
# one worker runs the module, so its shared fixture (14 CLI processes) runs once, not once per xdist worker
pytestmark = pytest.mark.xdist_group("secret_surface")

REFUSED = ("predict-bare", "capacity-bare", "compare-predict-bare", "predict-set-shorthand")


@pytest.fixture(scope="module")
def secret_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Ran]]:
    tmp = tmp_path_factory.mktemp("secret")
    key = "sk-" + secrets.token_hex(16)
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(SCENARIO))
    (tmp / "profile.yaml").write_text(yaml.safe_dump(PROFILE))
    subs = {
        "sc": str(tmp / "tiny.yaml"),
        "bare": str(_config(tmp, "bare.yaml", profile=False)),
        "prof": str(_config(tmp, "prof.yaml", profile=True)),
    }
    env = {**os.environ, KEY_ENV: key, "COLUMNS": "120"}

    def one(name: str) -> Ran:
        out = tmp / name
        out.mkdir()
        args = tuple(a.format(out=out, **subs) for a in COMMANDS[name])
        p = subprocess.run(
            [sys.executable, "-m", "voicepipe.cli", *args], capture_output=True, text=True, env=env, timeout=180
        )
        files = {f.name: f.read_text(errors="replace") for f in sorted(out.iterdir())}
        return Ran(args, p.returncode, p.stdout, p.stderr, files)

    # independent processes (each its own output folder), three at a time: the module's wall time, not its checks
    with ThreadPoolExecutor(max_workers=3) as pool:
        ran = dict(zip(COMMANDS, pool.map(one, COMMANDS), strict=True))
    return key, ran


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_api_key_and_tracebacks_appear_in_no_output(secret_runs, name):
    key, ran = secret_runs
    r = ran[name]
    outputs = {"stdout": r.stdout, "stderr": r.stderr, **r.files}
    for where, text in outputs.items():
        assert key not in text, f"{name}: the API key is in {where}"
        assert TRACEBACK not in text, f"{name}: a traceback in {where}:\n{text[:2000]}"


@pytest.mark.parametrize("name", REFUSED)
def test_virtual_time_refuses_an_endpoint_without_a_profile_in_one_line(secret_runs, name):
    _, ran = secret_runs
    r = ran[name]
    assert r.rc == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "voicepipe calibrate http://127.0.0.1:9/v1 --model m --out my.yaml" in lines[0]
    assert "agent.backend: my.yaml" in lines[0]
    assert not r.files or all(not t for t in r.files.values())  # refused before anything was written


@pytest.mark.parametrize(
    ("name", "records"), [("predict-profile", "pp.json"), ("compare-predict-profile", "cpp.json")]
)
def test_virtual_time_runs_an_endpoint_as_its_calibrated_profile(secret_runs, name, records):
    _, ran = secret_runs
    r = ran[name]
    assert r.rc == 0, r.stderr
    preds = [json.loads(line) for line in r.files[records].splitlines()]
    # under the endpoint's own name (as a live run names it); test_modelled checks the timing is the profile's
    assert preds and all(p["backend"] == "endpoint:127.0.0.1:9/m" and p["modelled"] for p in preds)


def test_capacity_runs_an_endpoint_as_its_calibrated_profile(secret_runs):
    _, ran = secret_runs
    r = ran["capacity-profile"]
    assert r.rc == 0, r.stderr
    levels = [json.loads(line) for line in r.files["kp.json"].splitlines()]
    assert [lv["load"] for lv in levels if lv["kind"] == "level"] == [1, 2]
    assert all(lv["p90_ms"] is not None for lv in levels if lv["kind"] == "level")


def test_live_commands_against_a_dead_endpoint_say_why_in_their_records(secret_runs):
    _, ran = secret_runs
    for name, rec_file in (("run", "run.json"), ("compare-live", "cl.json")):
        recs = [json.loads(line) for line in ran[name].files[rec_file].splitlines() if line]
        assert recs and all(r["status"] != "ok" for r in recs), name
        assert any("cannot connect to 127.0.0.1:9" in r["error"] for r in recs), recs


def test_no_typer_app_shows_exception_locals():
    """Every Typer app in voicepipe/cli/ (the root and each sub-app) has pretty exceptions and locals off."""
    apps = [
        (f"{info.name}.{attr}", obj)
        for info in pkgutil.iter_modules(cli_pkg.__path__, "voicepipe.cli.")
        if not info.name.endswith("__main__")  # importing it runs the CLI
        for attr, obj in vars(importlib.import_module(info.name)).items()
        if isinstance(obj, typer.Typer)
    ]
    apps.append(("voicepipe.cli.app", cli_pkg.app))
    assert len({id(a) for _, a in apps}) >= 5  # root, hardware, profile, scenarios, schema
    for name, a in apps:
        assert a.pretty_exceptions_enable is False, name
        assert a.pretty_exceptions_show_locals is False, name


def test_an_uncaught_exception_is_one_line_and_exit_5(tmp_path):
    """A bug inside a command (forced here by a scenario loader that raises) prints one line, no frames."""
    code = (
        "import sys, voicepipe.cli.common as c\n"
        "def boom(names): raise RuntimeError('kaput ' + 'x' * 3)\n"
        "c.load_scenarios = boom\n"
        "import voicepipe.cli.predict as p; p.load_scenarios = boom\n"
        "from voicepipe.cli import main\n"
        "sys.argv = ['voicepipe', 'predict', 'cafe-order']\n"
        "main()\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 5, p.stderr  # ExitCode.INTERNAL_ERROR
    assert p.stderr.strip().splitlines() == [
        "error: internal error (RuntimeError: kaput xxx); please report it (`-vv` logs the traceback)"
    ]
