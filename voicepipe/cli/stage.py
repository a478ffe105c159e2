"""``voicepipe stage``: serve some stages of a run in this process; the rest, and the client, run elsewhere.

Needs a broker URL and the shared run token (:func:`voicepipe.stages.guard.require_shared_token`). It joins
the instance the run announces (:mod:`voicepipe.bus.instance`, verified with the token), serves it until it
is over, then waits for the next start of the same run id; stops on Ctrl-C or SIGTERM. A broker that cannot
be reached is one error line, exit 2.

Real engines: ``--audio real`` (the same engines as ``run --audio real``), ``--engine`` for the one
speech stage named (``asr``: pocketsphinx or a speech endpoint; ``tts``: espeak-ng or an endpoint; either
implies ``--audio real``) and ``--vad`` for the ASR's VAD (the VAD runs inside the ASR stage: the endpoint
decision needs its output and the decoder's hypothesis frame by frame). ``--vad`` alone never brings in the
real recogniser: it is the VAD-only ASR, a real VAD endpointing the caller's audio for the script
recogniser (:mod:`voicepipe.audio.vad_asr`), the mix ``run`` has with ``--set client.voice=espeak-ng
--set vad.engine=silero``. Replicas: ``--replicas N`` plans N processes, each serving one replica of every
stage named (:func:`~voicepipe.bus.partition.plan_workers`: sessions partitioned by rendezvous hashing);
``--serve I,J`` runs only those of the N here (the others on other hosts, same run id, config and token).
Serving several, this command starts one child process per replica set (itself, with ``--serve I``) and
stops them on Ctrl-C or SIGTERM. The run says how many it expects:
``run --external asr:N``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Annotated

import typer

from voicepipe.audio.engines import REAL_AUDIO_SETS, check_engines
from voicepipe.bus.partition import REPLICATED, plan_workers
from voicepipe.cli.common import err, run_error, safe_url, stage_names, user_errors
from voicepipe.cli.options import ConfigOpt, SetOpt, broker_block
from voicepipe.config import BrokerOverrides, PipelineConfig, load_config
from voicepipe.errors import UserError, check_run_id
from voicepipe.modelled import require_keys
from voicepipe.stages.guard import require_shared_token
from voicepipe.workers import run_live_loop, serve_stages, until_signalled

ENGINE_FIELDS = {"asr": "asr.engine", "tts": "tts.engine"}
AUDIO_CALLER = "espeak-ng"  # the run's caller speaks audio (a real VAD hears it), as --audio real has it


def engine_sets(names: list[str], audio: str, engine: str | None, vad: str | None) -> list[str]:
    """The ``--set``s that ``--audio``, ``--engine`` and ``--vad`` stand for (before the user's own).
    ``--audio real`` and ``--engine`` are every engine of ``run --audio real`` (the one named replacing
    its own); ``--vad`` alone is that VAD and an audio caller, the ASR's recogniser left as the config has
    it (``model``: the VAD-only ASR and its script recogniser, :mod:`voicepipe.audio.vad_asr`)."""
    if audio not in ("model", "real"):
        raise UserError("--audio", f"{audio!r}: expected model or real")
    sets: list[str] = []
    if audio == "real" or (engine not in (None, "model")):
        sets += REAL_AUDIO_SETS  # a real engine listens to (or speaks) real audio: the run's must be real too
    elif vad not in (None, "model"):  # a real VAD alone hears the caller's audio, for the script recogniser
        sets.append(f"client.voice={AUDIO_CALLER}")
    if engine is not None:
        speech = [n for n in names if n in ENGINE_FIELDS]
        if len(speech) != 1:
            raise UserError("--engine", "names the engine of one speech stage: serve asr or tts (not both), "
                            "or give --set asr.engine=... --set tts.engine=...")  # fmt: skip
        sets.append(f"{ENGINE_FIELDS[speech[0]]}={json.dumps(engine)}")
    if vad is not None:
        if "asr" not in names:
            raise UserError("--vad", "the VAD runs inside the ASR stage: serve asr")
        sets.append(f"vad.engine={json.dumps(vad)}")
    return sets


def serve_indices(raw: str | None, replicas: int) -> list[int]:
    if raw is None:
        return list(range(replicas))
    try:
        got = sorted({int(x) for x in raw.split(",") if x.strip()})
    except ValueError:
        raise UserError("--serve", f"{raw!r}: expected replica numbers like 0,1") from None
    if not got or got[0] < 0 or got[-1] >= replicas:
        raise UserError(
            "--serve", f"{raw!r}: replica numbers run from 0 to {replicas - 1} (--replicas {replicas})"
        )
    return got


@broker_block
def stage(
    names: Annotated[list[str], typer.Argument(help="Stages to serve: asr router agent cache council tts.")],
    run_id: Annotated[str, typer.Option("--run-id", help="The run to serve (same as `run --run-id`).")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    broker: BrokerOverrides = BrokerOverrides(),
    audio: Annotated[
        str, typer.Option("--audio", help="model or real: the same as the run's `--audio` (real engines).")
    ] = "model",
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine",
            help="The speech stage's engine: asr pocketsphinx|URL, tts espeak-ng|URL (implies --audio real).",
        ),
    ] = None,
    vad: Annotated[
        str | None,
        typer.Option(
            "--vad",
            help="The ASR stage's VAD: silero or webrtc. Alone, it endpoints the caller's audio for the "
            "script recogniser (a modelled ASR), as `run --set client.voice=espeak-ng --set "
            "vad.engine=silero`; the real recogniser is --engine pocketsphinx (or --audio real).",
        ),
    ] = None,
    replicas: Annotated[
        int,
        typer.Option(
            "--replicas",
            min=1,
            max=64,
            help="Replicas of each stage named (sessions split among them); "
            "the run expects them with --external NAME:N.",
        ),
    ] = 1,
    serve: Annotated[
        str | None,
        typer.Option("--serve", metavar="I,J", help="Which of the --replicas to run here (default: all)."),
    ] = None,
) -> None:
    """Serve some stages of a run in this process (the rest, and the client, run elsewhere).

    Same broker, run id and config as the `voicepipe run ... --external NAMES` that plays the scenario;
    all processes must share one host clock (CLOCK_MONOTONIC). Stops on Ctrl-C or SIGTERM.
    """
    with user_errors():
        chosen = stage_names(names, "stage")
        sets = [*engine_sets(chosen, audio, engine, vad), *(set_ or [])]
        cfg = load_config(config, sets, broker)
        require_keys(cfg, str(config) if config else "")
        if cfg.real_stages:
            check_engines(cfg.vad.engine, cfg.asr.engine, cfg.tts.engine, "model", "voicepipe stage")
        check_run_id(run_id)
        if not cfg.broker.url:
            raise UserError("--broker", "stages in separate processes need a broker URL")
        require_shared_token("voicepipe stage")
        single = [n for n in chosen if n not in REPLICATED]
        if replicas > 1 and single:
            raise UserError(
                "--replicas", f"{', '.join(single)}: one instance per run (state across sessions)"
            )
        plan = plan_workers(chosen, replicas)
        mine = serve_indices(serve, replicas)
    if len(mine) > 1:
        raise typer.Exit(_supervise(mine))
    reps = plan[mine[0]]
    planned = [r for p in plan for r in p]
    shown = chosen if replicas == 1 else reps  # one replica each: the stages by name
    err.print(f"serving {', '.join(shown)} for run {run_id} on {safe_url(cfg.broker.url)}", highlight=False)
    try:
        run_live_loop(until_signalled(_follow(cfg, chosen, run_id, reps, planned)))
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        failure = run_error(cfg, exc)
        if failure is None:
            raise
        raise failure from None


def _without_serve(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--serve":
            skip = True
        elif not a.startswith("--serve="):
            out.append(a)
    return out


def _supervise(indices: list[int]) -> int:
    """One child process (this command, ``--serve I``) per replica set; Ctrl-C or SIGTERM stops them all.
    Exit code: 0 when all stopped cleanly, else the first non-zero one."""
    base = [sys.executable, "-m", "voicepipe.cli", *_without_serve(sys.argv[1:])]
    procs = [subprocess.Popen([*base, "--serve", str(i)]) for i in indices]
    stopping = False

    def stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s, h in old.items():
            signal.signal(s, h)
    codes = [p.returncode for p in procs]
    if not stopping:  # a child ended by itself: say which, and with what
        for i, c in zip(indices, codes, strict=True):
            err.print(f"replica set {i} exited with code {c}", highlight=False)
    return next((c for c in codes if c not in (0, -signal.SIGTERM)), 0)


async def _follow(
    cfg: PipelineConfig, names: list[str], run_id: str, reps: list[str], planned: list[str]
) -> None:
    """Serve each start of run ``run_id`` in turn (each with its own instance key)."""
    while True:
        await serve_stages(cfg, names, run_id, replicas=reps, planned=planned)
