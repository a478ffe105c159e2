"""The LLM backend interface the agent stage (and council, router classifier) talks to.

A backend answers two questions:

* ``predict(req, rng)`` — pure: the modelled timing of one request on an otherwise idle backend
  (TTFT and time per output token). The virtual-time predictor and the live run's ``predicted_ms`` use it.
* ``start(req, t0_ns, rng)`` — live: a :class:`TokenStream` whose ``token_time(i)`` sleeps until token
  ``i`` exists (on the shared monotonic clock) and returns that instant. A shared-device backend
  (continuous batching, queueing) realises contention here; an empirical one just follows its prediction.

Both use the same ``rng`` draws so a lone request's live timing equals its prediction.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeGuard

import numpy as np

from voicepipe.clock import sleep_until_ns
from voicepipe.llm import LLMRequest
from voicepipe.messages import Span
from voicepipe.spans import modelled_span


@dataclass(frozen=True)
class Timing:
    """Modelled timing of one request on an idle backend (seconds)."""

    ttft_s: float  # request sent -> first output token
    tpot_s: float  # time per output token after the first (mean, incl. speculative decoding)
    queue_s: float = 0.0

    def token_s(self, i: int) -> float:
        """Seconds from the request to output token ``i`` (0-based)."""
        return self.queue_s + self.ttft_s + i * self.tpot_s


@dataclass
class Prices:
    input_per_mtok: float  # USD per million input tokens
    output_per_mtok: float
    source: str = ""

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input_per_mtok + output_tokens * self.output_per_mtok) / 1e6


class TokenStream(Protocol):
    async def token_time(self, i: int) -> int:
        """Wait until output token ``i`` is produced; return its monotonic ns."""
        ...

    def spans(self, upto_token: int) -> list[Span]:
        """Modelled spans (queue, prefill/ttft, decode) up to and including token ``upto_token``."""
        ...

    def cancel(self) -> None:
        """Stop generating (frees the batch slot on a shared device)."""
        ...


class EndpointError(RuntimeError):
    """A real model's request failed (timeout, HTTP error, rate limit, malformed stream, dropped
    connection); the message is the one-line reason the turn's record carries."""


class TextStream(TokenStream, Protocol):
    """A stream whose model writes its own reply (a real endpoint), not the scenario's reference reply.

    ``pieces`` grows as text arrives (one entry per streamed delta, ~ one token each). ``chunks(cut)``
    yields the index of each chunk's last piece once it is final: ``cut(pieces)`` returns chunk ends for a
    list of pieces, and an end is final once the piece after it exists (or the stream is over). It raises
    :class:`EndpointError` if the request fails. ``usage()`` returns (prompt, completion) tokens as the
    server reported them, else the counts seen so far.
    """

    pieces: list[str]
    own_text: bool  # True: tells it from a TokenStream cheaply (a runtime protocol check costs ~0.1 ms)

    def chunks(self, cut: Callable[[list[str]], list[int]]) -> AsyncIterator[tuple[int, bool]]: ...

    def usage(self) -> tuple[int, int]: ...

    def metrics(self) -> dict[str, object]: ...


def writes_own_text(stream: TokenStream) -> TypeGuard[TextStream]:
    """Is ``stream`` a :class:`TextStream` (a real model writing its own reply)?"""
    return getattr(stream, "own_text", False) is True


def tokens_by(stream: TokenStream, n: int, t_ns: int) -> int:
    """How many of a stream's ``n`` output tokens exist at ``t_ns`` (binary search on their instants)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if stream.spans(mid)[-1].end_ns <= t_ns:
            lo = mid + 1
        else:
            hi = mid
    return lo


class Backend(Protocol):
    name: str
    prices: Prices
    quality: float | None  # modelled accuracy in [0, 1] from a public benchmark; None if unknown
    kind: str  # "empirical" | "hardware" | ...

    def predict(self, req: LLMRequest, rng: np.random.Generator) -> Timing: ...

    def start(self, req: LLMRequest, t0_ns: int, rng: np.random.Generator) -> TokenStream: ...

    def describe(self) -> dict[str, object]: ...


@dataclass
class ScheduledStream:
    """A TokenStream that follows a precomputed :class:`Timing` (no contention)."""

    timing: Timing
    t0_ns: int
    stage: str = "agent"
    cancelled: bool = field(default=False)
    _head: list[Span] | None = field(default=None, init=False, repr=False, compare=False)

    def at_ns(self, i: int) -> int:
        return self.t0_ns + round(self.timing.token_s(i) * 1e9)

    async def token_time(self, i: int) -> int:
        t = self.at_ns(i)
        await sleep_until_ns(t)
        return t

    def spans(self, upto_token: int) -> list[Span]:
        head = self._head
        if head is None:  # queue and ttft are the same for every chunk: built once (spans are frozen)
            head, t = [], self.t0_ns
            if self.timing.queue_s > 0:
                d = round(self.timing.queue_s * 1e9)
                head.append(modelled_span(self.stage, "queue", t, d))
                t += d
            d = round(self.timing.ttft_s * 1e9)
            head.append(modelled_span(self.stage, "ttft", t, d))
            self._head = head
        t = head[-1].start_ns + head[-1].dur_ns
        end = self.at_ns(upto_token)
        if end > t:
            return [*head, modelled_span(self.stage, "decode", t, end - t)]
        return list(head)

    def cancel(self) -> None:
        self.cancelled = True
