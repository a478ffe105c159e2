"""One stereo WAV per session on the caller's timeline: what the caller said (left), what it heard (right).

Sample ``n`` of the file is the instant ``origin_ns + n / 16 kHz`` on the client's monotonic clock: the
caller's frames are written where their samples were spoken, the agent's where they played (arrival, or the
end of the frame before when frames arrive faster than they play: a jitter buffer). So a gap measured on
the clock is the same gap in the file.
"""

from __future__ import annotations

import re
import wave
from pathlib import Path

import numpy as np

from voicepipe.audio import RATE

LEFT, RIGHT = 0, 1


class Recorder:
    def __init__(self, origin_ns: int) -> None:
        self.origin_ns = origin_ns
        self.data = np.zeros((RATE * 10, 2), dtype=np.int16)
        self.length = 0

    def index(self, at_ns: int) -> int:
        return round((at_ns - self.origin_ns) * RATE / 1e9)

    def ms(self, at_ns: int) -> float:
        return (at_ns - self.origin_ns) / 1e6

    def put(self, channel: int, at_ns: int, samples: np.ndarray) -> None:
        i = self.index(at_ns)
        if i < 0:
            samples, i = samples[-i:], 0
        end = i + len(samples)
        if end > len(self.data):
            grown = np.zeros((max(end, 2 * len(self.data)), 2), dtype=np.int16)
            grown[: len(self.data)] = self.data
            self.data = grown
        self.data[i:end, channel] = samples
        self.length = max(self.length, end)

    def clear(self, channel: int, from_ns: int) -> None:
        """Silence ``channel`` from ``from_ns`` on: audio queued to play past a stop is never heard."""
        self.data[max(0, self.index(from_ns)) : self.length, channel] = 0

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with wave.open(str(path), "wb") as w:
            w.setnchannels(2)
            w.setsampwidth(2)
            w.setframerate(RATE)
            w.writeframes(self.data[: self.length].astype("<i2").tobytes())


def recording_path(directory: str, session: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", session)
    return Path(directory) / f"{safe}.wav"
