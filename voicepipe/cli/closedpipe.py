"""A reader that closes the pipe early (``voicepipe hardware list | head -1``) ends the command quietly:
exit 141 (:attr:`~voicepipe.exitcodes.ExitCode.PIPE_CLOSED`, 128 + SIGPIPE, what a shell reports for a
tool SIGPIPE stopped), with no traceback, no ``error:`` line and no "Exception ignored" report from the
interpreter's flush at exit.

:func:`guard_streams`, called once by the console entry point (:func:`voicepipe.cli.main`), puts stdout
and stderr on writers of their own descriptors that turn a write the closed pipe refuses (EPIPE) into
that exit, so every way a command writes meets the same rule: the rich consoles, typer's help and echo,
``sys.stdout.write``. The closed stream is pointed at the null device first, so that nothing written
after it (the flush at exit) fails again. Only EPIPE: a write the disk refuses (``> /dev/full``, ENOSPC)
stays an :class:`OSError`, one line naming stdout and exit 2. SIGPIPE itself keeps Python's setting
(ignored): a broker socket or an engine host's pipe that closes must raise where it is written, not kill
the process.

Streams a test runner or a library caller has put in place of the interpreter's own are left as they are.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import TYPE_CHECKING, NoReturn, TextIO

from voicepipe.exitcodes import ExitCode

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

_closed: list[int] = []  # the descriptors a reader closed, in the order it happened


def pipe_closed(fd: int) -> NoReturn:
    """The reader of ``fd`` has gone: point it at the null device and end the command (exit 141)."""
    _closed.append(fd)
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    raise SystemExit(ExitCode.PIPE_CLOSED)


def closed() -> bool:
    """Did a reader close stdout or stderr during this command (in whichever thread wrote to it)?"""
    return bool(_closed)


class _Guarded(io.FileIO):
    """A standard stream's descriptor (not closed with this object) whose refused write ends the command."""

    def write(self, b: ReadableBuffer, /) -> int:
        try:
            return super().write(b)
        except BrokenPipeError:
            pipe_closed(self.fileno())


def _guarded(stream: TextIO | None, own: TextIO | None) -> TextIO | None:
    if stream is None or stream is not own or not isinstance(stream, io.TextIOWrapper):
        return stream  # not the interpreter's own stream (a test runner's capture): left alone
    try:
        fd = stream.fileno()
        stream.flush()
    except (OSError, ValueError):
        return stream
    return io.TextIOWrapper(
        io.BufferedWriter(_Guarded(fd, "w", closefd=False)),
        encoding=stream.encoding,
        errors=stream.errors,
        line_buffering=stream.line_buffering,
        write_through=stream.write_through,
    )


def guard_streams() -> None:
    """Put stdout and stderr on guarded writers (see the module's contract); once per process."""
    sys.stdout = _guarded(sys.stdout, sys.__stdout__)
    sys.stderr = _guarded(sys.stderr, sys.__stderr__)
