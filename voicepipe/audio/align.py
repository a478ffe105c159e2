"""The utterance's words placed on its real audio, for a modelled ASR listening to an audio caller.

The modelled ASR endpoints on word timings (``media_ns``, ``gap_after_ns``); the audio caller's stopwatch
starts at the last voiced sample of the audio it really sent. So that both agree on where speech is, the
caller sends the modelled words (:func:`~voicepipe.stages.client.spoken`) stretched onto the audio: each
stretch between pause markers maps linearly onto that stretch's voiced samples (first to last voiced
5 ms window), so the last word ends exactly at the caller's end of speech and a scripted pause is as long
to the modelled ASR as the silence in the audio. A recording (a ``wav`` turn with ``user`` text) is one
stretch: its words spread over its voiced samples.
"""

from __future__ import annotations

import numpy as np

from voicepipe.audio import RATE
from voicepipe.audio.engines import first_voiced_sample, last_voiced_sample
from voicepipe.messages import UserUtterance, UserWord


def _voiced_ns(pcm: np.ndarray, a: int, b: int) -> tuple[int, int]:
    lo, hi = first_voiced_sample(pcm[a:b]), last_voiced_sample(pcm[a:b])
    if lo is None or hi is None:
        lo, hi = 0, b - a
    return round((a + lo) * 1e9 / RATE), round((a + hi) * 1e9 / RATE)


def aligned(
    modelled: UserUtterance, pcm: np.ndarray, parts: list[tuple[str, int, int]] | None
) -> UserUtterance:
    """``modelled``'s words moved onto ``pcm``: ``parts`` are the spoken stretches (text, first sample, end
    sample) as :func:`~voicepipe.audio.engines.synthesize_parts` gives them; None (a recording), or parts
    whose words do not add up to the utterance's, make the whole signal one stretch."""
    words = modelled.words
    groups = [(len(text.split()), a, b) for text, a, b in parts or []]
    if sum(n for n, _, _ in groups) != len(words):
        groups = [(len(words), 0, len(pcm))]
    placed: list[tuple[int, int]] = []
    k = 0
    for n, a, b in groups:
        ws = words[k : k + n]
        k += n
        if not ws:
            continue
        r0, r1 = _voiced_ns(pcm, a, b)
        m0, m1 = ws[0].media_ns, ws[-1].media_ns + ws[-1].dur_ns
        scale = (r1 - r0) / max(1, m1 - m0)
        for w in ws:
            start = r0 + round((w.media_ns - m0) * scale)
            placed.append((start, min(r1, start + max(1, round(w.dur_ns * scale)))))
    out = []
    for i, (w, (start, end)) in enumerate(zip(words, placed, strict=True)):
        nxt = placed[i + 1][0] if i + 1 < len(placed) else None
        end = end if nxt is None else min(end, nxt)  # rounding must not run a word into the next
        out.append(UserWord(
            text=w.text, dur_ns=end - start, index=i, pause_before=w.pause_before, last_word=w.last_word,
            media_ns=start, gap_after_ns=None if nxt is None else max(0, nxt - end),
        ))  # fmt: skip
    return UserUtterance(words=out)
