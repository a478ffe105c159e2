"""Shared-device simulation: virtual-time schedule, batching, queueing, fast mode, the backend contract."""

from __future__ import annotations

import asyncio
import itertools
import math

import numpy as np
import pytest

from voicepipe.backends import build_backend
from voicepipe.backends.base import LLMRequest, ScheduledStream
from voicepipe.backends.hardware import make_hardware_backend, modelled_prices
from voicepipe.clock import now_ns
from voicepipe.hardware.engine import _Curve
from voicepipe.hardware.model import mixed_step_s, request_overhead_s
from voicepipe.hardware.serving import DeviceServer, closed_loop

T0 = 10**12
RNG = np.random.default_rng(0)


def req(session: str = "s", prompt: int = 512, out: int = 64, cached: int = 0, turn: int = 0) -> LLMRequest:
    return LLMRequest(
        session=session, turn=turn, prompt_tokens=prompt, output_tokens=out, cached_prompt_tokens=cached
    )


SPECS = [
    "h100-sxm/llama-3.1-8b",
    "cerebras-wse3/llama-3.1-8b",
    "groq-lpu/llama-3.1-70b",
    {
        "hardware": "h200-sxm",
        "model": "llama-3.1-70b",
        "speculative": {"alpha": 0.8, "gamma": 4, "draft_cost": 0.05},
    },
    {"hardware": "b200", "model": "mixtral-8x7b", "fast": True},
]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("cached", [0, 400])
def test_lone_request_realises_its_prediction(spec, cached):
    b = make_hardware_backend(spec)
    r = req(cached=cached, out=80)
    timing = b.predict(r, RNG)
    ref = ScheduledStream(timing, T0)
    stream = b.server.open(r, T0)
    for i in (0, 1, 2, 17, 79):
        assert abs(stream.at_ns(i) - ref.at_ns(i)) <= 1000
    got, want = stream.spans(79), ref.spans(79)
    assert [s.what for s in got] == [s.what for s in want] == ["ttft", "decode"]
    for g, w in zip(got, want, strict=True):
        assert g.stage == "agent" and g.modelled
        assert abs(g.start_ns - w.start_ns) <= 1000 and abs(g.dur_ns - w.dur_ns) <= 1000


def test_prefix_cache_skips_prefill_and_can_be_disabled():
    b = make_hardware_backend("h100-sxm/llama-3.1-8b")
    assert (
        b.predict(req(prompt=4000, cached=3500), RNG).ttft_s < 0.3 * b.predict(req(prompt=4000), RNG).ttft_s
    )
    off = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "prompt_cache": False})
    assert off.predict(req(prompt=4000, cached=3500), RNG).ttft_s == off.predict(req(prompt=4000), RNG).ttft_s


def test_second_arrival_slows_the_first_but_keeps_its_past():
    b = make_hardware_backend("h100-sxm/llama-3.1-8b")
    s = b.server
    first = s.open(req("a", out=200), T0)
    before = [first.at_ns(i) for i in range(200)]
    arrive = before[50] + 1  # reaches the engine then; it was sent the stack's per-request cost earlier
    second = s.open(req("b", out=200), arrive - round(request_overhead_s(b.system) * 1e9))
    after = [first.at_ns(i) for i in range(200)]
    # produced before the arrival, and by the step running when it came: unchanged (the engine takes
    # the newcomer when that step ends, at token 51)
    assert after[:52] == before[:52]
    assert all(a > b for a, b in zip(after[53:], before[53:], strict=True))
    # the newcomer's prefill shares the next step: the first's token gap then exceeds a plain 2-sequence step
    gap_prefill = after[52] - after[51]
    plain_two = float(mixed_step_s(b.system, 2, 2 * 544.0)) * 1e9
    assert gap_prefill > 1.5 * plain_two
    # once both decode, the first's pace is the 2-sequence step (per-user speed falls with batch)
    assert second.at_ns(0) < after[120]
    gap_two = after[121] - after[120]
    alone = before[121] - before[120]
    assert alone < gap_two < 1.5 * alone


