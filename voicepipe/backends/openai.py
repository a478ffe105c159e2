"""A real LLM: any OpenAI-compatible chat-completions endpoint, streamed over HTTP (httpx).

Spec: ``openai:URL#model`` or ``{endpoint: URL, model: NAME, api_key_env: VAR, prices: {input_per_mtok,
output_per_mtok, source}, timeout: S, profile: FILE, system: TEXT, name: LABEL, extra: {...}}``. URL is the
API base (``http://host:8080/v1``); requests go to ``URL/chat/completions`` with ``stream: true`` and
``stream_options.include_usage`` over one keep-alive connection pool per event loop.

Contract:

* The reply text is the model's own: an :class:`EndpointStream` is a
  :class:`~voicepipe.backends.base.TextStream` whose ``pieces`` are the streamed deltas with the monotonic
  instant each arrived. Its spans are *measured* (``modelled=False``) and named like the modelled ones
  (``ttft``: request start -> first text, ``decode``: first text -> a given piece); with a calibrated
  ``profile`` each carries the profile's prediction (``predicted_ns``), so a turn's predicted time still
  excludes the pipeline's own overhead.
* Per request it records vLLM's metrics (TTFT, ITL, TPOT, E2EL), the ``usage`` token counts the server
  reports, and the cost from the configured prices (:class:`RequestStats`).
* ``cancel()`` closes the HTTP response at once (the server sees the connection go) and keeps what
  arrived. Timeouts (no byte for ``timeout`` seconds), HTTP errors, 429 (with Retry-After), malformed SSE,
  a stream that ends without ``[DONE]`` and dropped connections end the stream with a one-line reason
  (:class:`~voicepipe.backends.base.EndpointError`); nothing is retried.
* The API key is read from the environment variable named by ``api_key_env`` when a request is made; it
  is never part of a name, description, error, log line or export.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import ssl
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from voicepipe.backends.base import EndpointError, LLMRequest, Prices, Timing
from voicepipe.clock import now_ns
from voicepipe.errors import UserError
from voicepipe.messages import Span

DEFAULT_SYSTEM = "You are a voice assistant. Answer in one or two short spoken sentences."
DEFAULT_TIMEOUT_S = 30.0
NO_PRICES = Prices(0.0, 0.0, "not configured (prices: {input_per_mtok, output_per_mtok})")
MAX_ERROR_BODY = 200  # characters of an error response quoted in the reason


@dataclass(frozen=True)
class EndpointConfig:
    url: str  # API base, e.g. http://127.0.0.1:8080/v1
    model: str
    api_key_env: str | None = None
    prices: Prices = field(default_factory=lambda: NO_PRICES)
    timeout_s: float = DEFAULT_TIMEOUT_S
    system: str = DEFAULT_SYSTEM
    name: str = ""
    extra: tuple[tuple[str, Any], ...] = ()  # further request fields (e.g. ignore_eos for calibration)

    @property
    def host(self) -> str:
        return urlsplit(self.url).netloc

    @property
    def label(self) -> str:
        return self.name or f"endpoint:{self.host}/{self.model}"


def parse_shorthand(spec: str) -> dict[str, Any]:
    """``openai:URL#model`` -> ``{endpoint: URL, model: model}``."""
    rest = spec.removeprefix("openai:")
    url, sep, model = rest.rpartition("#")
    if not sep or not url or not model:
        raise ValueError(
            f"{spec!r}: expected openai:URL#model (e.g. openai:http://127.0.0.1:8080/v1#my-model)"
        )
    return {"endpoint": url, "model": model}



