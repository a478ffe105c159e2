"""``voicepipe calibrate --stage asr|tts`` over real HTTP against tests/speech_server.py, and the profile as
the stage's model (``asr.profile`` / ``tts.profile``)."""

from __future__ import annotations

import shutil

import pytest
import yaml
from typer.testing import CliRunner

from tests.speech_server import SpeechServer
from voicepipe.cli import app
from voicepipe.config import load_config
from voicepipe.errors import UserError


def voicepipe(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.fixture
def server():
    srv = SpeechServer(first_ms=20, delta_ms=1, per_s_ms=60, per_word_ms=10).start()
    yield srv
    srv.stop()


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng reads the calibration audio")
def test_asr_calibration_fits_finalisation_to_audio_length_and_predict_uses_it(server, tmp_path):
    prof = tmp_path / "asr.yaml"
    r = voicepipe("calibrate", server.url, "--stage", "asr", "--out", str(prof), "--lengths", "1,4",
                  "--concurrency", "1,2", "--requests", "3", "--against", "model")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "MODELLED" in r.output and "asr.profile" in r.output
    data = yaml.safe_load(prof.read_text())
    assert data["kind"] == "asr" and len(data["points"]) == 4
    assert 30 <= data["fit"]["slope_ms"] <= 200  # the server waits 60 ms per second of audio
    assert {p["concurrency"] for p in data["points"]} == {1, 2}
    assert all(s.path == "/v1/audio/transcriptions" for s in server.seen)
    cfg = load_config(None, [f"asr.profile={prof}"])
    assert cfg.asr.finalize_ms.median == pytest.approx(data["finalize_ms"]["median"])
    assert cfg.asr.finalize_ms.median >= 20 + 60 * 2 * 0.9  # the fit at the 2 s reference, measured


def test_tts_calibration_fits_time_to_first_audio_to_text_length(server, tmp_path):
    prof = tmp_path / "tts.yaml"
    r = voicepipe("calibrate", server.url, "--stage", "tts", "--out", str(prof), "--lengths", "2,20",
                  "--concurrency", "1", "--requests", "3")  # fmt: skip
    assert r.exit_code == 0, r.output
    data = yaml.safe_load(prof.read_text())
    assert 5 <= data["fit"]["slope_ms"] <= 40  # 10 ms per word before the first chunk
    cfg = load_config(None, [f"tts.profile={prof}"])
    assert cfg.tts.ttfb_ms.median == pytest.approx(data["ttfb_ms"]["median"])
    assert cfg.tts.ttfb_ms.p90 >= cfg.tts.ttfb_ms.median


def test_a_profile_of_the_other_stage_or_a_failing_endpoint_is_one_line(server, tmp_path):
    prof = tmp_path / "tts.yaml"
    prof.write_text(yaml.safe_dump({"kind": "tts", "ttfb_ms": {"median": 10, "p90": 20}}))
    with pytest.raises(UserError, match=r"kind: a profile of 'tts', not of 'asr'"):
        load_config(None, [f"asr.profile={prof}"])
    server.mode = "500"
    r = voicepipe("calibrate", server.url, "--stage", "tts", "--out", str(tmp_path / "x.yaml"), "--lengths", "2",
                  "--concurrency", "1", "--requests", "1")  # fmt: skip
    assert r.exit_code == 2 and "every request failed: HTTP 500: boom" in r.output
    r = voicepipe("calibrate", server.url, "--stage", "nope", "--out", str(tmp_path / "x.yaml"))
    assert r.exit_code == 2 and "--stage" in r.output
