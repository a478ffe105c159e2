"""Measure a real OpenAI-compatible endpoint and turn the measurement into an empirical profile.

Model and contract (:func:`calibrate`): for each (prompt length, concurrency) level, ``concurrency``
clients each keep one streamed chat completion in flight (a closed loop, like ``vllm bench serve
--max-concurrency``) until ``requests`` have completed. Each level starts with ``concurrency`` warm-up
requests that are not counted. Every prompt begins with a request number so no two share a prefix
(prefix caching would flatter TTFT). Per request it takes vLLM's metrics from
:class:`~voicepipe.backends.openai.EndpointStream` (TTFT, ITL, TPOT, E2EL; token counts from ``usage``)
and per level vLLM's summary (mean / median / p90 / p99, request and output throughput).

:func:`from_vllm_bench` reads a ``vllm bench serve --save-result`` JSON into the same points, and
:func:`against` runs the hardware model (``voicepipe.hardware``) at the measured settings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from voicepipe.backends import UnknownBackend, build_backend
from voicepipe.backends.base import LLMRequest
from voicepipe.backends.openai import EndpointBackend, EndpointConfig, RequestStats
from voicepipe.backends.profile import Anchor, Point, Stat
from voicepipe.errors import UserError
from voicepipe.files import read_json
from voicepipe.hardware.serving import closed_loop
from voicepipe.limits import MAX_BENCH_JSON_BYTES

FILLER = "The quick brown fox jumps over the lazy dog while the barista steams a pitcher of oat milk. "
FILLER_TOKENS = 20  # ~ tokens in FILLER for Llama/GPT-style BPE vocabularies; the server's count is reported


@dataclass(frozen=True)
class Settings:
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int = 32  # counted requests per level (warm-up excluded)
    prompt_tokens: tuple[int, ...] = (256,)
    output_tokens: int = 64
    ignore_eos: bool = False  # send ignore_eos (vLLM, llama.cpp, SGLang) so replies have output_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "concurrency": list(self.concurrency),
            "requests": self.requests,
            "prompt_tokens": list(self.prompt_tokens),
            "output_tokens": self.output_tokens,
            "ignore_eos": self.ignore_eos,
            "warmup": "one request per client per level, not counted",
        }


def prompt_text(n: int, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens that starts with its request number (no shared prefix)."""
    reps = max(1, round(tokens / FILLER_TOKENS))
    return f"Request {n}. " + FILLER * reps + "Summarise this in one sentence."


def stat(values: Sequence[float]) -> Stat:
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return Stat(mean=0.0, median=0.0, p90=0.0, p99=0.0)
    return Stat(
        mean=float(a.mean()),
        median=float(np.median(a)),
        p90=float(np.percentile(a, 90)),
        p99=float(np.percentile(a, 99)),
    )


def summarise(stats: list[RequestStats], concurrency: int, duration_s: float) -> Point:
    """vLLM's per-level summary of the counted requests (failed ones only counted as failures)."""
    ok = [s for s in stats if not s.error and s.ttft_ms is not None]
    if not ok:
        reasons = sorted({s.error for s in stats if s.error}) or ["no text"]
        raise UserError("calibrate", f"every request at concurrency {concurrency} failed: {reasons[0]}")
    out_tokens = sum(s.completion_tokens for s in ok)
    return Point(
        concurrency=concurrency,
        prompt_tokens=float(np.mean([s.prompt_tokens for s in ok])),
        output_tokens=float(np.mean([s.completion_tokens for s in ok])),
        requests=len(ok),
        failed=len(stats) - len(ok),
        usage_reported=all(s.usage_reported for s in ok),
        duration_s=duration_s,
        ttft_ms=stat([s.ttft_ms for s in ok if s.ttft_ms is not None]),
        tpot_ms=stat([s.tpot_ms for s in ok if s.tpot_ms is not None]),
        itl_ms=stat([x for s in ok for x in s.itl_ms]),
        e2el_ms=stat([s.e2el_ms for s in ok if s.e2el_ms is not None]),
        output_throughput=out_tokens / duration_s,
        request_throughput=len(ok) / duration_s,
    )


