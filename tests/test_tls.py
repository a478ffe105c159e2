"""TLS, authentication, the example ACL and secrets, against mosquitto processes the tests spawn with a CA
the tests generate (tests/pki.py).

* a run over ``mqtts://`` with the test CA and a password from the environment measures every turn;
* a wrong CA, no CA (system store), a plain client on the TLS port, a TLS client on a plain port, a
  missing client certificate and a wrong password each end as one line, exit 2, no traceback;
* ``--insecure`` is the only way past verification;
* docs/mosquitto-acl.conf confines a user to ``voicepipe/<user>/#``: another user's forged publish never
  arrives, and a whole run works under it;
* the password appears in no output: stdout, stderr and logs, JSON, CSV, HTML report, OTel export, and the
  ``voicepipe stage`` banner — for a password given in the URL, a file and the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import aiomqtt
import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import fast_config, tiny_scenario
from voicepipe.bus.brokers import ServerTLS
from voicepipe.bus.mqtt import BrokerAddress
from voicepipe.cli import app
from voicepipe.config import BrokerOverrides
from voicepipe.runner import run_pipeline

pytestmark = pytest.mark.broker

REPO = Path(__file__).resolve().parent.parent
ACL = REPO / "docs" / "mosquitto-acl.conf"
PW = "Tr0ub4dor-zebra-8812"  # distinctive, so a search of every output cannot miss or mis-hit it
FAST = ["client.playout=first_audio", "agent.backend=cerebras-llama-3.1-8b", "client.turn_timeout_s=10"]
runner = CliRunner()


def server_tls(pki, require_certificate: bool = False) -> ServerTLS:
    return ServerTLS(str(pki.ca), str(pki.server_cert), str(pki.server_key), require_certificate)


def sets(*extra: str) -> list[str]:
    return [x for s in (*FAST, *extra) for x in ("--set", s)]


def scenario_file(tmp_path: Path, turns: int = 1) -> Path:
    f = tmp_path / "tiny.yaml"
    f.write_text(yaml.safe_dump(tiny_scenario(turns=turns).model_dump(mode="json")))
    return f


def one_error_line(res) -> str:
    text = res.stdout + res.stderr
    assert res.exit_code == 2, (res.exit_code, text, res.exception)
    assert "Traceback" not in text
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text
    return lines[0]


async def test_run_over_tls_with_test_ca_and_password_from_env(make_mosquitto, pki, monkeypatch):
    m = make_mosquitto(users={"vp": PW}, tls=server_tls(pki))
    assert m.url.startswith("mqtts://")
    monkeypatch.setenv("VOICEPIPE_BROKER_USERNAME", "vp")
    monkeypatch.setenv("VOICEPIPE_BROKER_PASSWORD", PW)
    from voicepipe.config import load_config

    cfg = load_config(None, FAST, BrokerOverrides(url=m.url, ca_file=str(pki.ca)))
    assert cfg.broker.username == "vp" and cfg.broker.password is not None
    res = await run_pipeline(cfg, [tiny_scenario()], 1)
    assert len(res.records) == 2 and all(r.status == "ok" for r in res.records)


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("other-ca", "certificate verify failed"),
        ("system-cas", "certificate verify failed"),
        ("wrong-password", "broker"),
    ],
)
def test_tls_failures_are_one_line(make_mosquitto, pki, tmp_path, case, needle):
    m = make_mosquitto(users={"vp": PW}, tls=server_tls(pki))
    pwf = tmp_path / "pw"
    pwf.write_text("not-" + PW + "\n" if case == "wrong-password" else PW + "\n")
    args = [
        "run",
        str(scenario_file(tmp_path)),
        "--broker",
        m.url,
        "--password-file",
        str(pwf),
        *sets("broker.username=vp"),
    ]
    if case in ("other-ca", "wrong-password"):
        args += ["--ca-file", str(pki.other_ca if case == "other-ca" else pki.ca)]
    line = one_error_line(runner.invoke(app, args))
    assert needle in line and PW not in line


def test_tls_client_on_a_plain_port_is_one_line(mosquitto, pki, tmp_path):
    url = mosquitto.url.replace("mqtt://", "mqtts://")
    line = one_error_line(
        runner.invoke(app, ["run", str(scenario_file(tmp_path)), "--broker", url, "--ca-file", str(pki.ca)])
    )
    assert "broker" in line


def test_insecure_is_the_only_way_past_verification(make_mosquitto, pki, tmp_path):
    """Without a CA the test broker's certificate fails verification; --insecure (explicit) connects."""
    m = make_mosquitto(tls=server_tls(pki))
    sc = str(scenario_file(tmp_path))
    assert "certificate verify failed" in one_error_line(
        runner.invoke(app, ["run", sc, "--broker", m.url, *sets()])
    )
    res = runner.invoke(app, ["run", sc, "--broker", m.url, "--insecure", "-q", *sets()])
    assert res.exit_code == 0, res.stdout + res.stderr


