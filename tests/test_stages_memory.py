"""Stage unit tests on the in-memory bus and the virtual clock: one stage, scripted messages, exact times."""

from __future__ import annotations

import asyncio

from tests.conftest import fast_config
from voicepipe.bus.memory import MemoryBroker
from voicepipe.clock import now_ns, run_virtual
from voicepipe.messages import (
    CancelReason,
    Envelope,
    Final,
    Route,
    Target,
    TurnScript,
    UserUtterance,
    UserWord,
)
from voicepipe.stages.asr import ASR
from voicepipe.stages.base import RunContext
from voicepipe.stages.guard import sign
from voicepipe.stages.router import Router

MS = 1_000_000
TOKEN = b"stage unit tests"


def _as(src: str, envs: list[tuple[int, Envelope]]) -> list[tuple[int, Envelope]]:
    """The feed as stage ``src`` sends it: its sender id, a sequence per session and channel, the run's MAC
    (the stages distrust anything else)."""
    seqs: dict[tuple[str, str], int] = {}
    for _, env in envs:
        key = (env.session, env.type)
        env.src, env.seq = f"{src}/test", seqs.setdefault(key, -1) + 1
        seqs[key] = env.seq
        sign(env, TOKEN)
    return envs


async def _run(stage_cls, cfg, feed, listen: tuple[str, ...]) -> list[tuple[int, Envelope]]:
    """Start one stage, play ``feed`` (at_ns, envelope) into the bus, return what it published, with times."""
    broker = MemoryBroker("t")
    stage = stage_cls(broker.connect(stage_cls.name), RunContext(run="t", cfg=cfg, token=TOKEN))
    probe = broker.connect("probe")
    probe.key = TOKEN  # the bus signs what it sends, as a stage's bus does (sent_ns is in the MAC)
    await probe.subscribe(*listen)
    task = asyncio.create_task(stage.run())
    await stage.ready.wait()
    got: list[tuple[int, Envelope]] = []

    async def collect() -> None:
        async for _, env in probe.messages():
            got.append((now_ns(), env))

    reader = asyncio.create_task(collect())
    for at, env in feed:
        await asyncio.sleep(max(0, at - now_ns()) / 1e9)
        await probe.publish(env)
    await asyncio.sleep(5)
    reader.cancel()
    task.cancel()
    await stage.shutdown()
    return got


def _words(texts: list[str], starts_ms: list[int], dur_ms: int = 200) -> list[tuple[int, Envelope]]:
    """The utterance, arriving when its first word's audio starts; each word's media time is its start."""
    out = []
    for i, (w, s) in enumerate(zip(texts, starts_ms, strict=True)):
        last = i == len(texts) - 1
        gap = None if last else (starts_ms[i + 1] - s - dur_ms) * MS
        word = UserWord(
            text=w, dur_ns=dur_ms * MS, index=i, pause_before=bool(gap), last_word=last, media_ns=s * MS,
            gap_after_ns=gap,
        )  # fmt: skip
        out.append(word)
    return [(starts_ms[0] * MS, Envelope.of(UserUtterance(words=out), "t", "s-0", 0))]


