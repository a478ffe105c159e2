"""The speech-API clients (voicepipe/backends/speech.py) over real HTTP against tests/speech_server.py:
the documented request and streaming contracts, and the faults (drop, stall, 429/500, malformed stream)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.speech_server import SpeechServer
from voicepipe.backends.base import EndpointError
from voicepipe.backends.speech import speech_endpoint, synthesize_stream, transcribe

PCM = (np.sin(np.arange(16_000) * 0.1) * 3000).astype("<i2").tobytes()  # 1 s


@pytest.fixture
def server():
    s = SpeechServer().start()
    yield s
    s.stop()


def asr(srv: SpeechServer, **kw):
    return speech_endpoint("asr", {"endpoint": srv.url, "timeout": 2, **kw})


def tts(srv: SpeechServer, **kw):
    return speech_endpoint("tts", {"endpoint": srv.url, "timeout": 2, **kw})


async def speak(ep, text="one two three"):
    return [c async for c in synthesize_stream(ep, text)]


async def test_a_streamed_transcription_times_each_delta_and_sends_the_audio_as_a_16khz_wav(server):
    got: list[str] = []
    t = await transcribe(asr(server, model="m1", language="en"), PCM, got.append)
    assert t.text == "heard 16000 samples" and t.streamed
    assert "".join(got) == t.text and len(t.deltas) == 3
    assert t.sent_ns < t.deltas[0][0] <= t.deltas[-1][0] <= t.done_ns
    (req,) = server.seen
    assert req.path == "/v1/audio/transcriptions" and req.samples == 16_000
    assert req.fields == {"model": "m1", "response_format": "json", "stream": "true", "language": "en"}


async def test_a_server_that_does_not_stream_answers_one_json_final(server):
    t = await transcribe(asr(server, stream=False), PCM)
    assert t.text == "heard 16000 samples" and not t.streamed and not t.deltas


async def test_speech_streams_chunks_resampled_to_16khz_as_they_arrive(server):
    chunks = await speak(tts(server, voice="nova"))
    x = np.concatenate([c for _, c in chunks])
    assert len(chunks) == 15  # 600 ms in 40 ms chunks
    assert abs(len(x) - 0.6 * 16_000) <= 15
    times = [t for t, _ in chunks]
    assert times == sorted(times) and times[-1] - times[0] > 50e6  # streamed, not one block
    (req,) = server.seen
    assert req.path == "/v1/audio/speech"
    assert json.loads(json.dumps(req.fields)) == {"model": "tts-1", "input": "one two three", "voice": "nova",
                                                  "response_format": "pcm"}  # fmt: skip


async def test_a_wav_response_is_read_past_its_header_at_its_own_rate(server):
    server.rate = 16_000
    x = np.concatenate([c for _, c in await speak(tts(server, format="wav"))])
    assert len(x) == round(0.6 * 16_000)


async def test_the_api_key_goes_in_the_header_and_never_in_an_error(server, monkeypatch):
    monkeypatch.setenv("SPEECH_KEY", "sk-secret-123")
    server.mode = "500"
    with pytest.raises(EndpointError) as err:
        await transcribe(asr(server, api_key_env="SPEECH_KEY"), PCM)
    assert server.seen[0].headers["authorization"] == "Bearer sk-secret-123"
    assert "sk-secret" not in str(err.value) and "HTTP 500" in str(err.value)


@pytest.mark.parametrize("kind", ["asr", "tts"])
async def test_a_429_names_its_retry_after_and_retries_recover_from_it(server, kind):
    server.mode = "429"
    call = (lambda: transcribe(asr(server), PCM)) if kind == "asr" else (lambda: speak(tts(server)))
    with pytest.raises(EndpointError, match=r"rate limited \(HTTP 429, Retry-After: 0 s\): slow down"):
        await call()
    server.mode, server.fail_first = "ok", 2
    ep = asr(server, retries=2) if kind == "asr" else tts(server, retries=2)
    out = await (transcribe(ep, PCM) if kind == "asr" else speak(ep))
    assert out and len(server.seen) == 1 + 3  # the refused one, then two 429s and the answer


async def test_retries_run_out_with_the_last_reason(server):
    server.fail_first = 5
    with pytest.raises(EndpointError, match="429"):
        await transcribe(asr(server, retries=1), PCM)
    assert len(server.seen) == 2


@pytest.mark.parametrize("kind", ["asr", "tts"])
async def test_a_stalled_stream_times_out_in_one_line(server, kind):
    server.mode = "slow"
    ep = speech_endpoint(kind, {"endpoint": server.url, "timeout": 0.3})
    with pytest.raises(EndpointError, match=r"timeout: no data for 0.3 s"):
        await (transcribe(ep, PCM) if kind == "asr" else speak(ep))


@pytest.mark.parametrize("kind", ["asr", "tts"])
async def test_a_dropped_connection_mid_stream_is_named(server, kind):
    server.mode = "kill"
    with pytest.raises(EndpointError, match=r"connection dropped|ended without"):
        await (transcribe(asr(server), PCM) if kind == "asr" else speak(tts(server)))


async def test_a_malformed_transcript_stream_or_a_non_audio_answer_is_refused(server):
    server.mode = "malformed"
    with pytest.raises(EndpointError, match=r"malformed SSE .* not JSON"):
        await transcribe(asr(server), PCM)
    with pytest.raises(EndpointError, match=r"malformed audio .*text/html"):
        await speak(tts(server))


async def test_no_server_is_cannot_connect(server):
    server.stop()
    with pytest.raises(EndpointError, match="cannot connect"):
        await transcribe(asr(server), PCM)
    server.start()


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"endpoint": "ftp://x"}, "endpoint"),
        ({"endpoint": "http://h/v1", "retries": 99}, "retries"),
        ({"endpoint": "http://h/v1", "timeout": 0}, "timeout"),
        ({"endpoint": "http://h/v1", "format": "mp3"}, "format"),
        ({"endpoint": "http://h/v1", "api_key_env": 42}, "api_key_env"),
        ({"endpoint": "http://h/v1", "colour": 1}, "colour"),
    ],
)
def test_a_bad_spec_names_its_field(spec, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        speech_endpoint("asr", spec)


def test_a_url_with_a_model_after_the_hash_is_a_spec():
    ep = speech_endpoint("tts", "http://127.0.0.1:9/v1#kokoro")
    assert (ep.url, ep.model, ep.label) == ("http://127.0.0.1:9/v1", "kokoro", "tts:127.0.0.1:9/kokoro")
