"""The fit's held-out error as evidence: overall, per group of points, and nearest to one configuration.

:class:`Accuracy` is what the CLI prints beside every modelled number (the shipped figures are read from
``data/validation-accuracy.json``, which :func:`update_doc` writes and a test keeps equal to a fresh run);
:func:`near_report` picks the published points that share parts of one configuration, most specific first,
and says how to read a prediction from the nearest group; :func:`evidence_lines` prints it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from voicepipe.hardware import catalog
from voicepipe.hardware.doctable import write_between
from voicepipe.hardware.validate.fit import BEGIN, END, Report, Row, markdown, run
from voicepipe.hardware.validate.points import Metric, Point, stack_key
from voicepipe.hardware.validate.slices import Residual, architecture, residuals

# rates (higher is faster); every other metric is a time
SPEED_METRICS: frozenset[Metric] = frozenset({"tok_s_user", "tok_s_total"})


def speed_ratio(row: Row) -> float | None:
    """Modelled speed over published speed (> 1: the model is optimistic), whatever the metric: a rate's
    ratio, a time's inverse ratio."""
    if row.predicted is None:
        return None
    ratio = row.predicted / row.point.value
    return ratio if row.point.metric in SPEED_METRICS else 1.0 / ratio


class Evidence(BaseModel):
    """Held-out error over a set of published points (all of them, or those sharing one model, device...)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    points: int
    sources: int
    median_error_pct: float
    within_30_pct: int  # share of the points within ±30 %, in %
    speed_ratio: float  # median modelled / published speed (a time inverted): > 1 reads faster than measured
    faster_pct: int  # share of the points the model reads faster than measured, in %


class Summary(Evidence):
    tier1_median_error_pct: float


class Accuracy(BaseModel):
    """What the CLI prints beside every modelled number: the cross-validated error in a few figures, and
    the same figures per group of points that share a model, device, stack or a combination of them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    summary: Summary
    by_model_device_stack: dict[str, Evidence]  # keys: "MODEL on DEVICE with STACK"
    by_model_device: dict[str, Evidence]  # keys: "MODEL on DEVICE"
    by_model_stack: dict[str, Evidence]  # keys: "MODEL with STACK"
    by_model: dict[str, Evidence]
    by_architecture: dict[str, Evidence]  # keys: architecture()
    by_device: dict[str, Evidence]
    by_stack: dict[str, Evidence]
    # every answered point's held-out residual with its slices: the per-slice table and the intervals
    residuals: list[Residual]


def evidence(rows: list[Row]) -> Evidence:
    """Held-out error figures over the answered ones of ``rows`` (at least one)."""
    answered = [r for r in rows if r.error is not None]
    errs = np.array([abs(r.error) for r in answered if r.error is not None])
    speed = np.array([v for r in answered if (v := speed_ratio(r)) is not None])
    return Evidence(
        points=len(answered),
        sources=len({r.point.held_out_with for r in answered}),
        median_error_pct=round(float(np.median(errs)) * 100, 1),
        within_30_pct=round(float((errs <= 0.30).mean()) * 100),
        speed_ratio=round(float(np.median(speed)), 2),
        faster_pct=round(float((speed > 1.0).mean()) * 100),
    )


def _grouped(rows: list[Row], key: Callable[[Point], str]) -> dict[str, Evidence]:
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(key(r.point), []).append(r)
    return {k: evidence(v) for k, v in sorted(groups.items())}


def accuracy(rep: Report) -> Accuracy:
    """:class:`Accuracy` of a validation run."""
    # fit points are no evidence; speculative points never speak for a prediction (none is speculative:
    # `hardware predict --speculative` applies the speculative model on top of a plain one)
    answered = [r for r in rep.rows if r.error is not None and not r.point.sram_fit and not r.point.is_speculative]
    return Accuracy(
        summary=Summary(
            **evidence(answered).model_dump(),
            tier1_median_error_pct=round(float(np.median(rep.errors(1))) * 100, 1),
        ),
        by_model_device_stack=_grouped(
            answered, lambda p: f"{p.model} on {p.device} with {stack_key(p.stack)}"
        ),
        by_model_device=_grouped(answered, lambda p: f"{p.model} on {p.device}"),
        by_model_stack=_grouped(answered, lambda p: f"{p.model} with {stack_key(p.stack)}"),
        by_model=_grouped(answered, lambda p: p.model),
        by_architecture=_grouped(answered, lambda p: architecture(catalog.model(p.model))),
        by_device=_grouped(answered, lambda p: p.device),
        by_stack=_grouped(answered, lambda p: stack_key(p.stack)),
        residuals=residuals(answered),
    )


