"""What ``voicepipe stage``'s ``--audio``, ``--engine`` and ``--vad`` serve: ``--vad`` alone is the real VAD
endpointing the caller's audio for the modelled (script) recogniser, the mix ``run`` has with
``--set client.voice=espeak-ng --set vad.engine=silero``; the real recogniser is ``--engine pocketsphinx``
or ``--audio real``, said, never implied by the VAD. The option resolution is checked on the config and the
stage class it picks (no engine is started)."""

from __future__ import annotations

import pytest
import typer

from voicepipe.audio.asr import RealASR
from voicepipe.audio.vad_asr import VadASR
from voicepipe.cli import app
from voicepipe.cli.stage import engine_sets
from voicepipe.config import load_config
from voicepipe.errors import UserError
from voicepipe.stageset import stage_class


def _served(names: list[str], audio: str = "model", engine: str | None = None, vad: str | None = None):
    cfg = load_config(None, engine_sets(names, audio, engine, vad))
    return cfg, stage_class("asr", cfg)


@pytest.mark.parametrize("vad", ["silero", "webrtc"])
def test_a_vad_alone_serves_the_vad_only_asr_with_the_script_recogniser(vad):
    cfg, served = _served(["asr"], vad=vad)
    assert served is VadASR
    assert (cfg.vad.engine, cfg.asr.engine, cfg.tts.engine) == (vad, "model", "model")
    assert cfg.real_stages == ["client", "vad"]  # the caller's audio, as the run that sends it has it


def test_a_vad_alone_serves_what_run_serves_for_the_same_mix():
    mix = ["client.voice=espeak-ng", "vad.engine=silero"]
    assert _served(["asr"], vad="silero")[0].real_stages == load_config(None, mix).real_stages


@pytest.mark.parametrize(
    ("audio", "engine", "vad", "want_vad"),
    [
        ("model", "pocketsphinx", "silero", "silero"),
        ("model", "pocketsphinx", None, "silero"),  # a real recogniser endpoints on a real VAD
        ("model", "pocketsphinx", "webrtc", "webrtc"),
        ("real", None, None, "silero"),
        ("real", None, "webrtc", "webrtc"),
    ],
)
def test_the_real_recogniser_is_served_only_when_asked_for(audio, engine, vad, want_vad):
    cfg, served = _served(["asr"], audio, engine, vad)
    assert served is RealASR
    assert (cfg.vad.engine, cfg.asr.engine) == (want_vad, "pocketsphinx")


def test_a_set_after_the_vad_still_chooses_the_recogniser():
    cfg = load_config(None, [*engine_sets(["asr"], "model", None, "silero"), "asr.engine=pocketsphinx"])
    assert stage_class("asr", cfg) is RealASR


def test_a_vad_for_a_process_that_serves_no_asr_is_one_line_naming_the_option():
    with pytest.raises(UserError, match="--vad"):
        engine_sets(["router"], "model", None, "silero")


def test_the_help_says_what_the_vad_alone_serves():
    stage = typer.main.get_command(app).commands["stage"]  # type: ignore[attr-defined]
    helps = {p.name: " ".join((p.help or "").split()) for p in stage.params}
    assert "script recogniser" in helps["vad"] and "--engine pocketsphinx" in helps["vad"]