def test_an_arrival_mid_step_starts_when_that_step_ends():
    b = make_hardware_backend("h100-sxm/llama-3.1-8b")
    s = b.server
    first = s.open(req("a", out=200), T0)
    ends = [first.at_ns(i) for i in range(200)]
    lead = round(request_overhead_s(b.system) * 1e9)
    early = s.open(req("b", out=20), ends[60] + 1 - lead)  # just after a step ended: waits almost a step
    assert abs(s.start_ns(early.job) - ends[61]) <= 1  # (token instants are whole ns)
    # an arrival a hair after a step's end (within rounding of it) starts there, never before it arrived
    hair = s.submit(req("d", out=20), s.token_ns(first.job, 80) + 0.002)
    assert s.start_ns(hair) >= hair.arrive_ns
    solo = make_hardware_backend("h100-sxm/llama-3.1-8b").server.open(req("c", out=20), T0)
    assert early.at_ns(0) - (ends[60] + 1 - lead) > solo.at_ns(0) - T0 + 0.9 * (ends[61] - ends[60])


def test_fcfs_queue_when_batch_is_full_and_cancel_frees_the_slot():
    b = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 1})
    s = b.server
    a = s.open(req("a", out=100), T0)
    c = s.open(req("c", out=10), T0 + 1000)
    d = s.open(req("d", out=10), T0 + 2000)
    assert c.at_ns(0) > a.at_ns(99) > a.at_ns(0)
    assert d.at_ns(0) > c.at_ns(9)
    spans = c.spans(9)
    assert [x.what for x in spans] == ["queue", "ttft", "decode"]
    assert spans[0].start_ns == T0 + 1000 and spans[0].end_ns == spans[1].start_ns
    assert spans[1].end_ns == c.at_ns(0) and spans[2].end_ns == c.at_ns(9)
    # cancelling `a` at its 10th token lets `c` start right then
    t_cancel = a.at_ns(10)
    s.cancel(a.job, t_cancel)
    assert c.spans(9)[1].start_ns == t_cancel
    assert c.at_ns(0) < a.at_ns(99)


def test_per_user_speed_falls_and_aggregate_rises_to_a_knee():
    b = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 16})
    results = {}
    for clients in (1, 2, 4, 8, 16, 32, 64):
        server = DeviceServer(b.system, max_batch=16)
        results[clients] = closed_loop(server, clients, 4, 512, 128)
    user = [results[c].mean_user_tokens_per_s for c in (1, 2, 4, 8, 16)]
    agg = [results[c].aggregate_tokens_per_s for c in (1, 2, 4, 8, 16)]
    assert all(x > y for x, y in itertools.pairwise(user))
    assert all(x < y for x, y in itertools.pairwise(agg))
    # past max_batch the aggregate stops growing (knee) and the wait moves into the queue (TTFT)
    assert results[64].aggregate_tokens_per_s == pytest.approx(results[16].aggregate_tokens_per_s, rel=0.1)
    assert results[64].mean_ttft_s > 3 * results[16].mean_ttft_s


def test_fast_mode_is_faster_per_user_lower_in_aggregate_and_dearer():
    normal = make_hardware_backend("h100-sxm/llama-3.1-70b")
    fast = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-70b", "fast": True})
    assert fast.name.endswith("+fast") and fast.server is not normal.server
    assert fast.deployment.max_batch < normal.deployment.max_batch
    load_n = closed_loop(normal.server, 64, 2, 1024, 256)
    load_f = closed_loop(fast.server, 64, 2, 1024, 256)
    assert load_f.mean_user_tokens_per_s > load_n.mean_user_tokens_per_s
    assert load_f.aggregate_tokens_per_s < load_n.aggregate_tokens_per_s
    assert fast.prices.output_per_mtok > normal.prices.output_per_mtok
    # idle device: same chips, same model, so predict is identical
    assert fast.predict(req(), RNG) == normal.predict(req(), RNG)


def test_fast_mode_with_public_price_scales_it():
    normal = make_hardware_backend("cerebras-wse3/llama-3.1-8b")
    fast = make_hardware_backend({"hardware": "cerebras-wse3", "model": "llama-3.1-8b", "fast": True})
    assert normal.prices.output_per_mtok == 0.10 and "cerebras.ai" in normal.prices.source
    assert fast.prices.output_per_mtok > normal.prices.output_per_mtok
    assert "MODELLED" in fast.prices.source