ACCURACY_FILE = "validation-accuracy.json"  # in voicepipe/hardware/data, written by update_doc


@cache
def shipped_accuracy() -> Accuracy:
    """The :func:`accuracy` of the shipped set, read from the file :func:`update_doc` writes (a test keeps
    it equal to a fresh run), so printing it costs no fit."""
    text = resources.files("voicepipe.hardware").joinpath("data", ACCURACY_FILE).read_text()
    return Accuracy.model_validate_json(text)


def accuracy_line(acc: Accuracy | None = None) -> str:
    a = (shipped_accuracy() if acc is None else acc).summary
    return (
        f"cross-validated on {a.points} published measurements, nearly all GPUs (the fitted GPU constants "
        f"refit without each publisher family): median error {a.median_error_pct} % (tier 1: "
        f"{a.tier1_median_error_pct} %), {a.within_30_pct} % within ±30 % — `voicepipe hardware "
        "validate`, docs/hardware-model.md §3"
    )


FEW = 5  # the nearest evidence is the most specific group with at least this many points
ODD = 1.15  # a median speed ratio beyond ×/÷ this ...
ONE_SIDED = 80  # ... with this share of the points on that side, from two sources or more, is a direction
Kind = Literal[
    "model_device_stack", "model_device", "model_stack", "model", "device", "stack", "architecture"
]


def twins(model: catalog.ModelSpec) -> list[str]:
    """Catalog models with this model's architecture (a user's config.json of a catalogued model), by the
    fields the physics reads (for MLA the latent width, not the head layout a config states for its
    projections), parameter counts within 2 %; those with the most published points first."""
    same = ["layers", "hidden", "heads", "experts", "experts_active", "kv_dim", "window"]
    if model.kv_dim is None:
        same += ["kv_heads", "head_dim"]
    found = [
        key
        for key, m in catalog.models().items()
        if all(getattr(m, f) == getattr(model, f) for f in same)
        and math.isclose(m.params_total_b, model.params_total_b, rel_tol=0.02)
    ]
    counts = shipped_accuracy().by_model
    return sorted(found, key=lambda k: -(counts[k].points if k in counts else 0))


class Group(BaseModel):
    """Published points that share a part of a configuration, with their held-out error."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Kind
    label: str
    evidence: Evidence
    command: str  # the `voicepipe hardware validate` call that lists them


class NearReport(BaseModel):
    """How the model fared on the published points that share parts of one configuration, most specific
    first, and how to read the prediction from the nearest of them (text and JSON are this one object)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str  # as given: a catalog key or a config.json path
    catalogued_as: str | None  # the catalog model whose points speak for it (itself, or a twin)
    twins: list[str]  # every catalog model with its architecture (a config.json)
    held_out: bool  # False on an SRAM machine: its per-layer time is fitted to its vendor's speeds
    groups: list[Group]
    unmeasured: list[str]  # parts of the configuration no published point has
    nearest: Group | None  # the most specific group with at least FEW points
    reading: str  # how to read the prediction, from the nearest group


def _reading(g: Group | None, held_out: bool) -> str:
    if not held_out:
        return (
            "not held out: an SRAM machine's constants are fitted to two published speeds "
            "(`voicepipe hardware show DEVICE`); its other published points are held out (docs §4)"
        )
    if g is None:
        return f"no group of this configuration has {FEW} published points or more: its error is unknown"
    e = g.evidence
    spread = f"median error {e.median_error_pct:g} %, {e.within_30_pct} % of points within ±30 %"
    if e.sources >= 2 and e.speed_ratio > ODD and e.faster_pct >= ONE_SIDED:
        return f"it read faster than measured on {e.faster_pct} % of them ({spread}): a best case"
    if e.sources >= 2 and e.speed_ratio < 1 / ODD and e.faster_pct <= 100 - ONE_SIDED:
        return f"it read slower than measured on {100 - e.faster_pct} % of them ({spread}): a worst case"
    return f"no consistent direction ({e.faster_pct} % read faster); {spread}"


