"""Word error rate of a transcript against the scripted text (both normalised: case, punctuation)."""

from __future__ import annotations

from voicepipe.text import normalise, plain


def wer(reference: str, hypothesis: str) -> float:
    """(substitutions + deletions + insertions) / reference words, by word-level edit distance. A reference
    with no words scores 0 for an empty hypothesis and 1 otherwise."""
    ref = normalise(plain(reference)).split()
    hyp = normalise(hypothesis).split()
    if not ref:
        return 0.0 if not hyp else 1.0
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1] / len(ref)