def test_asr_endpoints_after_the_silence_and_withdraws_a_premature_segment():
    cfg = fast_config("asr.silence_ms=300", "asr.finalize_ms=50")
    script = TurnScript(user="a b c", reply="ok", words=3)
    # "a" "b", then a 400 ms pause (> 300 ms silence: premature endpoint), then "c"
    feed = _as("client", [(0, Envelope.of(script, "t", "s-0", 0)), *_words(["a", "b", "c"], [10, 210, 810])])
    got = run_virtual(_run(ASR, cfg, feed, ("asr/final", "control/cancel")))
    finals = [(t, e.payload) for t, e in got if isinstance(e.payload, Final)]
    cancels = [e.payload for _, e in got if e.type == "control.cancel"]
    # "c" is heard when its audio arrives (810 ms), not when the utterance's message came (10 ms)
    assert [t for t, e in got if e.type == "control.cancel"] == [810 * MS]
    # segment 0 ends at 410 ms (end of "b"), +300 silence, +50 finalise = 760 ms: published before "c"
    assert finals[0] == (760 * MS, Final(text="a b", words=2, segment=0))
    assert [c.reason for c in cancels] == [CancelReason.USER_RESUMED] and cancels[0].segment == 0
    # the turn goes on as segment 1 with all the words: 1010 + 300 + 50
    assert finals[1] == (1360 * MS, Final(text="a b c", words=3, segment=1))
    spans = next(e.spans for t, e in got if t == 1360 * MS)
    assert [(s.what, s.dur_ns // MS) for s in spans] == [("endpoint wait", 300), ("finalise", 50)]


def test_asr_refuses_a_second_utterance_for_the_same_turn():
    """A client says a turn's words in one message; a second one for that turn (a replay under a new id, a
    confused client) would splice its words into the transcript: it is dead-lettered (Stage.reject), the turn
    goes on as if it never came."""
    cfg = fast_config("asr.silence_ms=300", "asr.finalize_ms=50")
    script = TurnScript(user="a b", reply="ok", words=2)
    feed = [
        (0, Envelope.of(script, "t", "s-0", 0)),
        *_words(["a", "b"], [10, 210]),
        *_words(["x", "y"], [300, 500]),
    ]
    got = run_virtual(_run(ASR, cfg, _as("client", feed), ("asr/final", "control/cancel")))
    finals = [(t, e.payload) for t, e in got if isinstance(e.payload, Final)]
    assert finals == [(760 * MS, Final(text="a b", words=2, segment=0))]
    assert not [e for _, e in got if e.type == "control.cancel"]


def test_router_sends_each_final_to_the_rule_that_matches():
    cfg = fast_config("router.policy=rules", "router.rules=[{when: {keywords: [menu]}, to: council}]",
                      "router.default=agent:main", "council.members=[groq-lpu/llama-3.1-8b]")  # fmt: skip
    scripts = [TurnScript(user="show me the menu", reply="ok", words=4), TurnScript(user="a latte please",
               reply="ok", words=3)]  # fmt: skip
    feed = sorted(
        _as("client", [(0, Envelope.of(scripts[0], "t", "s-0", 0)), (MS, Envelope.of(scripts[1], "t", "s-0", 1))])
        + _as("asr", [(MS // 2, Envelope.of(Final(text="show me the menu", words=4, segment=0), "t", "s-0", 0)),
                      (2 * MS, Envelope.of(Final(text="a latte please", words=3, segment=0), "t", "s-0", 1))]),
        key=lambda p: p[0],
    )  # fmt: skip
    got = run_virtual(_run(Router, cfg, feed, ("route",)))
    routes = [e.payload for _, e in got]
    assert [(r.target, r.route) for r in routes] == [
        (Target.COUNCIL, "rule 0"),
        (Target.AGENT, "rules default"),
    ]
    assert isinstance(routes[1], Route) and routes[1].agent == "main"


def test_asr_builds_partials_only_when_someone_can_receive_them():
    """In memory the bus knows its subscribers: with none on asr/partial (and no tap) the ASR skips them,
    and the final transcript comes at the same instant either way."""
    cfg = fast_config("asr.silence_ms=300", "asr.finalize_ms=50")
    script = TurnScript(user="a b", reply="ok", words=2)

    def feed() -> list[tuple[int, Envelope]]:
        return _as("client", [(0, Envelope.of(script, "t", "s-0", 0)), *_words(["a", "b"], [10, 210])])

    with_partials = run_virtual(_run(ASR, cfg, feed(), ("asr/final", "asr/partial")))
    without = run_virtual(_run(ASR, cfg, feed(), ("asr/final",)))
    assert [e.payload.text for _, e in with_partials if e.type == "asr.partial"] == ["a", "a b"]
    finals = [[(t, e.payload) for t, e in got if e.type == "asr.final"] for got in (with_partials, without)]
    assert finals[0] == finals[1] == [(760 * MS, Final(text="a b", words=2, segment=0))]


def test_the_router_takes_partials_only_for_preemptive_generation():
    assert "asr/partial" not in Router.channels_for(fast_config())
    assert "asr/partial" in Router.channels_for(fast_config("router.preemptive.enabled=true"))


def test_a_task_cancelled_before_it_starts_closes_its_coroutine():
    """A turn's work spawned and cancelled in the same instant (a barge-in, a withdrawn segment) never ran:
    its coroutine is closed, not left for the collector to warn 'coroutine ... was never awaited'."""
    import inspect

    async def work() -> None:
        await asyncio.sleep(1)

    async def go() -> str:
        stage = ASR(MemoryBroker("t").connect("asr"), RunContext(run="t", cfg=fast_config(), token=TOKEN))
        coro = work()
        stage.spawn("s-0", (0, "work"), coro).cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return inspect.getcoroutinestate(coro)

    assert run_virtual(go()) == inspect.CORO_CLOSED
