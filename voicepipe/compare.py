"""``voicepipe compare``: plan the configurations to run, and fold their turn records into one row each.

Pure functions only — the command in :mod:`voicepipe.cli.compare` runs the variants. A variant is a whole
config file (``--config``), one value of a varied field (``--vary path=v1,v2``), or one cell of a two-axis grid (two
``--vary``), crossed with several ``--config`` files when both are given. Every variant keeps the base
``--set`` overrides and the same seed, so the modelled ASR/TTS draws are paired across configurations and
the rows differ by what was varied.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from voicepipe.config import BrokerOverrides, PipelineConfig, load_config
from voicepipe.errors import UserError
from voicepipe.hardware import catalog
from voicepipe.records import TurnRecord, summarise

MAX_AXES = 2
FAST_MS = 200.0


@dataclass(frozen=True)
class Axis:
    path: str  # dotted field path, as written (stripped)
    values: tuple[str, ...]  # raw text of each value; parsed as YAML by load_config like --set

    def assignment(self, value: str) -> str:
        return f"{self.path}={value}"


def _field_path(path: str) -> str:
    return ".".join(k for k in path.strip().split(".") if k)


def parse_vary(spec: str) -> Axis:
    """``path.to.field=v1,v2,...`` → :class:`Axis`. Values split on ``,`` (so none may contain one);
    duplicates are dropped, order is kept."""
    if "=" not in spec:
        raise UserError("--vary", f"{spec!r}: expected path.to.field=value1,value2,...")
    raw_path, raw_values = spec.split("=", 1)
    path = _field_path(raw_path)
    if not path:
        raise UserError("--vary", f"{spec!r}: empty field path")
    values = [v.strip() for v in raw_values.split(",")]
    if any(not v for v in values):
        raise UserError("--vary", f"{path}: empty value in {raw_values!r} (values are comma-separated)")
    return Axis(path, tuple(dict.fromkeys(values)))


def _unique_stems(configs: Sequence[Path]) -> list[str]:
    """Label each config file by its stem; by the path as given where two stems collide."""
    stems = [Path(c).stem for c in configs]
    names = [str(c) if stems.count(s) > 1 else s for c, s in zip(configs, stems, strict=True)]
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n} ({seen[n]})")
    return out


def plan_variants(
    configs: Sequence[Path] | None,
    vary: Sequence[str] | None,
    sets: Sequence[str] | None = (),
    broker: str | BrokerOverrides | None = None,
) -> list[tuple[str, PipelineConfig]]:
    """The configurations ``compare`` runs, as ``(label, config)`` in run order.

    - ``--config`` files only: one variant per file, labelled by file stem.
    - ``--vary`` once: one variant per value, labelled ``path=value``; twice: the grid (cartesian product),
      labelled ``a=x, b=y``. A single ``--config`` is then the base all variants start from; several are
      crossed with the grid (``stem, a=x``).
    - base ``--set`` and the broker options (a URL, or every broker/TLS option as one
      :class:`BrokerOverrides`) apply to every variant.

    Bad input raises :class:`UserError` naming the variant's label and the field.
    """
    configs = list(configs or [])
    sets = list(sets or [])
    axes = [parse_vary(v) for v in (vary or [])]
    if not configs and not axes:
        raise UserError(
            "compare", "nothing to compare: give --config FILE twice or more, or --vary path=v1,v2"
        )
    if len(axes) > MAX_AXES:
        raise UserError(
            "--vary", f"at most {MAX_AXES} axes (a grid); larger sweeps are for `compare --predict`"
        )
    paths = [a.path for a in axes]
    for p in paths:
        if paths.count(p) > 1:
            raise UserError("--vary", f"{p}: varied twice; give all its values in one --vary")
    for s in sets:
        if "=" in s and _field_path(s.split("=", 1)[0]) in paths:
            p = _field_path(s.split("=", 1)[0])
            raise UserError("--set", f"{p}: also given to --vary; drop one")

    bases: list[tuple[str, Path | None]]
    if not configs:
        bases = [("", None)]
    elif len(configs) == 1 and axes:
        bases = [("", configs[0])]  # the one file is the base every variant starts from
    else:
        bases = list(zip(_unique_stems(configs), configs, strict=True))

    cells: list[tuple[str, ...]] = list(itertools.product(*(a.values for a in axes))) if axes else [()]
    out: list[tuple[str, PipelineConfig]] = []
    for (stem, path), cell in itertools.product(bases, cells):
        assigns = [a.assignment(v) for a, v in zip(axes, cell, strict=True)]
        label = ", ".join([*([stem] if stem else []), *assigns])
        try:
            cfg = load_config(path, [*sets, *assigns], broker)
        except UserError as exc:
            raise UserError(f"configuration {label!r}", str(exc)) from None
        out.append((label, cfg))
    return out


def display_names(labels: Sequence[str]) -> tuple[str, list[str]]:
    """Shorter names for a table: when every label is ``a=x[, b=y]`` over the same fields, drop the
    field paths and return them as a heading (``"agent.backend"``, ``"agent.backend · asr.silence_ms"``).
    Otherwise the labels unchanged and heading ``"config"``."""
    split = [[p.split("=", 1) for p in lab.split(", ")] for lab in labels]
    if labels and all(all(len(kv) == 2 for kv in parts) for parts in split):
        keys = [kv[0] for kv in split[0]]
        if all([kv[0] for kv in parts] == keys for parts in split):
            return " · ".join(keys), [" · ".join(kv[1] for kv in parts) for parts in split]
    return "config", list(labels)


@dataclass
class Row:
    """One configuration's results. Latencies are voice-to-voice ms on the client clock; cost and quality
    are modelled (catalog prices and public benchmarks)."""

    label: str
    turns: int
    answered: int
    budget_ms: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    within_budget: float  # share of all turns (timeouts count as misses)
    under_200ms: float
    uncertain: int = field(default=0, kw_only=True)  # predicted turns within budget only at their range's fast end
    tax_p50_ms: float | None
    stage_ms: dict[str, float]  # mean ms per stage over answered turns
    cost_per_turn_usd: float
    quality: float | None  # mean modelled quality in [0, 1]; None when unknown
    backends: list[str] = field(default_factory=list)
    best_p50: bool = False
    cheapest: bool = False
    best_quality: bool = False

    @property
    def cost_per_1k_usd(self) -> float:
        return self.cost_per_turn_usd * 1000.0

    @property
    def fits(self) -> bool:
        """Median turn inside the budget."""
        return self.p50_ms is not None and self.p50_ms <= self.budget_ms

    def top_stages(self, n: int = 3) -> list[tuple[str, float]]:
        return sorted(self.stage_ms.items(), key=lambda kv: -kv[1])[:n]


def _mark_best(rows: list[Row], attr: str, key, lowest: bool) -> None:
    """Set ``attr`` on the rows with the best ``key`` — only when the rows differ on it."""
    vals = [(r, key(r)) for r in rows]
    vals = [(r, v) for r, v in vals if v is not None]
    if len(vals) < 2 or len({round(v, 12) for _, v in vals}) < 2:
        return
    best = min(v for _, v in vals) if lowest else max(v for _, v in vals)
    for r, v in vals:
        if math.isclose(v, best, rel_tol=1e-9, abs_tol=1e-12):
            setattr(r, attr, True)


def compare_rows(runs: Mapping[str, Sequence[TurnRecord]]) -> list[Row]:
    """One :class:`Row` per configuration label, in the order given, with the best marked (lowest p50,
    cheapest per turn, highest modelled quality) where the rows differ."""
    rows = []
    for label, recs in runs.items():
        s = summarise(recs)
        rows.append(
            Row(
                label=label,
                turns=s.turns,
                answered=s.answered,
                budget_ms=recs[0].budget_ms if recs else 800.0,
                p50_ms=s.p50_ms,
                p90_ms=s.p90_ms,
                p99_ms=s.p99_ms,
                within_budget=s.within_budget,
                under_200ms=s.under_200ms,
                tax_p50_ms=s.tax_p50_ms,
                stage_ms=dict(s.mean_stage_ms),
                cost_per_turn_usd=s.mean_cost_usd,
                quality=s.mean_quality,
                backends=sorted({r.backend for r in recs if r.backend}),
                uncertain=s.uncertain,
            )
        )
    _mark_best(rows, "best_p50", lambda r: r.p50_ms, lowest=True)
    _mark_best(rows, "cheapest", lambda r: r.cost_per_turn_usd if r.turns else None, lowest=True)
    _mark_best(rows, "best_quality", lambda r: r.quality, lowest=False)
    return rows


def fmt_usd(v: float) -> str:
    """Dollars with enough decimals to show two significant figures of small amounts."""
    if v == 0:
        return "$0"
    if abs(v) >= 100:
        return f"${v:,.0f}"
    digits = max(2, 1 - math.floor(math.log10(abs(v))))
    return f"${v:.{digits}f}"


def join_parts(parts: Sequence[str], width: int | None = None, sep: str = " · ") -> str:
    """``parts`` joined by ``sep`` on lines no wider than ``width`` where possible (a part is never split)."""
    lines: list[str] = []
    for p in parts:
        if lines and (width is None or len(lines[-1]) + len(sep) + len(p) <= width):
            lines[-1] += sep + p
        else:
            lines.append(p)
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    r = a / b
    return f"{r:.0f}×" if r >= 10 else f"{r:.1f}×"


def verdict(rows: Sequence[Row], names: Sequence[str] | None = None) -> list[str]:
    """Plain-text answer to "which configuration fits the budget, at what cost" (a line or two)."""
    names = list(names or [r.label for r in rows])
    named = list(zip(names, rows, strict=True))
    measured = [(n, r) for n, r in named if r.p50_ms is not None]
    if not measured:
        return ["no turn was answered"]
    lines = []
    fits = sorted(((n, r) for n, r in measured if r.fits), key=lambda nr: nr[1].cost_per_turn_usd)
    if fits:
        parts = [f"{n} ({fmt_usd(r.cost_per_1k_usd)}/1k turns)" for n, r in fits]
        budget = fits[0][1].budget_ms
        lines.append(f"p50 inside the {budget:.0f} ms budget, cheapest first: " + ", ".join(parts))
    else:
        n, r = min(measured, key=lambda nr: nr[1].p50_ms or math.inf)
        lines.append(
            f"none has its p50 inside the {r.budget_ms:.0f} ms budget; closest: {n} ({r.p50_ms:,.0f} ms)"
        )
    if len(measured) > 1:
        fast_n, fast = min(measured, key=lambda nr: (nr[1].p50_ms, nr[1].cost_per_turn_usd))
        cheap_n, cheap = min(measured, key=lambda nr: (nr[1].cost_per_turn_usd, nr[1].p50_ms))
        if fast is not cheap and fast.p50_ms and cheap.p50_ms:
            speed = (
                f" ({_ratio(cheap.p50_ms, fast.p50_ms)} faster)" if cheap.p50_ms >= 1.05 * fast.p50_ms else ""
            )
            price = (
                f"{_ratio(fast.cost_per_turn_usd, cheap.cost_per_turn_usd)} the cost"
                if cheap.cost_per_turn_usd > 0
                else f"{fmt_usd(fast.cost_per_1k_usd)} vs {fmt_usd(cheap.cost_per_1k_usd)} per 1k turns"
            )
            lines.append(
                f"fastest {fast_n}: p50 {fast.p50_ms:,.0f} ms vs {cheap.p50_ms:,.0f} ms for cheapest "
                f"{cheap_n}{speed}, at {price}"
            )
    kinds = {k for _, r in measured for b in r.backends if (k := _backend_kind(b)) is not None}
    if kinds == {"hardware", "service"}:
        lines.append(
            "note: hardware backends (DEVICE/MODEL) model the chip next to the pipeline, with no API network "
            "or provider queue, which the measured service profiles include: read them as a best case"
        )
    return lines


def _backend_kind(label: str) -> str | None:
    """'hardware' for a modelled device (DEVICE/MODEL, DEVICE a catalog name or a device .yaml), None for
    the cache and the council (not backends of their own), else 'service': a measured profile or an
    endpoint, whose latency includes a network and a provider's queue."""
    if label == "cache" or label.startswith("council:"):
        return None
    if "/" in label and (label.split("/")[0] in catalog.devices() or ".yaml/" in label or ".yml/" in label):
        return "hardware"
    return "service"
