"""Predictor throughput: configuration × turn evaluations per second through predict_grid (numpy).

Builds a grid of configurations (backends × silence thresholds × TTS latencies) over a scenario, times
predict_grid, prints a table and writes JSON. The goal is >= 10,000 evaluations per second.

    python bench/predict_throughput.py [--scenario support-call] [--out bench/results/predict.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from voicepipe.config import load_config
from voicepipe.predict import Predictor, predict_grid
from voicepipe.scenario import load_scenario

BACKENDS = ["sonnet-gpu", "groq-llama-3.1-8b", "cerebras-llama-3.1-8b", "h100-sxm/llama-3.1-70b",
            "cerebras-wse3/llama-3.1-8b", "groq-lpu/llama-3.1-70b"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="support-call")
    ap.add_argument("--out", type=Path, default=Path("bench/results/predict.json"))
    args = ap.parse_args()
    sc = load_scenario(args.scenario)
    cfgs = [
        load_config(
            None,
            [
                f"agent.backend={b}",
                f"asr.silence_ms={s}",
                f"tts.ttfb_ms.median={m}",
                f"tts.ttfb_ms.p90={m * 1.4}",
            ],
        )
        for b in BACKENDS
        for s in range(100, 700, 25)
        for m in (75, 120, 188, 264, 313)
    ]
    predict_grid(cfgs[:2], sc)  # warm the backend and draw caches once
    t0 = time.perf_counter()
    grid = predict_grid(cfgs, sc)
    grid_s = time.perf_counter() - t0
    evals = grid.size
    t0 = time.perf_counter()
    for cfg in cfgs[:60]:
        Predictor(cfg).scenario(sc)
    scalar_rate = 60 * len(sc.turns) / (time.perf_counter() - t0)
    out = {
        "what": "predict_grid evaluations (configuration x turn) per second",
        "machine": platform.platform(),
        "scenario": args.scenario,
        "configs": len(cfgs),
        "turns": len(sc.turns),
        "evaluations": evals,
        "seconds": grid_s,
        "evaluations_per_s": evals / grid_s,
        "scalar_predictor_evaluations_per_s": scalar_rate,
    }
    t = Table(title=f"predictor throughput — {args.scenario}, measured")
    t.add_column("path")
    t.add_column("evaluations/s", justify="right")
    t.add_row(
        f"predict_grid ({len(cfgs)} configs × {len(sc.turns)} turns)", f"{out['evaluations_per_s']:,.0f}"
    )
    t.add_row("Predictor.scenario (full chain, one config at a time)", f"{scalar_rate:,.0f}")
    Console().print(t)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
