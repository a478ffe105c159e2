"""A small OpenAI-compatible speech server for tests: ``POST /v1/audio/transcriptions`` and
``POST /v1/audio/speech`` over real HTTP/1.1 on a loopback socket, in a thread, misbehaving on demand.

Transcription: a multipart form with ``file`` (a WAV), ``model``, ``stream``. With ``asr="pocketsphinx"``
the server really decodes the audio; otherwise it answers the canned ``heard N samples`` (so a test can see
that the audio arrived). ``stream=true`` answers Server-Sent Events — one ``transcript.text.delta`` per
word ``delta_ms`` apart after ``first_ms``, then ``transcript.text.done`` — else JSON ``{"text": ...}``.

Speech: JSON ``{model, input, voice, response_format}``. With ``tts="espeak-ng"`` the audio is espeak-ng's
(resampled to ``rate``); otherwise a canned tone, 200 ms per word. It streams chunked, ``chunk_ms`` of audio
per chunk, the first after ``first_ms``; ``pcm`` raw s16le, ``wav`` a header (sizes unknown) then data.

``mode``: ``ok``; ``slow`` (headers, then nothing); ``kill`` (drop the socket after ``kill_after`` deltas or
chunks); ``429`` (Retry-After: 0); ``500``; ``malformed`` (a non-JSON event / an HTML body). ``fail_first``
answers that many requests with 429 before behaving. Every request is recorded (path, headers, fields).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from dataclasses import dataclass, field
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from voicepipe.files import parse_wav


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    fields: dict[str, str]
    samples: int = 0


@dataclass
class SpeechServer:
    mode: str = "ok"
    asr: str = "canned"
    tts: str = "canned"
    rate: int = 24_000
    first_ms: float = 20.0
    delta_ms: float = 5.0
    chunk_ms: float = 40.0
    kill_after: int = 2
    fail_first: int = 0
    per_s_ms: float = 0.0  # transcription: extra wait per second of audio (a decoder's real-time factor)
    per_word_ms: float = 0.0  # speech: extra wait per input word before the first audio
    seen: list[Seen] = field(default_factory=list)
    port: int = 0

    def start(self) -> SpeechServer:
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def do_POST(self) -> None:
                # the client may hang up mid-stream: one that rejects a malformed chunk does
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    srv._handle(self)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # -- the protocol --------------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("content-length", 0)))
        seen = Seen(h.path, {k.lower(): v for k, v in h.headers.items()}, {})
        self.seen.append(seen)
        if self.fail_first > 0 or self.mode in ("429", "500"):
            if self.fail_first > 0:
                self.fail_first -= 1
                code = 429
            else:
                code = int(self.mode)
            return self._plain(h, code, {"error": {"message": "slow down" if code == 429 else "boom"}})
        if h.path == "/v1/audio/transcriptions":
            return self._transcribe(h, body, seen)
        if h.path == "/v1/audio/speech":
            return self._speak(h, body, seen)
        return self._plain(h, 404, {"error": {"message": "no such route"}})

    def _plain(self, h: BaseHTTPRequestHandler, code: int, obj: object, ctype: str = "application/json") -> None:
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        h.send_response(code)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        if code == 429:
            h.send_header("Retry-After", "0")
        h.end_headers()
        h.wfile.write(data)

    def _chunk(self, h: BaseHTTPRequestHandler, data: bytes) -> None:
        h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        h.wfile.flush()

    def _start_stream(self, h: BaseHTTPRequestHandler, ctype: str) -> None:
        h.send_response(200)
        h.send_header("Content-Type", ctype)
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        h.wfile.flush()

    def _stall_or_kill(self, h: BaseHTTPRequestHandler, i: int) -> bool:
        if self.mode == "slow":
            time.sleep(30)
            return True
        if self.mode == "kill" and i >= self.kill_after:
            h.close_connection = True
            h.connection.shutdown(2)
            return True
        return False

    def _transcribe(self, h: BaseHTTPRequestHandler, body: bytes, seen: Seen) -> None:
        msg = BytesParser(policy=HTTP).parsebytes(f"Content-Type: {h.headers['content-type']}\r\n\r\n".encode() + body)
        audio = b""
        for part in msg.iter_parts():
            name = part.get_param("name", header="content-disposition")
            payload = part.get_payload(decode=True) or b""
            if name == "file":
                audio = payload
            else:
                seen.fields[str(name)] = payload.decode()
        pcm = parse_wav(audio)
        seen.samples = len(pcm) // 2
        text = self._recognise(pcm) if self.asr == "pocketsphinx" else f"heard {seen.samples} samples"
        if seen.fields.get("stream") != "true":
            return self._plain(h, 200, {"text": text})
        time.sleep(self.per_s_ms * seen.samples / 16_000 / 1e3)
        self._start_stream(h, "text/event-stream")
        time.sleep(self.first_ms / 1e3)
        words = text.split()
        for i, w in enumerate(words):
            if self._stall_or_kill(h, i):
                return
            ev = {"type": "transcript.text.delta", "delta": ("" if i == 0 else " ") + w}
            self._chunk(h, f"data: {json.dumps(ev)}\n\n".encode())
            if self.mode == "malformed":
                self._chunk(h, b"data: {not json\n\n")
            time.sleep(self.delta_ms / 1e3)
        if self._stall_or_kill(h, len(words)):
            return
        self._chunk(h, f"data: {json.dumps({'type': 'transcript.text.done', 'text': text})}\n\n".encode())
        self._chunk(h, b"")

    def _recognise(self, pcm: bytes) -> str:
        import pocketsphinx

        dec = pocketsphinx.Decoder(loglevel="FATAL")
        dec.start_utt()
        dec.process_raw(pcm, False, True)
        dec.end_utt()
        hyp = dec.hyp()
        return hyp.hypstr if hyp is not None else ""

    def _audio(self, text: str) -> np.ndarray:
        if self.tts == "espeak-ng":
            out = subprocess.run(["espeak-ng", "--stdout", "--", text], capture_output=True, check=True).stdout
            x = np.frombuffer(out[44:][: (len(out) - 44) // 2 * 2], dtype="<i2").astype(np.float64)  # 22.05 kHz
            m = int(len(x) * self.rate / 22_050)
            return np.interp(np.arange(m) * 22_050 / self.rate, np.arange(len(x)), x).astype("<i2")
        n = round(0.2 * self.rate) * max(1, len(text.split()))
        return (6000 * np.sin(np.arange(n) * 2 * np.pi * 220 / self.rate)).astype("<i2")

    def _speak(self, h: BaseHTTPRequestHandler, body: bytes, seen: Seen) -> None:
        req = json.loads(body)
        seen.fields = {k: str(v) for k, v in req.items()}
        if self.mode == "malformed":
            return self._plain(h, 200, b"<html>not audio</html>", "text/html")
        fmt = req.get("response_format", "mp3")
        x = self._audio(str(req.get("input", "")))
        self._start_stream(h, "audio/wav" if fmt == "wav" else "audio/pcm")
        time.sleep((self.first_ms + self.per_word_ms * len(str(req.get("input", "")).split())) / 1e3)
        if fmt == "wav":
            rate = self.rate
            head = b"RIFF\xff\xff\xff\xffWAVEfmt " + (16).to_bytes(4, "little") + b"\x01\x00\x01\x00"
            head += rate.to_bytes(4, "little") + (2 * rate).to_bytes(4, "little") + b"\x02\x00\x10\x00"
            self._chunk(h, head + b"data\xff\xff\xff\xff")
        per = round(self.chunk_ms / 1e3 * self.rate)
        for i, k in enumerate(range(0, len(x), per)):
            if self._stall_or_kill(h, i):
                return
            self._chunk(h, x[k : k + per].tobytes())
            time.sleep(self.chunk_ms / 1e3 / 4)  # faster than real time, as a TTS server is
        self._chunk(h, b"")
