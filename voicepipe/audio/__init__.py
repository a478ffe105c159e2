"""Real audio (issue 25): PCM frames on the bus, a synthesized caller, real VAD/ASR/TTS engines, recordings.

Audio is 16 kHz mono signed 16-bit little-endian PCM in 20 ms frames (:mod:`voicepipe.audio.frames`). The
engines are optional (``pip install 'voicepipe[audio]'`` plus espeak-ng from the OS packages): a missing one
is a :class:`~voicepipe.errors.UserError` naming what to install (:func:`need`), never a traceback. Nothing
here downloads weights: PocketSphinx and Silero VAD use the models their packages ship.
"""

from __future__ import annotations

import importlib
import shutil
from types import ModuleType

from voicepipe.errors import UserError

RATE = 16_000  # samples per second
FRAME_MS = 20
FRAME_SAMPLES = RATE * FRAME_MS // 1000  # 320
FRAME_BYTES = FRAME_SAMPLES * 2  # s16le mono
FRAME_NS = FRAME_MS * 1_000_000
EXTRA = "pip install 'voicepipe[audio]'"


def need(module: str, engine: str, where: str = "--audio") -> ModuleType:
    """Import ``module`` for ``engine``, or a one-line UserError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(where, f"{engine} needs the Python package {module!r}: {EXTRA}") from None


def need_program(program: str, where: str = "--audio") -> str:
    """The path of an OS program (espeak-ng), or a one-line UserError saying how to install it."""
    found = shutil.which(program)
    if found is None:
        raise UserError(where, f"{program} is not installed: apt-get install {program} (an OS package)")
    return found
