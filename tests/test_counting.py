"""Count everything (issue 27 item 6): every refused delivery by reason — the bus's duplicate-id drops (exact
replays, tampered copies keeping the id) as well as the dead letters (unsigned, out of state) — reaches the
run's summary; and a turn during which the run's own event loop stalled, or a burst of refused messages
arrived, is marked not trusted with the reason, and counted."""

from __future__ import annotations

import asyncio
import json
import time

from tests.conftest import fast_config, tiny_scenario
from voicepipe.bus.instance import Follower
from voicepipe.bus.mqtt import BrokerAddress
from voicepipe.clock import now_ns
from voicepipe.measure import BURST_REFUSED, LAG_PERIOD_S, TAX_OUTLIER_MS, TURN_LAG_TRUST_MS, LagProbe
from voicepipe.messages import Cancel, CancelReason, Envelope
from voicepipe.runner import run_pipeline
from voicepipe.stages.guard import TOKEN_ENV, run_token, sign


# -- pure: which probe wake-ups belong to a turn ----------------------------------------------------------
def _probe(samples: list[tuple[int, float]], refused: list[int] | None = None, now: int = 0) -> LagProbe:
    counts = iter(refused or [])
    p = LagProbe(refused=(lambda: now) if refused is not None else None)
    p.woke_ns = [t for t, _ in samples]
    p.lags_ms = [lag for _, lag in samples]
    p.refused_at = [next(counts) for _ in samples] if refused is not None else []
    return p