async def test_plain_client_on_the_tls_port_fails(make_mosquitto, pki):
    """A plain MQTT client on a TLS listener gets no answer: an MqttError (the CLI prints it as one line,
    like the cases above), here with a short timeout instead of aiomqtt's 10 s."""
    m = make_mosquitto(tls=server_tls(pki))
    plain = BrokerAddress.parse(m.url.replace("mqtts://", "mqtt://"))
    with pytest.raises(aiomqtt.MqttError):
        async with plain.client(timeout=2) as c:
            await c.publish("voicepipe-probe/x", b"x", qos=1)


async def test_client_certificate_required(make_mosquitto, pki):
    m = make_mosquitto(tls=server_tls(pki, require_certificate=True))
    without = BrokerAddress.parse(m.url, ca_file=str(pki.ca))
    with pytest.raises(aiomqtt.MqttError):
        async with without.client(timeout=3) as c:  # the handshake fails, or the first exchange does
            await c.publish("voicepipe-probe/x", b"x", qos=1)
    cert = BrokerAddress.parse(
        m.url, ca_file=str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key)
    )
    async with cert.client() as c:
        await c.publish("voicepipe-probe/x", b"x", qos=1)


def test_encrypted_client_key_is_one_line_not_a_prompt(pki):
    res = runner.invoke(
        app,
        ["stage", "asr", "--run-id", "r", "--broker", "mqtts://127.0.0.1:9", "--ca-file", str(pki.ca),
         "--cert-file", str(pki.client_cert), "--key-file", str(pki.client_key_encrypted)],
        input="",
    )  # fmt: skip
    assert "broker.key_file: the key is encrypted" in one_error_line(res)


async def test_example_acl_confines_a_user_to_its_run(make_mosquitto):
    """docs/mosquitto-acl.conf: user runa reads and writes voicepipe/runa/#; user runb's publish into
    runa's topics is dropped by the broker, and runa never sees runb's run."""
    m = make_mosquitto(users={"runa": "pa-" + PW, "runb": "pb-" + PW}, acl_file=ACL)
    a = BrokerAddress.parse(m.url, "runa", "pa-" + PW)
    b = BrokerAddress.parse(m.url, "runb", "pb-" + PW)
    got: list[str] = []
    async with a.client(identifier="acl-a") as ca, b.client(identifier="acl-b") as cb:
        await ca.subscribe("voicepipe/#", qos=1)

        async def listen() -> None:
            async for msg in ca.messages:
                got.append(str(msg.topic))

        task = asyncio.create_task(listen())
        await cb.publish("voicepipe/runa/s-0/tts/audio", b'{"forged": true}', qos=1)  # into runa's run
        await cb.publish("voicepipe/runb/s-0/user/utterance", b"{}", qos=1)  # runb's own run
        await ca.publish("voicepipe/runa/s-0/user/utterance", b"{}", qos=1)  # positive control
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # anything forged would have arrived by now, in order after the control
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert got == ["voicepipe/runa/s-0/user/utterance"]

    cfg = fast_config(broker=m.url)
    cfg.broker.username, cfg.broker.password = "runa", "pa-" + PW
    res = await run_pipeline(cfg, [tiny_scenario()], 1, run_id="runa")
    assert len(res.records) == 2 and all(r.status == "ok" for r in res.records)


