"""Recompute preemption in the serving engine: on a stack that grows its caches (vLLM, SGLang), a running
set whose caches outgrow the pool loses its newest member, which goes back to the head of the queue,
prefills its prompt and the tokens it had emitted once it fits again, and resumes; the projection a live
stream reads agrees with the realised past to the last bit, through evictions."""

from __future__ import annotations

import numpy as np
import pytest

from voicepipe.backends.base import LLMRequest
from voicepipe.backends.hardware import make_hardware_backend
from voicepipe.hardware.engine import _Recorder, _State
from voicepipe.hardware.serving import DeviceServer, _Projection
from voicepipe.hardware.workload import static_batch

T0 = 10**12


def req(session: str, prompt: int, out: int) -> LLMRequest:
    return LLMRequest(session=session, turn=0, prompt_tokens=prompt, output_tokens=out)


def small_pool(tokens: float, spec: object = "h100-sxm/llama-3.1-8b", max_batch: int = 8) -> DeviceServer:
    """A vLLM server whose KV pool holds only ``tokens`` (the weights are what they are)."""
    server = make_hardware_backend(spec if isinstance(spec, dict) else {"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": max_batch}).server
    server.kv_pool = tokens
    return server


def all_tokens(server: DeviceServer, streams: list) -> list[list[int]]:
    return [[st.at_ns(i) for i in range(st.job.outputs)] for st in streams]


class Watch(_Recorder):
    """Checks the pool after every event: what the members and prefills hold never exceeds it by more
    than the rounding the eviction event allows."""

    def __init__(self, state: _State) -> None:
        from voicepipe.hardware.engine import _Curve

        super().__init__(_Curve())
        self.state = state
        self.evictions = 0
        self.worst = 0.0

    def evict(self, job, k, done, t):  # type: ignore[no-untyped-def]
        super().evict(job, k, done, t)
        self.evictions += 1

    def mark(self, t: float, v: float, r: float) -> None:
        s = self.state
        if len(s.members) >= 2:
            self.worst = max(self.worst, s.kv_used() - s.server.kv_pool)


def test_a_burst_that_outgrows_the_pool_evicts_the_newest_and_still_finishes_everyone():
    server = small_pool(6 * (300 + 200))  # six whole requests fit; eight start (at their prompts)
    streams = [server.open(req(f"u{k}", 300, 400), T0) for k in range(8)]
    schedule = all_tokens(server, streams)  # read from the projection, before anything is realised
    server.drain()
    assert all(st.job.finish_ns is not None for st in streams)
    evicted = [st.job for st in streams if st.job.cuts]
    assert evicted, "the caches outgrow the pool: someone is evicted"
    # the newest are evicted first: an evicted job was admitted no earlier than any survivor
    survivors = [st.job for st in streams if not st.job.cuts]
    assert min(j.id for j in evicted) > min(j.id for j in survivors)
    for st, times in zip(streams, schedule, strict=True):
        assert times == sorted(times), "a stream's tokens come out in order, across an eviction"
        assert [st.at_ns(i) for i in range(st.job.outputs)] == times, "projected == realised, to the bit"
        job = st.job
        for k, cut in enumerate(job.cuts):
            # the token a re-prefill emits comes out when that prefill ends, after the eviction
            assert times[cut] == round(job.joins[k][1]) and times[cut] > times[cut - 1]
    # the evicted wait for their recompute: they finish later than they would have, the rest no later
    plain = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 8}).server
    free = [plain.open(req(f"u{k}", 300, 400), T0) for k in range(8)]
    for st, ref in zip(streams, free, strict=True):
        if st.job.cuts:
            assert st.at_ns(399) > ref.at_ns(399)


def test_the_pool_is_never_overfilled_and_a_burst_pays_for_its_recompute():
    server = small_pool(6 * 500)
    state = _State(server)
    watch = Watch(state)
    jobs = []
    for k in range(8):
        job = server.submit(req(f"v{k}", 300, 400), 0.0)  # only to build the Job
        jobs.append(job)
    state.queue.extend(jobs)
    state.admit(watch)
    state.run(float("inf"), watch)
    assert watch.evictions > 0
    assert watch.worst <= 0.5 + 1e-9  # at most the half token an eviction event tolerates


def test_a_pool_that_fits_everything_changes_nothing():
    # the same burst on the real pool: no eviction, and the schedule is the one without a pool
    server = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 8}).server
    streams = [server.open(req(f"u{k}", 300, 400), T0) for k in range(8)]
    untracked = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 8}).server
    untracked.kv_pool = float("inf")
    ref = [untracked.open(req(f"u{k}", 300, 400), T0) for k in range(8)]
    assert all_tokens(server, streams) == all_tokens(untracked, ref)
    server.drain()
    assert not any(st.job.cuts for st in streams)


