"""The README's accuracy paragraph quotes the shipped held-out figures (data/validation-accuracy.json, which a
test keeps equal to a fresh `hardware validate`): a refit that moves them must move the README with them."""

from __future__ import annotations

import math
from pathlib import Path

from voicepipe.hardware.validate import shipped_accuracy
from voicepipe.hardware.validate.slices import coverage, slice_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readmes_accuracy_figures_are_the_shipped_held_out_ones():
    acc = shipped_accuracy()
    text = " ".join(README.read_text(encoding="utf-8").split())  # the paragraph's line breaks as spaces
    rows = {(s.kind, s.slice): s for s in slice_table(acc.residuals)}
    cov = {(c.kind, c.slice): c for c in coverage(acc.residuals)}
    s, every = acc.summary, cov[("all", "all")]
    lowest = min(c.covered_pct for k, c in cov.items() if k != ("all", "all"))
    expect = [
        f"held out by publisher family on {len(acc.residuals)} published points",
        f"median error of {s.tier1_median_error_pct} % on tier 1 and {s.median_error_pct} % over all",
        f"{rows[('publisher_family', 'vendor')].median_abs_error_pct} % on hardware vendors' points",
        f"{rows[('publisher_family', 'independent')].median_abs_error_pct} % on independent ones",
        f"reads **{rows[('publisher_family', 'independent')].bias_pct} % too fast**",
        f"MLA models +{rows[('architecture', 'mla')].bias_pct} %",
        f"({every.covered_pct:.0f} % of held-out points fall in theirs, every slice ≥ {math.floor(lowest)} %",  # a floor: "≥" must hold
        f"width {every.median_width:.2f}×, {cov[('phase', 'decode')].median_width:.2f}× for decode steps",
    ]
    missing = [e for e in expect if e not in text]
    assert not missing, f"README.md no longer quotes the shipped figures: {missing}"