def test_fast_mode_price_ratio_is_the_batch_alone_with_the_deployments_own_settings():
    # the public price is scaled by the modelled cost of the same deployment at its fast batch over its
    # normal one: a KV format that changes what fits must be in both, not only in the fast one
    for kv in (None, "fp8"):
        cfg = {"hardware": "groq-lpu", "model": "llama-3.1-8b", **({"kv_precision": kv} if kv else {})}
        normal, fast = make_hardware_backend(cfg), make_hardware_backend({**cfg, "fast": True})
        ratio = modelled_prices(fast.deployment).output_per_mtok / modelled_prices(normal.deployment).output_per_mtok
        assert fast.prices.output_per_mtok == pytest.approx(normal.prices.output_per_mtok * ratio, rel=1e-9)
        assert fast.deployment.sized_batch == normal.deployment.max_batch


def test_two_sessions_on_one_device_are_slower_per_token_than_one():
    alone = make_hardware_backend("h200-sxm/llama-3.1-8b").server
    shared = make_hardware_backend("h200-sxm/llama-3.1-8b").server
    solo = alone.open(req("a", out=100), T0)
    x = shared.open(req("a", out=100), T0)
    shared.open(req("b", out=100), T0)
    assert x.at_ns(99) - x.at_ns(1) > solo.at_ns(99) - solo.at_ns(1)


def test_many_sessions_stay_cheap():
    b = make_hardware_backend("cerebras-wse3/llama-3.1-8b")
    streams = [b.server.open(req(f"s{i}", out=200), T0 + i * 100_000) for i in range(300)]
    last = [st.at_ns(199) for st in streams]
    assert all(t > T0 for t in last)
    assert b.server.load()["decoding"] + b.server.load()["queued"] >= 1


async def test_live_streams_sleep_until_their_tokens_and_leave_no_tasks():
    b = make_hardware_backend("cerebras-wse3/llama-3.1-8b")
    t0 = now_ns()
    tasks_before = len(asyncio.all_tasks())

    async def consume(session: str, out: int) -> list[int]:
        stream = b.start(req(session, prompt=256, out=out), now_ns(), RNG)
        times = []
        for i in range(out):
            t = await stream.token_time(i)
            assert now_ns() >= t
            times.append(t)
        assert times == [stream.at_ns(i) for i in range(out)]
        return times

    one, two = await asyncio.gather(consume("a", 40), consume("b", 20))
    assert one == sorted(one) and two == sorted(two)
    assert now_ns() - t0 < 5e9  # ~40 tokens at ~0.6 ms: generous margin
    assert len(asyncio.all_tasks()) == tasks_before
    assert not b.server._waiters


async def test_cancelled_stream_does_not_hang():
    b = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 1})
    first = b.start(req("a", out=5000), now_ns(), RNG)
    queued = b.start(req("b", out=5), now_ns(), RNG)
    queued.cancel()
    assert await asyncio.wait_for(queued.token_time(3), 1.0) >= 0
    first.cancel()
    assert b.server.load() == {"decoding": 0, "prefilling": 0, "queued": 0}


def test_spec_errors_name_the_bad_field():
    cases = {
        "nope/llama-3.1-8b": "nope",
        "h100-sxm/nope": "nope",
        "h100-sxm": "DEVICE/MODEL",
    }
    for spec, word in cases.items():
        with pytest.raises(ValueError, match=word):
            make_hardware_backend(spec)
    with pytest.raises(ValueError, match="precision"):
        make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "precision": "fp5"})
    with pytest.raises(ValueError, match="colour"):
        make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "colour": 1})
    with pytest.raises(ValueError, match="does not fit"):
        make_hardware_backend({"hardware": "a100-40gb", "model": "llama-3.1-405b"})
    with pytest.raises(ValueError, match="max_batch"):
        make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 0})
    with pytest.raises(ValueError, match="alpha"):
        make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "speculative": {"gamma": 3}})


