"""Pipeline tax vs the raw bus: how much does voicepipe itself add on top of MQTT hops?

Spawns a mosquitto (set_tcp_nodelay true) on a free port, measures the raw aiomqtt one-way hop
(publisher -> broker -> subscriber, QoS 1, timestamps on one monotonic clock), then runs a scenario
through the pipeline on the same broker and prints the tax (measured - predicted per turn) p50/p99 and
its ratio to the hop. Writes the numbers as JSON.

    python bench/tax.py [--scenario cafe-order] [--sessions 1] [--out bench/results/tax.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import struct
import time
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


async def one_way_hops(url: str, n: int = 500) -> list[float]:
    addr = BrokerAddress.parse(url)
    got: list[float] = []
    async with addr.client(identifier="bench-pub") as pub, addr.client(identifier="bench-sub") as sub:
        await sub.subscribe("bench/hop", qos=1)
        done = asyncio.Event()

        async def recv() -> None:
            async for m in sub.messages:
                (t0,) = struct.unpack("q", bytes(m.payload)[:8])
                got.append((time.monotonic_ns() - t0) / 1e6)
                if len(got) >= n:
                    done.set()
                    return

        task = asyncio.create_task(recv())
        await asyncio.sleep(0.1)
        for _ in range(n):
            await pub.publish("bench/hop", struct.pack("q", time.monotonic_ns()) + b"x" * 200, qos=1)
            await asyncio.sleep(0.002)  # paced: latency, not throughput
        await asyncio.wait_for(done.wait(), 30)
        task.cancel()
    return got


def pct(v: list[float], q: float) -> float:
    return float(np.percentile(v, q))


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="cafe-order")
    ap.add_argument("--sessions", type=int, default=1)
    ap.add_argument("--backend", default="cerebras-llama-3.1-8b")
    ap.add_argument("--spread-ms", type=float, default=0.0, help="spread session starts over this window")
    ap.add_argument("--out", type=Path, default=Path("bench/results/tax.json"))
    args = ap.parse_args()
    with Mosquitto() as mq:
        hops = await one_way_hops(mq.url)
        cfg = load_config(
            None,
            [
                "client.playout=first_audio",
                f"agent.backend={args.backend}",
                f"client.start_spread_ms={args.spread_ms}",
            ],
            broker=mq.url,
        )
        res = await run_pipeline(cfg, [load_scenario(args.scenario)], args.sessions)
    tax = [r.tax_ms for r in res.records if r.tax_ms is not None]
    bus = [sum(p.ms for p in r.breakdown if p.stage == "bus") for r in res.records if r.measured_ms]
    hop50 = statistics.median(hops)
    out = {
        "what": "pipeline tax (measured - predicted per turn) vs raw aiomqtt one-way hop, mosquitto nodelay",
        "machine": platform.platform(),
        "scenario": args.scenario,
        "sessions": args.sessions,
        "start_spread_ms": args.spread_ms,
        "turns": len(res.records),
        "hop_ms": {"p50": hop50, "p99": pct(hops, 99), "n": len(hops)},
        "tax_ms": {"p50": pct(tax, 50), "p99": pct(tax, 99), "max": max(tax)},
        "bus_part_ms_p50": pct(bus, 50),
        "tax_over_hop_p50": pct(tax, 50) / hop50,
        "hops_on_chain": 5,
    }
    t = Table(title=f"pipeline tax vs bus hop — {args.scenario}, {args.sessions} session(s), measured")
    for c in ("metric", "p50 ms", "p99 ms"):
        t.add_column(c, justify="right" if c != "metric" else "left")
    t.add_row("raw aiomqtt one-way hop (QoS 1)", f"{hop50:.3f}", f"{out['hop_ms']['p99']:.3f}")
    t.add_row("pipeline tax per turn", f"{out['tax_ms']['p50']:.3f}", f"{out['tax_ms']['p99']:.3f}")
    t.add_row("tax / hop", f"{out['tax_over_hop_p50']:.1f}x", "")
    Console().print(t)
    Console().print(
        f"[dim]{len(res.records)} turns; the chain crosses the bus 5 times (client→asr→router→agent→tts→client)[/]"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    tune_for_runs()  # the collector settings the CLI runs with (voicepipe.clock.gc)
    asyncio.run(main())
