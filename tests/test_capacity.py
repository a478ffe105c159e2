"""Capacity planning on virtual time: one session is predict; p90 grows with load; the limit is the crossing."""

from __future__ import annotations

import csv
import itertools
import json
import subprocess
import sys

import pytest

from tests.conftest import tiny_scenario
from voicepipe.capacity import Level, Load, conversation_s, limit, parse_loads, plan, run_level
from voicepipe.config import load_config
from voicepipe.errors import UserError
from voicepipe.predict import predict
from voicepipe.records import percentile

SHARED = ("agent.backend=a100-40gb/llama-3.1-70b", "client.playout=first_audio")


@pytest.fixture(scope="module")
def sweep():
    cfg = load_config(None, list(SHARED))
    sc = tiny_scenario(turns=3)
    d = conversation_s(cfg, [sc])
    return cfg, sc, [run_level("a100", cfg, [sc], Load("sessions", n), conv_s=d) for n in (1, 8, 32, 96)]


def test_one_session_is_predict(sweep):
    cfg, sc, levels = sweep
    preds = [p.predicted_ms for p in predict(cfg, [sc])]
    one = levels[0]
    assert one.turns == len(preds) == 3
    for q, got in ((50, one.p50_ms), (90, one.p90_ms), (99, one.p99_ms)):
        assert got == pytest.approx(percentile(preds, q), abs=1e-9)
    assert one.devices[0].queue_mean_ms == 0.0


def test_p90_grows_with_load_on_a_shared_device_and_the_limit_is_the_crossing(sweep):
    _, _, levels = sweep
    p90 = [lv.p90_ms for lv in levels]
    assert all(b >= a - 0.5 for a, b in itertools.pairwise(p90)), p90  # monotone (to rounding)
    assert p90[-1] > p90[0] + 20, p90  # the device saturates: requests queue
    queue = [lv.devices[0].queue_mean_ms for lv in levels]
    busy = [lv.devices[0].busy_share for lv in levels]
    assert queue[-1] > queue[0] and busy[-1] > busy[0]
    # the limit reads p90 at the slow end of the turns' ranges (the hardware agent's interval carried in)
    slow = [lv.p90_slow_ms for lv in levels]
    assert all(s >= p for s, p in zip(slow, p90, strict=True))
    budget = (slow[2] + slow[3]) / 2  # between 32 and 96 sessions
    lim = limit("a100", levels, budget)
    assert lim.largest_ok is levels[2] and lim.first_over is levels[3]
    assert 32 < lim.crossing < 96
    assert "up to 32 concurrent conversations keep p90 inside" in lim.sentence()
    assert limit("a100", levels, p90[0] - 1).largest_ok is None
    assert limit("a100", levels, slow[-1] + 1).first_over is None


def test_limit_is_the_largest_load_inside_and_the_next_one():
    def lv(n: int, p90: float) -> Level:
        return Level("x", Load("sessions", n), n, 10, 10, p90, p90, p90, 1.0, 0.0, 1.0)

    lim = limit("x", [lv(1000, 1200), lv(1, 500), lv(10, 700), lv(100, 900)], 800)
    assert lim.largest_ok.load.value == 10 and lim.first_over.load.value == 100
    assert lim.crossing == pytest.approx(10 + 90 * 100 / 200)
    noisy = limit("x", [lv(1, 820), lv(4, 795)], 800)  # small samples: p90 need not be monotone
    assert noisy.largest_ok.load.value == 4 and noisy.first_over is None


def test_a_load_inside_only_at_the_ranges_fast_end_is_uncertain_not_inside():
    def lv(n: int, p90: float, slow: float) -> Level:
        return Level("x", Load("sessions", n), n, 10, 10, p90, p90, p90, 1.0, 0.0, 1.0,
                     p90_range_ms=(p90 * 0.9, slow))  # fmt: skip

    lim = limit("x", [lv(1, 500, 700), lv(10, 700, 900), lv(100, 900, 1100)], 800)
    assert lim.largest_ok.load.value == 1 and lim.first_over.load.value == 10
    assert [u.load.value for u in lim.uncertain] == [10]  # p90 700 is inside only at the fast end
    assert (
        "uncertain at 10 concurrent conversations (p90 700 ms, 900 at the range's slow end)" in lim.sentence()
    )
    assert lim.crossing == pytest.approx(1 + 9 * 100 / 200)  # interpolated on the slow ends


