"""How the 80 % interval rule's variants cover the shipped held-out residuals: the table behind docs §3,
"Twenty-seventh pass" (every publisher family one vote).

Each variant builds, for every shipped residual (``data/validation-accuracy.json``), the band for that
point's own configuration from the residuals of every *other* publisher family — as
:func:`voicepipe.hardware.validate.slices.coverage` scores the shipped rule — and reports the share of
points inside their band, the median width (high / low), the lowest slice's coverage, and the coverage
and width by how many thin slices the point had. ``shipped`` is :func:`~voicepipe.hardware.validate.slices.band`
itself; the others change one piece of it: the band's weighting (by count: the conformal ranks of
:func:`~voicepipe.hardware.validate.slices.speed_band`, the rule before the twenty-seventh pass) or the
thin widening. ``--grid`` adds the shipped rule over every cell size 15–39 and 2–5 families (minutes).
Prints a table and writes JSON. Nothing here is a timing; the figures are modelled residuals' coverage.

    python bench/interval_rules.py [--out bench/results/interval-rules.json] [--grid]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from benchinfo import code_rev
from rich.console import Console
from rich.table import Table

from voicepipe.hardware.validate import slices as S
from voicepipe.hardware.validate.evidence import shipped_accuracy

Band = tuple[float, float]
Rule = Callable[[Sequence[S.Residual], S.Query, str], tuple[Band, tuple[str, ...]]]


def by_count(cell: Sequence[S.Residual], level: float) -> Band:
    """The rule before: conformal ranks by count, the extremes when too few."""
    values = [r.log_speed for r in cell]
    return S.speed_band(values, level) or (min(values), max(values))


def by_family(cell: Sequence[S.Residual], level: float) -> Band:
    return S.cell_band(cell, level)


def variant(weigh: Callable[[Sequence[S.Residual], float], Band], widen: str) -> Rule:
    """A band rule: the cell weighed by ``weigh``; ``widen`` names what a thin slice unions it with."""

    def rule(res: Sequence[S.Residual], q: S.Query, family: str) -> tuple[Band, tuple[str, ...]]:
        pool = [r for r in res if r.family != family]
        if not any(r.device_kind == q.device_kind for r in pool):
            raise ValueError("no residuals of the kind")
        thin = S.thin_slices(pool, q)
        k = len(thin)
        keys = S.cell_keys(pool, q)
        cell = S.cell_of_keys(pool, q, keys)
        lo, hi = weigh(cell, S.LEVEL)
        wide: Band | None = None
        if widen == "kind" and k:
            wide = weigh(S.cell_of_keys(pool, q, []), 1 - (1 - S.LEVEL) / 2 ** (k - 1))
        elif widen == "two" and k >= 2:
            wide = weigh(S.cell_of_keys(pool, q, []), 1 - (1 - S.LEVEL) / 2 ** (k - 2))
        elif widen == "coarser80" and k:
            wide = weigh(S.cell_of_keys(pool, q, keys[: max(0, len(keys) - k)]), S.LEVEL)
        elif widen == "phase" and k:
            wide = weigh(S.cell_of_keys(pool, q, ["phase"]), 1 - (1 - S.LEVEL) / 2 ** (k - 1))
        elif widen == "cell-and-coarser" and k:
            a = weigh(cell, 1 - (1 - S.LEVEL) / 2**k)
            b = weigh(S.cell_of_keys(pool, q, keys[: max(0, len(keys) - k)]), 1 - (1 - S.LEVEL) / 2 ** (k - 1))
            wide = (min(a[0], b[0]), max(a[1], b[1]))
        if wide is not None:
            lo, hi = min(lo, wide[0]), max(hi, wide[1])
        return (lo, hi), thin

    return rule


def shipped(res: Sequence[S.Residual], q: S.Query, family: str) -> tuple[Band, tuple[str, ...]]:
    return S.band(res, q, exclude_family=family)


RULES: dict[str, Rule] = {
    "before: by count, union with the kind": variant(by_count, "kind"),
    "by family, union with the kind": variant(by_family, "kind"),
    "by family, no widening": variant(by_family, "none"),
    "by family, widening from two thin slices": variant(by_family, "two"),
    "by family, the cell k keys coarser at 80 %": variant(by_family, "coarser80"),
    "by family, the phase's band at the escalating level": variant(by_family, "phase"),
    "by family, the cell at 1 - 0.2/2^k with the coarser cell": variant(by_family, "cell-and-coarser"),
    "shipped: by family, the cell k keys coarser at the escalating level": shipped,
}


def score(rule: Rule, res: Sequence[S.Residual]) -> dict[str, object]:
    hits: list[tuple[S.Residual, bool, float, int]] = []
    for r in res:
        try:
            (lo, hi), thin = rule(res, S.query_of(r), r.family)
        except ValueError:
            continue
        hits.append((r, lo <= r.log_speed <= hi, math.exp(hi - lo), len(thin)))
    slices = {}
    for kind in ("publisher_family", *S.KINDS[1:]):
        for name in sorted({r.slice(kind) or "" for r, *_ in hits}):
            inside = [h for r, h, _, _ in hits if (r.slice(kind) or "") == name]
            slices[name] = round(100 * float(np.mean(inside)), 1)
    lowest = min(slices, key=lambda n: slices[n])
    by_thin = {}
    for k in sorted({min(t, 2) for *_, t in hits}):
        group = [(h, w) for _, h, w, t in hits if min(t, 2) == k]
        by_thin[f"{k}{'+' if k == 2 else ''}"] = {
            "points": len(group),
            "covered_pct": round(100 * float(np.mean([h for h, _ in group])), 1),
            "median_width": round(float(np.median([w for _, w in group])), 2),
        }
    return {
        "points": len(hits),
        "covered_pct": round(100 * float(np.mean([h for _, h, _, _ in hits])), 1),
        "median_width": round(float(np.median([w for _, _, w, _ in hits])), 2),
        "lowest_slice": [lowest, slices[lowest]],
        "by_thin_slices": by_thin,
    }


def grid(res: Sequence[S.Residual]) -> list[dict[str, float]]:
    """The shipped rule at every cell size 15–39 and family floor 2–5 (the module constants put back after)."""
    keep = S.MIN_POINTS, S.MIN_FAMILIES
    rows: list[dict[str, float]] = []
    try:
        for n in range(15, 40):
            for f in (2, 3, 4, 5):
                S.MIN_POINTS, S.MIN_FAMILIES = n, f
                cov = S.coverage(res)
                rows.append({"min_points": n, "min_families": f, "covered_pct": cov[0].covered_pct,
                             "median_width": cov[0].median_width,
                             "lowest_slice_pct": min(c.covered_pct for c in cov[1:])})  # fmt: skip
    finally:
        S.MIN_POINTS, S.MIN_FAMILIES = keep
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/interval-rules.json")
    ap.add_argument("--grid", action="store_true", help="also the shipped rule over cell sizes 15-39, 2-5 families")
    args = ap.parse_args()
    res = shipped_accuracy().residuals
    out: dict[str, object] = {"rev": code_rev(), "residuals": len(res), "level": S.LEVEL,
                              "rules": {name: score(rule, res) for name, rule in RULES.items()}}  # fmt: skip
    table = Table(title=f"80 % bands held out by family on {len(res)} shipped residuals (modelled residuals)")
    for col in ("rule", "cover", "median width", "lowest slice", "0 / 1 / 2+ thin: cover, width"):
        table.add_column(col)
    rules = out["rules"]
    assert isinstance(rules, dict)
    for name, s in rules.items():
        thin = ", ".join(f"{v['covered_pct']} % {v['median_width']}×" for v in s["by_thin_slices"].values())
        table.add_row(name, f"{s['covered_pct']} %", f"{s['median_width']}×",
                      f"{s['lowest_slice'][0]} {s['lowest_slice'][1]} %", thin)  # fmt: skip
    Console().print(table)
    if args.grid:
        rows = grid(res)
        out["grid"] = rows
        cov = [r["covered_pct"] for r in rows]
        wid = [r["median_width"] for r in rows]
        low = [r["lowest_slice_pct"] for r in rows]
        print(f"grid (cell size 15-39, 2-5 families): cover {min(cov)}-{max(cov)} %, "
              f"width {min(wid)}-{max(wid)}×, lowest slice {min(low)} %")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
