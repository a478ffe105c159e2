"""Fingerprint of what virtual runs simulate: a hash of every record over scenarios x configs x backends.

For speed work that must not change any simulated number: run it on the code before and after a change and
compare the totals (a line per case shows which one moved). Covers every scenario in ``scenarios/`` under
the default config and each config in ``scenarios/configs/``, for an empirical and a hardware-modelled
backend, at 1 and 7 sessions, plus 60 sessions of two scenarios on one shared device with zero hops, 1 ms
hops, and a tap (every message built). A record is hashed as its JSON without ``run`` and
``clock_offset_ns`` (wall-clock facts, not simulated ones).

    python bench/fingerprint.py [-v]
    PYTHONPATH=/tmp/old python bench/fingerprint.py [-v]   # an older checkout (git archive REV voicepipe scenarios)
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from voicepipe.config import load_config
from voicepipe.runner import simulate
from voicepipe.runresult import RunResult
from voicepipe.scenario import load_scenario

BACKENDS = ("groq-llama-3.1-8b", "h100-sxm/llama-3.1-8b")


def digest(res: RunResult) -> str:
    h = hashlib.sha256()
    for r in sorted(res.records, key=lambda r: (r.session, r.turn)):
        d = r.model_dump(mode="json", exclude={"run", "clock_offset_ns"})
        h.update(json.dumps(d, sort_keys=True).encode())
    h.update(repr((res.stage_errors, res.deadletters, res.open_tasks_after, len(res.records))).encode())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-v", action="store_true", help="a line per case")
    args = ap.parse_args()
    scenarios = sorted(Path("scenarios").glob("*.yaml"))
    configs: list[Path | None] = [None, *sorted(Path("scenarios/configs").glob("*.yaml"))]
    total = hashlib.sha256()

    def add(name: str, res: RunResult) -> None:
        d = digest(res)
        total.update(bytes.fromhex(d))
        if args.v:
            print(f"{d[:12]} {len(res.records):4d} records  {name}")

    for c in configs:
        for b in BACKENDS:
            cfg = load_config(str(c) if c else None, [f"agent.backend={b}"])
            for s in scenarios:
                for n in (1, 7):
                    add(
                        f"{c.name if c else 'default'} {b} {s.name} x{n}",
                        simulate(cfg, [load_scenario(str(s))], n),
                    )
    shared = [load_scenario("cafe-order"), load_scenario("support-call")]
    for b in BACKENDS:
        cfg = load_config(None, [f"agent.backend={b}"])
        for label, kw in (
            ("", {}),
            ("1 ms hops", {"hop_ns": 1_000_000}),
            ("tap", {"tap": lambda ch, e: None}),
        ):
            add(f"shared {b} x60 {label}", simulate(cfg, shared, 60, **kw))
    print("TOTAL", total.hexdigest())


if __name__ == "__main__":
    main()
