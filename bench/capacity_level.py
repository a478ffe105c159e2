"""CPU cost of single capacity levels: one backend at one load, in this process, on virtual time.

`voicepipe capacity` runs each (configuration, load) level as one job; the heaviest levels decide how long a
sweep takes. This runs :func:`voicepipe.capacity.run_level` for every backend x session count, one after
another in this process (after the backend's one-session conversation length, as `capacity` computes it),
and records CPU seconds (process_time: steadier than wall on a shared box), the CPU seconds of it spent in
the cyclic garbage collector (timed by a ``gc.callbacks`` hook; the collector's memory walks are what an
instruction count misses), wall seconds, the turns played
and counted, the level's p90 and the busiest device's mean requests in flight. Prints a table and writes
JSON. A saturated GPU level is where the shared device's serving simulation used to dominate.

    python bench/capacity_level.py [--scenario cafe-order] [--sessions 1000,2000]
        [--backends h100-sxm/llama-3.1-8b,cerebras-wse3/llama-3.1-8b] [--out bench/results/capacity-levels.json]

An older checkout is measured by putting it first on the path (``--label`` names it), as in
bench/predict_throughput.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

from benchinfo import code_rev, machine
from rich.console import Console
from rich.table import Table

import voicepipe
from voicepipe.capacity import Load, conversation_s, run_level
from voicepipe.clock.gc import tune_for_runs
from voicepipe.config import load_config
from voicepipe.scenario import load_scenario


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="cafe-order")
    ap.add_argument("--sessions", default="1000,2000")
    ap.add_argument("--backends", default="h100-sxm/llama-3.1-8b,cerebras-wse3/llama-3.1-8b")
    ap.add_argument("--out", type=Path, default=Path("bench/results/capacity-levels.json"))
    ap.add_argument("--label", default=None, help="what code was measured (default: git HEAD)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    in_gc = [0.0, 0.0]  # CPU s in collections, start of the current one

    def gc_timer(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            in_gc[1] = time.process_time()
        else:
            in_gc[0] += time.process_time() - in_gc[1]

    gc.callbacks.append(gc_timer)
    scs = [load_scenario(args.scenario)]
    rows = []
    for backend in args.backends.split(","):
        cfg = load_config(None, [f"agent.backend={backend}"])
        conv = conversation_s(cfg, scs)
        for n in (int(x) for x in args.sessions.split(",")):
            wall, cpu, in_gc[0] = time.perf_counter(), time.process_time(), 0.0
            level = run_level(backend, cfg, scs, Load("sessions", n), conv_s=conv)
            d = level.to_json()
            rows.append({"backend": backend, "sessions": n, "cpu_s": time.process_time() - cpu,
                         "gc_cpu_s": in_gc[0],
                         "wall_s": time.perf_counter() - wall, "turns_counted": d["turns"],
                         "turns_played": d["played_turns"], "p90_ms": d["p90_ms"],
                         "in_flight": max((x["in_flight"] for x in d["devices"]), default=0.0)})  # fmt: skip
            print(rows[-1], flush=True)
    out = {
        "what": "CPU and wall seconds of one capacity level (run_level), in one process, on virtual time",
        "code": args.label or code_rev(),
        "voicepipe": str(Path(voicepipe.__file__).parent),
        "scenario": args.scenario,
        "rows": rows,
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    t = Table(title=f"capacity levels — {args.scenario}, measured CPU ({out['code']})")
    for h in ("backend", "sessions", "CPU s", "in GC s", "wall s", "turns counted", "p90 ms", "in flight"):
        t.add_column(h, justify="left" if h == "backend" else "right")
    for r in rows:
        t.add_row(r["backend"], str(r["sessions"]), f"{r['cpu_s']:.1f}", f"{r['gc_cpu_s']:.2f}", f"{r['wall_s']:.1f}",
                  f"{r['turns_counted']:,}", f"{r['p90_ms']:,.0f}", f"{r['in_flight']:.0f}")  # fmt: skip
    Console().print(t)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    tune_for_runs()  # the collector settings the CLI runs with (voicepipe.clock.gc)
    main()
