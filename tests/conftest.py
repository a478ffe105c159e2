"""Shared fixtures: brokers (embedded amqtt, a spawned mosquitto) and tiny scenarios.

Real-broker tests skip when no mosquitto binary exists — except under CI (CI=true), where they fail:
the CI script installs mosquitto, so a missing binary there is a broken setup, not a reason to skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

import pytest

from voicepipe.bus.brokers import Mosquitto, MosquittoMissing
from voicepipe.config import load_config
from voicepipe.scenario import Scenario, Turn

UNDER_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_configure(config):
    """One cache folder for the whole test run (voicepipe.kept), shared by the xdist workers, which inherit
    the controller's environment: the held-out validation is computed once per run, not once per worker or
    CLI subprocess, and never read from a folder an earlier run left."""
    if hasattr(config, "workerinput") or "VOICEPIPE_CACHE_DIR" in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="voicepipe-test-cache-")
    os.environ["VOICEPIPE_CACHE_DIR"] = folder
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


@pytest.fixture(autouse=True)
def _signal_dispositions_kept(request):
    """A test must leave SIGINT/SIGTERM as it found them: processes started later inherit an ignored one."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    after = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert after == before, f"{request.node.nodeid} changed signal handlers: {before} -> {after}"


def _mosquitto(**kw) -> Mosquitto:
    try:
        Mosquitto.binary()
    except MosquittoMissing as exc:
        if UNDER_CI or os.environ.get("VOICEPIPE_REQUIRE_MOSQUITTO"):
            pytest.fail(f"real-broker tests are required here: {exc}")
        pytest.skip(str(exc))
    return Mosquitto(**kw)


@pytest.fixture
def mosquitto():
    m = _mosquitto()
    m.start()
    yield m
    m.stop()


@pytest.fixture
def mosquitto_nagle():
    """A mosquitto like Debian's default config: no set_tcp_nodelay, so small messages stall."""
    m = _mosquitto(nodelay=False)
    m.start()
    yield m
    m.stop()


@pytest.fixture
def make_mosquitto():
    started: list[Mosquitto] = []

    def make(**kw) -> Mosquitto:
        m = _mosquitto(**kw)
        m.start()
        started.append(m)
        return m

    yield make
    for m in started:
        m.stop()


def tiny_scenario(name: str = "tiny", turns: int = 2) -> Scenario:
    script = [
        ("Hi, can I get a latte?", "Sure, one latte. Anything else for you today?"),
        ("No thanks.", "Great, that will be four fifty, please."),
        ("When do you close?", "We close at six tonight, thanks for asking."),
    ]
    return Scenario(
        name=name,
        turns=[Turn(user=u, reply=r, gap_ms=50, words_per_minute=220) for u, r in (script * 3)[:turns]],
    )


def fast_config(*sets: str, broker: str | None = None):
    """A config that keeps integration tests short: fast backend, move on at first audio."""
    base = ["client.playout=first_audio", "agent.backend=cerebras-llama-3.1-8b", "client.turn_timeout_s=10"]
    return load_config(None, [*base, *sets], broker)


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A test CA with server/client certificates (openssl binary; required under CI like mosquitto)."""
    from tests.pki import make_pki, openssl

    if openssl() is None:
        if UNDER_CI or os.environ.get("VOICEPIPE_REQUIRE_MOSQUITTO"):
            pytest.fail("TLS tests need the openssl binary")
        pytest.skip("openssl binary not found")
    return make_pki(tmp_path_factory.mktemp("pki"))