async def sse_data(resp: httpx.Response, host: str) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event of ``resp`` (its lines joined), as the event ends; comments
    (keep-alives) skipped, a last event without its blank line still given; a line of an unknown field is
    an :class:`EndpointError` naming ``host``. The chat stream and the speech transcript stream read it."""
    data: list[str] = []
    async for line in resp.aiter_lines():
        if line.startswith(":"):
            continue  # SSE comment (keep-alive)
        if line == "":
            if data:
                yield "\n".join(data)
            data = []
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value.removeprefix(" "))
        elif name not in ("event", "id", "retry"):
            raise EndpointError(f"malformed SSE from {host}: line {line[:60]!r}")
    if data:
        yield "\n".join(data)

def config_from_spec(spec: dict[str, Any]) -> EndpointConfig:
    """Validate an endpoint mapping (ValueError names the field)."""
    known = {"endpoint", "model", "api_key_env", "prices", "timeout", "profile", "system", "name", "extra"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown endpoint field (known: {', '.join(sorted(known))})")
    url = spec.get("endpoint")
    if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
        raise ValueError(f"endpoint: {url!r} is not an http(s) URL")
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("model: the endpoint's model name is required")
    key_env = spec.get("api_key_env")
    if key_env is not None and (not isinstance(key_env, str) or not key_env):
        raise ValueError(f"api_key_env: {key_env!r} is not an environment variable's name")
    prices = NO_PRICES
    if spec.get("prices") is not None:
        p = spec["prices"]
        if not isinstance(p, dict) or not {"input_per_mtok", "output_per_mtok"} <= set(p):
            raise ValueError("prices: expected {input_per_mtok: USD, output_per_mtok: USD, source: ...}")
        prices = Prices(
            float(p["input_per_mtok"]), float(p["output_per_mtok"]), str(p.get("source", "config"))
        )
    timeout = float(spec.get("timeout", DEFAULT_TIMEOUT_S))
    if timeout <= 0:
        raise ValueError("timeout: must be > 0 seconds")
    extra = spec.get("extra") or {}
    if not isinstance(extra, dict):
        raise ValueError("extra: expected a mapping of request fields")
    return EndpointConfig(
        url=url.rstrip("/"),
        model=model,
        api_key_env=key_env,
        prices=prices,
        timeout_s=timeout,
        system=str(spec.get("system", DEFAULT_SYSTEM)),
        name=str(spec.get("name", "")),
        extra=tuple(sorted(extra.items())),
    )


@dataclass
class RequestStats:
    """vLLM's per-request metrics (ms), the server's usage counts and the cost of one request."""

    session: str
    turn: int
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)  # gaps between successive text pieces
    tpot_ms: float | None = None  # (E2EL - TTFT) / (output tokens - 1)
    e2el_ms: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_reported: bool = False  # the counts came from the server's usage field (else: pieces seen)
    cost_usd: float = 0.0
    cancelled: bool = False
    error: str = ""


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for all clients, made when the backend is built, not inside the first turn
    (loading the CA bundle takes ~0.1 s, and httpcore imports its asyncio backend on first use)."""
    import anyio._backends._asyncio
    import anyio.to_thread  # noqa: F401
    import h11  # noqa: F401
    import httpcore  # noqa: F401

    return httpx.create_ssl_context()


class _Pool:
    """One httpx client per event loop (a client's connections belong to the loop that opened them)."""

    def __init__(self, cfg: EndpointConfig) -> None:
        self.cfg = cfg
        self.tls = _tls()
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )

    def client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        c = self._clients.get(loop)
        if c is None or c.is_closed:
            t = self.cfg.timeout_s
            c = httpx.AsyncClient(
                timeout=httpx.Timeout(t, connect=min(t, 10.0)),
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
                verify=self.tls,
            )
            self._clients[loop] = c
        return c