def test_a_stall_whose_wait_overlaps_the_turn_distrusts_it_and_one_outside_does_not():
    t = now_ns()
    ms = 1_000_000
    period = int(LAG_PERIOD_S * 1e9)
    # a 100 ms stall that ended 50 ms into a turn [t, t + 200 ms]; wake-ups every 10 ms around it
    stall = [(t - 30 * ms, 0.5), (t + 50 * ms, 100.0 - LAG_PERIOD_S * 1e3), (t + 60 * ms, 0.4)]
    why = _probe(stall).distrust(t - 30 * ms + period // 2, t + 200 * ms)
    assert why.startswith("event-loop stall") and "90 ms late" in why
    # the same stall, 300 ms after the turn ended: not this turn's
    later = [(t - 30 * ms, 0.5), (t + 500 * ms, 90.0), (t + 510 * ms, 0.4)]
    assert _probe(later).distrust(t - 30 * ms, t + 200 * ms) == ""
    # lags under the per-turn bound: trusted
    calm = [(t + i * period, TURN_LAG_TRUST_MS / 2) for i in range(20)]
    assert _probe(calm).distrust(t, t + 15 * period) == ""


def test_a_wait_still_going_on_when_the_turn_is_recorded_counts_as_a_stall():
    t = now_ns()
    p = _probe([(t - 200_000_000, 0.3)])  # last wake-up 200 ms ago, before the turn ended: the loop is stuck
    assert p.distrust(t - 250_000_000, t - 100_000_000).startswith("event-loop stall")


def test_refused_messages_during_a_turn_past_the_bound_are_a_burst():
    t = now_ns()
    ms = 1_000_000
    samples = [(t + i * 10 * ms, 0.2) for i in range(10)]
    # 7 refused before the turn, BURST_REFUSED + 7 by the time it is recorded
    burst = _probe(samples, refused=[7] * 10, now=7 + BURST_REFUSED)
    assert burst.distrust(t + 35 * ms, t + 80 * ms) == f"message burst: {BURST_REFUSED} refused messages " \
        "arrived while the turn was in flight"
    few = _probe(samples, refused=[7] * 10, now=7 + BURST_REFUSED - 1)
    assert few.distrust(t + 35 * ms, t + 80 * ms) == ""


# -- live: a hostile burst, counted by reason, and the turns it hit ----------------------------------------
async def test_a_hostile_burst_is_counted_by_reason_in_the_summary_and_distrusts_its_turn(mosquitto, monkeypatch):
    """During turn 0: every asr.final is replayed as is and re-published tampered (same id, other text),
    1,000 unsigned cancels and 3 signed out-of-turn ones arrive. Each kind shows in the summary JSON under its
    reason; if the burst made that turn's tax an outlier, the turn is marked not trusted (a message burst).
    No turn's reply or status changes."""
    monkeypatch.setenv(TOKEN_ENV, "counting test token")  # the insider's messages are signed with it
    cfg = fast_config("client.turn_timeout_s=10", broker=mosquitto.url)
    addr = BrokerAddress.parse(mosquitto.url)
    run, sess = "cnt", "tiny-0"
    sent: list[int] = []

    def t(channel: str) -> str:
        return f"voicepipe/{run}/{sess}/{channel}"

    async def attack(_result) -> None:
        async with Follower(addr, run, run_token()) as f:  # an insider: holds the token, derives the key
            key = (await f.instance()).key
        async with addr.client() as c:
            await c.subscribe(t("asr/final"))
            async for m in c.messages:
                body = bytes(m.payload)
                env = json.loads(body)
                if env["turn"] != 0:
                    continue
                await c.publish(t("asr/final"), body, qos=1)  # an exact replay: the same envelope id
                env["payload"]["text"] = "TAMPERED"
                await c.publish(t("asr/final"), json.dumps(env).encode(), qos=1)  # tampered, same id
                forged = Cancel(reason=CancelReason.FAILED, error="forged")  # 1,000 envelopes and ids, no MAC
                unsigned = [Envelope.of(forged, run, sess, 0).to_bytes() for _ in range(1000)]
                await asyncio.gather(*(c.publish(t("control/cancel"), b, qos=1) for b in unsigned))
                for i in range(3):  # signed with the run's token, for a turn the session is far from
                    ahead = Envelope.of(Cancel(reason=CancelReason.HEARD), run, sess, 99)
                    ahead.src, ahead.seq = "client/insider", i
                    sign(ahead, key)
                    await c.publish(t("control/cancel"), ahead.to_bytes(), qos=1)
                sent.append(1)
                return

    tasks: list[asyncio.Task] = []
    res = await run_pipeline(cfg, [tiny_scenario(turns=3)], 1, run_id=run,
                             on_ready=lambda r: tasks.append(asyncio.create_task(attack(r))))  # fmt: skip
    await asyncio.gather(*tasks)
    assert sent == [1]
    assert [r.status for r in res.records] == ["ok"] * 3, [r.error for r in res.records]
    assert all("TAMPERED" not in r.transcript for r in res.records)
    summary = json.loads(json.dumps(res.summary_json()))  # what --summary-json writes
    bus = summary["bus"]
    refused = bus["refused"]
    # the exact replay of asr.final is a duplicate at each stage subscribed to it; the tampered copy fails
    # its whole-body MAC (checked before the id), like each unsigned cancel, at every stage it reached
    assert bus["duplicates"] >= 1 and refused["duplicate envelope id"] == bus["duplicates"], bus
    assert refused["unauthenticated"] >= 1001, refused
    # signed with the instance's key, for a turn the session is far from (or from a sender that never joined)
    assert refused.get("turn ahead", 0) + refused.get("not joined", 0) >= 3, refused
    assert sum(refused.values()) == sum(bus["dead_lettered"].values()) + bus["duplicates"]
    first = res.records[0]
    # the burst lands where it lands: checked during a long modelled sleep it delays nothing (a small tax,
    # trusted); if it made the turn's tax an outlier, the turn says so
    assert first.tax_ms is not None
    if first.tax_ms > TAX_OUTLIER_MS:
        assert not first.trusted and "message burst" in first.distrust, (first.tax_ms, first.distrust)
    trust = summary["trust"]
    assert trust["untrusted_turns"] == sum(not r.trusted for r in res.records)
    assert trust["burst_refused"] == BURST_REFUSED


async def test_a_stalled_event_loop_marks_the_turn_it_hit_not_trusted(monkeypatch):
    """A handler that blocks the run's event loop for 150 ms (time.sleep) on turn 1's final transcript: that
    turn is marked not trusted (an event-loop stall of about that size) and counted in the summary."""
    from voicepipe.stages.router import Router

    final = Router.final

    async def stalling(self, env: Envelope) -> None:
        if env.turn == 1:
            time.sleep(0.15)  # blocks the loop on purpose: the stall under test
        await final(self, env)

    monkeypatch.setattr(Router, "final", stalling)
    res = await run_pipeline(fast_config("client.turn_timeout_s=10"), [tiny_scenario(turns=3)], 1)
    assert [r.status for r in res.records] == ["ok"] * 3
    hit = res.records[1]
    assert hit.tax_ms is not None and hit.tax_ms > 100  # the stall was on the turn's chain
    assert not hit.trusted and hit.distrust.startswith("event-loop stall"), hit.distrust
    assert "(tax " in hit.distrust
    late_ms = float(hit.distrust.split("timers ran ", 1)[1].split(" ms", 1)[0])
    assert late_ms >= 100, hit.distrust
    assert res.summary_json()["trust"]["reasons"]["event-loop stall"] >= 1  # type: ignore[index]


def test_the_report_names_the_untrusted_turns_and_the_refusals_by_reason():
    from voicepipe.records import TurnRecord
    from voicepipe.report.html import render_html

    ok = TurnRecord(run="r", scenario="s", session="s-0", turn=0, measured_ms=500.0, tax_ms=10.0)
    hit = ok.model_copy(update={"turn": 1, "tax_ms": 300.0, "trusted": False,
                                "distrust": "event-loop stall: timers ran 290 ms late while the turn was in flight"})  # fmt: skip
    page = render_html({"cfg": [ok, hit]}, {"cfg": {}}, notes={"cfg": ["bus: 9 refused (7 unauthenticated)"]})
    assert "numbers NOT TRUSTED for 1 turn (1 event-loop stall)" in page and "s-0 turn 1" in page
    assert "bus: 9 refused (7 unauthenticated)" in page
    assert "NOT TRUSTED" not in render_html({"cfg": [ok]}, {"cfg": {}})


def test_the_untrusted_turns_line_joins_a_load_too_high_verdict_without_a_but_and_counts_turns_in_english():
    from voicepipe.cli.run import trust_line

    bad = "event-loop lag p99 6.1 ms: LOAD TOO HIGH — timers ran late"
    line = trust_line(bad, overloaded=True, untrusted=1, kinds="1 event-loop stall")
    assert line.startswith(f"{bad}; and NOT TRUSTED for 1 turn (1 event-loop stall): ") and "but" not in line
    good = "event-loop lag p99 1.0 ms: within the 5 ms p99 at which the numbers are trusted"
    line = trust_line(good, overloaded=False, untrusted=3, kinds="3 event-loop stall")
    assert line.startswith(f"{good} — but NOT TRUSTED for 3 turns (3 event-loop stall): ")
    assert trust_line(good, overloaded=False, untrusted=0, kinds="") == good
    assert trust_line("", overloaded=False, untrusted=2, kinds="2 x").startswith("NOT TRUSTED for 2 turns (2 x)")
