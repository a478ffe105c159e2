"""A speech-stage profile: what ``voicepipe calibrate --stage asr|tts`` measured, as that stage's model.

A profile is a YAML mapping ``{kind: asr|tts, <setting>: {median, p90}, fit: {...}, points: [...],
source: {...}}``. ``<setting>`` is the modelled stage's own figure it replaces — ``finalize_ms`` for the
ASR (transcript finalisation after the endpoint), ``ttfb_ms`` for the TTS (time to first audio) — a
length-independent lognormal (:class:`~voicepipe.config.Dist`), so the profile states the fit it was read
from: ``ms = intercept + slope x length`` over the idle endpoint's (one client) medians, evaluated at
``fit.reference`` (seconds of audio for ASR, words for TTS), with the measured p90/median ratio at that
level. ``asr.profile: FILE`` / ``tts.profile: FILE`` in a config set that figure (the profile wins over the
stage's own field); :func:`stage_figure` reads it through the file guard and checks it.
"""

from __future__ import annotations

from typing import Any, Literal

from voicepipe.errors import UserError
from voicepipe.files import read_yaml_mapping

SETTING = {"asr": "finalize_ms", "tts": "ttfb_ms"}


def stage_figure(kind: Literal["asr", "tts"], path: str) -> dict[str, float]:
    """The ``{median, p90}`` a profile gives the ``kind`` stage (a UserError naming the file and the field if
    it is not a profile of that stage)."""
    data = read_yaml_mapping(path, "a speech profile", f"{kind}.profile")
    if data.get("kind") != kind:
        raise UserError(path, f"kind: a profile of {data.get('kind')!r}, not of {kind!r} (given as {kind}.profile)")
    fig = data.get(SETTING[kind])
    if not isinstance(fig, dict):
        raise UserError(path, f"{SETTING[kind]}: missing (a mapping median, p90)")
    try:
        median, p90 = float(fig["median"]), float(fig["p90"])
    except (KeyError, TypeError, ValueError):
        raise UserError(path, f"{SETTING[kind]}: needs numbers median and p90") from None
    if not 0 <= median <= p90:
        raise UserError(path, f"{SETTING[kind]}: needs 0 <= median <= p90")
    return {"median": median, "p90": p90}


def apply_profiles(data: dict[str, Any]) -> None:
    """Set each stage's figure from its ``profile`` in a config's raw data (in place)."""
    for kind in ("asr", "tts"):
        stage = data.get(kind)
        if isinstance(stage, dict) and isinstance(stage.get("profile"), str):
            stage[SETTING[kind]] = stage_figure(kind, stage["profile"])


def describe(profile: dict[str, Any]) -> str:
    """One line: the figure, and the fit it came from."""
    kind = profile["kind"]
    fig, fit = profile[SETTING[kind]], profile["fit"]
    unit = "s of audio" if kind == "asr" else "words"
    return (
        f"{kind}.{SETTING[kind]} median {fig['median']:.1f} ms, p90 {fig['p90']:.1f} ms at {fit['reference']:g} "
        f"{unit} (fit {fit['intercept_ms']:.1f} ms + {fit['slope_ms']:.2f} ms per {unit.split()[0]}, "
        f"r2 {fit['r2']:.2f}, over one client's medians)"
    )
