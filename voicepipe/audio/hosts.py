"""The real ASR's blocking engine calls, off the event loop: engine host processes.

PocketSphinx holds the GIL for the whole of each call (a 20 ms frame is ~8 ms of CPU; loading its model
~0.5 s): in a thread of the stage's process it would still stall the event loop that carries every other
session's frames and the bus's messages. So each :class:`Listener` — one session's VAD and PocketSphinx
decoder — lives in an **engine host**, a child process (``python -c``) that serves requests on its stdin
and answers on its stdout in order, one at a time. A stage's :class:`EnginePool` starts at most ``size``
hosts (bounded: ``ENGINE_PROCESSES`` by default, one per core up to four) and places each new listener on
the host with the fewest; a session's requests go to one host in order, so its frames are decoded in order.
A listener comes back to the pool when its turn's listening ends, and also when its turn ends while it
is still loading (the opener cancelled): it joins the idle ones once its host has it, so no decoder is left
on a host that no one holds.
The loop side only writes a request and awaits its answer (no thread): the stage's media-time stamps and
arrival times are taken where they were before, in the receive path.

With ``with_rec`` false a listener is a VAD only (a speech endpoint transcribes the audio instead); Silero
runs in ONNX Runtime, WebRTC VAD in microseconds: in the host they cost the loop nothing either.

:data:`OFFLOAD` (true) is the switch ``bench/audio_cost.py --engines-on-loop`` turns off to measure the
before: :class:`InlineListener` runs the same engines synchronously on the event loop.

A host that dies fails the calls in flight and every later call (:class:`EngineFailed`): the turn fails with
that reason. Stopping the pool closes the hosts' stdin; a host exits on end of input (and ignores SIGINT:
Ctrl-C is its parent's to handle).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import sys
from collections import deque
from typing import Any, Protocol

import numpy as np

from voicepipe.audio.engines import Recognizer, Vad, last_voiced_sample, make_vad

OFFLOAD = True  # engines in host processes (False: on the event loop, the measured "before")
ENGINE_PROCESSES = max(1, min(4, os.cpu_count() or 1))
HOST_CODE = "from voicepipe.audio.hosts import host_main; host_main()"
SPENT_CPU_S = [0.0]  # CPU seconds of the engine hosts stopped so far in this process (bench/audio_cost.py)


def _cpu_s(pid: int) -> float:
    """utime + stime of a live child (Linux /proc; 0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class EngineFailed(RuntimeError):
    """An engine host answered with an error, or is gone."""


# -- the host process ------------------------------------------------------------------------------------
def voiced_end(pcm: bytes) -> int:
    """The sample just after the frame's last voiced window by the caller's energy stopwatch (-1: none)."""
    end = last_voiced_sample(np.frombuffer(pcm, dtype="<i2"))
    return -1 if end is None else end


def _send(out: Any, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(len(data).to_bytes(4, "little") + data)
    out.flush()


def host_main() -> None:
    """An engine host: requests ``(op, id, arg)`` in, answers ``(ok, value)`` out, in order, until end of input.
    Ops: ``open`` (arg: vad engine, threshold, webrtc mode, with a recognizer), ``hear`` (a frame: its VAD
    decision, the live hypothesis, and where its voiced samples end: :func:`voiced_end`), ``finish`` (close the utterance: the final hypothesis), ``close``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    engines: dict[int, tuple[Vad, Recognizer | None]] = {}
    while True:
        head = inp.read(4)
        if len(head) < 4:
            return
        op, eid, arg = pickle.loads(inp.read(int.from_bytes(head, "little")))
        try:
            if op == "open":
                vad_engine, threshold, mode, with_rec = arg
                engines[eid] = (make_vad(vad_engine, threshold, mode), Recognizer() if with_rec else None)
                value: object = None
            elif op == "hear":
                vad, rec = engines[eid]
                speech = vad.speech(arg)
                if rec is not None:
                    rec.feed(arg)
                value = (speech, rec.partial() if rec is not None else "", voiced_end(arg))
            elif op == "finish":
                vad, rec = engines[eid]
                value = rec.finish() if rec is not None else ""
                engines[eid] = (make_vad(*arg), rec) if arg else (vad, rec)  # a fresh VAD for the next user
            elif op == "close":
                engines.pop(eid, None)
                value = None
            else:
                raise ValueError(f"unknown op {op!r}")
            _send(out, (True, value))
        except Exception as exc:  # answered, not fatal: the caller fails its turn with the reason
            _send(out, (False, f"{type(exc).__name__}: {exc}"))


# -- the stage's side ----------------------------------------------------------------------------------
class EngineHost:
    """One engine host process and its queue of unanswered requests (answers come back in request order)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.reader: asyncio.Task[None] | None = None
        self.listeners = 0
        self.dead: str | None = None
        self.starting: asyncio.Future[None] | None = None  # the start, shared by every opener that waits on it

    async def ready(self) -> None:
        """Started (the first caller starts it; the others await the same start)."""
        if self.starting is None:
            self.starting = asyncio.ensure_future(self.start())
        await asyncio.shield(self.starting)

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", HOST_CODE, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        self.reader = asyncio.create_task(self._read(), name=f"engine-host-{self.index}")

    def call(self, op: str, eid: int, arg: object = None) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.dead is not None or self.proc is None or self.proc.stdin is None:
            fut.set_exception(EngineFailed(self.dead or "engine host not started"))
            return fut
        data = pickle.dumps((op, eid, arg), protocol=pickle.HIGHEST_PROTOCOL)
        self.pending.append(fut)
        self.proc.stdin.write(len(data).to_bytes(4, "little") + data)
        return fut

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        stdout = self.proc.stdout
        try:
            while True:
                n = int.from_bytes(await stdout.readexactly(4), "little")
                ok, value = pickle.loads(await stdout.readexactly(n))
                fut = self.pending.popleft()
                if fut.done():  # its caller was cancelled: the answer is dropped
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(EngineFailed(value))
        except (asyncio.IncompleteReadError, ConnectionError):
            rc = await self.proc.wait()
            self.dead = f"asr engine process exited (code {rc})"
        finally:
            while self.pending:
                fut = self.pending.popleft()
                if not fut.done():
                    fut.set_exception(EngineFailed(self.dead or "asr engine process stopped"))

    async def stop(self, timeout_s: float = 5.0) -> None:
        if self.starting is not None and not self.starting.done():
            with contextlib.suppress(Exception):
                await self.starting
        if self.proc is None:
            return
        SPENT_CPU_S[0] += _cpu_s(self.proc.pid)  # (a request still in flight when stopped is not counted)
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: a fire-and-forget call that failed is not an unhandled error


class Listener:
    """One session's VAD (and PocketSphinx decoder, ``with_rec``) in an engine host."""

    def __init__(self, host: EngineHost, eid: int, vad_args: tuple[str, float, int]) -> None:
        self.host, self.eid, self.vad_args = host, eid, vad_args

    async def hear(self, pcm: bytes, media_ns: int = 0) -> tuple[bool, str, int]:
        """This 20 ms frame: is it speech, the live hypothesis after it ('' without a recognizer), and the
        sample just after its last voiced window (-1: none voiced). ``media_ns`` (the frame's place in the
        turn's audio) is for a scripted recogniser; the engines hear the samples alone."""
        speech, hyp, end = await self.host.call("hear", self.eid, pcm)
        return bool(speech), str(hyp), int(end)

    async def finish(self) -> str:
        """Close the utterance: the final hypothesis (the decoder is ready for the next one)."""
        return str(await self.host.call("finish", self.eid))

    def reset(self) -> None:
        """Close the utterance and give the listener a fresh VAD, without waiting (it is queued before any
        later request, so the next user of this listener starts clean)."""
        self.host.call("finish", self.eid, self.vad_args).add_done_callback(_consume)


class Hears(Protocol):
    """What the ASR stage hears a turn through: a listener, or one wrapped (a script's transcript)."""

    async def hear(self, pcm: bytes, media_ns: int = 0) -> tuple[bool, str, int]: ...

    async def finish(self) -> str: ...


class InlineListener:
    """The same engines on the event loop (``OFFLOAD = False``): the "before" of the bench."""

    def __init__(self, vad_args: tuple[str, float, int], with_rec: bool) -> None:
        self.vad_args = vad_args
        self.vad = make_vad(*vad_args)
        self.rec = Recognizer() if with_rec else None

    async def hear(self, pcm: bytes, media_ns: int = 0) -> tuple[bool, str, int]:
        speech = self.vad.speech(pcm)
        if self.rec is None:
            return speech, "", voiced_end(pcm)
        self.rec.feed(pcm)
        return speech, self.rec.partial(), voiced_end(pcm)

    async def finish(self) -> str:
        return self.rec.finish() if self.rec is not None else ""

    def reset(self) -> None:
        if self.rec is not None:
            self.rec.finish()
        self.vad = make_vad(*self.vad_args)


class EnginePool:
    """A stage's engine hosts (at most ``size``) and its idle listeners (loading a decoder costs ~0.5 s of
    CPU: a listener whose session ended is reset and reused). Every listener opened comes back: one whose
    opener is cancelled while it loads goes to the idle list once its host has it."""

    def __init__(
        self, vad_args: tuple[str, float, int], with_rec: bool, size: int = ENGINE_PROCESSES
    ) -> None:
        self.vad_args, self.with_rec, self.size = vad_args, with_rec, max(1, size)
        self.offload = OFFLOAD
        self.hosts: list[EngineHost] = []
        self.idle: list[Listener | InlineListener] = []
        self._next_id = 0

    async def open(self) -> Listener | InlineListener:
        """A listener: an idle one, else a new one on the least-loaded host (a new host while under ``size``)."""
        while self.idle:
            lis = self.idle.pop()
            if isinstance(lis, InlineListener) or lis.host.dead is None:
                return lis
        if not self.offload:
            return InlineListener(self.vad_args, self.with_rec)
        live = [h for h in self.hosts if h.dead is None]  # a dead host is replaced, never reused
        host = min(live, key=lambda h: h.listeners, default=None)
        if host is None or (host.listeners and len(live) < self.size):
            host = EngineHost(len(self.hosts))
            self.hosts.append(host)
        host.listeners += 1  # counted before any wait, so concurrent openers spread over the hosts
        self._next_id += 1
        lis = Listener(host, self._next_id, self.vad_args)
        # the load goes on whatever becomes of its opener: a turn that ends while its decoder loads (a new
        # turn, the session's end, a cancel) must not leave a listener no one holds on the host
        loading = asyncio.ensure_future(self._load(host, lis))
        try:
            return await asyncio.shield(loading)
        except asyncio.CancelledError:
            loading.add_done_callback(self._loaded_late)
            raise

    async def _load(self, host: EngineHost, lis: Listener) -> Listener:
        try:
            await host.ready()
            await host.call("open", lis.eid, (*self.vad_args, self.with_rec))
        except BaseException:
            host.listeners -= 1  # never opened: the host holds nothing of it
            raise
        return lis

    def _loaded_late(self, loading: asyncio.Future[Listener]) -> None:
        """A listener whose opener was cancelled while it loaded: idle, for the next opener, once open."""
        if not loading.cancelled() and loading.exception() is None:
            self.idle.append(loading.result())

    def release(self, lis: Listener | InlineListener) -> None:
        lis.reset()
        self.idle.append(lis)

    async def stop(self) -> None:
        hosts, self.hosts, self.idle = self.hosts, [], []
        for h in hosts:
            await h.stop()
