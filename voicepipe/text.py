"""Text helpers shared by stages: word timing of a scripted utterance, token estimates, clauses.

Token counts are modelled, not a real tokenizer: ~4 characters per token for English (OpenAI's rule of
thumb, https://help.openai.com/en/articles/4936856), punctuation a token of its own.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

PAUSE = re.compile(r"\[(?:pause\s*)?(\d+(?:\.\d+)?)\s*(ms|s)?\]", re.IGNORECASE)
CLAUSE_END = re.compile(r"[,.;:!?…—]$")
SENTENCE_END = re.compile(r"[.!?…]$")


@dataclass(frozen=True)
class Word:
    text: str
    start_ms: float  # from the start of the utterance
    end_ms: float


def speak(utterance: str, words_per_minute: float) -> list[Word]:
    """Timed words of a scripted utterance. ``[900]``, ``[pause 900ms]`` or ``[1.2s]`` insert silence."""
    per_word = 60_000.0 / words_per_minute
    t = 0.0
    out: list[Word] = []
    pos = 0
    for m in [*PAUSE.finditer(utterance), None]:
        chunk = utterance[pos : m.start() if m else len(utterance)]
        for w in chunk.split():
            # longer words take longer: scale by letters around an average 5-letter word
            dur = per_word * (0.6 + 0.4 * min(len(w.strip(".,!?;:")), 12) / 5.0)
            out.append(Word(w, t, t + dur))
            t += dur
        if m:
            t += pause_ms(m)
            pos = m.end()
    return out


def audio_ms(words: list[str], words_per_minute: float) -> float:
    """How long the TTS takes to say ``words`` (its audio: words at the speaking rate)."""
    return len(words) * 60_000.0 / words_per_minute


def pause_ms(m: re.Match[str]) -> float:
    """The silence a :data:`PAUSE` marker stands for, in ms."""
    val = float(m.group(1))
    return val * 1000.0 if (m.group(2) or "").lower() == "s" else val


@functools.lru_cache(maxsize=4096)
def plain(utterance: str) -> str:
    """The utterance without pause markers, single-spaced (memoised: every session says the same lines)."""
    return " ".join(PAUSE.sub(" ", utterance).split())


def tokens_of(text: str) -> list[str]:
    """Split text into modelled tokens: each word ~ceil(len/4) tokens, punctuation attached to the last.

    Returns token strings whose concatenation (with the original spacing approximated) is the text, so a
    chunk boundary after a token that ends a clause is a clause boundary.
    """
    return list(_tokens(text))


def count_tokens(text: str) -> int:
    return len(_tokens(text))


@functools.lru_cache(maxsize=4096)
def _tokens(text: str) -> tuple[str, ...]:
    """:func:`tokens_of`, memoised: a run splits the same scripted replies and questions once per session
    and turn (every session of a capacity sweep plays the same scenarios)."""
    out: list[str] = []
    for w in text.split():
        core = len(w.rstrip(",.;:!?…—\"'"))
        n = max(1, math.ceil(core / 4))
        step = math.ceil(len(w) / n)
        pieces = [w[i : i + step] for i in range(0, len(w), step)]
        pieces[0] = " " + pieces[0] if out else pieces[0]
        out.extend(pieces)
    return tuple(out)


def first_clause_end(words: list[str], min_words: int, sentence: bool = False) -> int | None:
    """Index (exclusive) of the first speakable clause in ``words``, or None if none is complete yet.

    A clause ends at punctuation (sentence punctuation only when ``sentence``) once it has
    ``min_words`` words; TTS starts synthesising there.
    """
    rule = SENTENCE_END if sentence else CLAUSE_END
    for i, w in enumerate(words):
        if i + 1 >= min_words and rule.search(w):
            return i + 1
    return None


def normalise(text: str) -> str:
    """Lower case, no punctuation, single spaces: the form transcripts are compared in."""
    return " ".join(re.sub(r"[^\w\s']", " ", text.lower()).split())
