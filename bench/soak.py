"""Soak: many sessions x many turns with a broker restart in the middle — is every turn accounted for?

Spawns a nodelay mosquitto, plays ``--sessions`` sessions of a ``--turns``-turn conversation (the
rapid-fire scenario's turns repeated), starts spread ``--spread-ms`` per session, and SIGKILLs + restarts
the broker (same port, nothing persisted, down ``--down-s``) once ``--restart-at`` of the expected turns are recorded.
Prints and writes (JSON): turns expected / measured (ok) / failed with their reasons / lost (expected but
never recorded: the goal is 0), the broker outage, how the run ended, and tax p50/p99 of the measured
turns.

    python bench/soak.py [--sessions 200] [--turns 20] [--workers 0] [--out bench/results/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from collections import Counter
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from voicepipe.bus.brokers import Mosquitto
from voicepipe.clock.gc import tune_for_runs
from voicepipe.config import load_config
from voicepipe.records import TurnRecord
from voicepipe.runner import run_pipeline
from voicepipe.scenario import Scenario, load_scenario


def soak_scenario(turns: int) -> Scenario:
    base = load_scenario("rapid-fire")
    reps = [base.turns[i % len(base.turns)] for i in range(turns)]
    return base.model_copy(update={"name": "soak", "turns": reps})


def pct(v: list[float], q: float) -> float | None:
    return float(np.percentile(v, q)) if v else None


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--spread-ms", type=float, default=20.0, help="start spread per session")
    ap.add_argument(
        "--restart-at",
        type=float,
        default=0.5,
        help="restart once this share of the expected turns is recorded",
    )
    ap.add_argument("--down-s", type=float, default=1.0, help="how long the broker stays down")
    ap.add_argument("--no-restart", action="store_true", help="the same soak without the fault")
    ap.add_argument("--backend", default="cerebras-llama-3.1-8b")
    ap.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = ap.parse_args()
    sc = soak_scenario(args.turns)
    expected = args.sessions * len(sc.turns)
    records: list[TurnRecord] = []
    with Mosquitto() as mq:
        cfg = load_config(
            None,
            [
                "client.playout=first_audio",
                f"agent.backend={args.backend}",
                f"client.start_spread_ms={args.spread_ms * args.sessions}",
            ],
            broker=mq.url,
        )
        outage: dict[str, float] = {}
        expected = args.sessions * len(sc.turns)

        async def fault() -> None:
            # by progress, not by a time estimate: the restart lands when that share of the turns is recorded
            while len(records) < args.restart_at * expected:
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            outage["at_s"] = t0 - start
            outage["turns_recorded_before"] = len(records)
            await asyncio.to_thread(mq.restart, args.down_s)
            outage["down_s"] = time.monotonic() - t0

        start = time.monotonic()
        task = None if args.no_restart else asyncio.create_task(fault())
        ended = "completed"
        try:
            await run_pipeline(cfg, [sc], args.sessions, on_record=records.append, workers=args.workers)
        except Exception as exc:  # the soak reports how the run ended, whatever it was
            ended = f"{type(exc).__name__}: {str(exc)[:200]}"
        wall = time.monotonic() - start
        if task is not None:
            task.cancel()
    ok = [r for r in records if r.status == "ok"]
    tax = [r.tax_ms for r in ok if r.tax_ms is not None]
    out = {
        "what": "soak: sessions x turns, broker SIGKILL + restart mid-run, spawned nodelay mosquitto (measured)",
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "sessions": args.sessions,
        "turns_per_session": len(sc.turns),
        "workers": args.workers,
        "broker_restart": None if args.no_restart else outage,
        "turns_expected": expected,
        "turns_measured": len(ok),
        "turns_failed": len(records) - len(ok),
        "failed_reasons": dict(Counter(r.error or r.status for r in records if r.status != "ok")),
        "turns_lost": expected - len(records),
        "tax_ms_p50": pct(tax, 50),
        "tax_ms_p99": pct(tax, 99),
        "run_ended": ended,
        "wall_s": wall,
    }
    t = Table(
        title=f"soak — {args.sessions} sessions x {len(sc.turns)} turns, broker restart mid-run, measured"
    )
    for c in ("expected", "measured", "failed (reason)", "lost", "tax p50", "tax p99"):
        t.add_column(c, justify="right")
    reasons = "; ".join(f"{n} {why}" for why, n in out["failed_reasons"].items()) or "0"
    t.add_row(
        str(expected), str(len(ok)), f"{out['turns_failed']} ({reasons})" if out["turns_failed"] else "0",
        str(out["turns_lost"]), f"{out['tax_ms_p50'] or 0:.1f}", f"{out['tax_ms_p99'] or 0:.1f}",
    )  # fmt: skip
    con = Console(width=130)
    con.print(t)
    con.print(f"run ended: {ended}; broker restart: {out['broker_restart']}; wall {wall:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    tune_for_runs()  # the collector settings the CLI runs with (voicepipe.clock.gc)
    asyncio.run(main())
