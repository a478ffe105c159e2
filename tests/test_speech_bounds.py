"""A line that takes too long to say: refused when the scenario meets its config (one line, exit 2), never
a run whose own messages the bus guard refuses.

Text within MAX_TEXT can still take hours to say at a slow speaking rate, and the rates live in the config;
before this check a 2,000-word reply (inside MAX_TEXT) made 12 minutes of audio, the guard dead-lettered
the TTS's own chunk as out of range and ``predict`` failed with "got no reply".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_bad_files import NO_BROKER, one_line_exit_2, runner
from voicepipe.cli import app
from voicepipe.config import check_speech, load_config
from voicepipe.errors import UserError
from voicepipe.limits import MAX_SPEECH_MS, MAX_TEXT
from voicepipe.predict import predict
from voicepipe.scenario import load_scenario
from voicepipe.stages.guard import MAX_AUDIO_MS

WPM = 165.0  # tts.words_per_minute's default
LONGEST = int(MAX_SPEECH_MS / 60_000 * WPM)  # words of "word" one reply may hold at the default rate


def scenario(tmp_path: Path, user: str, reply: str, cache_answer: str | None = None) -> Path:
    p = tmp_path / "long.yaml"
    text = f'name: long\nturns:\n  - user: "{user}"\n    reply: "{reply}"\n'
    if cache_answer is not None:
        text += f'cache:\n  - questions: ["what now"]\n    answer: "{cache_answer}"\n'
    p.write_text(text)
    return p


def words(n: int, w: str = "word") -> str:
    return " ".join([w] * n)


def test_the_guard_bound_on_audio_is_the_loader_bound():
    assert MAX_AUDIO_MS == MAX_SPEECH_MS
    assert len(words(LONGEST + 1)) < MAX_TEXT  # the text bound alone lets such a reply through


@pytest.mark.parametrize(
    "args",
    [["predict"], ["run", "-q"], ["compare", "--predict", "--vary", "router.cache_first=false,true"],
     ["capacity", "--sessions", "1"]],
    ids=["predict", "run", "compare", "capacity"],
)  # fmt: skip
def test_a_reply_too_long_to_say_is_one_line_exit_2(args, tmp_path):
    path = scenario(tmp_path, "hi there", words(LONGEST + 1))
    one_line_exit_2([args[0], str(path), *args[1:]], path, "turns.0.reply")


def test_the_user_side_counts_the_rate_the_config_gives(tmp_path):
    # 200 five-letter words at 20 wpm: 3 s each, ten minutes; the pauses add past the bound
    path = scenario(tmp_path, words(200, "hello") + " [2s]" + " hello", "ok then")
    one_line_exit_2(["predict", str(path), "--set", "client.words_per_minute=20"], path, "turns.0.user")
    res = runner.invoke(app, ["predict", str(path)], env=NO_BROKER)  # at the default 150 wpm: 1.4 minutes
    assert res.exit_code == 0, res.stdout + res.stderr


def test_a_scenario_cache_answer_is_checked_too(tmp_path):
    path = scenario(tmp_path, "hi there", "hello", cache_answer=words(LONGEST + 1))
    with pytest.raises(UserError, match=r"long\.yaml: cache\.0\.answer: takes 10\.0 minutes"):
        check_speech(load_config(), [load_scenario(str(path))])


def test_a_config_cache_answer_is_checked_at_load(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f'cache:\n  enabled: true\n  entries:\n    - questions: ["hi"]\n      answer: "{words(LONGEST + 1)}"\n'
    )
    with pytest.raises(UserError, match=r"c\.yaml: cache\.entries\.0\.answer: takes 10\.0 minutes"):
        load_config(cfg)
    load_config(cfg, ["tts.words_per_minute=200"])  # the same answer at a faster voice fits


def test_a_reply_just_inside_the_bound_is_spoken_without_dead_letters(tmp_path):
    path = scenario(tmp_path, "hi there", words(LONGEST))
    cfg, sc = load_config(), load_scenario(str(path))
    check_speech(cfg, [sc])
    (turn,) = predict(cfg, [sc])
    assert turn.predicted_ms is not None and turn.predicted_ms > 0


def test_lines_at_the_bounds_run_without_dead_letters(tmp_path):
    """Every line as long as the loader lets it be, at both speaking-rate bounds: all turns answered, and
    not one of the run's own messages refused by the guard (the class of the 12-minute-chunk bug)."""
    from voicepipe.limits import MAX_MS, MAX_WPM, MIN_WPM
    from voicepipe.runner import simulate

    # 189 x 3 s at 20 wpm, a 30 s pause, one more word: 10 minutes exactly (a trailing pause is not said)
    slow = words(189, "hello") + f" [{MAX_MS / 2:g}] hello"
    fast = words(MAX_TEXT // 2 - 1, "a")  # the most words the text bound holds, at 1,000 wpm: 3.4 minutes
    p = tmp_path / "edges.yaml"
    p.write_text(
        "name: edges\nturns:\n"
        f'  - user: "{slow}"\n    words_per_minute: {MIN_WPM:g}\n    reply: "{words(LONGEST)}"\n'
        f"    gap_ms: {MAX_MS:g}\n"
        f'  - user: "{fast}"\n    words_per_minute: {MAX_WPM:g}\n    reply: "ok"\n'
    )
    cfg, sc = load_config(), load_scenario(str(p))
    check_speech(cfg, [sc])
    res = simulate(cfg, [sc], 1)
    assert res.deadletters == 0 and res.stage_errors == 0
    assert [r.status for r in res.records] == ["ok", "ok"]


def test_the_tts_cuts_a_runaway_clause_at_the_guard_bound():
    """Whatever text reaches the TTS (a stage process with a slower voice than the run's config, a real
    model's reply), no audio chunk is longer than the guard lets through: a run with no clause end is cut."""
    from voicepipe.config import TTSConfig
    from voicepipe.stages.tts import audio_ms, longest_clause, split_clauses

    cfg = TTSConfig(words_per_minute=20)
    assert longest_clause(20) == 200 and longest_clause(165) == LONGEST
    for wpm in (20, 137.3, 165, 999.9, 1000):
        assert audio_ms(["w"] * longest_clause(wpm), wpm) <= MAX_AUDIO_MS
    clauses, rest = split_clauses(["word"] * 450, cfg, final=False)
    assert [len(c) for c in clauses] == [200, 200] and len(rest) == 50
    clauses, rest = split_clauses(["word"] * 450, cfg, final=True)
    assert [len(c) for c in clauses] == [200, 200, 50] and rest == []
    short = ["one", "two", "three,", "four", "five", "six."]
    assert split_clauses(short, cfg, final=True) == split_clauses(short, TTSConfig(), final=True)


def test_the_python_api_checks_speech_too(tmp_path):
    """predict() and simulate() meet the same bound as the CLI (play_sessions checks every scenario)."""
    path = scenario(tmp_path, "hi there", words(LONGEST + 1))
    with pytest.raises(UserError, match=r"turns\.0\.reply: takes 10\.0 minutes"):
        predict(load_config(), [load_scenario(str(path))])
