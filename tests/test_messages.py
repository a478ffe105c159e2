"""Typed bus messages: strict payloads per type, the wire schema, dead-letter reasons."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from voicepipe.messages import (
    PAYLOADS,
    Audio,
    BadMessage,
    Cancel,
    CancelReason,
    Envelope,
    Partial,
    Path,
    ReplyText,
    Route,
    Target,
    TurnMeta,
    parse,
)


def _audio() -> Envelope:
    meta = TurnMeta(backend="b", path=Path.AGENT, cost_usd=1e-5)
    audio = Audio(seq=0, text="hi", duration_ms=250.0, last=True, words=3, segment=0, meta=meta)
    return Envelope.of(audio, "r1", "s-0", 2)


def test_round_trip_gives_the_typed_payload():
    env = parse(_audio().to_bytes())
    assert isinstance(env.payload, Audio)
    assert env.payload.meta.path is Path.AGENT and env.turn == 2
    cancel = parse(Envelope.of(Cancel(reason=CancelReason.BARGE_IN), "r", "s").to_bytes())
    assert cancel.payload.reason is CancelReason.BARGE_IN


@pytest.mark.parametrize(
    ("where", "value", "msg"),
    [
        (("turn",), True, "valid integer"),  # no bool -> int
        (("payload", "words"), "3", "valid integer"),  # no str -> int
        (("payload", "duration_ms"), float("nan"), "finite"),
        (("payload", "duration_ms"), float("inf"), "finite"),
        (("payload", "meta", "path"), "telepathy", "payload.meta.path"),
        (("payload", "extra"), 1, "Extra inputs"),
    ],
)
def test_lax_or_wrong_values_are_rejected(where, value, msg):
    body = json.loads(_audio().to_bytes())
    d = body
    for k in where[:-1]:
        d = d[k]
    d[where[-1]] = value
    with pytest.raises(BadMessage, match=msg):
        parse(json.dumps(body))


def test_payload_must_fit_the_type():
    with pytest.raises(ValueError, match="must be Route"):
        Envelope(type="route", run="r", session="s", payload=Cancel(reason=CancelReason.HEARD))
    body = json.loads(_audio().to_bytes())
    body["type"] = "asr.partial"
    with pytest.raises(BadMessage, match=r"asr\.partial"):
        parse(json.dumps(body))
    route = Route(target=Target.CACHE, text="hi", words=1, segment=0, fallback="council")
    assert parse(Envelope.of(route, "r", "s").to_bytes()).payload == route
    assert (
        parse(Envelope.of(Partial(text="a", words=1, segment=0), "r", "s").to_bytes()).payload.eager is False
    )


def test_schema_describes_each_type_with_its_payload():
    schema = Envelope.model_json_schema()
    assert set(schema["discriminator"]["mapping"]) == set(PAYLOADS)
    variants = {
        v["properties"]["type"]["const"]: v["properties"]["payload"]["$ref"].rsplit("/", 1)[-1]
        for v in (schema["$defs"][ref["$ref"].rsplit("/", 1)[-1]] for ref in schema["oneOf"])
    }
    assert variants["route"] == "Route" and variants["turn.record"] == "TurnRecord"
    cancel = schema["$defs"]["Cancel"]["properties"]["reason"]
    assert cancel["$ref"].endswith("CancelReason")
    assert set(schema["$defs"]["CancelReason"]["enum"]) == {r.value for r in CancelReason}


def test_rebase_shifts_a_copy_and_leaves_the_received_envelope_alone():
    """A receiver moves the spans onto its clock on a copy (the received envelope may be shared by other
    subscribers); the copy is what model_copy would give, and survives the wire."""
    from voicepipe.messages import Final, Span
    from voicepipe.stages.base import rebase

    spans = [Span(stage="asr", what="endpoint wait", start_ns=1_000, dur_ns=5), Span(
        stage="asr", what="finalise", start_ns=2_000, dur_ns=7, modelled=False, predicted_ns=6)]  # fmt: skip
    env = parse(Envelope.of(Final(text="a b", words=2, segment=0), "r", "s", 1, spans).to_bytes())
    moved = rebase(env, env.sent_ns + 500)
    want = env.model_copy(
        update={
            "sent_ns": env.sent_ns + 500,
            "spans": [s.model_copy(update={"start_ns": s.start_ns + 500}) for s in env.spans],
        }
    )
    assert moved == want and type(moved) is type(env)
    assert [s.start_ns for s in env.spans] == [1_000, 2_000]  # the received one is unchanged
    assert parse(moved.to_bytes()).model_dump() == moved.model_dump()
    assert rebase(env, env.sent_ns) is env  # no hop, nothing to move


@pytest.mark.parametrize(
    "config", [None, "scenarios/configs/preemptive.yaml", "scenarios/configs/council-vote.yaml"]
)
def test_every_message_of_a_virtual_run_is_what_the_wire_parser_accepts(config):
    """The in-memory bus passes the objects stages built, some of them without pydantic's validation
    (voicepipe.construct, spans.modelled_span, memoised payloads): each must be exactly what the MQTT bus's
    parser makes of its JSON."""
    from voicepipe.config import load_config
    from voicepipe.runner import simulate
    from voicepipe.scenario import load_scenario

    seen: list[Envelope] = []
    cfg = load_config(config, [])
    res = simulate(
        cfg, [load_scenario("rapid-fire"), load_scenario("barge-in")], 2, tap=lambda _, e: seen.append(e)
    )
    assert res.records and not res.stage_errors
    assert {"user.utterance", "asr.final", "reply.text", "tts.audio", "turn.record"} <= {e.type for e in seen}
    for env in seen:
        back = parse(env.to_bytes())  # the wire's variant class: compare the values, field by field
        assert back.model_dump() == env.model_dump(), env.type
        assert type(back.payload) is type(env.payload) and back.payload == env.payload, env.type
        assert all(type(a) is type(b) for a, b in zip(back.spans, env.spans, strict=True)), env.type
        assert back.to_bytes() == env.to_bytes(), env.type  # the same JSON: no int where a float belongs


@pytest.mark.parametrize(
    "config", [None, "scenarios/configs/preemptive.yaml", "scenarios/configs/council-vote.yaml"]
)
def test_payloads_built_without_validation_are_what_validation_makes(config):
    """reply_text() and audio() skip pydantic's validation for values already of their types: each such payload
    of a virtual run must equal, field by field and type by type (and in the fields it counts as set), what
    the validating constructor makes of the same values; a value of another type or out of range is
    validated (and refused) as the constructor would."""
    from voicepipe.config import load_config
    from voicepipe.messages import audio, reply_text
    from voicepipe.runner import simulate
    from voicepipe.scenario import load_scenario

    def same(a, b) -> bool:
        return (
            a.__dict__ == b.__dict__
            and all(type(a.__dict__[k]) is type(v) for k, v in b.__dict__.items())
            and a.model_fields_set == b.model_fields_set
        )

    seen: list[Envelope] = []
    cfg = load_config(config, [])
    res = simulate(
        cfg, [load_scenario("rapid-fire"), load_scenario("barge-in")], 2, tap=lambda _, e: seen.append(e)
    )
    checked = 0
    for env in seen:
        p = env.payload
        if type(p) in (ReplyText, Audio):
            assert same(type(p)(**p.__dict__), p), env.type
            checked += 1
    assert checked > 10 and res.records
    meta = TurnMeta(backend="b", path=Path.AGENT)
    assert same(audio(0, "a", 2, True, 1, 0, meta), Audio(seq=0, text="a", duration_ms=2, last=True, words=1,
                                                         segment=0, meta=meta))  # fmt: skip
    assert type(audio(0, "a", 2, True, 1, 0, meta).duration_ms) is float  # validated: the int became a float
    for bad in ({"duration_ms": -1.0}, {"duration_ms": float("nan")}, {"seq": -1}, {"last": 1}):
        with pytest.raises(ValidationError):
            audio(**{"seq": 0, "text": "a", "duration_ms": 1.0, "last": True, "words": 1, "segment": 0,
                     "meta": meta, **bad})  # fmt: skip
    for bad in ({"seq": True}, {"words": -2}, {"text": None}, {"final": 1}):
        with pytest.raises(ValidationError):
            reply_text(
                **{"text": "a", "seq": 0, "final": True, "words": 1, "segment": 0, "meta": meta, **bad}
            )
    as_dict = reply_text("a", 0, True, 1, 0, meta.model_dump())  # type: ignore[arg-type]  # validated
    assert same(as_dict, ReplyText(text="a", seq=0, final=True, words=1, segment=0, meta=meta))
