"""The command line's exit codes, in one place: every command exits with one of :class:`ExitCode`.

When several apply, the first in this order wins: a signal or a closed pipe (130, 141, 143), a broker
outage (4), an internal error (5), an output that could not be written (2), turns not measured (3), a
requirement missed (1). Bad input (2) stops a command before it runs, so it never meets the others.
Whatever the code, the outputs that were asked for are written first with the turns measured so far; but
a closed pipe (141) ends the command at the write its reader refused.
"""

from __future__ import annotations

import signal
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    """Every expected turn was measured and every ``--require`` was met."""

    REQUIREMENT_MISSED = 1
    """A ``--require`` was missed (:mod:`voicepipe.gate`): each one missed is named on stderr."""

    USAGE = 2
    """Bad input: a command-line option, a file or one of its fields, or a broker that cannot be reached
    (or refuses the run) when the run starts. One ``error:`` line naming it, nothing run. Also an output
    the system would not take after the run (a full disk): one line naming it, every other output written."""

    TURNS_NOT_MEASURED = 3
    """The run finished, but some expected turns have no measurement (failed, lost, timed out or never
    played): the turns line on stderr says how many and why. Takes precedence over 1."""

    BROKER_OUTAGE = 4
    """The broker stayed away longer than ``broker.outage_window_s`` mid-run and the run ended early."""

    INTERNAL_ERROR = 5
    """A bug in voicepipe ended the run: one ``error:`` line naming the exception (``-vv`` logs the
    traceback)."""

    INTERRUPTED = 130
    """Stopped by SIGINT (Ctrl-C): 128 + 2, as shells report it."""

    PIPE_CLOSED = 141
    """The reader of stdout (or stderr) closed the pipe early (``| head -1``): 128 + 13 (SIGPIPE), as shells
    report a tool SIGPIPE stopped. The command ends at the write that was refused, quietly (no line, no
    traceback); outputs it had not written yet are not written (:mod:`voicepipe.cli.closedpipe`)."""

    TERMINATED = 143
    """Stopped by SIGTERM (``kill``, a supervisor, a CI timeout): 128 + 15."""


def for_signal(signum: int) -> ExitCode:
    """The exit code of a run a signal stopped: 130 for SIGINT, 143 for SIGTERM."""
    return ExitCode.TERMINATED if signum == signal.SIGTERM else ExitCode.INTERRUPTED


def signal_name(signum: int) -> str:
    """``SIGINT``, ``SIGTERM``... (the number itself for one Python does not name)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
