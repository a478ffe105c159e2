"""The stages distrust the bus (issue 12 item 1): forged, replayed, out-of-turn and absurd messages are
dead-lettered with a reason and counted; no message crashes a run or changes a measured turn."""

from __future__ import annotations

import asyncio
import json
import os
import random

import pytest

from tests.conftest import fast_config, tiny_scenario
from voicepipe.bus.mqtt import BrokerAddress
from voicepipe.limits import MAX_TEXT
from voicepipe.messages import (
    SCHEMA_VERSION,
    Audio,
    Cancel,
    CancelReason,
    Envelope,
    Path,
    SessionEnd,
    TurnMeta,
    TurnScript,
    UserUtterance,
    UserWord,
)
from voicepipe.runner import run_pipeline
from voicepipe.scenario import Turn
from voicepipe.stages.client import spoken
from voicepipe.stages.guard import MAX_SPAN_NS, MAX_WORDS, TOKEN_ENV, Guard, Verdict, sign
from voicepipe.stageset import needed_stages

TOKEN = b"test token"
META = TurnMeta(backend="evil", path=Path.AGENT)


def signed(payload, *, src: str, seq: int, turn: int, session: str = "s", token: bytes = TOKEN) -> Envelope:
    env = Envelope.of(payload, "r", session, turn)
    env.src, env.seq = src, seq
    sign(env, token)
    return env


def script(turn: int, seq: int) -> Envelope:
    return signed(TurnScript(user="hi", reply="hello", words=1), src="client/1", seq=seq, turn=turn)


def said(*words: UserWord) -> UserUtterance:
    return UserUtterance(
        words=list(words) or [UserWord(text="hi", dur_ns=1, index=0, pause_before=False, last_word=True)]
    )


def word(turn: int, seq: int, **kw) -> Envelope:
    p = said(UserWord(text="hi", dur_ns=1, index=0, pause_before=False, last_word=True, **kw))
    return signed(p, src="client/1", seq=seq, turn=turn)


def audio(turn: int, seq: int, src: str = "tts/1", **kw) -> Envelope:
    p = Audio(
        seq=0, text="x", duration_ms=kw.pop("duration_ms", 10.0), last=True, words=1, segment=0, meta=META
    )
    return signed(p, src=src, seq=seq, turn=turn, **kw)


def test_guard_admits_only_what_fits_the_session():
    g = Guard(TOKEN)
    assert g.admit(word(0, 0)).verdict is Verdict.OK  # turn 0 word before its script: script dropped
    assert g.admit(script(0, 0)).reason.startswith("turn script repeated")
    assert g.admit(audio(0, 0)).verdict is Verdict.OK
    # forged: no MAC, a MAC under another token, a tampered field
    unsigned = Envelope.of(
        Audio(seq=0, text="HIJACKED", duration_ms=1, last=True, words=1, segment=0, meta=META), "r", "s", 0
    )
    assert g.admit(unsigned).reason.startswith("unauthenticated")
    assert g.admit(audio(0, 1, token=b"guess")).reason.startswith("unauthenticated")
    tampered = audio(0, 1)
    tampered.turn = 1
    assert g.admit(tampered).reason.startswith("unauthenticated")
    # the wrong stage for the channel or the cancel reason
    assert g.admit(signed(said(), src="tts/1", seq=5, turn=0)).reason.startswith("wrong sender")
    resumed = signed(Cancel(reason=CancelReason.USER_RESUMED), src="client/1", seq=0, turn=0)
    assert g.admit(resumed).reason.startswith("wrong sender")
    # replay and duplicates
    again = audio(0, 1)
    assert g.admit(again).verdict is Verdict.OK
    assert g.admit(again).reason.startswith("duplicate or replayed")
    assert g.admit(audio(0, 0)).reason.startswith("duplicate or replayed")
    # out of range and out of turn
    assert g.admit(audio(0, 2, duration_ms=1e12)).reason.startswith("out of range")
    for env in (
        signed(Cancel(reason=CancelReason.HEARD), src="client/1", seq=1, turn=999),
        word(999, 1),
        audio(999, 3),
    ):
        assert g.admit(env).reason.startswith("turn ahead"), env
    assert g.admit(script(1, 1)).verdict is Verdict.OK
    assert g.admit(audio(0, 4)).verdict is Verdict.LATE  # overtaken, authenticated: ignored quietly
    assert g.admit(audio(1, 0, session="other")).reason.startswith("unknown session")
    # a gap in a sender's sequence: the broker dropped messages; the turn is lost, with the reason
    got = g.admit(audio(1, 9))
    assert got.verdict is Verdict.OK and "dropped 4 tts.audio" in got.lost
    assert g.admit(signed(SessionEnd(), src="client/1", seq=0, turn=-1)).verdict is Verdict.OK
    g.end("s")
    assert g.admit(audio(1, 10)).verdict is Verdict.LATE
    c = g.counters
    assert c.dead["unauthenticated"] == 3 and c.dead["turn ahead"] == 3 and c.dead["out of range"] == 1
    assert c.late == 2 and c.lost == 1 + 4  # the dropped first script, then four audio chunks
    assert "test token" not in repr(g)


