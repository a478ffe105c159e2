"""Virtual-time throughput: full-chain turn evaluations per second (predict / capacity engine).

Runs a scenario through the live stages on the in-memory bus and the virtual clock (voicepipe.runner.
simulate) for a few backends and session counts, times each with perf_counter (wall clock, this process,
after one warm-up run), prints a table and writes JSON. The issue's goal is >= 2,000 turns per second on
a 2-core box. ``--profile`` adds the top functions by own time (cProfile) to the JSON.

    python bench/predict_throughput.py [--scenario support-call] [--sessions 1,50,200] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from voicepipe.config import load_config
from voicepipe.runner import simulate
from voicepipe.scenario import load_scenario

BACKENDS = ["groq-llama-3.1-8b", "h100-sxm/llama-3.1-8b"]
GOAL = 2000.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="support-call")
    ap.add_argument("--sessions", default="1,50,200")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/results/predict.json"))
    args = ap.parse_args()
    sc = load_scenario(args.scenario)
    rows = []
    for backend in BACKENDS:
        cfg = load_config(None, [f"agent.backend={backend}"])
        simulate(cfg, [sc], 1)  # warm: imports, backend tables
        for n in (int(x) for x in args.sessions.split(",")):
            t0, c0 = time.perf_counter(), time.process_time()
            res = simulate(cfg, [sc], n)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            turns = len(res.records)
            rows.append({"backend": backend, "sessions": n, "turns": turns, "wall_s": wall, "cpu_s": cpu,
                         "turns_per_s": turns / wall, "turns_per_cpu_s": turns / cpu,
                         "stage_errors": res.stage_errors})  # fmt: skip
    top: list[str] = []
    if args.profile:
        cfg = load_config(None, [f"agent.backend={BACKENDS[0]}"])
        prof = cProfile.Profile()
        prof.enable()
        simulate(cfg, [sc], 50)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        top = [line.strip() for line in buf.getvalue().splitlines() if "(" in line and "/" in line][:15]
    out = {
        "what": "full-chain turn evaluations per second on virtual time (live stages, in-memory bus)",
        "measured": "runner.simulate in one process after a warm-up run: wall clock (perf_counter) and this "
        "process's CPU time (process_time; steadier on a shared box)",
        "scenario": args.scenario,
        "goal_turns_per_s": GOAL,
        "rows": rows,
        "profile_top_tottime": top,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    t = Table(title=f"virtual-time throughput — {args.scenario}, measured (goal ≥ {GOAL:,.0f} turns/s)")
    for h in ("backend", "sessions", "turns", "wall s", "turns/s", "CPU s", "turns/CPU s"):
        t.add_column(h, justify="left" if h == "backend" else "right")
    for r in rows:
        t.add_row(
            r["backend"],
            str(r["sessions"]),
            str(r["turns"]),
            f"{r['wall_s']:.2f}",
            f"{r['turns_per_s']:,.0f}",
            f"{r['cpu_s']:.2f}",
            f"{r['turns_per_cpu_s']:,.0f}",
        )
    Console().print(t)
    for line in top:
        print(line)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
