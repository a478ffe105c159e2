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


def test_credentials_leave_the_url_and_the_dump_is_redacted():
    from voicepipe.config import config_dict

    cfg = load_config(None, [], "mqtt://bob:s%40cret@10.0.0.9:1884")
    b = cfg.broker
    assert b.url == "mqtt://10.0.0.9:1884" and b.username == "bob"
    assert b.password is not None and b.password.get_secret_value() == "s@cret"
    assert "s@cret" not in repr(cfg) and "s@cret" not in str(cfg.model_dump())
    d = config_dict(cfg)
    assert d["broker"]["password"] == "***" and d["broker"]["url"] == "mqtt://10.0.0.9:1884"
    assert "cret" not in str(d)


def test_password_and_username_from_env_file_and_flag(tmp_path, monkeypatch):
    from voicepipe.config import BrokerOverrides

    monkeypatch.setenv("VOICEPIPE_BROKER_USERNAME", "envuser")
    monkeypatch.setenv("VOICEPIPE_BROKER_PASSWORD", "envpw")
    cfg = load_config(None, [], "mqtt://h:1")
    assert (cfg.broker.username, cfg.broker.password.get_secret_value()) == ("envuser", "envpw")
    # an explicit password (URL, config, file) wins over the environment
    assert load_config(None, [], "mqtt://u:urlpw@h:1").broker.password.get_secret_value() == "urlpw"
    pw = tmp_path / "pw"
    pw.write_text("filepw\nignored second line\n")
    c = tmp_path / "c.yaml"
    c.write_text(f"broker:\n  url: mqtt://h:1\n  password_file: {pw}\n")
    assert load_config(c).broker.password.get_secret_value() == "filepw"
    flag = tmp_path / "flagpw"
    flag.write_text("flagpw")
    cfg = load_config(c, [], BrokerOverrides(password_file=str(flag)))
    assert cfg.broker.password.get_secret_value() == "flagpw"


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        (
            "broker:\n  url: mqtt://u:pw@h:1\n  password_file: {pw}\n",
            "broker.password_file: a password is also given",
        ),
        ("broker:\n  url: mqtt://h:1\n  password_file: {missing}\n", "broker.password_file: "),
        ("broker:\n  url: mqtt://h:1\n  password_file: {empty}\n", "is empty"),
        ("broker:\n  url: mqtt://h:1\n  ca_file: {pw}\n", "broker.ca_file: TLS options need an mqtts://"),
        (
            "broker:\n  cert_file: {pw}\n",
            "broker.cert_file: TLS options need an mqtts:// broker URL (none given)",
        ),
        ("broker:\n  url: mqtts://h:1\n  ca_file: {pw}\n", "broker.ca_file: "),
        (
            "broker:\n  url: mqtts://h:1\n  key_file: {pw}\n",
            "broker.key_file: a client key needs its certificate",
        ),
    ],
)
def test_bad_broker_settings_name_the_field_and_never_the_password(tmp_path, yaml_text, needle):
    pw = tmp_path / "pw"
    pw.write_text("hunter2\n")
    (tmp_path / "empty").write_text("\n")
    c = tmp_path / "c.yaml"
    c.write_text(yaml_text.format(pw=pw, missing=tmp_path / "nope", empty=tmp_path / "empty"))
    with pytest.raises(UserError) as ei:
        load_config(c)
    msg = str(ei.value)
    assert msg.startswith(str(c)) and needle in msg and "hunter2" not in msg, msg


def test_broker_address_hides_the_password():
    from voicepipe.bus.mqtt import BrokerAddress

    a = BrokerAddress.parse("mqtt://u:hunter2@h:1")
    assert a.password == "hunter2" and "hunter2" not in repr(a)
    with pytest.raises(UserError) as ei:
        BrokerAddress.parse("mqtt://u:hunter2@h:notaport")
    assert "hunter2" not in str(ei.value) and "u:***@h" in str(ei.value)
    assert BrokerAddress.parse("mqtts://h").port == 8883 and BrokerAddress.parse("mqtts://h").tls


def test_password_is_refused_on_the_command_line_without_echoing_it():
    for sets in (["broker.password=hunter2"], ["broker.url=mqtt://h:1", "broker.password=hunter2"]):
        with pytest.raises(UserError) as ei:
            load_config(None, sets)
        assert "--password-file" in str(ei.value) and "hunter2" not in str(ei.value)


def test_insecure_only_by_the_flag(tmp_path):
    from voicepipe.config import BrokerOverrides

    with pytest.raises(UserError, match="only the --insecure flag"):
        load_config(None, ["broker.insecure=true"], "mqtts://h:8883")
    assert load_config(None, [], BrokerOverrides(url="mqtts://h:8883", insecure=True)).broker.insecure