async def _level(
    backend: EndpointBackend,
    concurrency: int,
    settings: Settings,
    prompt_tokens: int,
    counter: list[int],
    on_request: Callable[[], None],
) -> Point:
    async def one(counted: bool) -> RequestStats:
        counter[0] += 1
        messages = (("user", prompt_text(counter[0], prompt_tokens)),)
        req = LLMRequest("calibrate", counter[0], prompt_tokens, settings.output_tokens, 0, messages)
        stream = backend.start(req, time.monotonic_ns(), np.random.default_rng(0))
        await stream.wait_closed()
        if counted:
            on_request()
        return stream.stats

    await asyncio.gather(*(one(False) for _ in range(concurrency)))  # warm-up: connections, caches
    remaining = settings.requests
    results: list[RequestStats] = []

    async def client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            results.append(await one(True))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(concurrency, settings.requests))))
    return summarise(results, concurrency, time.perf_counter() - t0)


async def calibrate(
    cfg: EndpointConfig, settings: Settings, on_request: Callable[[], None] = lambda: None
) -> list[Point]:
    """Measure every (prompt length, concurrency) level of ``settings`` on the endpoint ``cfg``."""
    extra = dict(cfg.extra) | ({"ignore_eos": True} if settings.ignore_eos else {})
    cfg = dataclasses.replace(cfg, extra=tuple(sorted(extra.items())), system="")
    backend = EndpointBackend(cfg)
    counter = [0]
    points = []
    for p in settings.prompt_tokens:
        for c in settings.concurrency:
            points.append(await _level(backend, c, settings, p, counter, on_request))
    return points


def source_of(cfg: EndpointConfig, settings: Settings) -> dict[str, Any]:
    return {
        "tool": "voicepipe calibrate",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": cfg.host,
        "model": cfg.model,
        "client": platform.node(),
        "settings": settings.as_dict(),
    }


# -- vllm bench serve ----------------------------------------------------------------------------------
def _vllm_stat(d: dict[str, Any], metric: str, raw: list[float] | None, where: str) -> tuple[Stat, str]:
    """A Stat from vLLM's ``mean_/median_/pNN_{metric}_ms`` keys; p90 from the raw samples when saved."""
    try:
        mean, median = float(d[f"mean_{metric}_ms"]), float(d[f"median_{metric}_ms"])
    except KeyError as exc:
        raise UserError(
            where, f"{exc.args[0]}: missing (is this a `vllm bench serve --save-result` file?)"
        ) from None
    p99 = float(d.get(f"p99_{metric}_ms", median))
    note = ""
    if f"p90_{metric}_ms" in d:
        p90 = float(d[f"p90_{metric}_ms"])
    elif raw:
        p90 = float(np.percentile(np.asarray(raw, dtype=float) * 1e3, 90))
    else:
        p90, note = p99, f"{metric} p90 not in the file: p99 used (conservative)"
    return Stat(mean=mean, median=median, p90=max(p90, median), p99=max(p99, median)), note


def from_vllm_bench(path: Path) -> tuple[list[Point], dict[str, Any], list[str]]:
    """Points, source and notes from a ``vllm bench serve --save-result`` JSON (one run, one level)."""
    where = str(path)
    d = read_json(path, MAX_BENCH_JSON_BYTES)  # the file guard: regular file, size and depth bounded
    if not isinstance(d, dict):
        raise UserError(where, "top level must be an object (a vllm bench serve result)")
    notes: list[str] = []
    stats = {}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        raw = d.get("ttfts") if metric == "ttft" else None
        stats[metric], note = _vllm_stat(d, metric, raw, where)
        if note:
            notes.append(note)
    completed = int(d.get("completed") or d.get("num_prompts") or 0)
    if completed < 1 or not d.get("duration"):
        raise UserError(where, "completed/duration: missing or zero")
    conc = d.get("max_concurrency")
    if conc is None:
        notes.append(
            f"max_concurrency not set (request rate {d.get('request_rate')}): recorded as concurrency 1"
        )
    point = Point(
        concurrency=int(conc or 1),
        prompt_tokens=float(d.get("total_input_tokens", 0)) / completed,
        output_tokens=float(d.get("total_output_tokens", 0)) / completed,
        requests=completed,
        failed=int(d.get("failed") or 0),
        duration_s=float(d["duration"]),
        ttft_ms=stats["ttft"],
        tpot_ms=stats["tpot"],
        itl_ms=stats["itl"],
        e2el_ms=stats["e2el"],
        output_throughput=float(d.get("output_throughput", 0.0)),
        request_throughput=float(d.get("request_throughput", 0.0)),
    )
    source = {
        "tool": "vllm bench serve (imported by voicepipe profile import)",
        "date": str(d.get("date", "unknown")),
        "model": str(d.get("model_id", "unknown")),
        "backend": str(d.get("backend") or d.get("endpoint_type") or "unknown"),
        "file": path.name,
        "settings": {
            k: d[k] for k in ("num_prompts", "request_rate", "burstiness", "max_concurrency") if k in d
        },
    }
    return [point], source, notes