def test_registry_builds_hardware_and_empirical_backends():
    hwb = build_backend({"hardware": "cerebras-wse3", "model": "llama-3.1-8b"})
    assert hwb.kind == "hardware" and hwb.name == "cerebras-wse3/llama-3.1-8b"
    assert hwb.quality == pytest.approx(0.73)
    d = hwb.describe()
    assert d["modelled"] and d["chips"] == 1 and d["sources"]
    emp = build_backend("sonnet-gpu")
    assert emp.quality == pytest.approx(0.887)


def _server_left_at_awkward_v(out: int) -> tuple[DeviceServer, int]:
    """A cerebras server whose progress clock V was left by a cancel at a value where ``(V + out) - 1``
    rounds below ``V + (out - 1)``, and an idle instant after it (found by a fixed search)."""
    j = 16 - out  # cancel between tokens j and j + 1: V + out crosses 16, a power of two, V + out - 1 not
    for offset in range(1, 10_000):
        s = make_hardware_backend("cerebras-wse3/llama-3.1-8b").server
        a = s.open(req("a", out=100), T0)
        t_cancel = a.at_ns(j) + offset * 997
        if t_cancel >= a.at_ns(j + 1):  # searched the whole gap between the two tokens
            break
        s.cancel(a.job, t_cancel)
        v = s._state.v
        if (v + out) - 1 < v + (out - 1):  # the finish V rounds below the last token's V
            return s, t_cancel + 1_000_000
    raise AssertionError("no awkward V found")


@pytest.mark.parametrize("out", [2, 5, 7])
def test_short_request_after_a_cancel_has_every_token_scheduled(out):
    # A short request joins decode at a fractional V (left by a cancelled neighbour) on an otherwise idle
    # device, so the projection's curve ends at its finish with rate 0: the last token's V must be formed
    # exactly as the finish event forms it, or it lies an ulp past the curve and "has no schedule".
    s, t1 = _server_left_at_awkward_v(out)
    b = s.open(req("b", prompt=1080, cached=1076, out=out), t1)
    projected = [b.at_ns(i) for i in range(out)]
    assert projected == sorted(projected) and projected[0] > t1
    assert projected[-1] == round(s.finish_ns(b.job))
    # the job finishes in the realised past (a later arrival moves the device on); nothing moves
    c = s.open(req("c", out=out), projected[-1] + 5_000_000)
    assert b.job.finish_ns is not None and b.job.history is not None
    assert [b.at_ns(i) for i in range(out)] == projected
    assert b.at_ns(out - 1) == round(b.job.finish_ns)
    assert b.at_ns(out + 10) == projected[-1]  # past the end: the last token
    # cancel after the finish (the council's finally) is a no-op; spans still resolve
    b.cancel()
    assert not b.job.cancelled
    assert [b.at_ns(i) for i in range(out)] == projected
    assert b.spans(out - 1)[-1].end_ns == projected[-1]
    assert all(c.at_ns(i) > projected[-1] for i in range(out))


def test_every_short_request_on_a_fractional_v_is_scheduled():
    # Sweep: many cancels leave many fractional V; every later short request resolves all its tokens,
    # its last token equals its finish, both projected and realised, and cancel() mid-way keeps a schedule.
    for offset in range(1, 120):
        s = make_hardware_backend("cerebras-wse3/llama-3.1-8b").server
        a = s.open(req("a", out=50), T0)
        t_cancel = a.at_ns(offset % 16) + offset * 7919
        s.cancel(a.job, t_cancel)
        for out in (2, 3, 5, 8):
            t = t_cancel + out * 10_000_000
            b = s.open(req(f"b{out}", prompt=600, cached=590, out=out), t)
            ts = [b.at_ns(i) for i in range(out)]
            assert ts == sorted(ts) and ts[-1] == round(s.finish_ns(b.job))
        # a cancelled member keeps its produced tokens' times and a finite time for the rest
        d = s.open(req("d", out=40), t + 100_000_000)
        mid = d.at_ns(3)
        s.cancel(d.job, mid)
        assert d.at_ns(3) == mid and d.at_ns(39) >= mid
        assert all(math.isfinite(d.at_ns(i)) for i in range(40))


