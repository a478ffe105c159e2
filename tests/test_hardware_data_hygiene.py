"""Data rules of the twelfth pass's hygiene checks (docs/hardware-model.md §3): the published runs as run.

Argonne's LLM-Inference-Bench counts MI250 *cards*; each card is two GCDs, each its own ROCm device, and its
runs are tensor-parallel over GCDs, so its rows run on ``mi250-gcd`` at twice the CSV's count. A device with a
published copy/triad bandwidth uses it; one without keeps the default share of its datasheet figure.
"""

from __future__ import annotations

import pytest

import voicepipe.hardware.catalog as cat
import voicepipe.hardware.validate as val


def _argonne_mi250() -> list[val.Point]:
    return [p for p in val.points() if p.id.startswith(("anl-mi250", "anl2-mi250"))]


def test_argonne_mi250_rows_run_on_gcds_at_twice_the_card_count():
    rows = _argonne_mi250()
    assert len(rows) == 12
    gcd = cat.device("mi250-gcd")
    for p in rows:
        assert p.device == "mi250-gcd" and p.chips is not None, p.id
        assert p.chips % 2 == 0 and p.chips <= gcd.max_tp, p.id  # whole cards, at most one 4-card node
        # the fp16 weights fit only on that many 64 GB GCDs (Mixtral, 93 GB, needs two: one card)
        weights = cat.model(p.model).total_params * 2
        assert weights < p.chips * gcd.capacity_bytes, p.id
        assert not val.prepare(p).reason, p.id


def test_a_gcd_is_half_a_card_and_both_take_the_same_sustained_rate():
    card, gcd = cat.device("mi250"), cat.device("mi250-gcd")
    assert gcd.memory_gb * 2 == card.memory_gb
    assert gcd.mem_bw_tbs * 2 == pytest.approx(card.mem_bw_tbs)
    assert gcd.stream_bytes_s * 2 == pytest.approx(card.stream_bytes_s, rel=1e-3)
    assert gcd.stream_bytes_s == pytest.approx(cat.device("mi250x-gcd").stream_bytes_s)


def test_consumer_gpus_use_a_published_bandwidth_where_one_exists():
    rtx, ada = cat.device("rtx-4090"), cat.device("rtx-6000-ada")
    assert rtx.stream_bw_tbs == pytest.approx(0.912) and "chsasank" in rtx.sources["stream_bw_tbs"]
    assert cat.device("h100-pcie").stream_bw_tbs == pytest.approx(1.832)
    # none found for the RTX 6000 Ada: the default share of its datasheet figure
    assert ada.stream_bw_tbs is None
    assert ada.stream_bytes_s == pytest.approx(0.960e12 * cat.STREAM_SHARE_DEFAULT)
