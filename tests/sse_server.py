"""A small OpenAI-compatible chat-completions server for fault injection: real HTTP/1.1 and real SSE over
a loopback socket, in its own thread and event loop, so tests can make it misbehave on purpose.

``mode`` (settable while running): ``ok`` streams ``reply_tokens`` pieces ``token_ms`` apart, then a usage
chunk and ``[DONE]``; ``slow`` sends the response headers, then nothing; ``kill`` closes the socket after
``kill_after`` pieces (no terminating chunk); ``429`` answers rate-limited with Retry-After; ``500`` an
error; ``malformed`` sends a data line that is not JSON. It records every request's headers and body and
how each stream ended (``completed`` / ``disconnected``: the client went away mid-stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Seen:
    headers: dict[str, str]
    body: dict
    ended: str = ""  # completed | disconnected | killed | refused
    pieces_sent: int = 0


@dataclass
class SSEServer:
    mode: str = "ok"
    reply_tokens: int = 30
    token_ms: float = 5.0
    ttft_ms: float = 20.0
    kill_after: int = 5
    seen: list[Seen] = field(default_factory=list)
    port: int = 0

    def start(self) -> SSEServer:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def main() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            async with self._server:
                await self._server.serve_forever()

        def run() -> None:
            with contextlib.suppress(asyncio.CancelledError):
                self._loop.run_until_complete(main())

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(5)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        def halt() -> None:
            for t in asyncio.all_tasks(self._loop):
                t.cancel()

        self._loop.call_soon_threadsafe(halt)
        self._thread.join(5)

    def wait_for(self, pred, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return True
            time.sleep(0.01)
        return False

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: several requests per connection
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = json.loads(await reader.readexactly(int(headers.get("content-length", 0))) or b"{}")
                seen = Seen(headers, body)
                self.seen.append(seen)
                if not await self._respond(seen, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _respond(self, seen: Seen, w: asyncio.StreamWriter) -> bool:
        mode = self.mode
        if mode in ("429", "500"):
            body = json.dumps({"error": {"message": "slow down" if mode == "429" else "boom"}}).encode()
            extra = "Retry-After: 7\r\n" if mode == "429" else ""
            status = "429 Too Many Requests" if mode == "429" else "500 Internal Server Error"
            w.write(
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{extra}"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await w.drain()
            seen.ended = "refused"
            return True
        w.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"Cache-Control: no-cache\r\n\r\n"
        )
        await w.drain()

        async def send(obj: dict | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            payload = f"data: {data}\n\n".encode()
            w.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            await w.drain()

        if mode == "slow":
            await asyncio.sleep(3600)
        n = min(self.reply_tokens, int(seen.body.get("max_tokens") or self.reply_tokens))
        try:
            await asyncio.sleep(self.ttft_ms / 1e3)
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(n):
                if mode == "kill" and i == self.kill_after:
                    seen.ended = "killed"
                    w.transport.abort()
                    return False
                if mode == "malformed" and i == 3:
                    await send("{not json")
                word = f" w{i}" if i else "Word0"
                await send({"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]})
                seen.pieces_sent += 1
                await asyncio.sleep(self.token_ms / 1e3)
            await send({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            usage = {"prompt_tokens": 17, "completion_tokens": n, "total_tokens": 17 + n}
            await send({"choices": [], "usage": usage})
            await send("[DONE]")
            w.write(b"0\r\n\r\n")
            await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            seen.ended = "disconnected"
            return False
        seen.ended = "completed"
        return True
