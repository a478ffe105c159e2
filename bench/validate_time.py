"""What `hardware validate` costs when nothing is kept: CPU and wall seconds of the whole hold-out.

One run of :func:`voicepipe.hardware.validate.fit.held_out` (every published point: the fit on all of them,
then each publisher family refitted without its points and its points run through the serving engine), in
this process, the disk cache bypassed. The default test run pays this once (the suite shares one kept
answer), and so does a user's first `hardware validate` after an install or upgrade. Also recorded: the
summary lines, so a change that moved a number (not only the time) shows here. Prints a table and writes
JSON.

    python bench/validate_time.py [--out bench/results/validate-time.json] [--label NAME]

An older checkout is measured by putting it first on the path: ``git archive REV voicepipe scenarios |
tar -x -C /tmp/old && PYTHONPATH=/tmp/old python bench/validate_time.py --label REV``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchinfo import code_rev, machine
from rich.console import Console
from rich.table import Table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/validate-time.json")
    ap.add_argument("--label", default=None, help="names the measured checkout in the JSON (default: git rev)")
    args = ap.parse_args()
    os.environ["VOICEPIPE_CACHE_DIR"] = "off"  # nothing kept: the whole computation
    load_before = os.getloadavg()[0]
    from voicepipe.hardware.validate.fit import held_out, summary_lines  # imported after the switch

    cpu0, wall0 = time.process_time(), time.perf_counter()
    rep = held_out()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    lines = summary_lines(rep)
    out = {
        "label": args.label or code_rev(),
        "machine": machine(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "points": len(rep.rows),
        "cpu_s": round(cpu, 2),
        "wall_s": round(wall, 2),
        "summary": lines,
    }
    table = Table(title="hardware validate, nothing kept (held_out)")
    for col in ("points", "CPU s", "wall s", "load before / after"):
        table.add_column(col, justify="right")
    table.add_row(str(out["points"]), f"{cpu:.1f}", f"{wall:.1f}", f"{load_before:.1f} / {out['load_after']:.1f}")
    Console().print(table)
    for line in lines:
        print(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
