"""What the Ray executor costs next to the local fork pool, on this machine, and when it pays.

Starts a Ray head on loopback (``ray start --head --block``, ``--num-cpus`` = this box's CPUs, token auth,
no dashboard) and reaches it as ``capacity`` would over Ray client (``--executor ray://127.0.0.1:PORT``).
Measures, wall seconds (perf_counter) after a warm-up map that starts the Ray workers:

* connect: ``executor_for("ray://...")`` (``ray.init`` with the voicepipe package shipped as py_modules);
* per-item overhead: ``map`` of a no-op over ``--items`` items, Ray and the local fork pool, divided by
  the item count (the fork pool's includes its fork);
* a capacity sweep, ``--sessions`` levels of one configuration: the local fork pool (the box's CPUs) vs
  Ray, and that the levels are equal (wall/CPU seconds aside).

Break-even (model, stated in the output): Ray pays when the cluster has more CPUs than this box and each
item runs long against the per-item overhead: wall ≈ ceil(items / cpus) x item seconds (+ overhead per item
spread over the cpus, + connect once). Writes JSON.

    python bench/ray_overhead.py [--sessions 20,40,80,160] [--items 200] [--out bench/results/ray-overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchinfo import code_rev, machine

from voicepipe.capacity import LevelJob, Load, conversation_s, level_batch
from voicepipe.config import load_config
from voicepipe.executors import executor_for
from voicepipe.parallel import LocalExecutor, default_workers
from voicepipe.scenario import load_scenario


def _noop(x: int, _report) -> int:
    return x


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _levels(executor, jobs) -> tuple[list[dict], float]:
    t = time.perf_counter()
    with level_batch(jobs, executor) as batch:
        levels = batch.results()
    return [{**lv.to_json(), "wall_s": 0, "cpu_s": 0} for lv in levels], time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="cafe-order")
    ap.add_argument("--backend", default="h100-sxm/llama-3.1-8b")
    ap.add_argument("--sessions", default="20,40,80,160")
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("bench/results/ray-overhead.json"))
    args = ap.parse_args()
    cpus = default_workers()
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0")
    tmp = Path(tempfile.mkdtemp(prefix="vp-ray-", dir="/tmp"))
    gcs, client = _port(), _port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    exe = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    head = subprocess.Popen(
        [exe, "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
         "--include-dashboard=false", f"--ray-client-server-port={client}", f"--temp-dir={tmp}",
         "--disable-usage-stats"],
        stdout=(tmp / "head.log").open("w"), stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        for _ in range(300):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", client)) == 0:
                    break
            time.sleep(0.3)
        cfg = load_config(None, [f"agent.backend={args.backend}"])
        sc = load_scenario(args.scenario)
        d = conversation_s(cfg, [sc])
        loads = [int(x) for x in args.sessions.split(",")]
        jobs = [LevelJob(args.backend, cfg, (sc,), Load("sessions", n), d) for n in loads]
        per_item = {}
        # the fork pool first: forking once the Ray client's gRPC threads run is what the CLI never does
        local = LocalExecutor(cpus)
        t = time.perf_counter()
        assert local.map(_noop, list(range(args.items))) == list(range(args.items))
        per_item["local"] = (time.perf_counter() - t) / args.items
        here, local_s = _levels(local, jobs)
        t = time.perf_counter()
        ray = executor_for(f"ray://127.0.0.1:{client}")
        connect_s = time.perf_counter() - t
        t = time.perf_counter()
        ray.map(_noop, list(range(2 * cpus)))  # warm-up: the workers start and import voicepipe
        warm_s = time.perf_counter() - t
        t = time.perf_counter()
        assert ray.map(_noop, list(range(args.items))) == list(range(args.items))
        per_item["ray"] = (time.perf_counter() - t) / args.items
        there, ray_s = _levels(ray, jobs)
        ray.close()
    finally:
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
    turns = sum(lv["played_turns"] for lv in here)
    out = {
        "code": code_rev(), "machine": machine(), "cpus_used": cpus, "ray_mode": "client (ray://) to a loopback head",
        "connect_s": connect_s, "first_map_s": warm_s, "per_item_s": per_item, "items": args.items,
        "capacity": {"scenario": args.scenario, "backend": args.backend, "sessions": loads, "turns": turns,
                     "local_fork_pool_s": local_s, "ray_s": ray_s, "equal": here == there},
        "load_avg": os.getloadavg(),
        "note": "wall seconds (perf_counter) on a shared box; Ray pays when items run long against per_item_s "
                "and the cluster has more CPUs than this machine",
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
