"""SRAM machines (Cerebras WSE-3, Groq LPU) against published points their constants were NOT fitted to.

Each SRAM machine has two fitted constants (devices.yaml), fitted to exactly two published speeds, which
data/validation.yaml marks ``sram_fit``. Every other published point on those machines is held out; this
file predicts them with the shipped model and holds the median absolute error to the bound that
docs/hardware-model.md §4 states beside the measured figure. The bounds are set from the measurement with
some margin, not the other way round: Cerebras' post-August-2024 speeds are 2-5x what the model gives.
A point served with speculative decoding whose α, γ and draft cost are not published (Cerebras' Llama 3.1
405B figures) is left out by validate and is not held-out evidence here either.
"""

from __future__ import annotations

import numpy as np
import pytest

import voicepipe.hardware.validate as val

SRAM = ("cerebras-wse3", "groq-lpu")
# (measured median absolute error when the bound was set, bound) — docs/hardware-model.md §4
# (remeasured 2026-12 after the hygiene pass left Cerebras' two speculative 405B points out: Groq 0.133, Cerebras
# 0.634, both 0.364 — the bounds were not moved)
BOUND = {"groq-lpu": (0.133, 0.20), "cerebras-wse3": (0.634, 0.75), None: (0.364, 0.65)}


@pytest.fixture(scope="module")
def rows() -> list[val.Row]:
    return [r for r in val.run().rows if r.point.device in SRAM]


def _held_out(rows: list[val.Row], device: str | None) -> list[val.Row]:
    """The held-out points a model without speculative decoding answers: not a fit point, not speculative."""
    return [
        r for r in rows
        if not r.point.sram_fit and not r.point.is_speculative and (device is None or r.point.device == device)
    ]  # fmt: skip


def test_each_sram_machine_has_exactly_its_two_fit_points_and_they_are_answered(rows):
    for dev in SRAM:
        fit = [r for r in rows if r.point.device == dev and r.point.sram_fit]
        assert len(fit) == 2, [r.point.id for r in fit]
        assert all(r.predicted is not None for r in fit)


def test_every_held_out_sram_point_is_answered_and_says_who_published_it(rows):
    for r in _held_out(rows, None):
        assert r.predicted is not None, (r.point.id, r.reason)
        assert r.point.publisher and r.point.publisher_family in ("vendor", "independent"), r.point.id
    held = _held_out(rows, None)
    assert {r.point.publisher_family for r in held} == {"vendor", "independent"}
    assert all(len(_held_out(rows, d)) >= 5 for d in SRAM)


def test_a_speculative_sram_point_without_its_settings_is_left_out_with_its_reason(rows):
    # Cerebras' Llama 3.1 405B figures were served with speculative decoding (its 2024-10 release, The
    # Register 2024-12); no α, γ or draft cost is published, so validate leaves them out rather than
    # predicting them without the speculative model (issue 24's rule)
    spec = [r for r in rows if r.point.is_speculative]
    assert {r.point.id for r in spec} >= {
        "cerebras-2024-11-llama31-405b-bf16",
        "cerebras-2024-11-llama31-405b-ttft",
    }
    for r in spec:
        assert r.predicted is None and r.error is None and r.reason == "speculative, no α", r.point.id
    # they count nowhere: not in the accuracy figures, not in any slice
    acc = val.accuracy(val.run())
    assert not {r.point.id for r in spec} & {x.id for x in acc.residuals}


@pytest.mark.parametrize("device", [*SRAM, None])
def test_held_out_sram_median_error_within_the_stated_bound(rows, device):
    errs = np.array([abs(r.error) for r in _held_out(rows, device) if r.error is not None])
    _, bound = BOUND[device]
    assert float(np.median(errs)) <= bound, (device, float(np.median(errs)))


def test_the_model_reads_cerebras_later_speeds_slower_than_published(rows):
    # the documented limit (docs §7): constants from Aug 2024 miss the vendor's later software. If a change
    # closes that gap, this test and the docs' statement both need revisiting
    held = [r for r in _held_out(rows, "cerebras-wse3") if r.point.metric == "tok_s_user"]
    slower = [r for r in held if r.predicted is not None and r.predicted < r.point.value]
    assert len(slower) >= 0.75 * len(held)


def test_fit_points_are_not_counted_as_held_out_evidence():
    acc = val.accuracy(val.run())
    answered = [r for r in val.run().rows if r.error is not None]
    fit = sum(1 for r in answered if r.point.sram_fit)
    assert fit == 4 and acc.summary.points == len(answered) - fit
    for dev in SRAM:
        want = sum(1 for r in answered if r.point.device == dev and not r.point.sram_fit)
        assert acc.by_device[dev].points == want
