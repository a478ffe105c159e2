"""Per-turn metric columns under the names users know, and the next-step advice built on the breakdown."""

from __future__ import annotations

from pathlib import Path

import pytest

from voicepipe.config import load_config
from voicepipe.messages import Span
from voicepipe.predict import predict
from voicepipe.records import METRICS, BreakdownPart, TurnRecord, span_metrics
from voicepipe.report.advice import advice, largest_part, shipped_configs
from voicepipe.report.export import read_csv, write_csv
from voicepipe.scenario import load_scenario
from voicepipe.text import count_tokens

MS = 1_000_000


def chain(stage: str = "agent") -> list[Span]:
    t = 0
    out = []
    for st, what, d in (
        ("transport", "uplink", 114), ("asr", "endpoint wait", 200), ("asr", "turn detector", 12),
        ("asr", "finalise", 100), ("router", "classifier", 10), (stage, "queue", 40), (stage, "ttft", 300),
        (stage, "decode", 60), ("tts", "time to first audio", 188), ("transport", "downlink", 89),
    ):  # fmt: skip
        out.append(Span(stage=st, what=what, start_ns=t, dur_ns=d * MS))
        t += d * MS
    return out


@pytest.mark.parametrize("stage", ["agent", "council"])
def test_span_metrics_from_what_names(stage: str) -> None:
    clause = "Sure, it will be sunny all day."
    gaps = count_tokens(clause) - 1
    m = span_metrics(chain(stage), clause, output_tokens=40)
    assert m["ttft_ms"] == pytest.approx(340.0)  # queue + prefill, as vLLM measures from the request
    assert m["tpot_ms"] == pytest.approx(60.0 / gaps) and m["itl_ms"] == m["tpot_ms"]
    assert m["e2el_ms"] == pytest.approx(340.0 + 39 * 60.0 / gaps)
    assert m["tts_ttfb_ms"] == pytest.approx(188.0)
    assert m["asr_final_ms"] == pytest.approx(100.0)
    assert m["endpoint_delay_ms"] == pytest.approx(212.0)


def test_cache_hit_has_no_llm_metrics() -> None:
    spans = [s for s in chain() if s.stage != "agent"]
    m = span_metrics(spans, "We close at six.", 0)
    assert m["ttft_ms"] is m["tpot_ms"] is m["e2el_ms"] is None
    assert m["tts_ttfb_ms"] == pytest.approx(188.0)


def test_record_carries_metrics_and_csv_round_trips(tmp_path: Path) -> None:
    r = TurnRecord(run="r", scenario="s", session="s-0", turn=0, spans=chain(), reply_text="Sure, it will.",
                   output_tokens=12, measured_ms=1100.0)  # fmt: skip
    assert all(getattr(r, m) is not None for m in METRICS)
    write_csv([r], tmp_path / "t.csv")
    header = (tmp_path / "t.csv").read_text().splitlines()[0].split(",")
    assert set(METRICS) <= set(header)
    (back,) = read_csv(tmp_path / "t.csv")
    assert all(getattr(back, m) == pytest.approx(getattr(r, m)) for m in METRICS)
    assert r.model_dump(mode="json")["ttft_ms"] == pytest.approx(340.0)


def _records(sets: list[str], scenario: str = "cafe-order") -> tuple[list[TurnRecord], object]:
    cfg = load_config(None, sets)
    return [p.as_record() for p in predict(cfg, [load_scenario(scenario)])], cfg


def test_advice_names_the_largest_part_and_a_fix_that_predicts_better() -> None:
    recs, cfg = _records([])
    a = advice(recs, cfg, ["cafe-order"], ["voicepipe", "run", "cafe-order"])
    assert a is not None and a.missed == len(recs)
    part, part_ms, _ = largest_part(recs)
    assert a.part == part == ("agent", "ttft") and a.part_ms == pytest.approx(part_ms)
    assert a.fix is not None and a.command and a.command.startswith("voicepipe run cafe-order")
    assert a.fix_p50_ms is not None and a.now_p50_ms is not None and a.fix_p50_ms < a.now_p50_ms
    # the suggested command, predicted independently, gives what the advice says
    flags = a.command.split()[3:]
    conf = flags[flags.index("-c") + 1] if "-c" in flags else None
    sets = [flags[i + 1] for i, f in enumerate(flags) if f == "--set"]
    again, _ = _records(sets) if conf is None else ([p.as_record() for p in predict(load_config(conf, sets),
                                                     [load_scenario("cafe-order")])], None)  # fmt: skip
    from voicepipe.records import summarise

    assert summarise(again).p50_ms == pytest.approx(a.fix_p50_ms)


def test_the_suggested_command_sets_each_key_once() -> None:
    """The user's own --set of the key the fix changes is replaced, not repeated beside the new value."""
    recs, cfg = _records(["agent.backend=sonnet-gpu"])
    base = [
        "voicepipe",
        "run",
        "cafe-order",
        "--set",
        "agent.backend=sonnet-gpu",
        "--set=seed=7",
        "--set",
        "x=1",
    ]
    a = advice(recs, cfg, ["cafe-order"], base)
    assert a is not None and a.fix is not None and a.command
    words = a.command.split()
    keys = [w.removeprefix("--set=").partition("=")[0] for i, w in enumerate(words)
            if w.startswith("--set=") or (i and words[i - 1] == "--set")]  # fmt: skip
    assert len(keys) == len(set(keys)), a.command
    # a --set fix replaces the user's override of its key and keeps the others
    from voicepipe.report.advice import _without_keys

    assert _without_keys(base, {"agent.backend", "seed"}) == [
        "voicepipe",
        "run",
        "cafe-order",
        "--set",
        "x=1",
    ]


def test_no_advice_when_nothing_missed_and_no_fake_fix() -> None:
    recs, cfg = _records(["budget_ms=5000"])
    assert advice(recs, cfg, ["cafe-order"]) is None
    # the bus is the largest part and the config is already the fast lane: nothing shipped predicts better,
    # so the line says so instead of inventing a fix
    fast = load_config(shipped_configs() / "fast-lane.yaml", [])
    recs = [p.as_record() for p in predict(fast, [load_scenario("cafe-order")])]
    r = recs[0].model_copy(update={"within_budget": False,
                                   "breakdown": [BreakdownPart(stage="bus", what="hops", ms=900.0)]})  # fmt: skip
    a = advice([r], fast, ["cafe-order"])
    assert a is not None and a.part == ("bus", "hops") and a.fix is None
    assert "no shipped change" in a.line()


def test_predictions_carry_the_metric_columns_of_the_stages_spans() -> None:
    """predict runs the real stages, so its records have the same metric columns a live run has."""
    preds = predict(load_config(None, []), [load_scenario("cafe-order")], 1)
    agent = [p for p in preds if p.path == "agent"]
    assert agent
    for p in agent:
        rec = p.as_record()
        assert rec.ttft_ms is not None and rec.ttft_ms > 0
        assert rec.tts_ttfb_ms is not None and rec.asr_final_ms is not None
        assert p.to_json()["ttft_ms"] == rec.ttft_ms
        # the parts named by the metrics are parts of the predicted chain
        assert rec.ttft_ms + rec.tts_ttfb_ms < p.predicted_ms


def test_advice_says_how_many_of_the_missed_turns_were_only_uncertain() -> None:
    recs, cfg = _records(["agent.backend=h100-sxm/llama-3.1-8b"])
    unsure = sum(r.uncertain for r in recs)
    a = advice(recs, cfg, ["cafe-order"])
    assert a is not None and a.uncertain == unsure
    assert (f"({unsure} of them uncertain)" in a.text()) == (unsure > 0)