def near_report(
    device: str, model: catalog.ModelSpec, stack: str | None, acc: Accuracy | None = None
) -> NearReport:
    """The evidence for a configuration (``stack`` None: an SRAM machine, which runs its vendor's software
    and which GPU points of the same model say nothing about)."""
    a = shipped_accuracy() if acc is None else acc
    own = model.key in catalog.models()
    tw = [] if own else twins(model)
    key = model.key if own else (tw[0] if tw else None)
    arch = architecture(model)
    candidates: list[tuple[Kind, str, Evidence | None, list[str]]] = []
    if key is not None:
        m = key
        on, with_ = f" on {device}", f" with {stack}"
        if stack is None:
            candidates.append(("model_device", f"{m}{on}", a.by_model_device.get(f"{m}{on}"),
                               ["--model", m, "--device", device]))  # fmt: skip
        else:
            candidates += [
                ("model_device_stack", f"{m}{on}{with_}",
                 a.by_model_device_stack.get(f"{m}{on}{with_}"), ["--model", m, "--device", device, "--stack", stack]),
                ("model_device", f"{m}{on}, any stack", a.by_model_device.get(f"{m}{on}"),
                 ["--model", m, "--device", device]),
                ("model_stack", f"{m}{with_}, any device", a.by_model_stack.get(f"{m}{with_}"),
                 ["--model", m, "--stack", stack]),
                ("model", f"{m}, any device or stack", a.by_model.get(m), ["--model", m]),
            ]  # fmt: skip
    dev_label = f"{device}, any model" + ("" if stack is None else " or stack")
    candidates.append(("device", dev_label, a.by_device.get(device), ["--device", device]))
    if stack is not None:
        candidates.append(
            ("stack", f"{stack}, any model or device", a.by_stack.get(stack), ["--stack", stack])
        )
        candidates.append(("architecture", f"{arch.upper() if arch != 'dense' else arch} models, any device or stack",
                           a.by_architecture.get(arch), ["--architecture", arch]))  # fmt: skip
    groups: list[Group] = []
    for kind, label, e, flags in candidates:
        # none, or the very figures of a more specific group (the same points)
        if e is None or any(e == g.evidence for g in groups):
            continue
        if kind == "architecture" and key is not None and (ev := a.by_model.get(key)) and ev.points >= FEW:
            continue  # the model's own points say more than its architecture's
        groups.append(
            Group(
                kind=kind, label=label, evidence=e, command="voicepipe hardware validate " + " ".join(flags)
            )
        )
    unmeasured = [
        what for what, present in ((device, device in a.by_device), (stack or "", stack is None or stack in a.by_stack))
        if not present
    ]  # fmt: skip
    nearest = next((g for g in groups if g.evidence.points >= FEW), None)
    held_out = stack is not None
    return NearReport(
        model=model.key, catalogued_as=key, twins=tw, held_out=held_out, groups=groups,
        unmeasured=unmeasured, nearest=nearest if held_out else None, reading=_reading(nearest, held_out),
    )  # fmt: skip


def _figures(e: Evidence) -> str:
    pts = (
        f"{e.points} point{'s' if e.points != 1 else ''} / {e.sources} source{'s' if e.sources != 1 else ''}"
    )
    return f"median error {e.median_error_pct:g} %, speed {e.speed_ratio:.2f}×, {pts}"


def evidence_lines(r: NearReport) -> list[str]:
    """The report as the lines `hardware predict` and `sweep` print under the prediction."""
    head = "published points sharing parts of this configuration, most specific first"
    lines = [f"held-out error on {head}:" if r.held_out else f"{head}:"]
    if r.catalogued_as is None and r.model not in catalog.models():
        lines.append(
            f"  {r.model}: not the architecture of a catalogued model, so no published point of its own"
        )
    elif r.catalogued_as != r.model:
        also = f" (as is {', '.join(r.twins[1:])})" if len(r.twins) > 1 else ""
        lines.append(
            f"  {r.model}: the architecture of catalogued {r.catalogued_as}{also}, whose points follow"
        )
    lines += [f"  {g.label}: {_figures(g.evidence)}" for g in r.groups]
    lines += [f"  {what}: no published point, so its error is unknown" for what in r.unmeasured]
    lines.append("  (speed: modelled / measured, median; > 1× reads faster than measured)")
    where = f"nearest ({r.nearest.label}): " if r.nearest else ""
    lines.append(f"  {where}{r.reading}")
    if r.nearest is not None:
        lines.append(f"  rows: {r.nearest.command}")
    return lines


def update_doc(path: str = "docs/hardware-model.md") -> None:
    """Rewrite the validation table between the markers in ``path`` and the shipped accuracy summary."""
    rep = run()
    write_between(path, BEGIN, END, markdown(rep))
    target = Path(str(resources.files("voicepipe.hardware").joinpath("data", ACCURACY_FILE)))
    target.write_text(accuracy(rep).model_dump_json(indent=2) + "\n")
