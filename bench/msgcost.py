"""CPU µs per bus message: what voicepipe's own process spends per MQTT message it sends or receives.

Measured, not modelled. Spawns a mosquitto (``set_tcp_nodelay true``, ``sys_interval 1``) on a free port and
runs two workloads in this process, timing the process's CPU (``time.process_time``: user + system, all
threads) over each:

* ``bus``      — the bare message path: a publisher stage's bus sends N typed envelopes (a one-word ``user.utterance`` with
                 one span) to a subscriber stage's bus that parses them; nothing else runs.
* ``pipeline`` — the live pipeline: S sessions of a scenario through every stage on the broker.

Messages are counted by the broker itself (``$SYS/broker/publish/messages/received`` + ``.../sent``: every
PUBLISH a client of ours sent or got), so the count does not depend on the code under test. µs/message =
CPU µs / (published + delivered); µs/published = CPU µs / published (the broker's ``received``), the measure
that stays comparable when the fan-out changes (stages of a process sharing one connection receive one copy
of a message several of them subscribe to: fewer deliveries, the same work). mosquitto's own CPU is not
included (another process).

Only public entry points are used (``MqttBus``, ``run_pipeline``, ``Mosquitto``), so the same file measures an
older checkout: ``PYTHONPATH=/path/to/old/checkout python bench/msgcost.py --label first-wave``.
``--loop asyncio|uvloop`` picks the event loop (default: uvloop where installed, like ``voicepipe run``).
It also times the envelope codec (pydantic-core's JSON vs orjson + validation, when orjson is installed): the
reason the wire path stays on pydantic-core.

    python bench/msgcost.py [--messages 4000] [--sessions 50] [--scenario rapid-fire] [--label NAME]
    python bench/msgcost.py --against /tmp/first-wave --against-code a2788ef --rounds 3

``--against DIR`` (a checkout, e.g. ``git archive a2788ef voicepipe scenarios | tar -x -C DIR``) runs
rounds of this checkout and that one one after the other, each in a fresh process, and prints the medians
and their ratio to bench/results/msgcost.json: on a shared machine the load drifts between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from benchinfo import code_rev

try:
    from voicepipe.bus.brokers import Mosquitto
    from voicepipe.bus.mqtt import BrokerAddress, MqttBus
except ImportError:  # a checkout from before the bus package (--against an older one)
    from voicepipe.brokers import Mosquitto  # type: ignore[no-redef]

    from voicepipe.bus import BrokerAddress, MqttBus  # type: ignore[no-redef,attr-defined]
from voicepipe.clock.gc import tune_for_runs
from voicepipe.config import PipelineConfig, load_config
from voicepipe.messages import Envelope, Span, UserUtterance, UserWord
from voicepipe.runner import run_pipeline
from voicepipe.scenario import Scenario, load_scenario


class CountingMosquitto(Mosquitto):
    """A spawned mosquitto that publishes its $SYS counters every second."""

    def config_text(self, workdir: Path) -> str:
        return super().config_text(workdir) + "sys_interval 1\n"


async def broker_counts(addr: BrokerAddress) -> tuple[int, int]:
    """(PUBLISH packets the broker received, and sent) so far (its $SYS counters, refreshed each second)."""
    want = ("$SYS/broker/publish/messages/received", "$SYS/broker/publish/messages/sent")
    got: dict[str, int] = {}
    async with addr.client(identifier=f"msgcost-sys-{time.monotonic_ns():x}") as c:
        for t in want:
            await c.subscribe(t, qos=0)
        async with asyncio.timeout(5):
            async for m in c.messages:
                got[str(m.topic)] = int(bytes(m.payload))
                if len(got) == len(want):
                    break
    return got[want[0]], got[want[1]]


async def counted(addr: BrokerAddress, work: Callable[[], Awaitable[None]]) -> tuple[float, int, int]:
    """(CPU seconds of this process during ``work``, PUBLISH packets the broker saw meanwhile (received plus
    sent), of which received: the messages our clients published)."""
    await asyncio.sleep(2.2)  # the counters include everything sent before
    r0, s0 = await broker_counts(addr)
    cpu0 = time.process_time()
    await work()
    cpu = time.process_time() - cpu0
    await asyncio.sleep(2.2)  # two $SYS periods: the counters include the last message
    r1, s1 = await broker_counts(addr)
    # the count's own subscription messages (2 before, 2 after) are subtracted: the broker sent them
    return cpu, (r1 - r0) + (s1 - s0) - 2 - 2, r1 - r0


async def bus_only(addr: BrokerAddress, n: int) -> None:
    run = f"mc{time.monotonic_ns() % 10**6:x}"
    pub, sub = MqttBus(addr, run, "client"), MqttBus(addr, run, "asr")
    async with pub, sub:
        await sub.subscribe("user/utterance")
        got = 0
        done = asyncio.Event()

        async def receive() -> None:
            nonlocal got
            async for _ch, env in sub.messages():
                assert env.payload.words[0].index >= 0
                got += 1
                if got >= n:
                    done.set()
                    return

        task = asyncio.create_task(receive())
        await asyncio.sleep(0.05)
        for i in range(n):
            word = UserUtterance(
                words=[
                    UserWord(text="minutes", dur_ns=300_000_000, index=0, pause_before=False, last_word=True)
                ]
            )
            span = Span(stage="transport", what="uplink", start_ns=time.monotonic_ns(), dur_ns=114_000_000)
            await pub.publish(Envelope.of(word, run, f"s{i % 50}", i // 50, [span]))
            if i % 20 == 19:
                await asyncio.sleep(0.001)  # paced in bursts of 20, as sessions publish
        await asyncio.wait_for(done.wait(), 60)
        with contextlib.suppress(asyncio.CancelledError):
            task.cancel()
            await task


async def pipeline(cfg: PipelineConfig, scenario: Scenario, sessions: int) -> dict[str, float]:
    res = await run_pipeline(cfg, [scenario], sessions)
    tax = sorted(r.tax_ms for r in res.records if r.tax_ms is not None)
    ok = sum(r.status == "ok" for r in res.records)
    return {"turns": len(res.records), "ok": ok, "tax_p50_ms": tax[len(tax) // 2] if tax else float("nan")}


def codec_us(n: int = 20000) -> dict[str, float]:
    """µs per call of the envelope codec choices for a one-word ``user.utterance`` with one span (timeit, this process)."""
    import timeit

    from voicepipe.messages import parse

    word = UserUtterance(
        words=[UserWord(text="minutes", dur_ns=300_000_000, index=0, pause_before=False, last_word=True)]
    )
    span = Span(stage="transport", what="uplink", start_ns=123_456_789, dur_ns=114_000_000)
    env = Envelope.of(word, "run1", "s1", 2, [span])
    body = env.to_bytes()
    out = {
        "encode pydantic-core to_json": timeit.timeit(env.to_bytes, number=n) / n * 1e6,
        "decode+validate pydantic-core validate_json": timeit.timeit(lambda: parse(body), number=n) / n * 1e6,
    }
    try:
        import orjson
    except ImportError:
        return out
    from voicepipe.messages import _WIRE

    out["encode orjson(model_dump)"] = (
        timeit.timeit(lambda: orjson.dumps(env.model_dump()), number=n) / n * 1e6
    )
    out["decode+validate orjson.loads + validate_python"] = (
        timeit.timeit(lambda: _WIRE.validate_python(orjson.loads(body)), number=n) / n * 1e6
    )
    return out


async def main(args: argparse.Namespace) -> dict[str, object]:
    with CountingMosquitto() as mq:
        addr = BrokerAddress.parse(mq.url)
        await bus_only(addr, 200)  # warm-up: imports, first connections
        cpu_b, n_b, pub_b = await counted(addr, lambda: bus_only(addr, args.messages))
        pipe: dict[str, float] = {}

        cfg = load_config(
            None,
            [
                "client.playout=first_audio",
                f"client.start_spread_ms={args.spread_ms}",
                "broker.probe=false",
                *([f"broker.protocol={args.protocol}"] if args.protocol else []),
            ],
            broker=mq.url,
        )
        scenario = load_scenario(args.scenario)

        async def play() -> None:
            pipe.update(await pipeline(cfg, scenario, args.sessions))

        cpu_p, n_p, pub_p = await counted(addr, play)
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    return {
        "what": "CPU µs of the voicepipe process per MQTT PUBLISH it sent or received (broker $SYS counts), "
        "spawned nodelay mosquitto, measured with time.process_time",
        "label": args.label,
        "code": code_rev(),
        "loop": loop,
        "machine": platform.platform(),
        "python": platform.python_version(),
        "bus": {
            "messages": n_b,
            "published": pub_b,
            "cpu_s": cpu_b,
            "us_per_message": cpu_b * 1e6 / max(1, n_b),
            "us_per_published": cpu_b * 1e6 / max(1, pub_b),
        },
        "pipeline": {
            "scenario": args.scenario,
            "sessions": args.sessions,
            "start_spread_ms": args.spread_ms,
            **pipe,
            "messages": n_p,
            "published": pub_p,
            "cpu_s": cpu_p,
            "us_per_message": cpu_p * 1e6 / max(1, n_p),
            # fan-out free: a process that receives one copy for several stages has fewer messages per turn
            "us_per_published": cpu_p * 1e6 / max(1, pub_p),
            "ms_per_turn": cpu_p * 1e3 / max(1, pipe.get("turns", 0)),
        },
    }


def run_on(loop_kind: str, args: argparse.Namespace) -> dict[str, object]:
    if loop_kind == "uvloop":
        import uvloop

        return uvloop.run(main(args))
    return asyncio.run(main(args))


def interleaved(args: argparse.Namespace) -> None:
    """Rounds of (this checkout, the one at ``--against``) one after the other, each in a fresh process:
    on a shared box the load drifts, so the ratio is taken from runs that saw the same load."""
    import statistics
    import tempfile

    here = Path(__file__).resolve()
    runs: dict[str, list[dict]] = {"current": [], "against": []}
    load0 = os.getloadavg()[0]
    common = ["--messages", str(args.messages), "--sessions", str(args.sessions), "--scenario", args.scenario,
              "--spread-ms", str(args.spread_ms), "--no-codec"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for who in ("current", "against"):
                out = Path(tmp) / f"{who}-{r}.json"
                env = dict(os.environ)
                cmd = [sys.executable, str(here), *common, "--out", str(out), "--label", who]
                if who == "against":
                    env["PYTHONPATH"] = str(args.against)
                    cmd += ["--loop", args.against_loop]
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
                runs[who].append(json.loads(out.read_text()))
                last = runs[who][-1]
                print(f"round {r + 1}/{args.rounds} {who}: bus {last['bus']['us_per_message']:.1f}"
                      f" µs/msg, pipeline {last['pipeline']['us_per_message']:.1f} µs/msg, "
                      f"{last['pipeline']['us_per_published']:.0f} µs/published")  # fmt: skip
    summary: dict[str, object] = {
        "what": "CPU µs per MQTT PUBLISH sent or received (broker $SYS counts), and per PUBLISH our clients "
        "sent (us_per_published: the same work whatever the fan-out), medians of interleaved rounds, each in "
        "a fresh process, spawned nodelay mosquitto; time.process_time",
        "load_avg_1m_before_after": [load0, os.getloadavg()[0]],
        "machine": platform.platform(),
        "rounds": args.rounds,
        "current": {"code": runs["current"][0]["code"], "loop": runs["current"][0]["loop"]},
        "against": {"code": args.against_code or str(args.against), "loop": args.against_loop},
    }
    print(f"CPU per bus message, median of {args.rounds} interleaved rounds (measured)")
    print(f"{'workload':<40} {'against':>9} {'current':>9} {'ratio':>6}")
    for key, name in (("bus", "bus only"), ("pipeline", f"pipeline {args.scenario} x{args.sessions}")):
        summary[key] = {}
        for measure, unit in (("us_per_message", "µs/msg"), ("us_per_published", "µs/published")):
            old = statistics.median(x[key][measure] for x in runs["against"])
            new = statistics.median(x[key][measure] for x in runs["current"])
            summary[key] |= {  # type: ignore[operator]
                f"against_{measure}": old,
                f"current_{measure}": new,
                f"ratio_{measure}": old / new,
                f"rounds_against_{measure}": [x[key][measure] for x in runs["against"]],
                f"rounds_current_{measure}": [x[key][measure] for x in runs["current"]],
            }
            print(f"{name + ', ' + unit:<40} {old:>9.1f} {new:>9.1f} {old / new:>5.2f}x")
    summary["codec_us"] = codec_us()
    dest = args.out or Path("bench/results/msgcost.json")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(summary, indent=2))
    print(f"wrote {dest}")


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=4000, help="envelopes in the bus-only workload")
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--scenario", default="rapid-fire")
    ap.add_argument("--spread-ms", type=float, default=1000.0)
    ap.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    ap.add_argument("--protocol", default=None, help="broker.protocol for the pipeline (default: its own)")
    ap.add_argument("--label", default="current")
    ap.add_argument("--no-codec", action="store_true", help="skip the codec micro-benchmark (old checkouts)")
    ap.add_argument("--code", default=None, help="what code was measured (default: git HEAD of voicepipe)")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/msgcost-LABEL.json")
    ap.add_argument("--compare", type=Path, default=None, help="an earlier result JSON to print beside")
    ap.add_argument("--against", type=Path, default=None, help="an older checkout: interleaved rounds vs it")
    ap.add_argument("--against-loop", default="asyncio", help="event loop for the older checkout")
    ap.add_argument("--against-code", default=None, help="what the older checkout is (for the JSON)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.against:
        interleaved(args)
        return
    kind = args.loop
    if kind == "auto":
        try:
            import uvloop  # noqa: F401

            kind = "uvloop"
        except ImportError:
            kind = "asyncio"
    out = run_on(kind, args)
    if args.code:
        out["code"] = args.code
    rows = [("bus only", "bus"), (f"pipeline {args.scenario} x{args.sessions}", "pipeline")]
    old = json.loads(args.compare.read_text()) if args.compare else None
    head = f"{'workload':<30} {'messages':>9} {'CPU s':>7} {'µs/msg':>8} {'µs/published':>13}"
    if old:
        head += f" {'µs/msg ' + str(old['label'])[:12]:>20} {'ratio':>6}"
    print(f"CPU per bus message — {out['label']} ({out['code']}, {out['loop']} loop), measured")
    print(head)
    for name, key in rows:
        r = out[key]
        line = f"{name:<30} {r['messages']:>9} {r['cpu_s']:>7.2f} {r['us_per_message']:>8.1f}"
        line += f" {r['us_per_published']:>13.1f}"
        if old:
            o = old[key]["us_per_message"]
            line += f" {o:>20.1f} {o / r['us_per_message']:>5.1f}x"
        print(line)
    p = out["pipeline"]
    print(f"pipeline: {p['ok']}/{p['turns']} turns ok, tax p50 {p['tax_p50_ms']:.1f} ms")
    if not args.no_codec:
        out["codec_us"] = codec_us()
        print("envelope codec, µs per call (timeit):")
        for name, us in out["codec_us"].items():
            print(f"  {name:<48} {us:6.1f}")
    dest = args.out or Path(f"bench/results/msgcost-{args.label}.json")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2))
    print(f"wrote {dest}")


if __name__ == "__main__":
    tune_for_runs()  # the collector settings the CLI runs with (voicepipe.clock.gc)
    cli()
