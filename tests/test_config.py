import pytest

from voicepipe.config import PipelineConfig, load_config
from voicepipe.errors import UserError
from voicepipe.scenario import load_scenario, shipped


def test_defaults_come_from_published_figures():
    cfg = PipelineConfig()
    assert cfg.budget_ms == 800
    assert cfg.transport.uplink_ms == 40 + 21 + 10 + 2 + 40 + 1  # Daily primer
    assert cfg.transport.downlink_ms == 74 + 15
    assert cfg.agent.backend == "sonnet-gpu"


def test_set_overrides_nested_fields_with_yaml_values(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("budget_ms: 600\nasr:\n  silence_ms: 500\n")
    cfg = load_config(f, ["asr.silence_ms=250", "agent.backend=groq-llama-3.1-8b", "tts.ttfb_ms.median=90"])
    assert cfg.budget_ms == 600
    assert cfg.asr.silence_ms == 250
    assert cfg.agent.backend == "groq-llama-3.1-8b"
    assert cfg.tts.ttfb_ms.median == 90


def test_env_broker_is_used_unless_flag_given(monkeypatch):
    monkeypatch.setenv("VOICEPIPE_BROKER", "mqtt://10.0.0.9:1884")
    assert load_config().broker.url == "mqtt://10.0.0.9:1884"
    assert load_config(broker="mqtt://127.0.0.1:1999").broker.url == "mqtt://127.0.0.1:1999"


@pytest.mark.parametrize(
    ("content", "sets", "needle"),
    [
        ("asr:\n  silense_ms: 100\n", [], "asr.silense_ms: unknown field"),
        ("asr:\n  silence_ms: -5\n", [], "asr.silence_ms"),
        ("agent:\n  backend: gpt-9\n", [], "agent.backend"),
        ("budget_ms: [\n", [], "invalid YAML"),
        ("- a\n- b\n", [], "top level must be a mapping"),
        ("", ["tts.ttfb_ms.p90=1"], "tts.ttfb_ms"),
        ("", ["agent.backend=nope"], "unknown backend 'nope'"),
    ],
)
def test_bad_config_names_file_and_field(tmp_path, content, sets, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(content)
    with pytest.raises(UserError) as ei:
        load_config(f, sets)
    msg = str(ei.value)
    assert str(f) in msg and needle in msg
    assert "\n" not in msg


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_config(tmp_path / "nope.yaml")


def test_set_needs_equals():
    with pytest.raises(UserError, match="--set"):
        load_config(None, ["agent.backend"])


def test_shipped_scenarios_are_valid_and_cover_the_four_kinds():
    names = {p.stem for p in shipped()}
    assert {"cafe-order", "support-call", "hesitant-speaker", "rapid-fire"} <= names
    for p in shipped():
        sc = load_scenario(str(p))
        assert 5 <= len(sc.turns) <= 10, p


def test_hesitant_scenario_pauses_exceed_short_endpointing():
    from voicepipe.text import speak

    sc = load_scenario("hesitant-speaker")
    longest = max(
        b.start_ms - a.end_ms
        for t in sc.turns
        for a, b in zip(speak(t.user, 130), speak(t.user, 130)[1:], strict=False)
    )
    assert longest > PipelineConfig().asr.silence_ms * 2


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("name: x\nturns: []\n", "turns"),
        ("name: x\nturns:\n  - user: hi\n", "turns.0.reply"),
        ("name: x\nturns:\n  - user: hi\n    reply: yo\n    complexity: extreme\n", "turns.0.complexity"),
        ("name: x\nturns:\n  - user: hi\n    reply: yo\n    colour: red\n", "turns.0.colour: unknown field"),
        ("name: [x\n", "invalid YAML"),
    ],
)
def test_bad_scenario_names_file_and_field(tmp_path, content, needle):
    f = tmp_path / "s.yaml"
    f.write_text(content)
    with pytest.raises(UserError) as ei:
        load_scenario(str(f))
    assert str(f) in str(ei.value) and needle in str(ei.value)