def test_a_non_ascii_auth_is_refused_as_unauthenticated_not_raised():
    """compare_digest raises TypeError on non-ASCII str: that must be a dead letter, not a handler failure
    (which would make the stage fail the genuine turn under its own signature)."""
    g = Guard(TOKEN)
    assert g.admit(script(0, 0)).verdict is Verdict.OK
    forged = audio(0, 0)
    forged.auth = "é" * 32
    assert g.admit(forged).reason.startswith("unauthenticated")
    assert g.counters.handler_errors == 0


def test_an_utterance_no_one_could_speak_is_out_of_range():
    def w(i: int, media: int, last: bool = False, dur: int = 10, gap: int | None = 0) -> UserWord:
        return UserWord(
            text="x", dur_ns=dur, index=i, pause_before=False, last_word=last, media_ns=media,
            gap_after_ns=None if last else gap,
        )  # fmt: skip

    g = Guard(TOKEN)
    assert g.admit(script(0, 0)).verdict is Verdict.OK
    fine = said(w(0, 0), w(1, 10), w(2, 30, last=True))
    assert g.admit(signed(fine, src="client/1", seq=0, turn=0)).verdict is Verdict.OK
    bad = {
        "overlapping words": said(w(0, 0), w(1, 5, last=True)),
        "index out of place": said(w(1, 0), w(0, 10, last=True)),
        "last word not last": said(w(0, 0, last=True), w(1, 10)),
        "no silence stamped after a word": said(w(0, 0, gap=None), w(1, 10, last=True)),
        "too long": said(w(0, 0, last=True, dur=MAX_SPAN_NS + 1)),
        "too many words": said(*[w(i, 10 * i, last=i == MAX_WORDS) for i in range(MAX_WORDS + 1)]),
    }
    for seq, (why, p) in enumerate(bad.items(), start=1):
        got = g.admit(signed(p, src="client/1", seq=seq, turn=0))
        assert got.reason.startswith("out of range"), why