# -- the hardware model at the same settings -----------------------------------------------------------
@dataclass(frozen=True)
class Versus:
    concurrency: int
    measured_ttft_ms: float
    modelled_ttft_ms: float
    measured_tpot_ms: float
    modelled_tpot_ms: float
    measured_throughput: float  # output tok/s, all clients
    modelled_throughput: float


def hardware_model(spec: str | dict[str, Any]) -> Any:
    """A fresh hardware backend for ``spec`` (UserError if it is not DEVICE/MODEL)."""
    try:
        hw = build_backend(spec)
    except UnknownBackend as exc:
        raise UserError("--against", str(exc)) from None
    if getattr(hw, "kind", "") != "hardware":
        raise UserError("--against", f"{spec!r} is not a hardware model (DEVICE/MODEL)")
    return hw


def against(spec: str | dict[str, Any], points: list[Point]) -> list[Versus]:
    """The hardware model's closed-loop prediction for each measured level (same clients, prompt and
    output lengths, request count), beside the measurement (mean TTFT, mean TPOT, output tok/s)."""
    out = []
    for p in points:
        hw = hardware_model(spec)  # a fresh modelled device per level
        per_client = max(1, round(p.requests / p.concurrency))
        load = closed_loop(
            hw.server, p.concurrency, per_client, round(p.prompt_tokens), max(2, round(p.output_tokens))
        )
        out.append(
            Versus(
                concurrency=p.concurrency,
                measured_ttft_ms=p.ttft_ms.mean,
                modelled_ttft_ms=load.mean_ttft_s * 1e3,
                measured_tpot_ms=p.tpot_ms.mean,
                modelled_tpot_ms=1e3 / load.mean_user_tokens_per_s,
                measured_throughput=p.output_throughput,
                modelled_throughput=load.aggregate_tokens_per_s,
            )
        )
    return out


def anchor_of(points: list[Point], hardware: str, hw: Any, measured: str) -> Anchor:
    """The anchor of a measurement (``calibrate --anchor``): the configuration of the hardware model
    ``hw`` the server ran on (``hardware`` as the user named the device) and the measured means of the
    lowest-concurrency, shortest-prompt level (the level the profile's idle figures come from)."""
    base = min(points, key=lambda p: (p.concurrency, p.prompt_tokens))
    if base.output_tokens < 2 or base.tpot_ms.mean <= 0:
        raise UserError(
            "--anchor", "the anchored level streamed under 2 tokens per request: no time per output token "
            "to anchor (raise --output-tokens or pass --ignore-eos)",
        )  # fmt: skip
    sys_ = hw.system
    return Anchor(
        hardware=hardware, model=sys_.model.key, precision=sys_.precision, kv_precision=sys_.kv,
        stack=sys_.serving.key, chips=sys_.chips, concurrency=base.concurrency,
        prompt_tokens=max(1, round(base.prompt_tokens)), output_tokens=round(base.output_tokens),
        ttft_ms=base.ttft_ms.mean, tpot_ms=base.tpot_ms.mean, measured=measured,
    )  # fmt: skip
