"""Hostile files: how long each command takes to reject each of the ~140 files in tests/hostile.py
(scenarios and configs; JSON model configs and vLLM results through ``predict`` and ``profile import``).

Two measurements, because the goal ("one line, exit 2, within a second") is what a user sees:

* in process (typer's CliRunner, the click command built once): the checking cost alone, for every file ×
  every command that reads it (run, compare, predict, stage);
* real processes (``python -m voicepipe.cli``): wall time including interpreter start and imports, for the
  slowest few files of the in-process pass, with ``predict`` (config) and ``run`` (scenario), and for
  ``/dev/zero``, a FIFO and a 200,000-deep JSON as a model's config.json.

It also times ``predict`` on a reply at the text bound (limits.MAX_TEXT characters, no punctuation — the
quadratic case of TTS clause chunking; at the fastest speaking rate, so it is also inside the bound on
speech) to show what the bound buys. Prints a table, writes JSON.

    python bench/bad_files.py [--out bench/results/bad_files.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer.main
import typer.testing
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.hostile import ALL_CONFIGS, ALL_SCENARIOS, JSON_FILES, Hostile
from voicepipe.cli import app
from voicepipe.config import load_config
from voicepipe.limits import MAX_TEXT, MAX_WPM
from voicepipe.predict import predict
from voicepipe.scenario import Scenario, Turn

NO_BROKER = {"VOICEPIPE_BROKER": "mqtt://127.0.0.1:9"}
HUNG = ("char-device", "fifo", "deep-200k")  # model files timed in real processes too


def commands(kind: str, f: str) -> dict[str, list[str]]:
    if kind == "json":  # a model's config.json (through a config) and a vLLM result for `profile import`
        c = Path(f).parent / "model-config.yaml"
        c.write_text(f"agent:\n  backend: {{hardware: h100-sxm, model: '{f}'}}\n")
        return {
            "predict": ["predict", "cafe-order", "--config", str(c)],
            "profile import": ["profile", "import", f, "--out", str(Path(f).parent / "out.yaml")],
        }
    if kind == "config":
        return {
            "run": ["run", "cafe-order", "--config", f, "-q"],
            "compare": ["compare", "cafe-order", "--config", f, "--vary", "router.cache_first=false,true"],
            "predict": ["predict", "cafe-order", "--config", f],
            "stage": ["stage", "asr", "--run-id", "t", "--config", f],
        }
    return {
        "run": ["run", f, "-q"],
        "compare": ["compare", f, "--vary", "seed=1,2"],
        "predict": ["predict", f],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/bad_files.json"))
    args = ap.parse_args()
    load_before = round(os.getloadavg()[0], 2)
    command = typer.main.get_command(app)
    typer.testing._get_command = lambda _app: command  # build the click command once
    runner = typer.testing.CliRunner()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, corpus in (("config", ALL_CONFIGS), ("scenario", ALL_SCENARIOS), ("json", JSON_FILES)):
            for h in corpus:
                d = Path(tmp) / f"{kind}-{h.name}"
                d.mkdir()
                path = Hostile.write(h, d)
                for cmd, argv in commands(kind, str(path)).items():
                    t0 = time.perf_counter()
                    res = runner.invoke(app, argv, env=NO_BROKER)
                    ms = (time.perf_counter() - t0) * 1e3
                    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
                    rows.append(
                        {"kind": kind, "file": h.name, "command": cmd, "ms": round(ms, 2), "exit": res.exit_code,
                         "one_line": len(lines) == 1, "path": str(path)}
                    )  # fmt: skip
        worst: dict[tuple[str, str], dict] = {}
        for r in sorted(rows, key=lambda r: -r["ms"]):
            worst.setdefault((r["kind"], r["file"]), r)
        slowest = [r for r in worst.values() if r["kind"] != "json"][:4]
        procs = []
        for r in slowest:
            argv = (
                ["predict", "cafe-order", "--config", r["path"]]
                if r["kind"] == "config"
                else ["run", r["path"]]
            )
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "voicepipe.cli", *argv], capture_output=True, text=True,
                               timeout=120, env={**NO_BROKER, "PATH": "/usr/bin:/bin"})  # fmt: skip
            procs.append(
                {"kind": r["kind"], "file": r["file"], "command": argv[0], "exit": p.returncode,
                 "wall_s": round(time.perf_counter() - t0, 3), "traceback": "Traceback" in p.stderr}
            )  # fmt: skip

        # the model files that used to hang (/dev/zero grew to GBs, a FIFO blocked) or print a traceback
        for r in rows:
            if r["kind"] == "json" and r["command"] == "predict" and r["file"] in HUNG:
                t0 = time.perf_counter()
                p = subprocess.run([sys.executable, "-m", "voicepipe.cli", *commands("json", r["path"])["predict"]],
                                   capture_output=True, text=True, timeout=120, env={**NO_BROKER, "PATH": "/usr/bin:/bin"})  # fmt: skip
                procs.append(
                    {"kind": "model json", "file": r["file"], "command": "predict", "exit": p.returncode,
                     "wall_s": round(time.perf_counter() - t0, 3), "traceback": "Traceback" in p.stderr}
                )  # fmt: skip

        floor = []  # the same start-up with no file at all: interpreter + imports
        for argv in (["predict", "--help"], ["run", "--help"]):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "voicepipe.cli", *argv], capture_output=True, timeout=120)
            floor.append({"command": " ".join(argv), "wall_s": round(time.perf_counter() - t0, 3)})

    # at the fastest voice the config allows, so this reply (12 minutes at the default 165 wpm) is inside
    # the bound on speech (voicepipe.limits.MAX_SPEECH_MS) and predict really runs it
    cfg = load_config(None, [f"tts.words_per_minute={MAX_WPM:g}"])
    words = MAX_TEXT // 5
    sc = Scenario(name="bound", turns=[Turn(user="hi there", reply=" ".join(["word"] * words))])
    t0 = time.perf_counter()
    predict(cfg, [sc], 1)
    bound_s = time.perf_counter() - t0

    con = Console()
    t = Table(title="hostile files: in-process rejection time per command (CliRunner)", title_justify="left")
    for c in ("kind", "command", "files", "exit 2 + one line", "p50 ms", "max ms", "slowest file"):
        t.add_column(c, justify="right" if c not in ("kind", "command", "slowest file") else "left")
    summary = []
    for kind in ("config", "scenario", "json"):
        for cmd in ("run", "compare", "predict", "stage", "profile import"):
            rs = [r for r in rows if r["kind"] == kind and r["command"] == cmd]
            if not rs:
                continue
            ok = sum(r["exit"] == 2 and r["one_line"] for r in rs)
            worst = max(rs, key=lambda r: r["ms"])
            p50 = statistics.median(r["ms"] for r in rs)
            summary.append({"kind": kind, "command": cmd, "files": len(rs), "ok": ok, "p50_ms": p50,
                            "max_ms": worst["ms"], "slowest": worst["file"]})  # fmt: skip
            t.add_row(
                kind, cmd, str(len(rs)), f"{ok}/{len(rs)}", f"{p50:.1f}", f"{worst['ms']:.1f}", worst["file"]
            )
    con.print(f"load average (1 min) before the run: {load_before} on {os.cpu_count()} CPUs")
    con.print(t)
    t2 = Table(
        title="real processes (python -m voicepipe.cli): wall time incl. start-up", title_justify="left"
    )
    for c in ("file", "command", "exit", "wall s", "traceback"):
        t2.add_column(c)
    for p in procs:
        t2.add_row(p["file"], p["command"], str(p["exit"]), f"{p['wall_s']:.2f}", str(p["traceback"]))
    for f in floor:
        t2.add_row("(none: start-up floor)", f["command"], "0", f"{f['wall_s']:.2f}", "-")
    con.print(t2)
    con.print(f"predict, one reply at the text bound ({MAX_TEXT:,} chars, {words:,} words, no punctuation): "
              f"{bound_s:.2f} s")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"machine": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
             "load_average_1m_before": load_before, "summary": summary,
             "processes": procs, "startup_floor": floor, "predict_at_text_bound_s": round(bound_s, 3), "text_bound_chars": MAX_TEXT,
             "rows": [{k: v for k, v in r.items() if k != "path"} for r in rows]},
            indent=1,
        )
    )  # fmt: skip
    con.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