def test_lone_request_after_idle_fractional_v_matches_its_prediction():
    # The contract holds at any V: a lone request's tokens are t0 + predict().token_s(i).
    s, t1 = _server_left_at_awkward_v(5)
    b = make_hardware_backend("cerebras-wse3/llama-3.1-8b")
    r = req("b", prompt=1080, cached=1076, out=5)
    ref = ScheduledStream(b.predict(r, RNG), t1)
    got = s.open(r, t1)
    for i in range(5):
        assert abs(got.at_ns(i) - ref.at_ns(i)) <= 1000


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_more_work_never_shortens_a_step(spec):
    # the server wakes no wait when a request queues because more work never speeds anyone up: its step
    # (speculative decoding and fast mode included) grows with decoders, their KV and a prefill in the step
    server = make_hardware_backend(spec).server
    for ctx in (100.0, 1500.0, 6000.0):
        plain = [server.step_ns(d, d * ctx, 0, 0) for d in range(0, 300)]
        assert all(b >= a for a, b in itertools.pairwise(plain[1:]))
        for d in range(1, 300, 7):
            assert server.step_ns(d, d * ctx + ctx, 0, 0) >= plain[d]  # more KV
            assert server.step_ns(d, d * ctx, 300, 100) >= plain[d]  # a prefill shares the step


def _schedule(s, streams):
    # a request cancelled before it decoded has no schedule (its stream answers "now"): left out
    return [
        [st.at_ns(i) for i in (0, 1, st.job.outputs // 2, st.job.outputs - 1)]
        for st in streams
        if not (st.job.cancelled and st.job.v_join is None)
    ]


@pytest.mark.parametrize("seed", range(6))
def test_amended_projection_equals_a_fresh_one(seed):
    # A saturated device: requests that queue amend the projection (appended, or re-run from where the
    # projection had emptied its queue); the schedule must be the one a projection started afresh from the
    # realised state gives, to the last bit, whatever lookups happened in between.
    from voicepipe.hardware.serving import _Projection

    rng = np.random.default_rng(seed)
    s = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 4}).server
    streams = []
    t = T0
    for k in range(40):
        t += int(rng.integers(1, 40_000_000))
        st = s.open(req(f"u{k}", prompt=int(rng.integers(50, 900)), out=int(rng.integers(2, 120))), t)
        streams.append(st)
        if rng.random() < 0.5:  # look far ahead (past the queue) or near, or not at all
            st.at_ns(0)
        if rng.random() < 0.3:
            streams[int(rng.integers(0, len(streams)))].at_ns(1)
        if rng.random() < 0.1:
            victim = streams[int(rng.integers(0, len(streams)))]
            victim.server.cancel(victim.job, t)
    assert s.load()["queued"] > 0  # the case under test: arrivals behind a queue
    amended = _schedule(s, streams)
    s._proj = _Projection(s._state)
    assert _schedule(s, streams) == amended
    assert all(a == sorted(a) for a in amended)


@pytest.mark.parametrize("spec", ["h100-sxm/llama-3.1-8b", "cerebras-wse3/llama-3.1-8b", SPECS[3]], ids=str)
def test_no_prefill_is_shorter_than_the_servers_shortest(spec):
    # earliest_first_ns counts each queued prefill at the server's shortest: it must be a lower bound
    server = make_hardware_backend(spec).server
    for d, ctx, n, c in itertools.product((0, 1, 16, 200), (0.0, 900.0), (1, 7, 500, 4000), (0, 300)):
        assert server.step_ns(d, d * ctx, n, c) >= server._min_prefill_ns


@pytest.mark.parametrize("seed", range(4))
def test_a_queued_streams_bound_is_below_its_first_token_and_holds_through_cancels(seed):
    rng = np.random.default_rng(seed)
    s = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 3}).server
    streams = [
        s.open(req(f"u{k}", prompt=int(rng.integers(20, 900)), out=60), T0 + k * 1000) for k in range(30)
    ]
    bounds = {st.job.id: s.earliest_first_ns(st.job) for st in streams}
    assert sum(b is not None for b in bounds.values()) >= 20  # most of them queue
    t = T0
    for _ in range(6):  # cancel decoding members: every bound still holds and none falls
        live = [st for st in streams if not st.job.cancelled and st.at_ns(5) > t]
        victim = min(live, key=lambda st: st.at_ns(5))
        t = victim.at_ns(5)
        s.cancel(victim.job, t)
        assert victim.job.cancelled and victim.job.v_join is not None  # it was decoding
        for st in streams:
            b, old = s.earliest_first_ns(st.job), bounds[st.job.id]
            if b is None:
                continue
            assert b <= st.at_ns(0)
            assert old is None or b >= old
            bounds[st.job.id] = b
    queued = [st for st in streams if s.earliest_first_ns(st.job) is not None]
    s.cancel(queued[0].job, t)  # a cancel ahead in the queue may lower the bounds behind it: still below
    assert all(s.earliest_first_ns(st.job) <= st.at_ns(0) for st in queued[1:])


