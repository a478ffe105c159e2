"""The shared device's serving simulation alone: CPU seconds of a closed loop on virtual time.

``clients`` users each send ``requests`` requests back to back (:func:`voicepipe.hardware.serving.closed_loop`)
on one ``DeviceServer`` per backend; the fastest of ``--repeat`` runs (process_time) is kept, with the
engine events it took and its aggregate tok/s (the simulated figure: a change that moves it moved the
physics, not only the speed). No bus, no stages: what the engine's event step and projections cost, which
is a share of every turn on a shared GPU (docs/performance.md). Prints a table and writes JSON.

    python bench/engine_events.py [--backends h100-sxm/llama-3.1-8b,...] [--clients 128] [--requests 20]

An older checkout is measured by putting it first on the path (``PYTHONPATH=/tmp/old``; ``--label``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchinfo import code_rev, machine
from rich.console import Console
from rich.table import Table

from voicepipe.backends.hardware import make_hardware_backend
from voicepipe.hardware.serving import closed_loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="h100-sxm/llama-3.1-8b,cerebras-wse3/llama-3.1-8b,h100-sxm/llama-3.1-70b")
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench/results/engine-events.json"))
    ap.add_argument("--label", default=None, help="what code was measured (default: git HEAD)")
    a = ap.parse_args()
    rows = []
    for spec in a.backends.split(","):
        hw, model = spec.split("/")
        best = float("inf")
        result = None
        for _ in range(a.repeat):
            server = make_hardware_backend({"hardware": hw, "model": model, "max_batch": 64}).server
            t = time.process_time()
            result = closed_loop(server, a.clients, a.requests, a.prompt, a.output)
            best = min(best, time.process_time() - t)
        assert result is not None
        rows.append({"backend": spec, "cpu_s": round(best, 4), "requests": result.requests,
                     "aggregate_tok_s": round(result.aggregate_tokens_per_s, 3)})  # fmt: skip
    table = Table(title=f"engine closed loop: {a.clients} clients x {a.requests} requests, {a.prompt}/{a.output}")
    for col in ("backend", "CPU s (fastest)", "requests", "aggregate tok/s (simulated)"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for r in rows:
        table.add_row(r["backend"], f"{r['cpu_s']:.3f}", str(r["requests"]), f"{r['aggregate_tok_s']:,.1f}")
    Console().print(table)
    out = {"label": a.label or code_rev(), "machine": machine(), "clients": a.clients, "requests": a.requests,
           "prompt": a.prompt, "output": a.output, "repeat": a.repeat, "rows": rows}  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
