"""The lean MQTT path and its fallback: the same live pipeline measures every turn on both the lean client and
aiomqtt's plain one, and other aiomqtt/paho-mqtt versions than the pinned ones select the plain client with one
warning (voicepipe.bus.mqtt._private)."""

from __future__ import annotations

import pytest
import structlog

from tests.conftest import fast_config, tiny_scenario
from tests.test_pipeline import check_records
from voicepipe.bus.mqtt import BrokerAddress, LeanClient, MqttLink, PlainClient, _private
from voicepipe.bus.mqtt import link as link_mod
from voicepipe.runner import run_pipeline

ADDR = BrokerAddress.parse("mqtt://127.0.0.1:1")  # links below are never connected


@pytest.fixture
def fresh_note(monkeypatch):
    monkeypatch.setattr(_private, "_warned", False)
    monkeypatch.delenv(_private.LEAN_ENV, raising=False)


@pytest.mark.broker
@pytest.mark.parametrize("lean", ["1", "0"])
async def test_a_live_pipeline_measures_every_turn_on_the_lean_and_the_plain_client(
    mosquitto, monkeypatch, fresh_note, lean
):
    made: list[str] = []

    class CountedLean(LeanClient):
        def __init__(self, *a, **kw):
            made.append("lean")
            super().__init__(*a, **kw)

    class CountedPlain(PlainClient):
        def __init__(self, *a, **kw):
            made.append("plain")
            super().__init__(*a, **kw)

    monkeypatch.setattr(link_mod, "LeanClient", CountedLean)
    monkeypatch.setattr(link_mod, "PlainClient", CountedPlain)
    monkeypatch.setenv(_private.LEAN_ENV, lean)
    res = await run_pipeline(
        fast_config(broker=mosquitto.url), [tiny_scenario(turns=3)], 2, run_id=f"lf{lean}"
    )
    check_records(res, 6)
    assert made and set(made) == {"lean" if lean == "1" else "plain"}


async def test_other_library_versions_select_the_plain_client_with_one_warning(monkeypatch, fresh_note):
    monkeypatch.setattr(_private, "installed", lambda: {"aiomqtt": "2.6.0", "paho-mqtt": "2.2.0"})
    with structlog.testing.capture_logs() as logs:
        links = [MqttLink(ADDR, "r", f"p{i}") for i in range(3)]
    assert all(isinstance(k.client, PlainClient) and not k.lean for k in links)
    notes = [e for e in logs if e["log_level"] == "warning"]
    assert len(notes) == 1 and "aiomqtt 2.6.0" in notes[0]["event"], logs
    assert "plain client" in notes[0]["event"]


async def test_pinned_versions_select_the_lean_client(monkeypatch, fresh_note):
    monkeypatch.setattr(_private, "installed", lambda: {"aiomqtt": "2.5.9", "paho-mqtt": "2.1.0"})
    with structlog.testing.capture_logs() as logs:
        link = MqttLink(ADDR, "r", "p")
    assert isinstance(link.client, LeanClient) and link.lean and not logs


async def test_lean_off_in_the_environment_selects_the_plain_client_without_a_warning(monkeypatch, fresh_note):
    monkeypatch.setenv(_private.LEAN_ENV, "0")
    with structlog.testing.capture_logs() as logs:
        link = MqttLink(ADDR, "r", "p")
    assert isinstance(link.client, PlainClient) and not logs


@pytest.mark.parametrize(
    ("aiomqtt", "paho", "bad"),
    [
        ("2.5.1", "2.2.0", []),
        ("2.5", "2.1.3", []),
        ("2.50.0", "2.2.0", ["aiomqtt 2.50.0"]),  # a series, not a prefix of the text
        ("2.4.0", "3.0.0", ["aiomqtt 2.4.0", "paho-mqtt 3.0.0"]),
        ("", "2.2.0", ["aiomqtt (unknown)"]),
    ],
)
def test_version_pins_name_each_package_outside_its_series(aiomqtt, paho, bad):
    assert _private.mismatches({"aiomqtt": aiomqtt, "paho-mqtt": paho}) == bad
