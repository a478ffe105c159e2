"""Distrust the bus: every message must fit the session's state before a stage acts on it.

Anyone who can publish on the broker can put a well-formed envelope on a run's topics (issue 12: one forged
``tts.audio`` crashed a run, others falsified turns or cost each turn a 29 s timeout). So a stage admits a
message only when all of these hold, in this order:

1. **authenticated**: ``auth`` is a 128-bit MAC of the whole wire body — routing facts, spans, ``sent_ns`` and
   payload — under the key of this run *instance* (:mod:`voicepipe.keys`): derived from the run's token
   (``VOICEPIPE_RUN_TOKEN`` for stages in other processes) and a fresh nonce each start of a run announces
   (:mod:`voicepipe.bus.instance`). So a message recorded in an earlier run with the same id and token, or
   sent by a concurrent one, never verifies here; neither does a captured message re-sent with another
   payload, on one broker or across a bridge. The MQTT bus checks the MAC on the raw bytes it received and
   leaves its verdict on the envelope (no second serialisation); the token itself never travels, is never
   printed and has no repr. Why a MAC in the envelope rather than MQTT 5 user properties: it works the same
   on every bus (MQTT 3.1.1, the embedded amqtt broker, the in-memory bus of ``predict``), and a property
   holding a plain token would hand it to anyone who can read the run's topics. The one exception: the
   in-process bus of a virtual run (``predict``, ``capacity``; :attr:`voicepipe.bus.base.Bus.trusted`) carries
   no MACs, since nothing outside the run's own stages can reach it; checks 2-6 still apply there.
   **Joined** (the client's guard, live runs): the sender instance must be one of the run's own stages or
   one that joined this instance with a signed hello (its liveness marker, :mod:`voicepipe.bus.liveness`).
2. **the right sender**: each channel has owners (``user.utterance`` only from the client, ``tts.audio`` only from
   the TTS or the cache...), and each cancel reason its own (only the ASR withdraws a segment).
3. **in sequence**: per (sender instance, session, channel) the sequence numbers rise by one. A repeat or a
   step back is refused (duplicate / replay); a jump means the broker dropped messages on the way (a queue
   limit): the message is used, the loss is counted, and unless the channel is best-effort (QoS 0 partials)
   the turn is reported lost with that reason (:class:`Verdict.lost`).
4. **no duplicate id** within the session.
5. **the current turn of a known session**: sessions are opened by the client's ``turn.script`` for turn 0
   and move on by the client's scripts (turn + 1; further only when a sequence gap shows that the scripts in
   between were dropped). An authenticated message for turn 0 of an unknown session, or for the turn after
   the current one, means the script was dropped on the way: the session follows, and the turn is reported
   lost. A message for any later turn is refused; one for an earlier turn, or after ``session.end``, is *late* (authenticated, legitimately
   overtaken: e.g. audio still in flight when the client moved on) — ignored and counted, not dead-lettered.
6. **values in range**: span durations non-negative and at most :data:`MAX_SPAN_NS`, at most
   :data:`MAX_SPANS` spans, audio chunks at most :data:`MAX_AUDIO_MS`, word durations and media positions
   at most :data:`MAX_SPAN_NS`.

What fails a check is dead-lettered with its reason and counted per reason (:class:`Counters`); it never
raises. The guard is pure bookkeeping (no I/O, no clock), so it can be tested on its own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from voicepipe.keys import TOKEN_ENV, mac, require_shared_token, run_token, sign, verified
from voicepipe.limits import MAX_SPEECH_MS, MAX_TEXT
from voicepipe.messages import Audio, Cancel, CancelReason, Envelope, UserUtterance

__all__ = ["TOKEN_ENV", "Guard", "mac", "require_shared_token", "run_token", "sign", "verified"]

# A span longer than an hour is not a voice turn (the longest scripted or modelled duration is a minute:
# voicepipe.limits.MAX_MS); the chain of one turn is ~10-20 spans, 256 leaves room for any council.
MAX_SPAN_NS = 3_600 * 10**9
MAX_SPANS = 256
# One audio chunk is at most one reply or cached answer: the loader refuses any that takes longer to say at
# its speaking rate (voicepipe.limits.MAX_SPEECH_MS), so our own audio never meets this bound.
MAX_AUDIO_MS = MAX_SPEECH_MS
# The most words a scenario's utterance can hold: its text is at most MAX_TEXT characters (voicepipe.limits),
# a word and the space after it at least two. A legitimate utterance is never refused: the loader bounds its
# spoken length, pauses included, by MAX_SPEECH_MS (well inside MAX_SPAN_NS); 2,000 refused scenarios the
# loader accepts.
MAX_WORDS = (MAX_TEXT + 1) // 2

STAGES = ("client", "asr", "router", "agent", "council", "cache", "tts")
OWNERS: dict[str, frozenset[str]] = {
    "turn.script": frozenset({"client"}),
    "user.utterance": frozenset({"client"}),
    "user.speech_start": frozenset({"client", "asr"}),  # asr: its real VAD heard a barge-in
    "session.end": frozenset({"client"}),
    "turn.record": frozenset({"client"}),
    "asr.partial": frozenset({"asr"}),
    "asr.final": frozenset({"asr"}),
    "route": frozenset({"router", "cache"}),
    "reply.text": frozenset({"agent", "council"}),
    "tts.audio": frozenset({"tts", "cache"}),
    "control.cancel": frozenset(STAGES),
}
CANCEL_OWNERS: dict[CancelReason, frozenset[str]] = {
    CancelReason.USER_RESUMED: frozenset({"asr"}),
    CancelReason.PREEMPTIVE_MISMATCH: frozenset({"router"}),
    CancelReason.HEARD: frozenset({"client"}),
    CancelReason.BARGE_IN: frozenset({"tts"}),
    CancelReason.FAILED: frozenset(STAGES),  # any stage whose handler failed fails the turn
    CancelReason.LOST: frozenset(STAGES),  # any stage that saw the broker drop the turn's messages
}
LOSSY = frozenset(
    {"asr.partial"}
)  # published at QoS 0: the broker may drop them, the turn does not depend on them


class Verdict(Enum):
    OK = "ok"
    LATE = "late"  # authenticated but overtaken (earlier turn, ended session): ignore quietly
    DEAD = "dead"  # dead-letter with the reason


@dataclass
class Counters:
    """What one stage did with what it received (summed over stages for the run's summary)."""

    received: int = 0
    dead: Counter[str] = field(default_factory=Counter)  # reason -> messages dead-lettered
    late: int = 0
    lost: int = 0  # messages the broker dropped on the way here (sequence gaps)
    handler_errors: int = 0
    # deliveries the bus dropped before the guard, as a copy of an envelope id already seen (a QoS 1
    # redelivery, a replayed capture, a tampered re-publication keeping its id)
    duplicates: int = 0

    def add(self, other: Counters) -> None:
        self.received += other.received
        self.duplicates += other.duplicates
        self.dead.update(other.dead)
        self.late += other.late
        self.lost += other.lost
        self.handler_errors += other.handler_errors


@dataclass
class SessionState:
    turn: int = -1
    seqs: dict[tuple[str, str], int] = field(default_factory=dict)  # (sender, channel) -> last sequence
    ids: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Admission:
    verdict: Verdict
    reason: str = ""
    lost: str = ""  # with OK: the broker dropped messages before this one (why the turn is lost)


ADMITTED = Admission(Verdict.OK)  # the common verdict, shared (an admission is never changed)


class Guard:
    """One stage's view of which sessions exist, where they are, and who may say what."""

    def __init__(self, token: bytes, *, client_side: bool = False, trusted: bool = False) -> None:
        self.token = token  # the run instance's key (voicepipe.keys.Instance.key)
        self.trusted = trusted  # on a bus only this run's stages can reach (Bus.trusted): no MAC to check
        self.client_side = client_side  # the client opens and advances its own sessions (:meth:`open`)
        self.sessions: dict[str, SessionState] = {}
        self.ended: set[str] = set()
        self.counters = Counters()
        # a replica that takes over the sessions of a dead peer (voicepipe.bus.partition) first sees them
        # mid-stream: it adopts each session and each sender's sequence where it finds them
        self.adopt = False
        self._kinds: dict[str, str] = {}  # sender instance -> its stage kind (kind/replica)
        # the sender instances that joined this run instance (the run's own stages, and those whose signed
        # hello arrived); None: any holder of the key (a stage's guard, the in-process bus)
        self.joined: set[str] | None = None

    def __repr__(self) -> str:  # never the token
        return f"Guard(sessions={len(self.sessions)})"

    # -- the client's own sessions ----------------------------------------------------------------
    def open(self, session: str, turn: int) -> None:
        """The client starts ``turn`` of ``session`` (the client is the only source of turns)."""
        self.ended.discard(session)
        self.sessions.setdefault(session, SessionState()).turn = turn

    def end(self, session: str) -> None:
        self.sessions.pop(session, None)
        self.ended.add(session)

    # -- admission ----------------------------------------------------------------------------------
    def admit(self, env: Envelope) -> Admission:
        self.counters.received += 1
        got = self._check(env)
        if got.verdict is Verdict.DEAD:
            self.counters.dead[got.reason.split(":", 1)[0]] += 1
        elif got.verdict is Verdict.LATE:
            self.counters.late += 1
        return got

    def _check(self, env: Envelope) -> Admission:
        d = env.__dict__  # the fields themselves (every message takes this path): no attribute machinery
        if not self.trusted and (not d["auth"] or not verified(env, self.token)):
            return Admission(Verdict.DEAD, "unauthenticated: no valid MAC under this run instance's key")
        src, type_, seq = d["src"], d["type"], d["seq"]
        joined = self.joined
        if joined is not None and src not in joined:
            return Admission(Verdict.DEAD, f"not joined: sender {src!r} sent no hello to this run instance")
        kind = self._kinds.get(src)
        if kind is None:
            kind = self._kinds[src] = src.partition("/")[0]
        if kind not in OWNERS[type_]:
            return Admission(Verdict.DEAD, f"wrong sender: {kind!r} may not send {type_}")
        p = d["payload"]
        if _kind(p) == _CANCEL and kind not in CANCEL_OWNERS[p.reason]:
            return Admission(Verdict.DEAD, f"wrong sender: {kind!r} may not cancel for {p.reason.value!r}")
        bad = out_of_range(env, self.trusted)
        if bad:
            return Admission(Verdict.DEAD, f"out of range: {bad}")
        session, turn = d["session"], d["turn"]
        if session in self.ended:
            return Admission(Verdict.LATE, "session ended")
        st = self.sessions.get(session)
        dropped_script = ""
        if st is None:
            if type_ == "session.end":
                return Admission(Verdict.LATE, "nothing to end")  # its scripts were all dropped on the way
            if self.adopt and not self.client_side:
                # a dead peer's session (even at turn 0, its script seen only by the peer): take it where it
                # stands; a new session whose first script the broker dropped then shows as a late turn
                st = self.sessions[session] = SessionState(turn=turn - (type_ == "turn.script"))
            elif self.client_side or turn != 0:
                return Admission(Verdict.DEAD, f"unknown session: {session!r} was never opened by the client")
            elif type_ != "turn.script":
                # authenticated, turn 0: the client opened this session, but its script never came here
                dropped_script = "the broker dropped the session's first turn.script"
            if st is None:
                st = self.sessions[session] = SessionState(turn=0 if dropped_script else -1)
        # sequence per (sender, channel): MQTT keeps order per topic, not across topics or QoS levels
        key = (src, type_)
        seqs = st.seqs
        last = seqs.get(key, seq - 1 if self.adopt else -1)
        if seq <= last:
            return Admission(Verdict.DEAD, f"duplicate or replayed: sequence {seq} after {last}")
        seqs[key] = seq
        id_, ids = d["id"], st.ids
        if id_ in ids:
            return Admission(Verdict.DEAD, f"duplicate id: {id_}")
        ids.add(id_)
        lost = seq - last - 1
        if type_ == "session.end":
            return ADMITTED
        if self.client_side:
            if turn > st.turn:
                return Admission(Verdict.DEAD, f"turn ahead: {turn} while the session is at {st.turn}")
            if turn < st.turn:
                return Admission(Verdict.LATE, "earlier turn")
        elif type_ == "turn.script":
            if turn == st.turn + 1 or (lost > 0 and turn > st.turn):
                # the next turn (or a later one when a sequence gap shows that the scripts between were dropped)
                st.turn = turn
                st.ids = {id_}  # ids of earlier turns can no longer matter: overtaken messages are late
            elif turn <= st.turn:
                return Admission(Verdict.DEAD, f"turn script repeated: turn {turn} already started")
            else:
                return Admission(Verdict.DEAD, f"turn ahead: {turn} while the session is at {st.turn}")
        elif turn == st.turn + 1 and st.turn >= 0:
            # authenticated, one turn on: the client moved on, but its script for that turn never came here
            st.turn = turn
            st.ids = {id_}
            dropped_script = f"the broker dropped the turn.script of turn {turn}"
        elif turn > st.turn:
            return Admission(Verdict.DEAD, f"turn ahead: {turn} while the session is at {st.turn}")
        elif turn < st.turn:
            return Admission(Verdict.LATE, "earlier turn")
        if dropped_script:
            self.counters.lost += 1
            return Admission(Verdict.OK, lost=f"{dropped_script} (a queue limit?)")
        if lost > 0:
            self.counters.lost += lost
            if type_ not in LOSSY:
                return Admission(
                    Verdict.OK,
                    lost=f"the broker dropped {lost} {type_} message(s) from {kind} "
                    f"(sequence {last} -> {seq}; a queue limit?)",
                )
        return ADMITTED


# What kind of payload the range checks look at, per payload class: a class test per message instead of
# isinstance (pydantic's model classes are ABCs, whose isinstance costs ~3x a plain class test on a miss)
_OTHER, _AUDIO, _UTTERANCE, _CANCEL = 0, 1, 2, 3
_kinds: dict[type, int] = {}


def _kind(p: object) -> int:
    cls = p.__class__
    got = _kinds.get(cls)
    if got is None:
        got = _kinds[cls] = (
            _AUDIO
            if isinstance(p, Audio)
            else _UTTERANCE
            if isinstance(p, UserUtterance)
            else _CANCEL
            if isinstance(p, Cancel)
            else _OTHER
        )
    return got


# On a trusted bus (a virtual run's in-process bus) an utterance payload is an object the run's client built and
# shares between the sessions that say it (voicepipe.stages.client.spoken: memoised, never changed once
# built), so its verdict is kept per object (with the object, so its id cannot be reused meanwhile): one
# check per utterance of the run instead of one per turn (a word-by-word walk: ~2 % of a virtual turn's
# instructions, callgrind). On other buses every message is parsed into new objects: checked each time.
_UTTERANCE_VERDICTS_KEEP = 1024
_utterance_verdicts: dict[int, tuple[UserUtterance, str]] = {}


def out_of_range(env: Envelope, trusted: bool = False) -> str:
    """What in ``env`` no real turn could produce ("" when nothing). ``trusted``: the message came over a
    trusted bus (:attr:`voicepipe.bus.base.Bus.trusted`), where an utterance's verdict is kept per payload object."""
    d = env.__dict__
    turn, spans = d["turn"], d["spans"]
    if turn < -1 or (turn == -1) != (d["type"] == "session.end"):
        return f"turn {env.turn} of a {env.type}"
    if d["seq"] < 0:
        return f"sequence {env.seq}"
    if len(spans) > MAX_SPANS:
        return f"{len(spans)} spans"
    for s in spans:
        if not 0 <= s.dur_ns <= MAX_SPAN_NS:
            return f"span {s.stage}/{s.what} duration {s.dur_ns} ns"
    p = d["payload"]
    kind = _kind(p)
    if kind == _AUDIO and p.duration_ms > MAX_AUDIO_MS:
        return f"audio duration {p.duration_ms:g} ms"
    if kind == _UTTERANCE:
        if not trusted:
            return _bad_utterance(p)
        got = _utterance_verdicts.get(id(p))
        if got is not None and got[0] is p:
            return got[1]
        verdict = _bad_utterance(p)
        if len(_utterance_verdicts) >= _UTTERANCE_VERDICTS_KEEP:
            _utterance_verdicts.clear()
        _utterance_verdicts[id(p)] = (p, verdict)
        return verdict
    return ""


def _bad_utterance(p: UserUtterance) -> str:
    """What in an utterance no spoken one has: too many words, a value past the limits, words out of order
    on the media timeline (each starts after the one before ends), a misplaced index or last word, a silence
    after the last word or none after another (the client stamps the gap to the next word on every other)."""
    words = p.words
    if len(words) > MAX_WORDS:
        return f"{len(words)} words"
    end = 0
    last = len(words) - 1
    for i, w in enumerate(words):
        if w.dur_ns > MAX_SPAN_NS or w.media_ns > MAX_SPAN_NS or (w.gap_after_ns or 0) > MAX_SPAN_NS:
            return "word duration, media position or gap"
        if (
            w.index != i
            or w.last_word != (i == last)
            or (w.gap_after_ns is None) != (i == last)
            or w.media_ns < end
        ):
            return f"word {i} out of order"
        end = w.media_ns + w.dur_ns
    return ""