def test_a_request_alone_is_never_evicted():
    server = small_pool(100.0)  # not even its prompt fits
    st = server.open(req("solo", 300, 50), T0)
    server.drain()
    assert st.job.finish_ns is not None and not st.job.cuts


def test_a_reserving_stack_and_an_sram_machine_track_no_pool():
    trt = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "stack": "trtllm"}).server
    sram = make_hardware_backend("cerebras-wse3/llama-3.1-8b").server
    assert trt.kv_pool == float("inf") and sram.kv_pool == float("inf")


@pytest.mark.parametrize("seed", range(4))
def test_arrivals_and_cancels_amid_evictions_keep_projection_and_realised_equal(seed):
    rng = np.random.default_rng(seed)
    server = small_pool(4 * 700.0, max_batch=6)
    streams = []
    t = T0
    for k in range(24):
        t += int(rng.integers(1, 8_000_000))
        st = server.open(req(f"u{k}", int(rng.integers(100, 500)), int(rng.integers(200, 600))), t)
        streams.append(st)
        if rng.random() < 0.5:
            st.at_ns(0)
        if rng.random() < 0.3:
            other = streams[int(rng.integers(0, len(streams)))]
            other.at_ns(min(other.job.outputs - 1, 30))
        if rng.random() < 0.08:
            victim = streams[int(rng.integers(0, len(streams)))]
            server.cancel(victim.job, t)
    live = [st for st in streams if not st.job.cancelled]
    projected = all_tokens(server, live)
    server._proj = _Projection(server._state)  # a projection started afresh reads the same schedule
    assert all_tokens(server, live) == projected
    server.drain()
    assert any(st.job.cuts for st in streams), "the case under test: evictions"
    assert all_tokens(server, live) == projected
    assert all(times == sorted(times) for times in projected)


def test_a_static_burst_on_virtual_time_evicts_and_counts_its_recompute():
    # the validation workload (one engine): a burst that outgrows the pool takes longer than one that fits
    big = small_pool(float("inf"))
    tight = small_pool(6 * 500.0)
    fits, outgrows = static_batch(big, 8, 300, 400), static_batch(tight, 8, 300, 400)
    assert any(j.cuts for j in outgrows.jobs)
    assert outgrows.figure("duration") > fits.figure("duration")
    assert outgrows.prefill.sum() > fits.prefill.sum()  # the evicted prefill again what they had emitted


def test_an_evicted_request_cancelled_while_it_waits_resolves_its_remaining_tokens_at_the_cancel():
    server = small_pool(6 * 500.0)
    streams = [server.open(req(f"u{k}", 300, 400), T0) for k in range(8)]
    server.drain()
    first_cut = min((st.job for st in streams if st.job.cuts), key=lambda j: j.joins[0][1])
    t_cut = server.token_ns(first_cut, first_cut.cuts[0] - 1)  # its last token before the eviction
    again = small_pool(6 * 500.0)
    streams = [again.open(req(f"u{k}", 300, 400), T0) for k in range(8)]
    victim = next(st for st in streams if st.job.id == first_cut.id)
    t_cancel = round(t_cut + 0.3 * (first_cut.joins[0][1] - t_cut))  # evicted, waiting to be recomputed
    again.cancel(victim.job, t_cancel)
    again.drain()
    assert victim.job.cancelled and victim.job.cuts and not victim.job.joins
    done = victim.job.cuts[0]
    assert victim.at_ns(done - 1) == round(t_cut)
    assert victim.at_ns(done) == victim.at_ns(victim.job.outputs - 2) == t_cancel
    assert all(st.job.finish_ns is not None for st in streams if st is not victim)


def test_a_windowed_model_grows_its_cache_by_what_its_layers_keep():
    # gpt-oss under vLLM keeps only the 128-token window on its local layers: past the window a member's
    # cache grows by the global layers' share per token, so the pool fills later than a linear count says
    spec = {"hardware": "h100-sxm", "model": "gpt-oss-20b", "max_batch": 8}
    server = make_hardware_backend(spec).server
    assert not server.kv_linear and server.window == 128
    assert server.kept(1128) == pytest.approx(1128 - 1000 * (1 - server.window_slope))
    server.kv_pool = 6 * server.kept(700)
    streams = [server.open(req(f"u{k}", 300, 400), T0) for k in range(8)]
    schedule = all_tokens(server, streams)
    server.drain()
    assert any(st.job.cuts for st in streams)
    assert all(st.job.finish_ns is not None for st in streams)
    assert all_tokens(server, streams) == schedule
    assert all(times == sorted(times) for times in schedule)