def test_a_trusted_bus_keeps_an_utterances_verdict_and_refuses_the_same_utterances():
    """On a trusted bus an utterance's verdict is kept per payload object (clients share memoised ones):
    every utterance refused above is still refused there, the first time and when the same object comes
    again, and a fine one shared by two sessions passes for both; a subclass of a payload class is
    range-checked as its class (the per-class lookup that replaced isinstance)."""

    def w(i: int, media: int, last: bool = False, dur: int = 10, gap: int | None = 0) -> UserWord:
        return UserWord(
            text="x", dur_ns=dur, index=i, pause_before=False, last_word=last, media_ns=media,
            gap_after_ns=None if last else gap,
        )  # fmt: skip

    bad = [
        said(w(0, 0), w(1, 5, last=True)),
        said(w(1, 0), w(0, 10, last=True)),
        said(w(0, 0, last=True), w(1, 10)),
        said(w(0, 0, last=True, dur=MAX_SPAN_NS + 1)),
    ]
    fine = said(w(0, 0), w(1, 10), w(2, 30, last=True))
    g = Guard(TOKEN, trusted=True)
    for session in ("a", "b"):
        opened = g.admit(signed(script(0, 0).payload, src="client/1", seq=0, turn=0, session=session))
        assert opened.verdict is Verdict.OK
        seq = 0
        for p in [*bad, *bad]:
            seq += 1
            got = g.admit(signed(p, src="client/1", seq=seq, turn=0, session=session))
            assert got.reason.startswith("out of range: word"), got.reason
        got = g.admit(signed(fine, src="client/1", seq=seq + 1, turn=0, session=session))
        assert got.verdict is Verdict.OK, got.reason

    class LongAudio(Audio):
        pass

    g = Guard(TOKEN)
    assert g.admit(script(0, 0)).verdict is Verdict.OK
    long = LongAudio(seq=0, text="x", duration_ms=600_001.0, last=True, words=1, segment=0, meta=META)
    got = g.admit(signed(long, src="tts/1", seq=0, turn=0))
    assert got.reason == "out of range: audio duration 600001 ms", got.reason


