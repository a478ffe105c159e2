"""Validation against published measurements: fit the few global constants, error held out by publisher family.

:mod:`~voicepipe.hardware.validate.points` (the published points, each reduced to step parts),
:mod:`~voicepipe.hardware.validate.fit` (the constants fitted to them, held-out predictions) and
:mod:`~voicepipe.hardware.validate.evidence` (the held-out error as the CLI prints it). This package
re-exports the names its callers use; ``python -c 'import voicepipe.hardware.validate as v; v.update_doc()'``
regenerates the shipped table and accuracy file.
"""

from __future__ import annotations

from voicepipe.hardware.validate.evidence import (
    FEW,
    ODD,
    ONE_SIDED,
    SPEED_METRICS,
    Accuracy,
    Evidence,
    Group,
    NearReport,
    Summary,
    accuracy,
    accuracy_line,
    architecture,
    evidence,
    evidence_lines,
    near_report,
    shipped_accuracy,
    speed_ratio,
    twins,
    update_doc,
)
from voicepipe.hardware.validate.fit import (
    BOUNDS,
    Report,
    Row,
    batch_of,
    fit,
    markdown,
    predicted,
    run,
    summary_lines,
)
from voicepipe.hardware.validate.points import Metric, Point, Prepared, points, prepare, stack_key
from voicepipe.hardware.validate.ranges import THIN, Ranges, fmt_range, ranges, thin_slices
from voicepipe.hardware.validate.slices import (
    LEVEL,
    Coverage,
    Residual,
    SliceRow,
    config_slices,
    coverage,
    interval,
    residuals,
    slice_lines,
    slice_table,
)

__all__ = [
    "BOUNDS",
    "FEW",
    "LEVEL",
    "ODD",
    "ONE_SIDED",
    "SPEED_METRICS",
    "THIN",
    "Accuracy",
    "Coverage",
    "Evidence",
    "Group",
    "Metric",
    "NearReport",
    "Point",
    "Prepared",
    "Report",
    "Residual",
    "Row",
    "Ranges",
    "SliceRow",
    "Summary",
    "accuracy",
    "accuracy_line",
    "architecture",
    "batch_of",
    "config_slices",
    "coverage",
    "evidence",
    "evidence_lines",
    "fit",
    "fmt_range",
    "interval",
    "markdown",
    "near_report",
    "points",
    "predicted",
    "prepare",
    "ranges",
    "residuals",
    "run",
    "shipped_accuracy",
    "slice_lines",
    "slice_table",
    "speed_ratio",
    "stack_key",
    "summary_lines",
    "thin_slices",
    "twins",
    "update_doc",
]
