"""Which speech stages run real engines and which are modelled (issue 25), and which mixes make sense.

Every speech stage is real or modelled on its own — the caller (``client.voice``), the VAD and ASR, the TTS
— on the same scenarios, with the same records: the client's kind fixes the stopwatch and every other stage
gives it what it times. A word client times the first ``tts.audio`` message (plus the modelled downlink)
from the end of the modelled utterance, whether a modelled or a real TTS sent it; an audio caller times
the first reply sample above the energy threshold from its last voiced sample, so a modelled TTS answering
it plays its reply as frames (a tone of the modelled duration, :mod:`voicepipe.audio.tone`), and a modelled
ASR listening to it gets the utterance's words placed on the real audio's timeline beside the frames
(:mod:`voicepipe.audio.align`).

A real VAD with a modelled ASR endpoints the caller's audio for a recogniser that returns the words said
so far (:mod:`voicepipe.audio.vad_asr`). Two couplings remain, each refused in one line: a real VAD or ASR
hears audio, so it needs an audio caller; and a real ASR endpoints on a real VAD (the modelled VAD is the
modelled ASR's timing of the scripted words, which a real decoder does not see).
"""

from __future__ import annotations

SPEECH_STAGES = ("client", "vad", "asr", "tts")


def real_speech_stages(voice: str, vad: str, asr: object, tts: object) -> list[str]:
    """The speech stages that run real engines, in pipeline order."""
    real = {"client": voice != "model", "vad": vad != "model", "asr": asr != "model", "tts": tts != "model"}
    return [k for k in SPEECH_STAGES if real[k]]


def modelled_speech_stages(real: list[str]) -> list[str]:
    """The speech stages not in ``real``, in pipeline order."""
    return [k for k in SPEECH_STAGES if k not in real]


def mix_problem(voice: str, vad: str, asr: object, tts: object) -> str | None:
    """Why this mix of engines cannot run (one line naming the field), or None."""
    real = real_speech_stages(voice, vad, asr, tts)
    if "asr" in real and "client" not in real:
        return (
            f"asr.engine: {asr!r} hears audio, and a modelled caller sends words: set client.voice "
            "espeak-ng or wav (or use --audio real)"
        )
    if "asr" in real and "vad" not in real:
        return f"vad.engine: a real ASR ({asr!r}) endpoints on a real VAD: set vad.engine silero or webrtc"
    if "vad" in real and "client" not in real:
        return (
            f"vad.engine: {vad!r} hears audio, and a modelled caller sends words: set client.voice "
            "espeak-ng or wav (or use --audio real)"
        )
    return None
