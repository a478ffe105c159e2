"""Text from a file, a server or a bus message is printed as text, never as terminal commands.

Contract: :func:`printable` returns its argument with every control character escaped — C0 (``\\x00``-
``\\x1f``, ESC included), DEL and C1 (``\\x80``-``\\x9f``, which some terminals read as ESC + a letter)
— and the Unicode bidirectional overrides and isolates (which reorder what a reader sees). A newline is
kept when ``newlines=True`` (a multi-line cell, a traceback), else escaped too. Escapes are Python's
(``\\t``, ``\\x1b``, ``\\u202e``), so the output shows what the input held. Text with nothing to escape is returned
as is (same object), so the check is cheap on every line printed.

It is the one escape the tool uses: every rich console of the CLI is a
:class:`voicepipe.report.term.SafeConsole` (each printed segment goes through it), fitted tables escape
their cells before layout (so widths are right), :class:`voicepipe.errors.UserError` lines and the console
log renderer (:mod:`voicepipe.logs`) escape their text.
"""

from __future__ import annotations

import re

_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[\\x00-\\x09\\x0b-\\x1f\\x7f-\\x9f{_BIDI}]")
_CONTROL_OR_NL = re.compile(f"[\\x00-\\x1f\\x7f-\\x9f{_BIDI}]")


_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def printable(text: str, newlines: bool = True) -> str:
    """``text`` with control characters escaped (see the module docstring)."""
    rx = _CONTROL if newlines else _CONTROL_OR_NL
    if rx.search(text) is None:
        return text
    return rx.sub(_escape, text)