class EndpointStream:
    """One streamed chat completion (see the module docstring); reading starts at construction."""

    own_text = True  # a TextStream: the reply is the model's own words

    def __init__(
        self, backend: EndpointBackend, req: LLMRequest, t0_ns: int, predicted: Timing | None
    ) -> None:
        self.backend = backend
        self.req = req
        self.t0_ns = t0_ns
        self.predicted = predicted
        self.stage = "agent"
        self.pieces: list[str] = []
        self.times: list[int] = []
        self.stats = RequestStats(req.session, req.turn)
        self.done = False
        self.error: str | None = None
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._read())
        self._task.add_done_callback(self._closed)

    # -- reading ------------------------------------------------------------------------------------
    async def _read(self) -> None:
        cfg = self.backend.cfg
        headers = {"Accept": "text/event-stream"}
        if cfg.api_key_env:
            headers["Authorization"] = f"Bearer {os.environ.get(cfg.api_key_env, '')}"
        try:
            async with self.backend.pool.client().stream(
                "POST", f"{cfg.url}/chat/completions", json=self.backend.body(self.req), headers=headers
            ) as resp:
                if resp.status_code != 200:
                    raise EndpointError(await _http_reason(resp))
                await self._consume(resp)
        except EndpointError as exc:
            self.error = str(exc)
        except httpx.TimeoutException as exc:
            self.error = f"timeout: {_timeout_what(exc)} for {cfg.timeout_s:g} s"
        except httpx.ConnectError:
            self.error = f"cannot connect to {cfg.host}"
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            self.error = f"connection dropped by {cfg.host} after {len(self.pieces)} pieces"
        except httpx.HTTPError as exc:
            self.error = f"HTTP error talking to {cfg.host}: {type(exc).__name__}"

    def _closed(self, _task: asyncio.Task[None]) -> None:
        """The request is over (finished, failed or cancelled, even before it started)."""
        self.done = True
        self._finish()
        self._changed.set()

    async def _consume(self, resp: httpx.Response) -> None:
        async for data in sse_data(resp, self.backend.cfg.host):
            if self._event(data):
                return
        raise EndpointError(
            f"stream from {self.backend.cfg.host} ended without [DONE] after {len(self.pieces)} pieces"
        )

    def _event(self, data: str) -> bool:
        """Handle one SSE event; True at ``[DONE]``."""
        if data.strip() == "[DONE]":
            return True
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            raise EndpointError(
                f"malformed SSE from {self.backend.cfg.host}: data is not JSON ({data[:60]!r})"
            ) from None
        if not isinstance(obj, dict):
            raise EndpointError(f"malformed SSE from {self.backend.cfg.host}: data is not an object")
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise EndpointError(f"server error mid-stream: {str(msg)[:MAX_ERROR_BODY]}")
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.stats.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.stats.completion_tokens = int(usage.get("completion_tokens") or 0)
            self.stats.usage_reported = True
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {} if isinstance(choice, dict) else {}
            text = delta.get("content") if isinstance(delta, dict) else None
            if text:
                self.times.append(now_ns())
                self.pieces.append(text)
                self._changed.set()
        return False

    def _finish(self) -> None:
        s = self.stats
        if self.times:
            s.ttft_ms = (self.times[0] - self.t0_ns) / 1e6
            s.e2el_ms = (self.times[-1] - self.t0_ns) / 1e6
            s.itl_ms = [(b - a) / 1e6 for a, b in zip(self.times, self.times[1:], strict=False)]
            if len(self.times) > 1:
                s.tpot_ms = (s.e2el_ms - s.ttft_ms) / (len(self.times) - 1)
        if not s.usage_reported:
            s.prompt_tokens, s.completion_tokens = self.req.prompt_tokens, len(self.pieces)
        s.cost_usd = self.backend.prices.cost(s.prompt_tokens, s.completion_tokens)
        s.error = self.error or ""
        self.backend.log.append(s)

    # -- TokenStream / TextStream --------------------------------------------------------------------
    async def _wait(self, i: int) -> bool:
        """Wait until piece ``i`` exists (True) or the stream is over without it (False)."""
        while len(self.pieces) <= i and not self.done:
            self._changed.clear()
            await self._changed.wait()
        return len(self.pieces) > i

    async def token_time(self, i: int) -> int:
        """Piece ``i``'s arrival; if the reply is shorter (or ``i`` < 0), its last piece's, once it ended."""
        if i >= 0 and await self._wait(i):
            return self.times[i]
        await self._wait(len(self.pieces) + (1 << 30))  # until the stream is over
        if self.error:
            raise EndpointError(self.error)
        if not self.times:
            raise EndpointError(f"{self.backend.cfg.host} sent no text")
        return self.times[-1]  # the model stopped early: its last piece ends the reply

    async def chunks(self, cut: Callable[[list[str]], list[int]]) -> AsyncIterator[tuple[int, bool]]:
        emitted = -1
        while True:
            if self.error:
                raise EndpointError(self.error)
            n, done = len(self.pieces), self.done
            if done and not "".join(self.pieces).strip():
                raise EndpointError(f"{self.backend.cfg.host} sent no words")
            for end in cut(self.pieces) if n else []:
                if end <= emitted:
                    continue
                # a chunk is final once words follow it (so the last chunk, and TTS's last clause, has words)
                if not done and not "".join(self.pieces[end + 1 :]).strip():
                    break
                emitted = end
                yield end, done and end == n - 1
            if done:
                return
            if len(self.pieces) == n and not self.done:  # nothing new while our consumer held the yield
                self._changed.clear()
                await self._changed.wait()

    def spans(self, upto_token: int) -> list[Span]:
        if not self.times:  # nothing yet: the wait so far (the council reads where a request starts)
            return [
                Span(
                    stage=self.stage,
                    what="ttft",
                    start_ns=self.t0_ns,
                    dur_ns=max(0, now_ns() - self.t0_ns),
                    modelled=False,
                )
            ]
        upto = min(upto_token, len(self.times) - 1)
        first = self.times[0]
        p = self.predicted
        out = [
            Span(stage=self.stage, what="ttft", start_ns=self.t0_ns, dur_ns=first - self.t0_ns, modelled=False,
                 predicted_ns=round(p.ttft_s * 1e9) if p else None)
        ]  # fmt: skip
        if upto > 0:
            out.append(
                Span(stage=self.stage, what="decode", start_ns=first, dur_ns=self.times[upto] - first,
                     modelled=False, predicted_ns=round(upto * p.tpot_s * 1e9) if p else None)
            )  # fmt: skip
        return out

    def metrics(self) -> dict[str, Any]:
        """The finished request's metrics (the fields of :class:`voicepipe.records.EndpointMetrics`)."""
        s = self.stats
        return {
            "ttft_ms": s.ttft_ms,
            "tpot_ms": s.tpot_ms,
            "itl_ms_mean": float(np.mean(s.itl_ms)) if s.itl_ms else None,
            "itl_ms_max": max(s.itl_ms) if s.itl_ms else None,
            "e2el_ms": s.e2el_ms,
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens,
            "usage_reported": s.usage_reported,
        }

    def usage(self) -> tuple[int, int]:
        s = self.stats
        if s.usage_reported:
            return s.prompt_tokens, s.completion_tokens
        return self.req.prompt_tokens, len(self.pieces)

    def cancel(self) -> None:
        if not self._task.done():
            self.stats.cancelled = True
            self._task.cancel()  # leaving the `async with` closes the response: the server sees the drop

    async def wait_closed(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def _http_reason(resp: httpx.Response) -> str:
    code = resp.status_code
    try:
        body = (await resp.aread()).decode("utf-8", "replace")
    except httpx.HTTPError:
        body = ""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        err = json.loads(body).get("error")
        body = str(err.get("message", err) if isinstance(err, dict) else err)
    body = " ".join(body.split())[:MAX_ERROR_BODY]
    if code == 429:
        after = resp.headers.get("retry-after")
        return f"rate limited (HTTP 429{f', Retry-After: {after} s' if after else ''}){f': {body}' if body else ''}"
    return f"HTTP {code}{f': {body}' if body else ''}"


def _timeout_what(exc: httpx.TimeoutException) -> str:
    if isinstance(exc, httpx.ConnectTimeout):
        return "no connection"
    if isinstance(exc, httpx.PoolTimeout):
        return "no free connection"
    return "no data"


class EndpointBackend:
    """A :class:`~voicepipe.backends.base.Backend` that is a real OpenAI-compatible server."""

    kind = "endpoint"

    def __init__(self, cfg: EndpointConfig, profile: Any = None) -> None:
        self.cfg = cfg
        self.name = cfg.label
        self.prices = cfg.prices
        self.quality: float | None = None
        self.profile = profile  # an EmpiricalBackend (calibrated) or None
        self.pool = _Pool(cfg)
        self.log: list[RequestStats] = []

    def body(self, req: LLMRequest) -> dict[str, Any]:
        messages = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []
        messages += [{"role": r, "content": c} for r, c in req.messages] or [
            {"role": "user", "content": "Hello."}
        ]
        return {
            "model": self.cfg.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max(1, req.output_tokens),
            **dict(self.cfg.extra),
        }

    def predict(self, req: LLMRequest, rng: np.random.Generator) -> Timing:
        if self.profile is None:
            raise UserError(
                "agent.backend",
                f"{self.name} has no profile to predict with: `voicepipe calibrate {self.cfg.url} "
                f"--model {self.cfg.model} --out my.yaml`, then add `profile: my.yaml` to the endpoint",
            )
        return self.profile.predict(req, rng)

    def start(self, req: LLMRequest, t0_ns: int, rng: np.random.Generator) -> EndpointStream:
        predicted = self.profile.predict(req, rng) if self.profile is not None else None
        return EndpointStream(self, req, t0_ns, predicted)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kind": self.kind,
            "description": f"OpenAI-compatible endpoint {self.cfg.host}, model {self.cfg.model} (measured)",
            "model": self.cfg.model,
            "host": self.cfg.host,
            "api_key_env": self.cfg.api_key_env,
            "price_in_per_mtok": self.prices.input_per_mtok,
            "price_out_per_mtok": self.prices.output_per_mtok,
            "price_source": self.prices.source,
            "profile": self.profile.name if self.profile is not None else None,
            "quality": None,
        }