def test_a_long_saturated_run_keeps_its_projection_bounded(monkeypatch):
    # amended projections would otherwise keep every event of a device that never idles (~130k entries here)
    monkeypatch.setattr("voicepipe.hardware.serving.PROJECTION_KEEP", 2000)
    b = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 4})
    closed_loop(b.server, 8, 3200, 256, 16)
    assert b.server._proj.size() <= 2000 + 64


def test_a_cancel_cannot_reach_before_a_token_already_handed_out():
    b = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 1})
    s = b.server
    a = s.open(req("a", out=100), T0)
    c = s.open(req("c", out=10), T0 + 1000)
    handed = a.at_ns(20)
    s.commit(handed)  # token 20 of `a` was handed out (token_time commits what it returns)
    s.cancel(a.job, a.at_ns(10))  # asked for an earlier instant: it takes effect at the handed-out one
    assert c.spans(9)[1].start_ns == handed



# opens (at T0 + ns, prompt, output, cached) and cancels (at T0 + ns, stream) on SGLang, whose prefill steps
# pause the decoders: the step lattice puts finishes within ulps of one instant (a review's randomised trace)
LATTICE_TRACE = [
    ("open", 18927548, 777, 113, 13),
    ("open", 53688558, 646, 41, 102),
    ("open", 83829082, 1260, 81, 131),
    ("open", 122905319, 218, 58, 0),
    ("open", 131043529, 111, 42, 0),
    ("open", 134727697, 1092, 44, 369),
    ("open", 145803345, 643, 77, 0),
    ("open", 160317393, 927, 116, 170),
    ("open", 162811377, 696, 96, 341),
    ("open", 186074329, 774, 101, 392),
    ("cancel", 189839480, 5),
    ("open", 218859397, 1144, 118, 76),
    ("open", 227659373, 1285, 100, 336),
    ("open", 227943047, 1260, 97, 0),
    ("open", 255644694, 966, 126, 390),
    ("open", 291433328, 1199, 63, 235),
    ("cancel", 293881945, 10),
    ("open", 329454897, 1243, 70, 29),
    ("open", 355869112, 1334, 32, 332),
    ("cancel", 359728478, 14),
    ("open", 386155620, 488, 5, 297),
    ("open", 396655409, 840, 63, 42),
    ("open", 416844538, 987, 24, 0),
    ("open", 451537358, 416, 51, 217),
    ("open", 461265977, 237, 39, 0),
    ("open", 468165927, 1052, 116, 0),
    ("open", 483215467, 866, 68, 0),
    ("open", 506084081, 560, 42, 0),
    ("open", 518649437, 1077, 47, 230),
    ("open", 524951747, 1190, 105, 285),
    ("open", 548831256, 550, 75, 30),
    ("open", 585488487, 768, 41, 383),
    ("open", 597288745, 1367, 23, 0),
]


def test_every_token_has_a_schedule_and_comes_out_in_order_where_finishes_meet_on_the_step_lattice():
    s = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 4, "stack": "sglang"}).server
    streams = []
    for op in LATTICE_TRACE:
        if op[0] == "open":
            _, t, p, o, c = op
            streams.append(s.open(LLMRequest(f"u{len(streams)}", 0, p, o, min(c, p)), T0 + t))
        else:
            s.cancel(streams[op[2]].job, T0 + op[1])
    live = [st for st in streams if not st.job.cancelled]
    projected = [[st.at_ns(i) for i in range(st.job.outputs)] for st in live]  # raises where one has none
    s.drain()
    for st, before in zip(live, projected, strict=True):
        out = [s.token_ns(st.job, i) for i in range(st.job.outputs)]
        assert out == sorted(out)
        assert [round(x) for x in out] == before


