"""Live at N sessions on a shared simulated device vs ``capacity`` at N: do they agree within the tax?

Plans one load level (N conversation slots, voicepipe.capacity.plan), runs it twice with the same plan:
on virtual time (capacity's engine: in-memory bus, zero hops) and live (real time, every stage its own
MQTT client on a spawned mosquitto with TCP_NODELAY, PATH must find it). Both are summarised over the
same window by voicepipe.capacity.level_of. Before the live run it measures the broker's one-way hop
(half the median QoS 1 ping-pong between two clients, voicepipe.bus.probe_round_trip, 64 rounds) and runs
capacity twice: with zero hops (the modelled spans alone, as predict) and charging that measured hop per
message (``capacity --hop-ms``). Prints p50/p90 of both, of the live run's measured voice-to-voice
(client clock), of its modelled part (predicted_ms) and of its pipeline tax (measured − predicted), and
writes JSON. Agreement: |live measured − capacity| at p50 and p90 within the live tax at that percentile.
It also pairs the two runs turn by turn (same session and turn of the same plan): the difference of the
modelled parts (live predicted_ms − capacity's), how many turns have identical modelled time and identical
queue spans, and the per-turn live measured − capacity. The modelled parts differ only where the live
run's timing (its tax) changed the order or overlap of requests on the shared device.

    python bench/live_vs_capacity.py [--sessions 50] [--scenario cafe-order] [--backend a100-40gb/llama-3.1-70b] [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import time
from pathlib import Path

from benchinfo import code_rev
from rich.console import Console
from rich.table import Table

from voicepipe.bus.brokers import Mosquitto
from voicepipe.bus.mqtt import BrokerAddress, probe_round_trip
from voicepipe.capacity import Level, Load, conversation_s, level_of, plan, run_level
from voicepipe.clock import now_ns
from voicepipe.clock.gc import tune_for_runs
from voicepipe.config import PipelineConfig, load_config
from voicepipe.records import TurnRecord, percentile
from voicepipe.runresult import RunResult
from voicepipe.scenario import Scenario, load_scenario
from voicepipe.sessions import play_sessions
from voicepipe.stages.base import RunContext
from voicepipe.stageset import build_stages, mqtt_connector, needed_stages


async def live(cfg, slots, url: str) -> tuple[RunResult, int]:
    ctx = RunContext(run=f"lvc{time.monotonic_ns() % 100000:x}", cfg=cfg)
    result = RunResult(run=ctx.run, broker=url)
    stages = build_stages(mqtt_connector(BrokerAddress.parse(url), ctx), ctx, needed_stages(cfg),
                          on_record=result.records.append)  # fmt: skip
    t0 = now_ns()
    async with contextlib.AsyncExitStack() as stack:
        await play_sessions(stack, stages, slots, result)
    return result, t0


def _queue_ms(r: TurnRecord) -> float:
    return sum(s.dur_ns for s in r.spans if s.what == "queue") / 1e6


def paired(cap_records: list[TurnRecord], live_records: list[TurnRecord]) -> dict:
    """The same turns of the same plan, virtual vs live: how far apart are their modelled parts?"""
    cap_by = {(r.session, r.turn): r for r in cap_records if r.predicted_ms is not None}
    pairs = [(cap_by[k], r) for r in live_records if (k := (r.session, r.turn)) in cap_by
             and r.predicted_ms is not None and r.measured_ms is not None]  # fmt: skip
    if not pairs:
        return {"turns": 0}
    dp = [lv.predicted_ms - c.predicted_ms for c, lv in pairs]  # type: ignore[operator]
    dm = [lv.measured_ms - c.predicted_ms for c, lv in pairs]  # type: ignore[operator]
    return {
        "turns": len(pairs),
        "predicted_live_minus_capacity_ms": {
            "p10": percentile(dp, 10), "median": percentile(dp, 50), "p90": percentile(dp, 90),
            "mean": sum(dp) / len(dp),
        },
        "identical_predicted": sum(abs(x) < 1e-3 for x in dp),
        "identical_queue": sum(abs(_queue_ms(lv) - _queue_ms(c)) < 1e-3 for c, lv in pairs),
        "measured_live_minus_capacity_ms": {"median": percentile(dm, 50), "p90": percentile(dm, 90)},
    }  # fmt: skip


def one_run(
    args: argparse.Namespace,
    cfg: PipelineConfig,
    sc: Scenario,
    d: float,
    cap: Level,
    cap_records: list[TurnRecord],
) -> dict:
    """One live run beside capacity (zero hops: ``cap``; and at the hop measured just before it)."""
    load = Load("sessions", args.sessions)
    p = plan(load, [sc], d, cfg.seed, 10)
    broker = Mosquitto()
    broker.start()
    try:
        hop_ms = asyncio.run(probe_round_trip(BrokerAddress.parse(broker.url), rounds=64)) / 2
        cap_hop = run_level(args.backend, cfg, [sc], load, conv_s=d, hop_ms=hop_ms)
        res, t0 = asyncio.run(live(cfg, p.slots, broker.url))
    finally:
        broker.stop()
    meas = level_of(args.backend, cfg, load, p, res, t0, latency="measured_ms")
    pred = level_of(args.backend, cfg, load, p, res, t0, latency="predicted_ms")
    lo, hi = t0 + p.window_ns[0], t0 + p.window_ns[1]
    tax = [r.tax_ms for r in res.records if r.tax_ms is not None and lo <= (r.end_of_speech_ns or 0) < hi]
    tax50, tax90 = percentile(tax, 50), percentile(tax, 90)

    def agree(c: Level) -> dict[str, bool]:
        return {
            "p50": abs(meas.p50_ms - c.p50_ms) <= tax50 if tax50 is not None else False,
            "p90": abs(meas.p90_ms - c.p90_ms) <= tax90 if tax90 is not None else False,
        }

    t = Table(title=f"live vs capacity — {args.scenario}, {args.sessions} sessions, {args.backend}")
    for h in ("", "turns", "p50 ms", "p90 ms"):
        t.add_column(h, justify="left" if not h else "right")
    t.add_row("capacity (modelled, virtual time)", str(cap.turns), f"{cap.p50_ms:.1f}", f"{cap.p90_ms:.1f}")
    t.add_row(f"capacity --hop-ms {hop_ms:.2f} (measured hop)", str(cap_hop.turns), f"{cap_hop.p50_ms:.1f}",
              f"{cap_hop.p90_ms:.1f}")  # fmt: skip
    t.add_row("live measured (mosquitto)", str(meas.turns), f"{meas.p50_ms:.1f}", f"{meas.p90_ms:.1f}")
    t.add_row(
        "live modelled part (predicted_ms)", str(pred.turns), f"{pred.p50_ms:.1f}", f"{pred.p90_ms:.1f}"
    )
    t.add_row("live pipeline tax", str(len(tax)), f"{tax50:.1f}", f"{tax90:.1f}")
    Console().print(t)
    pair = paired(cap_records, res.records)
    if pair["turns"]:
        dp = pair["predicted_live_minus_capacity_ms"]
        print(f"paired turns {pair['turns']}: modelled part live − capacity median {dp['median']:+.3f} ms "
              f"(p10 {dp['p10']:+.1f}, p90 {dp['p90']:+.1f}, mean {dp['mean']:+.2f}); identical modelled time "
              f"{pair['identical_predicted']}, identical queue span {pair['identical_queue']}")  # fmt: skip
    a0, a1 = agree(cap), agree(cap_hop)
    print(f"agree within the measured tax: zero hops p50 {a0['p50']}, p90 {a0['p90']}; "
          f"measured hop p50 {a1['p50']}, p90 {a1['p90']}")  # fmt: skip
    return {
        "hop_ms_measured": hop_ms, "capacity_with_hop": cap_hop.to_json(),
        "live_measured": meas.to_json(), "live_predicted": pred.to_json(),
        "tax_p50_ms": tax50, "tax_p90_ms": tax90,
        "agree_within_tax": a0, "agree_within_tax_with_hop": a1, "paired": pair,
        "live_stage_errors": res.stage_errors, "live_deadletters": res.deadletters,
        "load_average_1min_after": os.getloadavg()[0],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--scenario", default="cafe-order")
    ap.add_argument("--backend", default="a100-40gb/llama-3.1-70b")
    ap.add_argument("--runs", type=int, default=1, help="live runs back to back (capacity is deterministic)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/live_vs_capacity.json"))
    args = ap.parse_args()
    cfg = load_config(None, [f"agent.backend={args.backend}"])
    sc = load_scenario(args.scenario)
    d = conversation_s(cfg, [sc])
    cap_records: list[TurnRecord] = []
    cap = run_level(
        args.backend, cfg, [sc], Load("sessions", args.sessions), conv_s=d, on_record=cap_records.append
    )
    runs = [one_run(args, cfg, sc, d, cap, cap_records) for _ in range(args.runs)]
    counts = {
        kind: {q: sum(r[key][q] for r in runs) for q in ("p50", "p90")}
        for kind, key in (("zero_hops", "agree_within_tax"), ("measured_hop", "agree_within_tax_with_hop"))
    }
    out = {
        "what": f"live at {args.sessions} sessions vs capacity at {args.sessions} (same plan, same window), "
                f"{args.runs} live run(s) back to back",
        "measured": "live: client clock over mosquitto (nodelay), real time; capacity: modelled, virtual time; "
                    "hop: half the median of 64 QoS 1 ping-pongs on the same mosquitto before each live run",
        "scenario": args.scenario, "backend": args.backend, "conversation_s": d, "code": code_rev(),
        "capacity": cap.to_json(), "runs": runs, "agree_counts": {**counts, "of": len(runs)},
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"within the tax in {counts} of {len(runs)} runs; wrote {args.out}")


if __name__ == "__main__":
    tune_for_runs()  # the collector settings the CLI runs with (voicepipe.clock.gc)
    main()
