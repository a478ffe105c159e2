"""Scale: sessions x worker processes on a spawned nodelay mosquitto — turns, tax, hop and CPU per message.

For each (sessions, workers) cell: a fresh mosquitto (``set_tcp_nodelay true``, ``max_queued_messages``
100000), the scenario played by ``sessions`` concurrent sessions whose starts are spread ``--spread-ms``
per session (the issue's "20 ms per session"), stages in ``workers`` processes (0: all in this process).
Measured in the same run:

* turns expected (sessions x scenario turns) / completed (status ok) / failed (with their reasons) / lost
  (expected but never recorded — must be 0);
* tax p50/p99: measured voice-to-voice minus modelled spans, per completed turn (the client's clock);
* hop p50: a raw aiomqtt QoS 1 one-way hop (publisher -> broker -> subscriber, one monotonic clock),
  sampled every 100 ms *during* the run on the same broker — what one bus crossing costs under that load;
* loop lag p99/max: the run process's own event-loop lag (``RunResult.lag``); past 5 ms p99 the tax includes
  the tool's own scheduling delay (``load_too_high``);
* CPU us per message: CPU seconds of every voicepipe process (this one: ``time.process_time``; the workers:
  their heartbeats) plus mosquitto's (``/proc/PID/stat``) from the moment every stage is up (start-up
  excluded) to the end, over the messages the stages published (the hop samples count as messages too).

    python bench/scale.py [--quick] [--sessions 50,100] [--workers 0,1,2] [--out bench/results/scale.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import struct
import time
from collections import Counter
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from voicepipe.bus.brokers import Mosquitto
from voicepipe.bus.mqtt import BrokerAddress
from voicepipe.clock.gc import tune_for_runs
from voicepipe.config import load_config
from voicepipe.runner import run_pipeline
from voicepipe.scenario import load_scenario
from voicepipe.workers import run_live_loop

TICKS = os.sysconf("SC_CLK_TCK")
HOP_EVERY_S = 0.1  # hop samples while the run goes on: few enough not to load the run they measure


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def hops_during(url: str, stop: asyncio.Event, out: list[float]) -> None:
    """One-way QoS 1 hops every 20 ms until ``stop`` (timestamps on this process's monotonic clock)."""
    addr = BrokerAddress.parse(url)
    async with addr.client(identifier="scale-hop-pub") as pub, addr.client(identifier="scale-hop-sub") as sub:
        await sub.subscribe("bench/hop", qos=1)

        async def recv() -> None:
            async for m in sub.messages:
                (t0,) = struct.unpack("q", bytes(m.payload)[:8])
                out.append((time.monotonic_ns() - t0) / 1e6)

        task = asyncio.create_task(recv())
        while not stop.is_set():
            await pub.publish("bench/hop", struct.pack("q", time.monotonic_ns()) + b"x" * 200, qos=1)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HOP_EVERY_S)
        await asyncio.sleep(0.2)
        task.cancel()


def pct(v: list[float], q: float) -> float | None:
    return float(np.percentile(v, q)) if v else None