def test_a_progress_target_passed_at_a_breakpoint_is_reached_at_that_instant():
    flat_then_jump = _Curve([0.0, 10.0], [5.0, 5.0 + 1e-12], [0.0, 1.0])
    assert flat_then_jump.time_at(5.0 + 5e-13) == 10.0
    jump = _Curve([0.0, 2.0], [0.0, 5.0], [1.0, 1.0])  # V leapt from 2 to 5 at t = 2
    assert jump.time_at(3.0) == 2.0
    assert jump.time_at(7.0) == 4.0


def _sglang(**extra: object):
    return make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "stack": "sglang", **extra})


def test_an_overlap_scheduler_starts_a_mid_step_arrival_a_step_after_the_running_one():
    # SGLang forms the next batch while a step runs: an arrival mid-step is taken in as that step ends,
    # after the next step's batch was formed, so it starts when that next step ends
    b = _sglang()
    s = b.server
    assert s.schedule_ahead == 1
    first = s.open(req("a", out=200), T0)
    ends = [first.at_ns(i) for i in range(200)]
    lead = round(request_overhead_s(b.system) * 1e9)
    late = s.open(req("b", out=20), ends[60] + 1 - lead)
    assert abs(s.start_ns(late.job) - ends[62]) <= 1
    # the same engine forming each batch between steps starts it one step sooner
    sync = _sglang().server
    sync.schedule_ahead = 0
    f2 = sync.open(req("a", out=200), T0)
    assert [f2.at_ns(i) for i in range(62)] == ends[:62]
    early = sync.open(req("b", out=20), ends[60] + 1 - lead)
    assert abs(sync.start_ns(early.job) - ends[61]) <= 1


def test_an_overlap_scheduler_starts_a_request_at_once_on_an_idle_device():
    # (speculating, the engine forms each batch between steps: its finishes fall off the step grid)
    assert _sglang(speculative={"alpha": 0.8, "gamma": 4, "draft_cost": 0.05}).server.schedule_ahead == 0
    s = _sglang().server
    job = s.submit(req("a", out=8), T0)
    assert s.start_ns(job) == T0
    again = s.submit(req("b", out=8), s.finish_ns(job) + 5_000_000)  # idle again by then
    assert s.start_ns(again) == again.arrive_ns


def test_a_request_waiting_for_a_cancelled_prefill_to_end_starts_at_the_cancel():
    # taken in when the running prefill step would end; that step is cancelled away, the device idles,
    # and the waiting request starts at once instead of waiting for a step that never comes
    s = _sglang().server
    long = s.submit(req("a", prompt=8000, out=50), T0)
    waiting = s.submit(req("b", out=20), T0 + 1_000_000)
    assert waiting.recv_ns is not None and waiting.recv_ns > T0 + 1_000_000
    s.cancel(long, T0 + 2_000_000)
    assert s.start_ns(waiting) == T0 + 2_000_000
    assert s.token_ns(waiting, 19) > s.first_ns(waiting)


@pytest.mark.parametrize("seed", range(3))
def test_an_overlap_scheduler_keeps_projection_and_realised_equal(seed):
    rng = np.random.default_rng(seed)
    server = _sglang(max_batch=6).server
    streams = []
    t = T0
    for k in range(24):
        t += int(rng.integers(1, 8_000_000))
        st = server.open(req(f"u{k}", prompt=int(rng.integers(100, 500)), out=int(rng.integers(1, 400))), t)
        streams.append(st)
        if rng.random() < 0.5:
            st.at_ns(0)
        if rng.random() < 0.08:
            server.cancel(streams[int(rng.integers(0, len(streams)))].job, t)
    live = [st for st in streams if not st.job.cancelled]
    projected = [[st.at_ns(i) for i in range(st.job.outputs)] for st in live]
    server.drain()
    assert [[st.at_ns(i) for i in range(st.job.outputs)] for st in live] == projected
    assert all(times == sorted(times) for times in projected)
    assert all(server.start_ns(st.job) >= st.job.arrive_ns for st in live)
    assert any(st.job.recv_ns is not None for st in live), "the case under test: arrivals mid-step"