def test_predict_says_when_the_running_set_outgrows_its_cache():
    from typer.testing import CliRunner

    from voicepipe.cli import app
    from voicepipe.hardware import catalog as cat
    from voicepipe.hardware import model as hm

    a100, llama = cat.device("a100-80gb"), cat.model("llama-2-7b")
    p = hm.predict(a100, llama, batch=64, prompt_tokens=2048, output_tokens=2048)
    assert p.preempts and "recompute preemption" in p.note
    assert not hm.predict(a100, llama, batch=8, prompt_tokens=2048, output_tokens=2048).preempts
    trt = hm.predict(a100, llama, batch=64, prompt_tokens=2048, output_tokens=2048, stack=cat.stack("trtllm"))
    assert not trt.preempts  # it reserves the whole length at admission: nothing to evict
    args = ["hardware", "predict", "-H", "a100-80gb", "-m", "llama-2-7b", "--batch", "64"]
    out = CliRunner().invoke(app, [*args, "--prompt-tokens", "2048", "--output-tokens", "2048"]).output
    assert "as they grow" in out  # the row that says the newest are evicted and recomputed


def test_a_windowed_model_on_its_real_pool_runs_to_the_end():
    # the fill point is found across the window crossings, not by an event at each (which rounding once
    # left a few ulps short, for ever): two prompts inside gpt-oss's 128-token window
    server = make_hardware_backend({"hardware": "h100-sxm", "model": "gpt-oss-20b", "max_batch": 8}).server
    a, b = server.open(req("a", 93, 300), T0), server.open(req("b", 50, 300), T0)
    last = b.at_ns(299)
    server.drain()
    assert b.at_ns(299) == last and a.job.finish_ns is not None and not (a.job.cuts or b.job.cuts)


def test_a_finish_due_now_is_not_put_off_by_a_prefill_that_pauses_the_decoders():
    # SGLang runs its prefill steps apart: two members finishing at the same V both finish there, even
    # when the first finish admits a prompt whose step holds the decoders
    from dataclasses import replace

    base = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "stack": "sglang"}).server
    stk = base.system.serving.model_copy(update={"prefill_token_budget": 8192, "prefill_mixed": False})
    server = DeviceServer(replace(base.system, stack=stk), max_batch=2)
    a, b = server.open(req("a", 300, 50), T0), server.open(req("b", 300, 50), T0)
    server.open(req("c", 2000, 50), T0 + 1)
    projected = b.at_ns(49)
    server.drain()
    assert b.at_ns(49) == projected == round(b.job.finish_ns) == round(a.job.finish_ns)


@pytest.mark.parametrize("spec", [None, {"alpha": 0.8, "gamma": 4, "draft_cost": 0.05}], ids=["plain", "spec"])
def test_admission_leaves_room_for_what_the_members_emit_during_the_prefill(spec, monkeypatch):
    # a member emits E tokens a step (more with speculative decoding) while a newcomer prefills: admitted
    # only where that fits too, the newcomer is never evicted the instant its prefill ends
    evicted_at: dict[int, float] = {}
    real_evict = _Recorder.evict

    def evict(self, job, k, done, t):  # type: ignore[no-untyped-def]
        evicted_at.setdefault(job.id, t)
        real_evict(self, job, k, done, t)

    monkeypatch.setattr(_Recorder, "evict", evict)
    for prompt in range(1600, 1700, 3):
        cfg: dict = {"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 8}
        if spec:
            cfg["speculative"] = spec
        server = make_hardware_backend(cfg).server
        server.kv_pool = 2000.0
        server.open(req("a", 300, 1000), T0)
        b = server.open(req("b", prompt, 50), T0 + 50_000_000)
        evicted_at.clear()
        server.drain()
        assert evicted_at.get(b.job.id) != b.job.first_ns, prompt


def test_a_token_due_at_the_fill_point_counts_as_out_whatever_the_rounding():
    # the pool fills on a token boundary: which side of the eviction that token lies on must not turn on
    # an ulp, or a queued arrival (which changes no physics before it) could move it by a whole re-prefill
    server = make_hardware_backend({"hardware": "h100-sxm", "model": "llama-3.1-8b", "max_batch": 5}).server
    server.kv_pool = 2044.0
    server.open(req("a", 887, 162), 1000014141830)
    b = server.open(req("b", 880, 288), 1000034613822)
    before = b.at_ns(138)
    server.open(req("c", 88, 3), 1000063075093)  # it queues
    assert b.at_ns(138) >= before
