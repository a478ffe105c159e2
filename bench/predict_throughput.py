"""Virtual-time throughput: full-chain turn evaluations per second (predict / capacity engine).

Runs a scenario through the live stages on the in-memory bus and the virtual clock (voicepipe.runner.
simulate) for a few backends and session counts, after one warm-up run, ``--repeat`` times each, and keeps
the fastest: CPU seconds of this process (process_time) and wall seconds (perf_counter). Then the largest
run once per worker process at the same time (voicepipe.parallel.ForkPool, ``--workers``, default the
CPUs): turns per wall second of the whole machine, as ``capacity`` uses it. The box's load average before
and after is recorded: on a shared machine wall (and, less so, CPU) seconds grow with the other load.
Prints a table and writes JSON. The issue's goal is >= 2,000 turns per second on a 2-core box.
``--profile`` adds the top functions by own time (cProfile) to the JSON.

    python bench/predict_throughput.py [--scenario support-call] [--sessions 1,50,200] [--repeat 3] [--profile]

An older checkout is measured the same way by putting it first on the path (``--label`` names it in the JSON):
``git archive df00153 voicepipe scenarios | tar -x -C /tmp/old && PYTHONPATH=/tmp/old python
bench/predict_throughput.py --label df00153 --out bench/results/predict-before-stagecpu.json``.
On a shared box the other load comes and goes over minutes, so two such runs one after the other can differ
by more than the change measured: ``--against DIR --rounds N`` runs N rounds of (that checkout, this one),
each in a fresh process, and keeps per row the fastest of all rounds for each side (other load only ever
slows a run down); ``--against-out`` gets the older checkout's JSON, ``--out`` this one's, each with every
round's numbers.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import time
from pathlib import Path

from benchinfo import code_rev, machine
from rich.console import Console
from rich.table import Table

import voicepipe
from voicepipe.clock.gc import tune_for_runs
from voicepipe.config import PipelineConfig, load_config
from voicepipe.parallel import ForkPool, default_workers
from voicepipe.runner import simulate
from voicepipe.scenario import load_scenario

BACKENDS = ["groq-llama-3.1-8b", "h100-sxm/llama-3.1-8b"]
GOAL = 2000.0


def _timed(job: tuple[PipelineConfig, str, int], _report: object = None) -> tuple[int, float, float]:
    """(turns, wall s, CPU s) of one simulate run."""
    cfg, scenario, n = job
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(cfg, [load_scenario(scenario)], n)
    if res.stage_errors:
        raise RuntimeError(f"{res.stage_errors} stage errors: {res.first_error}")
    return len(res.records), time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="support-call")
    ap.add_argument("--sessions", default="1,50,200")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=default_workers())
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/results/predict.json"))
    ap.add_argument("--label", default=None, help="what code was measured (default: git HEAD)")
    ap.add_argument("--against", type=Path, default=None, help="an older checkout: interleaved rounds vs it")
    ap.add_argument("--against-label", default=None, help="what the older checkout is (for its JSON)")
    ap.add_argument("--against-out", type=Path, default=Path("bench/results/predict-before.json"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.against is not None:
        interleaved(args)
        return
    load_before = os.getloadavg()
    sizes = [int(x) for x in args.sessions.split(",")]
    rows = []
    for backend in BACKENDS:
        cfg = load_config(None, [f"agent.backend={backend}"])
        _timed((cfg, args.scenario, 1))  # warm: imports, backend tables
        for n in sizes:
            runs = [_timed((cfg, args.scenario, n)) for _ in range(args.repeat)]
            turns = runs[0][0]
            wall, cpu = min(r[1] for r in runs), min(r[2] for r in runs)
            rows.append({"backend": backend, "sessions": n, "turns": turns, "wall_s": wall, "cpu_s": cpu,
                         "turns_per_s": turns / wall, "turns_per_cpu_s": turns / cpu,
                         "repeats": args.repeat})  # fmt: skip
    parallel = []
    for backend in BACKENDS:
        cfg = load_config(None, [f"agent.backend={backend}"])
        jobs = [(cfg, args.scenario, sizes[-1])] * args.workers
        t0 = time.perf_counter()
        with ForkPool(_timed, jobs, workers=args.workers) as pool:
            got = pool.results()
        wall = time.perf_counter() - t0
        turns = sum(g[0] for g in got)
        parallel.append({"backend": backend, "sessions": sizes[-1], "processes": args.workers, "turns": turns,
                         "wall_s": wall, "turns_per_s": turns / wall,
                         "cpu_s_per_process": [g[2] for g in got]})  # fmt: skip
    top: list[str] = []
    if args.profile:
        cfg = load_config(None, [f"agent.backend={BACKENDS[0]}"])
        prof = cProfile.Profile()
        prof.enable()
        simulate(cfg, [load_scenario(args.scenario)], 50)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        top = [line.strip() for line in buf.getvalue().splitlines() if "(" in line and "/" in line][:15]
    out = {
        "what": "full-chain turn evaluations per second on virtual time (live stages, in-memory bus)",
        "measured": "runner.simulate in one process after a warm-up run, fastest of `repeats`: wall clock "
        "(perf_counter) and this process's CPU time (process_time; steadier on a shared box); `parallel`: "
        "the largest run once per worker process at the same time (ForkPool), turns per wall second",
        "code": args.label or code_rev(),
        "voicepipe": str(Path(voicepipe.__file__).parent),
        "scenario": args.scenario,
        "goal_turns_per_s": GOAL,
        "rows": rows,
        "parallel": parallel,
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "profile_top_tottime": top,
        "machine": machine(),
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
    for r in parallel:
        print(
            f"{r['processes']} processes x {r['sessions']} sessions, {r['backend']}: {r['turns']} turns in "
            f"{r['wall_s']:.2f} s wall = {r['turns_per_s']:,.0f} turns/s"
        )
    print(
        f"load average (1 min) before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    for line in top:
        print(line)
    print(f"wrote {args.out}")


def interleaved(args: argparse.Namespace) -> None:
    """Rounds of (the checkout at ``--against``, this one), each a fresh run of this script; per row the
    fastest round of each side, and every round's numbers, go to ``--against-out`` and ``--out``."""
    import sys
    import tempfile

    sides = {
        "against": (args.against_out, args.against_label or str(args.against)),
        "current": (args.out, None),
    }
    runs: dict[str, list[dict]] = {who: [] for who in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for who, (_, label) in sides.items():
                out = Path(tmp) / f"{who}-{r}.json"
                cmd = [sys.executable, __file__, "--scenario", args.scenario, "--sessions", args.sessions,
                       "--repeat", str(args.repeat), "--workers", str(args.workers), "--out", str(out)]  # fmt: skip
                cmd += ["--label", label or args.label or code_rev()]
                if args.profile and r == args.rounds - 1:
                    cmd.append("--profile")
                env = dict(os.environ)
                if who == "against":
                    env["PYTHONPATH"] = str(args.against)
                print(f"round {r + 1}/{args.rounds}: {who}", flush=True)
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
                runs[who].append(json.loads(out.read_text()))
    best: dict[str, dict] = {}
    for who, (path, _) in sides.items():
        first = runs[who][-1]
        rows = []
        for i in range(len(first["rows"])):
            fastest = max((x["rows"][i] for x in runs[who]), key=lambda x: x["turns_per_cpu_s"])
            rows.append(
                {**fastest, "rounds_turns_per_cpu_s": [x["rows"][i]["turns_per_cpu_s"] for x in runs[who]]}
            )
        parallel = []
        for i in range(len(first["parallel"])):
            fastest = max((x["parallel"][i] for x in runs[who]), key=lambda x: x["turns_per_s"])
            parallel.append(
                {**fastest, "rounds_turns_per_s": [x["parallel"][i]["turns_per_s"] for x in runs[who]]}
            )
        best[who] = {
            **first,
            "measured": first["measured"]
            + f"; interleaved with the other checkout, {args.rounds} rounds: per row "
            "the fastest round (rounds_*: every round)",
            "rows": rows,
            "parallel": parallel,
            "load_average_1min": [x["load_average_1min"] for x in runs[who]],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(best[who], indent=2) + "\n")
    t = Table(
        title=f"virtual-time throughput — {args.scenario}, turns per CPU-second, fastest of {args.rounds} rounds"
    )
    for h in ("backend", "sessions", best["against"]["code"], best["current"]["code"], "ratio"):
        t.add_column(h, justify="left" if h == "backend" else "right")
    for old, new in zip(best["against"]["rows"], best["current"]["rows"], strict=True):
        t.add_row(old["backend"], str(old["sessions"]), f"{old['turns_per_cpu_s']:,.0f}",
                  f"{new['turns_per_cpu_s']:,.0f}", f"{new['turns_per_cpu_s'] / old['turns_per_cpu_s']:.2f}x")  # fmt: skip
    Console().print(t)
    for old, new in zip(best["against"]["parallel"], best["current"]["parallel"], strict=True):
        print(
            f"{new['processes']} processes x {new['sessions']} sessions, {new['backend']}: "
            f"{old['turns_per_s']:,.0f} -> {new['turns_per_s']:,.0f} turns per wall second"
        )
    print(f"wrote {args.against_out} and {args.out}")


if __name__ == "__main__":
    tune_for_runs()  # the collector settings the CLI runs with (voicepipe.clock.gc)
    main()
