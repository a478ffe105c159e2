"""Audio frames on the bus: encode/decode round trip, what the MAC binds, the sequence gate; WER."""

from __future__ import annotations

import pytest

import voicepipe.audio as audio
from voicepipe.audio import FRAME_BYTES
from voicepipe.audio.frames import DOWN, SIZE, UP, BadFrame, Frame, FrameGate, decode, encode
from voicepipe.audio.wer import wer
from voicepipe.errors import UserError

TOKEN = b"k" * 32
PCM = bytes(range(256)) * 2 + bytes(FRAME_BYTES - 512)


def frame(**kw) -> Frame:
    base = {"direction": UP, "turn": 3, "seq": 7, "media_ns": 140_000_000, "pcm": PCM, "last": True, "segment": 2}
    return Frame(**{**base, **kw})


def test_a_frame_round_trips_with_every_header_field():
    body = encode(frame(), "run1", "s-0", TOKEN)
    assert len(body) == SIZE
    assert decode(body, "run1", "s-0", TOKEN) == frame()


def test_a_short_last_frame_is_padded_with_silence():
    got = decode(encode(frame(pcm=b"\x01\x02" * 10), "r", "s", TOKEN), "r", "s", TOKEN)
    assert got.pcm == b"\x01\x02" * 10 + bytes(FRAME_BYTES - 20)


@pytest.mark.parametrize(
    ("run", "session", "token"),
    [("run2", "s-0", TOKEN), ("run1", "s-1", TOKEN), ("run1", "s-0", b"other token")],
)
def test_a_frame_moved_to_another_run_or_session_or_signed_with_another_token_is_refused(run, session, token):
    body = encode(frame(), "run1", "s-0", TOKEN)
    with pytest.raises(BadFrame, match="MAC"):
        decode(body, run, session, token)


@pytest.mark.parametrize("offset", [5, 6, 10, 14, 17, 22 + 16 + 100])  # flags, turn, seq, segment, media, samples
def test_a_changed_byte_in_the_header_or_the_samples_is_refused(offset):
    body = bytearray(encode(frame(), "run1", "s-0", TOKEN))
    body[offset] ^= 0x01
    with pytest.raises(BadFrame):
        decode(bytes(body), "run1", "s-0", TOKEN)


def test_a_body_of_the_wrong_size_or_magic_is_refused():
    body = encode(frame(), "r", "s", TOKEN)
    with pytest.raises(BadFrame, match="bytes"):
        decode(body[:-2], "r", "s", TOKEN)
    with pytest.raises(BadFrame, match="magic"):
        decode(b"XXXX" + body[4:], "r", "s", TOKEN)


def test_encode_refuses_odd_or_oversized_sample_data():
    with pytest.raises(ValueError):
        encode(frame(pcm=b"\x00" * 3), "r", "s", TOKEN)
    with pytest.raises(ValueError):
        encode(frame(pcm=bytes(FRAME_BYTES + 2)), "r", "s", TOKEN)


def test_the_gate_refuses_repeats_and_counts_gaps_per_session_and_direction():
    g = FrameGate()
    assert g.admit("a", frame(seq=0))
    assert g.admit("a", frame(seq=1))
    assert not g.admit("a", frame(seq=1))  # a repeat
    assert not g.admit("a", frame(seq=0))  # a step back
    assert g.admit("a", frame(seq=4))
    assert g.lost == 2 and g.refused == 2
    assert g.admit("a", frame(seq=0, direction=DOWN))  # the other direction has its own numbers
    assert g.admit("b", frame(seq=0))  # so has another session
    g.end("a")
    assert g.admit("a", frame(seq=0))


def test_wer_counts_substitutions_deletions_and_insertions_on_normalised_words():
    assert wer("Do you have any pastries today?", "do you have any pastries today") == 0.0
    assert wer("Yes please.", "yes") == 0.5
    assert wer("Yes please.", "yes please now") == 0.5
    assert wer("A croissant, please.", "was ah please") == pytest.approx(2 / 3)
    assert wer("Wait [900] a moment", "wait a moment") == 0.0  # pause markers are not words


def test_a_missing_engine_is_one_line_naming_the_extra(monkeypatch):
    with pytest.raises(UserError) as exc:
        audio.need("voicepipe_no_such_engine", "asr.engine pocketsphinx")
    assert "pip install 'voicepipe[audio]'" in str(exc.value) and "\n" not in str(exc.value)
    monkeypatch.setattr(audio.shutil, "which", lambda _name: None)
    with pytest.raises(UserError, match="apt-get install espeak-ng"):
        audio.need_program("espeak-ng")