async def cell(scenario: str, sessions: int, workers: int, spread_ms: float, backend: str) -> dict:
    sc = load_scenario(scenario)
    expected = sessions * len(sc.turns)
    load0 = os.getloadavg()[0]
    with Mosquitto() as mq:
        cfg = load_config(
            None,
            [
                "client.playout=first_audio",
                f"agent.backend={backend}",
                f"client.start_spread_ms={spread_ms * sessions}",
            ],
            broker=mq.url,
        )
        stop = asyncio.Event()
        hops: list[float] = []
        t0 = time.monotonic()
        base: list[float] = []  # CPU (this process, mosquitto) once every stage is up: start-up excluded

        def ready(_r: object) -> None:
            base.extend([time.process_time(), proc_cpu_s(mq.pid() or 0)])

        hop_task = asyncio.create_task(hops_during(mq.url, stop, hops))
        error = None
        try:
            res = await run_pipeline(cfg, [sc], sessions, workers=workers, ready_timeout_s=60, on_ready=ready)
        except Exception as exc:  # a cell that breaks is reported, not hidden
            res, error = None, f"{type(exc).__name__}: {exc}"
        stop.set()
        await hop_task
        wall = time.monotonic() - t0
        cpu0, mq0 = base or [time.process_time(), proc_cpu_s(mq.pid() or 0)]
        cpu_here = time.process_time() - cpu0
        cpu_broker = proc_cpu_s(mq.pid() or 0) - mq0
    records = res.records if res else []
    ok = [r for r in records if r.status == "ok"]
    tax = [r.tax_ms for r in ok if r.tax_ms is not None]
    published = (res.local_published + res.remote_published + len(hops)) if res else 0
    cpu_total = cpu_here + (res.remote_cpu_s if res else 0.0) + cpu_broker
    return {
        "sessions": sessions,
        "workers": workers,
        "turns_expected": expected,
        "turns_completed": len(ok),
        "turns_failed": len(records) - len(ok),
        "failed_reasons": dict(Counter(r.error or r.status for r in records if r.status != "ok")),
        "turns_lost": expected - len(records),
        "premature_endpoints": sum(1 for r in ok if r.premature_endpoint),
        # the run process's own event-loop lag: past its trust line the tax includes the tool's own delay
        "loop_lag_ms_p99": res.lag.p99_ms if res and res.lag else None,
        "loop_lag_ms_max": res.lag.max_ms if res and res.lag else None,
        "load_too_high": res.lag.overloaded if res and res.lag else None,
        "tax_ms_p50": pct(tax, 50),
        "tax_ms_p99": pct(tax, 99),
        "hop_ms_p50": pct(hops, 50),
        "hop_ms_p99": pct(hops, 99),
        "hop_samples": len(hops),
        "messages_published": published,
        "messages_skipped_by_replicas": res.remote_skipped if res else 0,
        "cpu_s": {
            "run_process": cpu_here,
            "workers": res.remote_cpu_s if res else 0.0,
            "mosquitto": cpu_broker,
        },
        "cpu_us_per_message": cpu_total / published * 1e6 if published else None,
        "wall_s": wall,
        "load_avg_1m_before_after": [load0, os.getloadavg()[0]],  # the box is shared: other work competes
        "deaths": res.deaths if res else [],
        "error": error,
    }


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "—" if v is None else format(v, spec)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="rapid-fire")
    ap.add_argument("--sessions", default="50,100,200,500,1000")
    ap.add_argument(
        "--workers", default="0,1,2,4", help="worker processes (0: all stages in the run process)"
    )
    ap.add_argument("--quick", action="store_true", help="a subset: sessions 50,200 x workers 0,2")
    ap.add_argument("--spread-ms", type=float, default=20.0, help="start spread per session")
    ap.add_argument("--backend", default="cerebras-llama-3.1-8b")
    ap.add_argument("--out", type=Path, default=Path("bench/results/scale.json"))
    ap.add_argument(
        "--loop", choices=("auto", "asyncio"), default="auto",
        help="event loop of the run process: uvloop where installed, like `voicepipe run` (auto), or asyncio's",
    )  # fmt: skip
    return ap.parse_args()


async def main(args: argparse.Namespace) -> None:
    sessions = [50, 200] if args.quick else [int(x) for x in args.sessions.split(",")]
    workers = [0, 2] if args.quick else [int(x) for x in args.workers.split(",")]
    rows: list[dict] = []
    con = Console(width=130)
    out = {
        "what": "scale: sessions x worker processes, rapid-fire, spawned nodelay mosquitto (measured)",
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "scenario": args.scenario,
        "spread_ms_per_session": args.spread_ms,
        "backend": args.backend,
        "loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for n in sessions:
        for w in workers:
            con.print(f"[dim]{n} sessions, {w} workers ...[/]")
            rows.append(await cell(args.scenario, n, w, args.spread_ms, args.backend))
            args.out.write_text(
                json.dumps(out, indent=2)
            )  # after every cell: a long grid keeps what it measured
            r = rows[-1]
            con.print(
                f"[dim]  {r['turns_completed']}/{r['turns_expected']} ok, lost {r['turns_lost']}, "
                f"tax p99 {fmt(r['tax_ms_p99'])} ms, loop lag p99 {fmt(r['loop_lag_ms_p99'])} ms, "
                f"{fmt(r['cpu_us_per_message'], '.0f')} us/msg, "
                f"{r['wall_s']:.0f} s, load {r['load_avg_1m_before_after'][0]:.1f}{', ' + r['error'] if r['error'] else ''}[/]"
            )
    t = Table(
        title=f"scale — {args.scenario}, starts {args.spread_ms:g} ms apart, spawned nodelay mosquitto, measured"
    )
    for c in ("sessions", "workers", "expected", "completed", "failed", "lost", "tax p50", "tax p99", "hop p50",
              "lag p99", "CPU µs/msg"):  # fmt: skip
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(
            str(r["sessions"]), str(r["workers"]), str(r["turns_expected"]), str(r["turns_completed"]),
            str(r["turns_failed"]), str(r["turns_lost"]), fmt(r["tax_ms_p50"]), fmt(r["tax_ms_p99"]),
            fmt(r["hop_ms_p50"], ".2f"), fmt(r["loop_lag_ms_p99"]), fmt(r["cpu_us_per_message"], ".0f"),
        )  # fmt: skip
    con.print(t)
    con.print(
        "[dim]tax = measured - modelled per completed turn (ms, client clock); hop = raw aiomqtt QoS 1 one-way "
        "hop sampled during the run; lag = the run process's event-loop lag (ms; past 5 ms p99 the run says "
        "LOAD TOO HIGH); CPU = all voicepipe processes + mosquitto over messages published[/]"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    tune_for_runs()  # the collector settings the CLI runs with (voicepipe.clock.gc)
    a = parse_args()
    # the run process's event loop as `voicepipe run` picks it (the workers pick theirs: workers.worker_entry)
    (asyncio.run if a.loop == "asyncio" else run_live_loop)(main(a))