def test_a_capacity_level_counts_turns_inside_only_at_the_fast_end_as_uncertain_not_within(sweep):
    """The 8-session level's turns, judged against a budget between their p90s' fast and slow ends."""
    cfg, sc, levels = sweep
    lv = levels[1]
    assert lv.p90_range_ms is not None
    lo, hi = lv.p90_range_ms
    assert lo < lv.p90_ms < hi  # the a100's held-out interval is carried into the turns
    mid = cfg.model_copy(update={"budget_ms": (lo + hi) / 2})
    judged = run_level("a100", mid, [sc], lv.load, conv_s=conversation_s(cfg, [sc]))
    assert judged.uncertain > 0
    assert judged.within_budget + judged.uncertain <= 1.0


def test_loads_and_plans():
    assert [ld.value for ld in parse_loads("100,10", None)] == [10, 100]
    assert [ld.value for ld in parse_loads(None, "1/s,30/min")] == [30, 60]
    for bad in (("0", None), ("ten", None), (None, "5/fortnight"), (None, None), ("1", "1/min")):
        with pytest.raises(UserError):
            parse_loads(*bad)
    sc = tiny_scenario(turns=1)
    p = plan(Load("sessions", 4), [sc], 10.0, 0, 1)
    assert [at for at, _ in p.slots] == [0.0, 2.5, 5.0, 7.5] and p.conversations == 8
    ids = [sid for _, convs in p.slots for _, sid in convs]
    assert len(set(ids)) == 8
    arr = plan(Load("arrivals", 60), [sc], 10.0, 0, 2)  # Poisson: about 120 calls in 2 minutes
    assert 80 < arr.conversations < 160 and all(
        a <= b for (a, _), (b, _) in zip(arr.slots, arr.slots[1:], strict=False)
    )


def test_cli_capacity_outputs(tmp_path):
    j, c, h = tmp_path / "c.jsonl", tmp_path / "c.csv", tmp_path / "c.html"
    r = subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", "capacity", "rapid-fire", "--set", "agent.backend=groq-lpu/llama-3.1-8b",
         "--sessions", "1,4", "--json", str(j), "--csv", str(c), "--report", str(h)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "MODELLED" in r.stdout and "concurrent conversations" in r.stdout
    rows = [json.loads(line) for line in j.read_text().splitlines()]
    assert [row["kind"] for row in rows] == ["level", "level", "limit"]
    assert rows[0]["load"] == 1 and rows[1]["load"] == 4 and rows[0]["modelled"]
    assert len(c.read_text().splitlines()) == 3
    html = h.read_text()
    assert "budget-line" in html and "<polyline" in html
    bad = subprocess.run([sys.executable, "-m", "voicepipe.cli", "capacity", "rapid-fire", "--sessions", "x"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--sessions" in bad.stderr and "Traceback" not in bad.stderr


def test_hop_ms_charges_every_bus_message_and_is_said(sweep, tmp_path):
    """``--hop-ms`` models a real bus: one session alone (no queue) is slower by at least the hops on a turn's
    critical path (client→ASR→router→agent→TTS→client: 5), the level records it, and the output says so."""
    cfg, sc, levels = sweep
    d = conversation_s(cfg, [sc])
    hop = run_level("a100", cfg, [sc], Load("sessions", 1), conv_s=d, hop_ms=2.0)
    assert hop.hop_ms == 2.0 and levels[0].hop_ms == 0.0
    assert hop.p50_ms - levels[0].p50_ms >= 5 * 2.0 - 1e-6
    assert hop.p50_ms - levels[0].p50_ms < 20 * 2.0  # a hop per message, not per token
    j, c, h = tmp_path / "c.jsonl", tmp_path / "c.csv", tmp_path / "c.html"
    r = subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", "capacity", "rapid-fire", "--set", "agent.backend=groq-lpu/llama-3.1-8b",
         "--sessions", "1", "--hop-ms", "0.4", "--json", str(j), "--csv", str(c), "--report", str(h)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "0.4 ms per message" in " ".join(r.stdout.split())
    assert json.loads(j.read_text().splitlines()[0])["hop_ms"] == 0.4
    assert [float(row["hop_ms"]) for row in csv.DictReader(c.open())] == [0.4]  # a CSV alone says it too
    assert "0.4 ms per message" in h.read_text()
    bad = subprocess.run(
        [sys.executable, "-m", "voicepipe.cli", "capacity", "rapid-fire", "--sessions", "1", "--hop-ms", "-1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