def test_a_run_id_the_acl_refuses_is_one_line_at_start_not_timeouts(make_mosquitto, tmp_path, monkeypatch):
    """mosquitto accepts the connection, subscriptions and publishes of user runa on run runb's topics and
    delivers nothing: without a check every turn would time out with no reason. The run stops at start
    with one line naming the run, the user and the ACL, before playing any turn; the right run id plays."""
    import time

    m = make_mosquitto(users={"runa": "pa-" + PW}, acl_file=ACL)
    monkeypatch.setenv("VOICEPIPE_BROKER_PASSWORD", "pa-" + PW)
    base = ["run", str(scenario_file(tmp_path)), "--broker", m.url, *sets("broker.username=runa")]
    t0 = time.monotonic()
    line = one_error_line(runner.invoke(app, [*base, "--run-id", "runb"]))
    assert time.monotonic() - t0 < 60  # the check waits 5 s; a turn timeout per turn would be far longer
    assert "'runb'" in line and "'runa'" in line and "ACL" in line and PW not in line
    ok = runner.invoke(app, [*base, "--run-id", "runa", "-q"])
    assert ok.exit_code == 0, ok.stdout + ok.stderr


@pytest.mark.parametrize("how", ["url", "file", "env"])
def test_no_secret_in_any_output(make_mosquitto, pki, tmp_path, how):
    """Every output of a run over TLS with a password — stdout, stderr (with logs), JSON, CSV, HTML report
    (its config section), OTel — is searched for the password."""
    m = make_mosquitto(users={"vp": PW}, tls=server_tls(pki))
    out = {k: tmp_path / f"out.{k}" for k in ("json", "csv", "html", "otel")}
    url, env, extra = m.url, {}, ["--set", "broker.username=vp"]
    if how == "url":
        url = m.url.replace("mqtts://", f"mqtts://vp:{PW}@")
        extra = []
    elif how == "file":
        (tmp_path / "pw").write_text(PW + "\n")
        extra += ["--password-file", str(tmp_path / "pw")]
    else:
        env = {"VOICEPIPE_BROKER_PASSWORD": PW}
    res = runner.invoke(
        app,
        ["run", str(scenario_file(tmp_path)), "--broker", url, "--ca-file", str(pki.ca), *extra, *sets(),
         "--json", str(out["json"]), "--csv", str(out["csv"]), "--report", str(out["html"]),
         "--otel", str(out["otel"])],
        env=env,
    )  # fmt: skip
    assert res.exit_code == 0, res.stdout + res.stderr
    html = out["html"].read_text()
    assert "broker" in html and "***" in html  # the config section is there, redacted
    for name, text in {
        "stdout": res.stdout,
        "stderr": res.stderr,
        **{k: p.read_text() for k, p in out.items()},
    }.items():
        assert PW not in text, name


def test_stage_banner_and_error_carry_no_password(make_mosquitto, pki):
    """`voicepipe stage` as a real process: the banner names the broker without the password, and a
    refused login is one line without it."""
    m = make_mosquitto(users={"vp": PW}, tls=server_tls(pki))
    bad = m.url.replace("mqtts://", f"mqtts://vp:{PW}-wrong@")
    r = subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", "stage", "asr", "--run-id", "r1", "--broker", bad,
         "--ca-file", str(pki.ca)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "VOICEPIPE_RUN_TOKEN": "tls test token"},  # stage processes need the run's secret
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith("serving asr for run r1 on mqtts://127.0.0.1:")
    assert len(lines) == 2 and lines[1].startswith("error: broker")
    assert PW not in r.stderr + r.stdout
