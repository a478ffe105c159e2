"""The Ray executor returns exactly what the local executor returns (capacity levels, compare --predict,
hardware sweep), on a Ray head this test starts on loopback and reaches over Ray client (ray://).

Needs the ``ray`` extra; without it the cluster tests skip, and VOICEPIPE_REQUIRE_RAY=1 makes that a
failure. The ``--executor`` parsing tests run everywhere.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import tiny_scenario
from voicepipe.capacity import LevelJob, Load, conversation_s, level_batch
from voicepipe.config import load_config
from voicepipe.errors import UserError
from voicepipe.executors import executor_for
from voicepipe.parallel import ItemFailed, LocalExecutor

MISSING_EXTRA = "ray executor needs the ray extra: pip install 'voicepipe[ray]'"


def _need_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        if os.environ.get("VOICEPIPE_REQUIRE_RAY"):
            pytest.fail(f"VOICEPIPE_REQUIRE_RAY is set but ray does not import: {exc}")
        pytest.skip("ray is not installed (pip install 'voicepipe[ray]'); VOICEPIPE_REQUIRE_RAY=1 fails instead")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, head: subprocess.Popen, log: Path, timeout_s: float = 90) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if head.poll() is not None:
            pytest.fail(f"ray head exited {head.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"ray client server not listening on 127.0.0.1:{port} after {timeout_s:g} s")


@pytest.fixture
def ray_head(monkeypatch) -> Iterator[str]:
    """A Ray head on loopback (2 CPUs, no dashboard), as ``ray start --block`` so its pid stops it all.
    Token authentication on (Ray's default for a new cluster), with a token of its own: the driver here
    sends it because RAY_AUTH_MODE/RAY_AUTH_TOKEN are set before ray is imported."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    _need_ray()
    exe = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if exe is None:
        pytest.fail("ray imports but its `ray` command is not on PATH")
    tmp = Path(tempfile.mkdtemp(prefix="vp-ray-", dir="/tmp"))  # short: Ray's unix sockets live under it
    gcs, client = _free_port(), _free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    log = tmp / "head.log"
    with log.open("w") as out:
        head = subprocess.Popen(
            [exe, "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
             "--include-dashboard=false", f"--ray-client-server-port={client}", f"--temp-dir={tmp}",
             "--disable-usage-stats"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        _wait_for_port(client, head, log)
        yield f"ray://127.0.0.1:{client}"
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _fails_on_two(x: int, report) -> int:
    report(1)
    if x == 2:
        raise ValueError("two is refused")
    return x * 10


def _levels(executor) -> tuple[list[dict], int]:
    cfg = load_config(None, ["agent.backend=a100-40gb/llama-3.1-70b", "client.playout=first_audio"])
    sc = tiny_scenario(turns=2)
    d = conversation_s(cfg, [sc])
    jobs = [LevelJob("a100", cfg, (sc,), Load("sessions", n), d) for n in (1, 6, 3)]
    counted: list[int] = []
    with level_batch(jobs, executor) as batch:
        levels = batch.results(counted.append)
    # wall and CPU seconds are measurements of the run, the only fields that are not the model's output
    return [{**lv.to_json(), "wall_s": 0, "cpu_s": 0} for lv in levels], sum(counted)


@pytest.mark.ray
def test_sweeps_on_a_ray_cluster_return_exactly_the_local_results(ray_head, tmp_path):
    from voicepipe.cli.hardware import app as hardware_app
    from voicepipe.predict import predict_each

    local_levels, local_turns = _levels(LocalExecutor(1))
    sc = tiny_scenario(turns=2)
    cfgs = [load_config(None, [f"agent.backend={b}"]) for b in ("groq-llama-3.1-8b", "h100-sxm/llama-3.1-8b")]
    local_predicted = [[p.to_json() for p in ps] for ps in predict_each(cfgs, [sc], 2, workers=1)]

    ray = executor_for(ray_head)
    try:
        assert ray.name == "ray"
        ray_levels, ray_turns = _levels(ray)
        assert ray_levels == local_levels
        assert [r["load"] for r in ray_levels] == [1, 6, 3]  # item order, though submitted heaviest first
        assert ray_turns == local_turns > 0  # progress: each item's count arrives when it finishes
        got = predict_each(cfgs, [sc], 2, executor=ray)
        assert [[p.to_json() for p in ps] for ps in got] == local_predicted
        with pytest.raises(ItemFailed) as failed:
            ray.map(_fails_on_two, [1, 2, 3, 2])
        assert failed.value.index == 1 and isinstance(failed.value.error, ValueError)
        assert "two is refused" in str(failed.value.error)
    finally:
        ray.close()

    args = ["sweep", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--batches", "1,8,64,512", "--format", "json"]
    runner = CliRunner()
    here = runner.invoke(hardware_app, args)
    there = runner.invoke(hardware_app, [*args, "--executor", ray_head])
    assert here.exit_code == 0 and there.exit_code == 0, there.output
    assert json.loads(there.stdout) == json.loads(here.stdout)
    assert [r["batch"] for r in json.loads(there.stdout)["rows"]][:3] == [1, 4, 8]


def test_executor_text_is_checked_before_any_run():
    assert isinstance(executor_for(None, 3), LocalExecutor)
    assert executor_for("local", 2).workers == 2
    for bad, where in (("dask", "--executor"), ("ray://", "--executor"), ("ray:/x", "--executor")):
        with pytest.raises(UserError, match=where):
            executor_for(bad)
    with pytest.raises(UserError, match="--jobs"):
        executor_for("ray", 2)


def test_a_missing_ray_extra_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError, as when not installed
    with pytest.raises(UserError) as err:
        executor_for("ray://127.0.0.1:1")
    assert str(err.value) == MISSING_EXTRA


def test_cli_without_the_extra_exits_2_with_that_line(tmp_path):
    # a stub package named ray that fails to import stands for an environment without the extra
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('no ray here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).parent.parent)])}
    r = subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", "hardware", "sweep", "-H", "h100-sxm", "-m", "llama-3.1-8b",
         "--executor", "ray"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: {MISSING_EXTRA}"]


def test_a_ray_client_whose_server_fails_to_start_is_tried_again_and_an_unreachable_one_is_not(monkeypatch):
    _need_ray()
    from voicepipe import parallel_ray

    calls: list[str] = []
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def init(address: str, **_kw: object) -> None:
        calls.append(address)
        signal.signal(signal.SIGTERM, lambda *_: None)  # as ray.init installs its own before it fails
        if len(calls) == 1:
            raise ConnectionError("Initialization failure from server:\nTraceback ... specific server timed out")

    monkeypatch.setattr(parallel_ray.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel_ray.ray, "init", init)
    monkeypatch.setattr(parallel_ray, "CLIENT_RETRY_S", 0.01)
    try:
        assert parallel_ray.connect("ray://127.0.0.1:10001") == before  # the second try connects
        assert len(calls) == 2
        for s, h in before.items():  # as RayExecutor.close puts them back
            signal.signal(s, h)

        def unreachable(address: str, **_kw: object) -> None:
            calls.append(address)
            signal.signal(signal.SIGTERM, lambda *_: None)
            raise ConnectionError("ray client connection timeout")

        calls.clear()
        monkeypatch.setattr(parallel_ray.ray, "init", unreachable)
        with pytest.raises(UserError, match=r"cannot start or reach ray://127\.0\.0\.1:1: ray client connection timeout"):
            parallel_ray.connect("ray://127.0.0.1:1")
        assert len(calls) == 1  # a connection timeout (~30 s each) is not repeated
        assert {s: signal.getsignal(s) for s in before} == before  # the failed init's handler is taken back
    finally:
        for s, h in before.items():
            signal.signal(s, h)