def test_a_dist_never_draws_past_a_modelled_durations_bound():
    """A valid but extreme shape (median 0.001 ms, p90 260 ms: sigma ~9.7) drew hours, so a turn could
    never be answered (found by fuzzing configs within their bounds); draws stop at MAX_MS."""
    import numpy as np

    from voicepipe.config import Dist
    from voicepipe.limits import MAX_MS

    rng = np.random.default_rng(0)
    wide = Dist(median=0.001, p90=260.0)
    draws = [wide.sample_ms(rng) for _ in range(2000)]
    assert max(draws) == MAX_MS and min(draws) > 0
    usual = Dist(median=188.0, p90=260.0)  # the TTS default: never near the bound, so unchanged
    assert max(usual.sample_ms(rng) for _ in range(2000)) < 1000


@pytest.mark.parametrize(
    ("content", "sets", "needle"),
    [
        ("agent:\n  backnd: sonnet-gpu\n", [], "agent.backnd: unknown field (did you mean 'backend'?)"),
        ("", ["asr.silense_ms=100"], "asr.silense_ms: unknown field (did you mean 'silence_ms'?)"),
        ("budgt_ms: 700\n", [], "budgt_ms: unknown field (did you mean 'budget_ms'?)"),
        ("", ["agent.backend=sonnet-gpuu"], "(did you mean 'sonnet-gpu'?)"),
        ("", ["agent.backend=h100-sx/llama-3.1-8b"], "unknown hardware 'h100-sx' (did you mean 'h100-sxm'?)"),
        ("", ["agent.backend=h100-sxm/llama-3.1-8c"], "unknown model 'llama-3.1-8c' (did you mean"),
        ("agent:\n  backend: {hardware: h100-sxm, model: llama-3.1-8b, stack: sglng}\n", [],
         "unknown stack 'sglng' (did you mean 'sglang'?)"),
    ],
)
def test_misspelt_keys_and_backends_suggest_the_nearest_name(tmp_path, content, sets, needle):
    f = tmp_path / "c.yaml"
    f.write_text(content)
    with pytest.raises(UserError) as ei:
        load_config(f, sets)
    assert needle in str(ei.value) and str(f) in str(ei.value)


def test_a_scalar_where_a_section_belongs_names_the_fields_it_takes_and_never_echoes_the_value(tmp_path):
    """Not pydantic's "valid dictionary or instance of BrokerConfig": the writer never sees that class."""
    from voicepipe.backends.profile import parse_profile

    f = tmp_path / "c.yaml"
    f.write_text("broker: mqtt://user:s3cret@host\n")
    with pytest.raises(UserError) as ei:
        load_config(f)
    msg = str(ei.value)
    assert "broker: a mapping with fields url, username" in msg and msg.endswith("(got a string)")
    assert "s3cret" not in msg and "instance of" not in msg
    with pytest.raises(UserError, match=r"p\.yaml: ttft_ms: a mapping with fields median, p90 \(got a number\)"):
        parse_profile({"ttft_ms": 40, "tokens_per_s": 80}, "p.yaml")
    with pytest.raises(UserError, match=r"points\.0: a mapping with fields concurrency, prompt_tokens"):
        parse_profile({"ttft_ms": {"median": 1, "p90": 2}, "tokens_per_s": 1, "points": [3]}, "p.yaml")


def test_unrelated_key_gets_no_suggestion(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("zzzzqqq: 1\n")
    with pytest.raises(UserError) as ei:
        load_config(f)
    assert "zzzzqqq: unknown field" in str(ei.value) and "did you mean" not in str(ei.value)


def test_misspelt_scenario_name_suggests_the_shipped_one():
    with pytest.raises(UserError) as ei:
        load_scenario("cafe-ordr")
    assert "(did you mean 'cafe-order'?)" in str(ei.value)


def test_misspelt_shipped_config_name_suggests_it():
    with pytest.raises(UserError) as ei:
        load_config("fast-lan")
    assert "fast-lan: no such file or shipped config (did you mean 'fast-lane'?)" in str(ei.value)


@pytest.mark.parametrize("req", ["within>=90%", "within>=90", "ok>=95 %"])
def test_within_as_a_percentage_explains_it_is_a_share(req):
    from voicepipe.gate import parse

    with pytest.raises(UserError) as ei:
        parse([req])
    msg = str(ei.value)
    assert "share from 0 to 1" in msg and ">=0.9" in msg


def test_a_bare_metric_says_to_quote_the_requirement_the_shell_split_at_its_redirect():
    """`--require within>=0.5` unquoted reaches voicepipe as `within` (the shell wrote stdout to `=0.5`)."""
    from voicepipe.gate import parse

    with pytest.raises(UserError, match="quote it: the shell reads an unquoted > or < as a redirect"):
        parse(["within"])
    with pytest.raises(UserError) as ei:
        parse(["p90=800"])  # a typo, not a redirect: no quoting advice
    assert "quote" not in str(ei.value) and "is not NAME<=NUMBER" in str(ei.value)
