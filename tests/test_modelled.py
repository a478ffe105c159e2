"""voicepipe.modelled: on virtual time a real endpoint is its calibrated profile, or refused by name."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import tiny_scenario
from voicepipe.config import load_config
from voicepipe.errors import UserError
from voicepipe.modelled import on_virtual_time, require_keys
from voicepipe.predict import predict

DEAD = "http://127.0.0.1:9/v1"  # nothing listens there: a request would fail, so none may be made
PROFILE = {"name": "measured", "ttft_ms": {"median": 140, "p90": 210}, "tokens_per_s": 75}


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "measured.yaml"
    path.write_text(yaml.safe_dump(PROFILE))
    return path


def endpoint(profile=None, **more) -> str:
    spec = {"endpoint": DEAD, "model": "m", "timeout": 1, **more}
    if profile is not None:
        spec["profile"] = str(profile)
    return yaml.safe_dump(spec, default_flow_style=True).strip()


def test_a_config_without_endpoints_is_returned_as_is():
    cfg = load_config(None, ["agent.backend=sonnet-gpu"])
    assert on_virtual_time(cfg) is cfg


@pytest.mark.parametrize(
    ("sets", "field"),
    [
        ([f"agent.backend=openai:{DEAD}#m"], "agent.backend"),
        (["agent.extra={fast: " + endpoint() + "}"], "agent.extra.fast"),
        (["council.members=[sonnet-gpu, " + endpoint() + "]", "router.default=council"], "council.members.1"),
        (["council.members=[sonnet-gpu]", f"council.judge=openai:{DEAD}#m"], "council.judge"),
    ],
)
def test_an_endpoint_without_a_profile_is_refused_naming_its_field(sets, field):
    cfg = load_config(None, sets)
    with pytest.raises(UserError) as e:
        on_virtual_time(cfg, "my.yaml")
    line = str(e.value)
    assert line.startswith(f"my.yaml: {field}: endpoint:127.0.0.1:9/m is a live server")
    assert f"`voicepipe calibrate {DEAD} --model m --out my.yaml`, then use `agent.backend: my.yaml`" in line


def test_an_endpoint_with_a_profile_predicts_as_that_profile_under_its_own_name(profile_file):
    sc = [tiny_scenario(turns=3)]
    via_endpoint = predict(load_config(None, [f"agent.backend={endpoint(profile_file)}"]), sc)
    direct = predict(load_config(None, [f"agent.backend={profile_file}"]), sc)
    assert [p.backend for p in via_endpoint] == ["endpoint:127.0.0.1:9/m"] * 3
    assert [p.backend for p in direct] == ["measured"] * 3
    # the same model, the same seed: the same turns, to the nanosecond
    assert [p.predicted_ms for p in via_endpoint] == [p.predicted_ms for p in direct]
    assert [p.metrics["ttft_ms"] for p in via_endpoint] == [p.metrics["ttft_ms"] for p in direct]


def test_the_endpoints_own_prices_win_over_the_profiles(profile_file):
    prices = {"input_per_mtok": 3.0, "output_per_mtok": 15.0, "source": "the provider's page"}
    cfg = on_virtual_time(load_config(None, [f"agent.backend={endpoint(profile_file, prices=prices)}"]))
    spec = cfg.agent.backend
    assert isinstance(spec, dict) and "endpoint" not in spec
    assert (spec["price_in_per_mtok"], spec["price_out_per_mtok"], spec["price_source"]) == (
        3.0, 15.0, "the provider's page",
    )  # fmt: skip
    cost = predict(cfg, [tiny_scenario(turns=1)])[0].cost_usd
    assert cost > 0


def test_the_input_config_is_not_changed(profile_file):
    cfg = load_config(None, [f"agent.backend={endpoint(profile_file)}"])
    before = cfg.model_dump()
    on_virtual_time(cfg)
    assert cfg.model_dump() == before


def test_a_calibrated_endpoint_predicts_without_its_api_key_but_a_live_run_needs_it(profile_file, monkeypatch):
    """Virtual time sends no request, so the key's variable may be unset; a live run refuses up front."""
    monkeypatch.delenv("VP_UNSET_KEY_42", raising=False)
    cfg = load_config(None, [f"agent.backend={endpoint(profile_file, api_key_env='VP_UNSET_KEY_42')}"])
    assert predict(cfg, [tiny_scenario()])  # the profile answers
    with pytest.raises(UserError, match=r"agent\.backend: api_key_env: .*VP_UNSET_KEY_42.* is not set"):
        require_keys(cfg)
    monkeypatch.setenv("VP_UNSET_KEY_42", "secret")
    require_keys(cfg)  # set: nothing to refuse


def test_a_speech_endpoints_missing_key_is_refused_for_a_live_run(monkeypatch):
    monkeypatch.delenv("VP_UNSET_KEY_43", raising=False)
    spec = yaml.safe_dump({"endpoint": "http://127.0.0.1:9/v1", "api_key_env": "VP_UNSET_KEY_43"},
                          default_flow_style=True).strip()  # fmt: skip
    real = ["client.voice=espeak-ng", "vad.engine=webrtc", "tts.engine=espeak-ng"]
    cfg = load_config(None, [*real, f"asr.engine={spec}"])
    with pytest.raises(UserError, match=r"asr\.engine: api_key_env"):
        require_keys(cfg, "my.yaml")
