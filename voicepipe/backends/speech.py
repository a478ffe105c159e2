"""Speech services by URL: OpenAI-compatible transcription (ASR) and speech (TTS) endpoints over httpx.

Spec (``asr.engine`` / ``tts.engine``): an ``http(s)://HOST/v1`` URL, optionally ``#model``, or a mapping
``{endpoint: URL, model: NAME, api_key_env: VAR, timeout: S, retries: N, voice: V, format: pcm|wav,
sample_rate: HZ, stream: BOOL, language: CODE, name: LABEL}``. The model defaults to ``whisper-1`` (ASR) or
``tts-1`` (TTS), the voice to ``alloy``.

Contracts (the documented OpenAI request/response shapes; tests/speech_server.py implements them):

* **ASR** :func:`transcribe`: ``POST URL/audio/transcriptions``, multipart form: ``file`` (the segment as a
  16 kHz mono 16-bit WAV), ``model``, ``response_format=json``, ``stream=true`` when ``stream`` (default)
  and ``language`` when given. A ``text/event-stream`` answer is read as transcript events:
  ``{"type": "transcript.text.delta", "delta": "..."}`` (each delta timed on arrival) until
  ``{"type": "transcript.text.done", "text": "..."}``; a JSON answer ``{"text": "..."}`` is one final.
* **TTS** :func:`synthesize_stream`: ``POST URL/audio/speech`` with JSON ``{model, input, voice,
  response_format}``; the body streams audio (chunked): ``pcm`` is raw s16le mono at ``sample_rate``
  (OpenAI's is 24 kHz), ``wav`` a RIFF header then the same. Chunks are yielded as 16 kHz int16 as they
  arrive (each resampled on its own: speech-grade, a chunk edge can click), so time to first audio is the
  first chunk's arrival, not the whole reply's.
* **Errors** end the request with one line (:class:`~voicepipe.backends.base.EndpointError`), as for the
  LLM endpoint (:mod:`voicepipe.backends.openai`): a timeout (no byte for ``timeout`` s), HTTP errors, 429
  with its Retry-After, a malformed stream (not SSE, not JSON, no ``done`` event, a non-audio content type
  or an odd number of PCM bytes), a dropped connection. **Retries**: unlike the LLM endpoint, up to
  ``retries`` (default 0) further attempts are made for a refusal that came before any data (429, 5xx, no
  connection), waiting Retry-After (at most 2 s) or 100 ms; what was already streamed is never re-requested.
* The API key is read from ``api_key_env`` when a request is made; it is never part of a name, error,
  log line or export.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import os
import wave
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import httpx
import numpy as np
from pydantic import AfterValidator

from voicepipe.backends.base import EndpointError
from voicepipe.backends.openai import MAX_ERROR_BODY, _http_reason, _timeout_what, _tls, sse_data
from voicepipe.clock import now_ns

RATE = 16_000
MAX_RETRY_WAIT_S = 2.0
KNOWN = {"endpoint", "model", "api_key_env", "timeout", "retries", "voice", "format", "sample_rate", "stream",
         "language", "name"}  # fmt: skip


@dataclass(frozen=True)
class SpeechEndpoint:
    kind: Literal["asr", "tts"]
    url: str  # API base, e.g. http://127.0.0.1:9000/v1
    model: str
    api_key_env: str | None = None
    timeout_s: float = 30.0
    retries: int = 0
    voice: str = "alloy"
    format: Literal["pcm", "wav"] = "pcm"
    sample_rate: int = 24_000
    stream: bool = True
    language: str | None = None
    name: str = ""

    @property
    def host(self) -> str:
        return urlsplit(self.url).netloc

    @property
    def label(self) -> str:
        return self.name or f"{self.kind}:{self.host}/{self.model}"


def is_url(spec: object) -> bool:
    return isinstance(spec, dict) or (isinstance(spec, str) and spec.startswith(("http://", "https://")))


def speech_endpoint(kind: Literal["asr", "tts"], spec: str | dict[str, Any]) -> SpeechEndpoint:
    """Validate a speech endpoint spec (ValueError naming the field)."""
    if isinstance(spec, str):
        base, _, model = spec.partition("#")
        spec = {"endpoint": base, **({"model": model} if model else {})}
    unknown = sorted(set(spec) - KNOWN)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown speech endpoint field (known: {', '.join(sorted(KNOWN))})")
    url = spec.get("endpoint")
    if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
        raise ValueError(f"endpoint: {url!r} is not an http(s) URL")
    key_env = spec.get("api_key_env")
    if key_env is not None and (not isinstance(key_env, str) or not key_env):
        raise ValueError(f"api_key_env: {key_env!r} is not an environment variable's name")
    timeout, retries, rate = spec.get("timeout", 30.0), spec.get("retries", 0), spec.get("sample_rate", 24_000)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout <= 600:
        raise ValueError("timeout: must be a number of seconds in (0, 600]")
    if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries <= 10:
        raise ValueError("retries: must be an integer 0-10")
    if not isinstance(rate, int) or isinstance(rate, bool) or not 8_000 <= rate <= 48_000:
        raise ValueError("sample_rate: must be an integer 8000-48000 (Hz)")
    fmt = spec.get("format", "pcm")
    if fmt not in ("pcm", "wav"):
        raise ValueError("format: pcm or wav")
    stream = spec.get("stream", True)
    if not isinstance(stream, bool):
        raise ValueError("stream: true or false")
    texts = {k: spec.get(k) for k in ("model", "voice", "language", "name")}
    for k, v in texts.items():
        if v is not None and (not isinstance(v, str) or not 0 < len(v) <= 200):
            raise ValueError(f"{k}: a string of 1-200 characters")
    return SpeechEndpoint(
        kind=kind, url=url.rstrip("/"), model=texts["model"] or ("whisper-1" if kind == "asr" else "tts-1"),
        api_key_env=key_env, timeout_s=float(timeout), retries=retries, voice=texts["voice"] or "alloy",
        format=fmt, sample_rate=rate, stream=stream, language=texts["language"], name=texts["name"] or "",
    )  # fmt: skip


def engine_spec(kind: Literal["asr", "tts"], local: str, v: Any) -> Any:
    """A stage's ``engine``: ``model``, the local engine's name, or a speech endpoint (ValueError if not)."""
    if v in ("model", local):
        return v
    if not is_url(v):
        raise ValueError(f"{v!r}: expected model, {local}, an http(s) endpoint URL or an endpoint mapping")
    speech_endpoint(kind, v)  # ValueError names the field
    return v


AsrEngine = Annotated[str | dict[str, Any], AfterValidator(functools.partial(engine_spec, "asr", "pocketsphinx"))]
TtsEngine = Annotated[str | dict[str, Any], AfterValidator(functools.partial(engine_spec, "tts", "espeak-ng"))]

_clients: dict[tuple[int, float], httpx.AsyncClient] = {}


def _client(ep: SpeechEndpoint) -> httpx.AsyncClient:
    """One keep-alive client per event loop and timeout (a client's connections belong to its loop)."""
    key = (id(asyncio.get_running_loop()), ep.timeout_s)
    c = _clients.get(key)
    if c is None or c.is_closed:
        t = ep.timeout_s
        c = _clients[key] = httpx.AsyncClient(
            timeout=httpx.Timeout(t, connect=min(t, 10.0)),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            verify=_tls(),
        )
    return c


def _headers(ep: SpeechEndpoint, accept: str) -> dict[str, str]:
    h = {"Accept": accept}
    if ep.api_key_env:
        h["Authorization"] = f"Bearer {os.environ.get(ep.api_key_env, '')}"
    return h


class _Refused(Exception):
    def __init__(self, reason: str, wait_s: float | None) -> None:
        super().__init__(reason)
        self.wait_s = wait_s


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return min(MAX_RETRY_WAIT_S, max(0.0, float(resp.headers.get("retry-after", ""))))
    except ValueError:
        return None


async def _attempts(ep: SpeechEndpoint, once: Callable[[], Any]) -> Any:
    """``once()`` with retries for refusals before any data (see the module docstring); errors as one line."""
    for left in range(ep.retries, -1, -1):
        try:
            return await once()
        except _Refused as exc:
            if not left:
                raise EndpointError(str(exc)) from None
            await asyncio.sleep(exc.wait_s if exc.wait_s is not None else 0.1)
        except httpx.ConnectError:
            if not left:
                raise EndpointError(f"cannot connect to {ep.host}") from None
            await asyncio.sleep(0.1)
        except httpx.TimeoutException as exc:
            raise EndpointError(f"timeout: {_timeout_what(exc)} for {ep.timeout_s:g} s") from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            raise EndpointError(f"connection dropped by {ep.host} mid-response") from None
        except httpx.HTTPError as exc:
            raise EndpointError(f"HTTP error talking to {ep.host}: {type(exc).__name__}") from None
    raise AssertionError("unreachable")


async def _check(resp: httpx.Response) -> None:
    if resp.status_code == 429 or resp.status_code >= 500:
        raise _Refused(await _http_reason(resp), _retry_after(resp))
    if resp.status_code != 200:
        raise EndpointError(await _http_reason(resp))


# -- ASR ---------------------------------------------------------------------------------------------------
def wav_bytes(pcm: bytes, rate: int = RATE) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return buf.getvalue()


@dataclass
class Transcript:
    text: str = ""
    deltas: list[tuple[int, str]] = field(default_factory=list)  # (arrival ns, delta)
    sent_ns: int = 0  # the request left (the last attempt's)
    done_ns: int = 0  # the final text arrived
    streamed: bool = False


async def transcribe(
    ep: SpeechEndpoint, pcm: bytes, on_delta: Callable[[str], None] | None = None
) -> Transcript:
    """The transcript of ``pcm`` (16 kHz mono s16le) from the endpoint (see the module docstring)."""
    form = {"model": ep.model, "response_format": "json", **({"stream": "true"} if ep.stream else {})}
    if ep.language:
        form["language"] = ep.language
    audio = wav_bytes(pcm)

    async def once() -> Transcript:
        out = Transcript(sent_ns=now_ns())
        files = {"file": ("audio.wav", audio, "audio/wav")}
        async with _client(ep).stream(
            "POST", f"{ep.url}/audio/transcriptions", data=form, files=files,
            headers=_headers(ep, "text/event-stream, application/json"),
        ) as resp:  # fmt: skip
            await _check(resp)
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                out.streamed = True
                await _read_events(ep, resp, out, on_delta)
            else:
                body = await resp.aread()
                try:
                    obj = json.loads(body)
                    out.text = str(obj["text"])
                except (ValueError, KeyError, TypeError):
                    raise EndpointError(f"malformed transcription from {ep.host}: {body[:60]!r}") from None
            out.done_ns = now_ns()
        return out

    return await _attempts(ep, once)


async def _read_events(
    ep: SpeechEndpoint, resp: httpx.Response, out: Transcript, on_delta: Callable[[str], None] | None
) -> None:
    def event(raw: str) -> bool:
        if raw.strip() == "[DONE]":
            return bool(out.text or out.deltas)
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            raise EndpointError(f"malformed SSE from {ep.host}: data is not JSON ({raw[:60]!r})") from None
        if not isinstance(obj, dict):
            raise EndpointError(f"malformed SSE from {ep.host}: data is not an object")
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise EndpointError(f"server error mid-stream: {str(msg)[:MAX_ERROR_BODY]}")
        kind = obj.get("type")
        if kind == "transcript.text.delta":
            d = str(obj.get("delta", ""))
            out.deltas.append((now_ns(), d))
            if on_delta is not None:
                on_delta(d)
        elif kind == "transcript.text.done":
            out.text = str(obj.get("text", "".join(d for _, d in out.deltas)))
            return True
        return False

    async for data in sse_data(resp, ep.host):
        if event(data):
            return
    raise EndpointError(f"transcript stream from {ep.host} ended without transcript.text.done")


# -- TTS ---------------------------------------------------------------------------------------------------
def to_16k(x: np.ndarray, rate: int) -> np.ndarray:
    """int16 at ``rate`` as int16 at 16 kHz by linear interpolation (speech-grade; no filtering)."""
    if rate == RATE or not len(x):
        return x.astype(np.int16)
    m = int(len(x) * RATE / rate)
    y = np.interp(np.arange(m) * (rate / RATE), np.arange(len(x)), x.astype(np.float64))
    return np.round(y).astype(np.int16)


def _wav_header(buf: bytes, host: str) -> tuple[int, int] | None:
    """(data offset, sample rate) once the header is complete, else None; a non-16-bit-mono WAV is refused."""
    if len(buf) >= 4 and buf[:4] != b"RIFF":
        raise EndpointError(f"malformed audio from {host}: response_format wav but no RIFF header")
    pos, rate = 12, None
    while pos + 8 <= len(buf):
        cid, size = buf[pos : pos + 4], int.from_bytes(buf[pos + 4 : pos + 8], "little")
        if cid == b"fmt ":
            if pos + 24 > len(buf):
                return None
            ch, rate, bits = (int.from_bytes(buf[pos + 10 : pos + 12], "little"),
                              int.from_bytes(buf[pos + 12 : pos + 16], "little"),
                              int.from_bytes(buf[pos + 22 : pos + 24], "little"))  # fmt: skip
            if ch != 1 or bits != 16:
                raise EndpointError(f"malformed audio from {host}: {ch} channels, {bits}-bit (need mono 16-bit)")
        elif cid == b"data":
            if rate is None:
                raise EndpointError(f"malformed audio from {host}: data before fmt")
            return pos + 8, rate
        pos += 8 + (size if cid != b"data" else 0) + (size & 1)
    return None


async def synthesize_stream(ep: SpeechEndpoint, text: str) -> AsyncIterator[tuple[int, np.ndarray]]:
    """(arrival ns, 16 kHz int16 samples) chunks of ``text`` spoken by the endpoint, as they stream in."""
    body = {"model": ep.model, "input": text, "voice": ep.voice, "response_format": ep.format}
    queue: asyncio.Queue[tuple[int, np.ndarray] | BaseException | None] = asyncio.Queue()

    async def once() -> None:
        sent = False
        async with _client(ep).stream(
            "POST", f"{ep.url}/audio/speech", json=body, headers=_headers(ep, "audio/*")
        ) as resp:
            await _check(resp)
            ctype = resp.headers.get("content-type", "")
            if not ctype.startswith(("audio/", "application/octet-stream")):
                raise EndpointError(f"malformed audio from {ep.host}: content type {ctype[:40]!r}")
            buf, start, rate = b"", 0 if ep.format == "pcm" else None, ep.sample_rate
            async for chunk in resp.aiter_bytes():
                buf += chunk
                if start is None:
                    head = _wav_header(buf, ep.host)
                    if head is None:
                        continue
                    start, rate = head
                    buf = buf[start:]
                n = len(buf) // 2 * 2
                if n:
                    x = np.frombuffer(buf[:n], dtype="<i2")
                    buf = buf[n:]
                    queue.put_nowait((now_ns(), to_16k(x, rate)))
                    sent = True
            if buf:
                raise EndpointError(f"malformed audio from {ep.host}: an odd number of PCM bytes")
            if not sent:
                raise EndpointError(f"{ep.host} sent no audio")

    async def run() -> None:
        try:
            await _attempts(ep, once)
            queue.put_nowait(None)
        except Exception as exc:  # handed to the consumer
            queue.put_nowait(exc)

    task = asyncio.create_task(run())
    try:
        while True:
            item = await queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        if not task.done():
            task.cancel()  # closing the response: the server sees the drop
