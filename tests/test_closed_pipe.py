"""A reader that closes the pipe early (``voicepipe hardware list | head -1``) ends the command quietly with
exit 141 (128 + SIGPIPE), whichever way the command writes: no traceback, no "Exception ignored" report,
nothing on stderr; a stdout the disk refuses stays one line and exit 2 (tests/test_cli_errors.py)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from voicepipe.exitcodes import ExitCode

needs_pipe_size = pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="Linux pipes only")


def _small_pipe() -> tuple[int, int]:
    """A pipe that holds one page, so that an output of a few pages must wait on its reader."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    return r, w


def _start(args: list[str], stdout: int, stderr: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "voicepipe", *args], stdout=stdout, stderr=stderr)


@needs_pipe_size
@pytest.mark.parametrize(
    "args",
    [
        ["hardware", "list"],  # a rich table (14 kB)
        ["schema", "config"],  # sys.stdout.write (25 kB)
    ],
)
def test_a_reader_that_closes_the_pipe_after_the_first_line_ends_the_command_quietly_with_141(args):
    r, w = _small_pipe()
    proc = _start(args, stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    first = b""
    while not first.endswith(b"\n"):  # byte by byte: nothing past the first line is read
        chunk = os.read(r, 1)
        assert chunk, f"the output ended before its first line ended: {first!r}"
        first += chunk
    os.close(r)  # the rest (several pages) no longer fits the pipe: the next write is refused
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.PIPE_CLOSED == 141, stderr
    assert stderr == b""


@needs_pipe_size
@pytest.mark.parametrize(
    "args",
    [
        ["--help"],  # typer's own help console
        ["hardware", "predict", "-H", "h100-sxm", "-m", "llama-3.1-8b", "--format", "json"],  # typer.echo
        ["hardware", "sweep", "-H", "h100-sxm", "-m", "llama-3.1-8b"],  # a console on sys.stdout
    ],
)
def test_a_pipe_whose_reader_is_gone_before_the_first_write_ends_the_command_quietly_with_141(args):
    r, w = _small_pipe()
    os.close(r)
    proc = _start(args, stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.PIPE_CLOSED, stderr
    assert stderr == b""


@needs_pipe_size
def test_a_closed_stderr_ends_the_command_with_141_like_a_closed_stdout():
    """``voicepipe ... 2>&1 | head -1``: the error line meets the closed pipe; the exit still says so."""
    r, w = _small_pipe()
    os.close(r)
    proc = _start(["hardware", "show", "no-such-device"], stdout=subprocess.DEVNULL, stderr=w)
    os.close(w)
    proc.wait(timeout=60)
    assert proc.returncode == ExitCode.PIPE_CLOSED
