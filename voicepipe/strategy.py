"""Pure pieces of the latency strategies: text similarity, an LRU, council quality arithmetic.

No I/O: the cache, council and router stages call these, and the tests check them alone.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from voicepipe.text import normalise

K = TypeVar("K")
V = TypeVar("V")


# -- similarity --------------------------------------------------------------------------------------
def _grams(text: str, n: int = 3) -> Counter[str]:
    t = f" {normalise(text)} "
    return Counter(t[i : i + n] for i in range(max(0, len(t) - n + 1)))


def similarity(a: str, b: str) -> float:
    """Cosine similarity of character trigram counts of the normalised texts, in [0, 1].

    Robust to punctuation, case and small wording changes ("when do you close" vs "what time do you
    close" ~0.6; identical after normalising = 1.0). A cheap stand-in for an embedding model.
    """
    ga, gb = _grams(a), _grams(b)
    if not ga or not gb:
        return 0.0
    dot = sum(v * gb.get(k, 0) for k, v in ga.items())
    return dot / math.sqrt(sum(v * v for v in ga.values()) * sum(v * v for v in gb.values()))


def best_match(text: str, questions: Iterable[tuple[str, K]]) -> tuple[float, K | None]:
    """Highest similarity between ``text`` and any (question, key) pair."""
    best: tuple[float, K | None] = (0.0, None)
    for q, key in questions:
        s = similarity(text, q)
        if s > best[0]:
            best = (s, key)
    return best


def same_utterance(a: str, b: str) -> bool:
    """Preemptive commit rule: equal ignoring case and punctuation."""
    return normalise(a) == normalise(b)


class LRU(Generic[K, V]):
    """Least-recently-used map with a capacity (0 = keeps nothing)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.data: OrderedDict[K, V] = OrderedDict()
        self.evictions = 0

    def get(self, key: K) -> V | None:
        if key not in self.data:
            return None
        self.data.move_to_end(key)
        return self.data[key]

    def put(self, key: K, value: V) -> None:
        if self.capacity <= 0:
            return
        self.data[key] = value
        self.data.move_to_end(key)
        while len(self.data) > self.capacity:
            self.data.popitem(last=False)
            self.evictions += 1

    def items(self) -> list[tuple[K, V]]:
        return list(self.data.items())

    def __len__(self) -> int:
        return len(self.data)


# -- council quality (modelled) ----------------------------------------------------------------------
def majority_accuracy(ps: Sequence[float]) -> float:
    """P(a strict majority of independent members is right); a tie is broken by a fair coin.

    Poisson-binomial by dynamic programming over members: dist[j] = P(j correct so far).
    """
    if not ps:
        raise ValueError("no members")
    dist = [1.0]
    for p in ps:
        nxt = [0.0] * (len(dist) + 1)
        for j, q in enumerate(dist):
            nxt[j] += q * (1 - p)
            nxt[j + 1] += q * p
        dist = nxt
    n = len(ps)
    win = sum(q for j, q in enumerate(dist) if 2 * j > n)
    tie = dist[n // 2] if n % 2 == 0 else 0.0
    return win + tie / 2


def judge_accuracy(ps: Sequence[float], gain: float) -> float:
    """A judge reading all answers: at best its best member plus a configured gain (capped at 1)."""
    return min(1.0, max(ps) + gain)


def council_quality(aggregation: str, ps: Sequence[float | None], gain: float = 0.0) -> float | None:
    """Modelled accuracy of a council answer from its members' accuracies (None if any is unknown).

    ``ps`` are the members that took part, in the order their answers counted (first = the winner).
    """
    if not ps or any(p is None for p in ps):
        return None
    known = [float(p) for p in ps if p is not None]
    if aggregation in ("first", "draft-refine"):
        return known[0]
    if aggregation == "vote":
        return majority_accuracy(known)
    if aggregation == "judge":
        return judge_accuracy(known, gain)
    raise ValueError(f"unknown aggregation {aggregation!r}")
