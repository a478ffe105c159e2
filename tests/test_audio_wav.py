"""A scenario turn given as a WAV file (a real recorded caller): the bounded reader, and what a bad file or a
recorded turn in a modelled run does at the command line (one line naming the file and field, exit 2).

The real-audio run of a recorded turn is in tests/test_audio_e2e.py (marked ``audio``).
"""

from __future__ import annotations

import struct
import wave
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from voicepipe.cli import app
from voicepipe.errors import UserError
from voicepipe.files import read_wav
from voicepipe.scenario import load_scenario

runner = CliRunner()
NO_BROKER = {"VOICEPIPE_BROKER": ""}


def write_wav(path: Path, samples: np.ndarray, rate: int = 16_000, channels: int = 1, width: int = 2) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return path


def tone(n: int = 1600) -> np.ndarray:
    return (3000 * np.sin(np.arange(n) * 0.2)).astype("<i2")


def scenario_with(tmp_path: Path, wav: str, user: str | None = None) -> Path:
    user_line = f"    user: {user!r}\n" if user else ""
    p = tmp_path / "rec.yaml"
    p.write_text(f"name: rec\nturns:\n  - wav: {wav}\n{user_line}    reply: Sure thing.\n")
    return p


def test_a_16khz_mono_16bit_wav_reads_back_its_samples(tmp_path):
    x = tone()
    got = read_wav(write_wav(tmp_path / "a.wav", x))
    assert np.array_equal(np.frombuffer(got, dtype="<i2"), x)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"rate": 44_100}, "sample rate 44100 Hz"),
        ({"channels": 2}, "2 channels"),
        ({"width": 1}, "8-bit samples"),
    ],
)
def test_a_wav_in_another_format_is_one_line_naming_the_file_field_and_what_is_wrong(tmp_path, kw, why):
    x = tone(3200) if kw.get("channels") == 2 else tone()
    if kw.get("width") == 1:
        x = (x // 256 + 128).astype(np.uint8)
    path = write_wav(tmp_path / "bad.wav", x, **kw)
    with pytest.raises(UserError) as err:
        read_wav(path, "turns.0.wav")
    msg = str(err.value)
    assert msg.startswith(f"turns.0.wav: {path}: ") and why in msg and "\n" not in msg


def test_a_file_that_is_not_a_wav_or_is_a_float_wav_is_refused(tmp_path):
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"not audio at all" * 10)
    with pytest.raises(UserError, match="not a WAV"):
        read_wav(junk)
    fmt = struct.pack("<HHIIHH", 3, 1, 16_000, 64_000, 4, 32)  # IEEE float
    flt = tmp_path / "float.wav"
    flt.write_bytes(b"RIFF" + struct.pack("<I", 36) + b"WAVEfmt " + struct.pack("<I", 16) + fmt + b"data\0\0\0\0")
    with pytest.raises(UserError, match="not PCM"):
        read_wav(flt)


def test_a_recorded_turn_path_is_relative_to_the_scenario_file(tmp_path):
    (tmp_path / "clips").mkdir()
    write_wav(tmp_path / "clips" / "hello.wav", tone())
    sc = load_scenario(str(scenario_with(tmp_path, "clips/hello.wav")))
    assert sc.turns[0].wav == str(tmp_path / "clips" / "hello.wav")
    assert sc.turns[0].user == ""


def test_a_scenario_naming_a_wav_at_44khz_exits_2_with_one_line_naming_scenario_file_field_and_wav(tmp_path):
    write_wav(tmp_path / "hi.wav", tone(), rate=44_100)
    scen = scenario_with(tmp_path, "hi.wav", user="hello")
    res = runner.invoke(app, ["predict", str(scen)], env=NO_BROKER)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output
    assert "turns.0.wav" in lines[0] and "hi.wav" in lines[0] and "44100 Hz" in lines[0]


def test_a_missing_wav_is_one_line_exit_2(tmp_path):
    res = runner.invoke(app, ["predict", str(scenario_with(tmp_path, "nowhere.wav", user="hi"))], env=NO_BROKER)
    assert res.exit_code == 2 and "turns.0.wav" in res.output and "no such file" in res.output


def test_a_recorded_turn_without_text_in_a_modelled_run_asks_for_real_audio(tmp_path):
    write_wav(tmp_path / "hi.wav", tone())
    res = runner.invoke(app, ["predict", str(scenario_with(tmp_path, "hi.wav"))], env=NO_BROKER)
    assert res.exit_code == 2, res.output
    assert "turns.0.wav" in res.output and "--audio real" in res.output


def test_a_recorded_turn_with_text_predicts_from_the_text(tmp_path):
    write_wav(tmp_path / "hi.wav", tone())
    scen = scenario_with(tmp_path, "hi.wav", user="hello there")
    res = runner.invoke(app, ["predict", str(scen)], env=NO_BROKER)
    assert res.exit_code == 0, res.output
    assert "hello there" in res.output


def test_a_turn_with_neither_user_nor_wav_names_the_field(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("name: e\nturns:\n  - reply: Sure.\n")
    res = runner.invoke(app, ["predict", str(p)], env=NO_BROKER)
    assert res.exit_code == 2 and "turns.0" in res.output and "wav" in res.output