def test_the_longest_utterance_a_scenario_can_hold_is_not_out_of_range():
    """A turn's text may be MAX_TEXT characters (voicepipe.limits): one-letter words make that 5,000 of them,
    and the client's utterance of them must pass the guard (a 2,000-word bound turned such a turn into a
    timeout: the ASR dead-lettered its only message)."""
    user = " ".join(["a"] * ((MAX_TEXT + 1) // 2))
    turn = Turn(user=user, reply="ok")  # the scenario loader accepts it
    p = spoken(turn.user, 1000.0)
    assert len(p.words) == (MAX_TEXT + 1) // 2
    g = Guard(TOKEN)
    assert g.admit(script(0, 0)).verdict is Verdict.OK
    got = g.admit(signed(p, src="client/1", seq=0, turn=0))
    assert got.verdict is Verdict.OK, got.reason


def test_only_a_trusted_bus_skips_the_mac_and_every_other_check_stays():
    """The in-process bus of a virtual run (Bus.trusted) carries unsigned messages; any other refuses them."""
    plain = Envelope.of(TurnScript(user="hi", reply="hello", words=1), "r", "s", 0)
    plain.src, plain.seq = "client/1", 0
    assert Guard(TOKEN).admit(plain).reason.startswith("unauthenticated")
    trusted = Guard(TOKEN, trusted=True)
    assert trusted.admit(plain).verdict is Verdict.OK
    assert trusted.admit(plain).reason.startswith("duplicate")  # sequence and id checks still apply
    wrong = audio(0, 0, src="client/1")
    wrong.auth = ""
    assert trusted.admit(wrong).reason.startswith("wrong sender")


async def test_a_virtual_run_sends_no_macs():
    from voicepipe.clock import run_virtual
    from voicepipe.runner import simulate_async

    seen: list[Envelope] = []
    cfg = fast_config()
    res = await asyncio.to_thread(
        run_virtual, simulate_async(cfg, [tiny_scenario()], 1, tap=lambda _ch, env: seen.append(env))
    )
    assert len(res.records) == 2 and all(r.status == "ok" for r in res.records)
    assert seen and all(env.auth == "" for env in seen)
    assert sum(res.counters.dead.values()) == 0


def test_an_adopting_replica_takes_a_dead_peers_session_where_it_stands():
    """A replica taking over a dead peer's sessions (partition.py) first sees them mid-stream, even at turn 0
    with sequence 0 on a channel: that is the takeover, not a dropped first script."""
    fresh, adopter = Guard(TOKEN), Guard(TOKEN)
    adopter.adopt = True
    assert fresh.admit(word(0, 0)).lost  # without adoption: the script the broker dropped
    got = adopter.admit(word(0, 0))
    assert got.verdict is Verdict.OK and not got.lost and adopter.counters.lost == 0
    assert adopter.admit(audio(0, 3)).verdict is Verdict.OK and not adopter.admit(audio(0, 4)).lost
    assert adopter.admit(script(1, 1)).verdict is Verdict.OK  # and it follows the session's next turn
    assert adopter.admit(word(0, 1)).verdict is Verdict.LATE


def test_the_mac_is_keyed_blake2b_of_the_whole_body_and_any_token_length_works():
    import hashlib

    from voicepipe.keys import body_verified
    from voicepipe.stages.guard import mac, verified

    env = audio(0, 3)
    body = env.to_bytes()
    zeroed = body.replace(env.auth.encode(), b"0" * 32)
    assert env.auth == hashlib.blake2b(zeroed, key=TOKEN, digest_size=16).hexdigest()
    assert body_verified(body, env.auth, TOKEN) and not body_verified(body, env.auth, b"other")
    # the payload and the times are in the MAC now: a changed reply or sent_ns no longer verifies
    for field, value in (("text", "HIJACKED"), ("duration_ms", 1.0)):
        changed = env.model_copy(update={"payload": env.payload.model_copy(update={field: value})})
        assert not verified(changed, TOKEN)
        assert not body_verified(changed.to_bytes(), env.auth, TOKEN)
    assert not verified(env.model_copy(update={"sent_ns": env.sent_ns + 1}), TOKEN)
    for token in (b"k", b"x" * 64, b"y" * 65, b"z" * 500):  # longer than BLAKE2b's key: hashed to one
        e = audio(0, 3, token=token)
        assert verified(e, token) and not verified(e, token + b"!") and mac(e, token) == e.auth
        assert Guard(token).admit(e).verdict is not Verdict.DEAD
    assert mac(env, b"y" * 65) != mac(env, b"y" * 66)  # long tokens still differ (hashed, not cut)


def forged(run: str, session: str, type_: str, turn: object, payload: dict) -> bytes:
    return json.dumps({"v": SCHEMA_VERSION, "type": type_, "run": run, "session": session, "turn": turn,
                       "payload": payload}).encode()  # fmt: skip


async def test_the_issues_attacks_change_nothing(mosquitto, monkeypatch):
    """Issue 12's forged messages, from outside (no token) and from inside (signed with the run's token but
    out of turn or absurd): every turn completes, measured as without them, and each is dead-lettered."""
    monkeypatch.setenv(TOKEN_ENV, "attack test token")
    cfg = fast_config("client.turn_timeout_s=5", broker=mosquitto.url)
    addr = BrokerAddress.parse(mosquitto.url)
    run, sess = "atk", "tiny-0"
    sent: list[str] = []

    def t(channel: str) -> str:
        return f"voicepipe/{run}/{sess}/{channel}"

    meta = {"backend": "evil", "path": "agent"}

    async def attack(_result) -> None:
        async with addr.client() as c:
            await c.subscribe(t("user/utterance"))
            await c.subscribe(t("asr/final"))
            first_word = final = False
            async for m in c.messages:
                if str(m.topic).endswith("user/utterance") and not first_word:
                    first_word = True
                    # the 90-byte message that crashed a run
                    await c.publish(t("tts/audio"), forged(run, sess, "tts.audio", 0, {"words": 999}), qos=1)
                    script = {"user": "x", "reply": "EVIL", "words": 1}
                    await c.publish(t("turn/script"), forged(run, sess, "turn.script", 0, script), qos=1)
                    await c.publish(t("user/utterance"), forged(run, sess, "user.utterance", True, {}), qos=1)
                    # signed by an insider, but for turn 999 / absurd
                    for env in await insider(addr, run, sess):
                        await c.publish(t(env.type.replace(".", "/")), env.to_bytes(), qos=1)
                    sent.append("word")
                if str(m.topic).endswith("asr/final") and not final:
                    final = True
                    hijack = {"seq": 0, "text": "HIJACKED", "duration_ms": 100.0, "last": True, "words": 7,
                              "segment": 0, "meta": meta}  # fmt: skip
                    await c.publish(t("tts/audio"), forged(run, sess, "tts.audio", 0, hijack), qos=1)
                    big = {**hijack, "duration_ms": 1e12}
                    await c.publish(t("tts/audio"), forged(run, sess, "tts.audio", 0, big), qos=1)
                    sent.append("final")
                if first_word and final:
                    return

    tasks: list[asyncio.Task] = []
    res = await run_pipeline(
        cfg,
        [tiny_scenario(turns=2)],
        1,
        run_id=run,
        on_ready=lambda r: tasks.append(asyncio.create_task(attack(r))),
    )
    await asyncio.gather(*tasks, return_exceptions=True)
    assert sent == ["word", "final"]
    assert [r.status for r in res.records] == ["ok", "ok"], [r.error for r in res.records]
    for r in res.records:
        assert "HIJACKED" not in r.reply_text and "EVIL" not in r.reply_text
        assert 0 <= r.tax_ms < 250 and abs(sum(p.ms for p in r.breakdown) - r.measured_ms) < 0.01
    assert res.records[0].measured_ms > 300  # not the forged reply's time
    acc = res.accounting()
    assert acc.expected == acc.completed == 2 and acc.balanced
    dead = res.counters.dead
    assert dead["malformed"] >= 2  # {"words": 999} and "turn": true never parse (strict validation)
    assert dead["unauthenticated"] >= 4  # forged script (x stages), hijack, 1e12
    assert dead["turn ahead"] >= 3 and dead["out of range"] >= 1
    assert res.counters.handler_errors == 0 and res.stage_errors == 0


async def insider(addr: BrokerAddress, run: str, sess: str) -> list[Envelope]:
    """Messages signed by a compromised participant (it holds the run's token, so it can read the run's
    announcement and derive this instance's key) that fit no state."""
    from voicepipe.bus.instance import Follower
    from voicepipe.stages.guard import run_token

    async with Follower(addr, run, run_token()) as f:
        token = (await f.instance()).key
    out = []
    for i, p in enumerate((Cancel(reason=CancelReason.HEARD), SessionEnd(), said())):
        env = Envelope.of(p, run, sess, 999)
        env.src, env.seq = "client/evil", i
        sign(env, token)
        out.append(env)
    big = Envelope.of(
        Audio(seq=0, text="x", duration_ms=1e12, last=True, words=1, segment=0, meta=META), run, sess, 0
    )
    big.src, big.seq = "tts/evil", 0
    sign(big, token)
    return [*out, big]


def hostile(rng: random.Random, run: str, sessions: list[str], turns: int) -> tuple[str, bytes]:
    """One hostile message: malformed bytes, lax types, or a well-formed envelope nobody signed."""
    sess = rng.choice(sessions)
    channel = rng.choice(["user/utterance", "tts/audio", "asr/final", "turn/script", "control/cancel", "route",
                          "reply/text", "session/end", "asr/partial"])  # fmt: skip
    type_ = channel.replace("/", ".")
    kind = rng.randrange(6)
    if kind == 0:
        body = rng.randbytes(rng.randrange(0, 200))
    elif kind == 1:
        body = forged(run, sess, type_, rng.choice([True, "1", 1.5, None, -5, 2**70]), {})
    elif kind == 2:  # well-formed, unsigned, plausible turn
        body = Envelope.of(
            Cancel(reason=rng.choice(list(CancelReason)), error="x"), run, sess, rng.randrange(turns)
        ).to_bytes()
        channel = "control/cancel"
    elif kind == 3:
        a = Audio(seq=0, text="HIJACKED", duration_ms=rng.choice([1.0, 1e12]), last=True, words=rng.randrange(9),
                  segment=0, meta=META)  # fmt: skip
        body, channel = Envelope.of(a, run, sess, rng.randrange(turns)).to_bytes(), "tts/audio"
    elif kind == 4:
        env = Envelope.of(said(), run, sess, 0)
        env.src, env.seq, env.auth = "client/x", rng.randrange(100), "00" * 16
        body, channel = env.to_bytes(), "user/utterance"
    else:
        body = (
            b'{"v":2,"type":"' + type_.encode() + b'","run":"' + run.encode() + b'","payload":' + b"[" * 200
        )
    return channel, body


async def test_fuzz_10000_hostile_messages_over_mosquitto(mosquitto):
    """10,000 hostile payloads during a run: every turn completes and every delivery is dead-lettered."""
    await fuzz_run(mosquitto, 10_000, sessions=2, turns=6)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("VOICEPIPE_SLOW"), reason="minutes of fuzz: set VOICEPIPE_SLOW=1")
async def test_fuzz_100000_hostile_messages_over_mosquitto(mosquitto):
    await fuzz_run(mosquitto, 100_000, sessions=4, turns=8)


async def fuzz_run(mosquitto, n: int, *, sessions: int, turns: int) -> None:
    # everything (the storm's publisher, the broker, every stage) shares this box's CPUs: turns may be slow
    # while the storm lasts, and they must still complete, so the timeout is generous
    cfg = fast_config("client.turn_timeout_s=30", broker=mosquitto.url)
    addr = BrokerAddress.parse(mosquitto.url)
    run = f"fz{n}"
    sc = tiny_scenario(turns=turns)
    # the last turn's pause keeps the run (and every stage) alive until the storm has surely been delivered:
    # ~2-4 s of publishing on a quiet box, and once over 8 s beside a valgrind job, hence 20 s
    sc.turns[-1] = sc.turns[-1].model_copy(update={"gap_ms": 20000})
    names = [f"{sc.name}-{i}" for i in range(sessions)]
    rng = random.Random(12)
    msgs = [hostile(rng, run, names, turns) for _ in range(n)]
    # deliveries: each message reaches every stage subscribed to its channel
    from voicepipe.stageset import STAGES

    subs: dict[str, int] = {}
    for name in needed_stages(cfg):
        for ch in (*STAGES[name].channels_for(cfg), "session/end"):
            subs[ch] = subs.get(ch, 0) + 1
    deliveries = sum(subs.get(ch, 0) for ch, _ in msgs)
    done = asyncio.Event()

    async def storm(_result) -> None:
        async with addr.client() as c:
            for i in range(0, n, 100):  # paced (<= 5,000/s): the stages must keep answering real turns
                await asyncio.gather(*(c.publish(f"voicepipe/{run}/{_topic_session(b)}/{ch}", b, qos=1)
                                       for ch, b in msgs[i : i + 100]))  # fmt: skip
                await asyncio.sleep(0.02)
        done.set()

    tasks: list[asyncio.Task] = []
    res = await run_pipeline(cfg, [sc], sessions, run_id=run,
                             on_ready=lambda r: tasks.append(asyncio.create_task(storm(r))))  # fmt: skip
    assert done.is_set(), "the storm outlasted the run: make the run longer"
    await asyncio.gather(*tasks)
    assert [r.status for r in res.records] == ["ok"] * sessions * turns, (
        dict(res.counters.dead),
        res.counters,
    )
    for r in res.records:
        assert "HIJACKED" not in r.reply_text and abs(sum(p.ms for p in r.breakdown) - r.measured_ms) < 0.01
    acc = res.accounting()
    assert acc.completed == acc.expected == sessions * turns and acc.balanced
    c = res.counters
    assert sum(c.dead.values()) == deliveries, dict(c.dead)
    assert c.handler_errors == 0 and res.stage_errors == 0


def _topic_session(body: bytes) -> str:
    """The session a hostile body names, if it names one (the topic must match it or the bus refuses it)."""
    try:
        return json.loads(body)["session"]
    except Exception:
        return "tiny-0"


async def test_a_bug_in_a_handler_fails_its_turn_not_the_run(monkeypatch):
    from voicepipe.stages.router import Router

    final = Router.final

    async def buggy(self, env: Envelope) -> None:
        if env.turn == 0:
            raise KeyError("bug on purpose")
        await final(self, env)

    monkeypatch.setattr(Router, "final", buggy)
    res = await run_pipeline(fast_config("client.turn_timeout_s=5"), [tiny_scenario(turns=2)], 1)
    assert [r.status for r in res.records] == ["failed", "ok"]
    assert "router failed on asr.final" in res.records[0].error and "bug on purpose" in res.records[0].error
    acc = res.accounting()
    assert acc.completed == 1 and sum(acc.failed.values()) == 1 and acc.balanced
    assert res.counters.handler_errors == 1
