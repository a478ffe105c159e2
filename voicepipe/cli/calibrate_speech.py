"""``voicepipe calibrate URL --stage asr|tts --out P.yaml``: a speech endpoint measured into a stage profile.

Everything printed is MEASURED (client side) except the ``--against model`` columns: the modelled stage's
figure (``asr.finalize_ms`` / ``tts.ttfb_ms`` of the default config or ``--config``), which is one
lognormal, independent of length and load. The profile is used as ``asr.profile: P.yaml`` /
``tts.profile: P.yaml`` by ``run``, ``predict`` and ``capacity`` (:mod:`voicepipe.backends.speech_profile`).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from rich.table import Table

from voicepipe.backends.speech import speech_endpoint
from voicepipe.backends.speech_calibrate import Level, measure, profile, versus
from voicepipe.backends.speech_profile import SETTING, describe
from voicepipe.cli.common import out
from voicepipe.config import load_config
from voicepipe.errors import UserError


def _floats(raw: str, where: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise UserError(where, f"{raw!r}: expected numbers separated by commas") from None
    if not vals or min(vals) <= 0 or max(vals) > 60:
        raise UserError(where, f"{raw!r}: expected numbers in (0, 60]")
    return vals


def levels_table(levels: list[Level], kind: str, host: str) -> Table:
    what = "finalisation (sent -> final transcript)" if kind == "asr" else "time to first audio (sent -> first chunk)"
    t = Table(title=f"MEASURED: {host} {what}, warm-up excluded", title_justify="left")
    for c in ("clients", "audio s" if kind == "asr" else "words", "ok", "failed", "median ms", "p90 ms", "p99 ms"):
        t.add_column(c, justify="right")
    for lv in levels:
        t.add_row(str(lv.concurrency), f"{lv.length:g}", str(lv.requests), str(lv.failed), f"{lv.median_ms:.1f}",
                  f"{lv.p90_ms:.1f}", f"{lv.p99_ms:.1f}")  # fmt: skip
    return t


def calibrate_speech(
    kind: Literal["asr", "tts"], url: str, model: str | None, out_path: Path, concurrency: tuple[int, ...],
    requests: int, lengths: str | None, reference: float | None, api_key_env: str | None, timeout: float,
    against: str | None, config: Path | None,
) -> None:  # fmt: skip
    if against not in (None, "model"):
        raise UserError("--against", f"{against!r}: for a speech stage, --against model (the modelled stage)")
    spec: dict[str, Any] = {"endpoint": url, "timeout": timeout, **({"model": model} if model else {})}
    if api_key_env:
        if api_key_env not in os.environ:
            raise UserError("--api-key-env", f"environment variable {api_key_env!r} is not set")
        spec["api_key_env"] = api_key_env
    try:
        ep = speech_endpoint(kind, spec)
    except ValueError as exc:
        raise UserError("calibrate", str(exc)) from None
    lens = _floats(lengths or ("1,2,4" if kind == "asr" else "3,8,16"), "--lengths")
    ref = reference if reference is not None else (2.0 if kind == "asr" else 8.0)
    cfg = load_config(config) if against else None
    levels = asyncio.run(measure(ep, lens, concurrency, requests))
    if not any(lv.requests for lv in levels):
        raise UserError("calibrate", f"every request failed: {levels[0].error}")
    settings = {"lengths": list(lens), "concurrency": list(concurrency), "requests": requests, "reference": ref,
                "warmup": "one request per client per level, not counted"}  # fmt: skip
    prof = profile(ep, levels, ref, settings)
    try:
        out_path.write_text(yaml.safe_dump(prof, sort_keys=False), encoding="utf-8")
    except OSError as exc:
        raise UserError(str(out_path), f"cannot write ({exc.strerror or exc})") from None
    out.print(levels_table(levels, kind, ep.host))
    if cfg is not None:
        d = getattr(cfg, kind).model_dump()[SETTING[kind]]
        t = Table(title=f"measured vs the modelled {kind}.{SETTING[kind]} (MODELLED: one lognormal, any length/load)",
                  title_justify="left")  # fmt: skip
        for c in ("clients", "length", "meas. median", "model median", "meas. p90", "model p90"):
            t.add_column(c, justify="right")
        for v in versus(levels, kind, (d["median"], d["p90"])):
            ratio = v.modelled_median_ms / v.measured_median_ms if v.measured_median_ms else float("nan")
            t.add_row(str(v.concurrency), f"{v.length:g}", f"{v.measured_median_ms:.1f} ms",
                      f"{v.modelled_median_ms:.1f} ms ({ratio:.2g}x)", f"{v.measured_p90_ms:.1f} ms",
                      f"{v.modelled_p90_ms:.1f} ms")  # fmt: skip
        out.print(t)
    out.print(f"wrote {out_path}: {describe(prof)}; use it as {kind}.profile: {out_path}")
