"""Logging: structlog configured once, to **stderr**, so stdout carries results only.

Contract:

* :func:`configure` sets one level and one format for every logger in the process: structlog loggers
  (``structlog.get_logger(...)``) and stdlib ones (aiomqtt, amqtt, ``voicepipe.bus``...), which are routed
  through the same structlog renderer by a ``ProcessorFormatter`` on the root handler.
* ``fmt="console"`` (default) renders ``LEVEL event key=value`` lines; ``fmt="json"`` renders one JSON
  object per line with ``timestamp``, ``level``, ``logger`` and ``event`` keys.
* The stream is looked up on every write (``sys.stderr`` at that moment), so a test that captures stderr
  sees the lines, and nothing is ever written to stdout.
* Levels: ``warning`` by default; the CLI's ``-v`` gives ``info``, ``-vv`` ``debug``, ``-q`` ``error``.
  Chatty third-party loggers (aiomqtt's per-publish backpressure warning, amqtt's broker lifecycle) are
  held one level quieter than ours unless ``debug`` is asked for.
* Console lines escape control characters in every value (:func:`voicepipe.safeprint.printable`), so a
  hostile name or message never reaches the terminal as an escape sequence; JSON lines are escaped by JSON.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, Literal, TextIO

import structlog

from voicepipe.safeprint import printable

LogFormat = Literal["console", "json"]
LEVELS = ("debug", "info", "warning", "error")
THIRD_PARTY = ("aiomqtt", "amqtt", "transitions", "asyncio", "urllib3")


class _Stderr:
    """A file-like that forwards to whatever ``sys.stderr`` is at write time."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


def level_from_flags(verbose: int, quiet: bool, level: str | None = None) -> str:
    """The level asked for on the command line: an explicit ``level`` wins, then ``-q``, then ``-v``s."""
    if level:
        return level.lower()
    if quiet:
        return "error"
    return ("warning", "info", "debug")[min(verbose, 2)]


def _printable_values(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Console lines show text, never terminal commands: control characters in every value are escaped
    (a traceback keeps its line breaks, any other value is one line)."""
    for k, v in event_dict.items():
        if isinstance(v, str):
            event_dict[k] = printable(v, newlines=k in _MULTILINE)
        elif not isinstance(v, int | float | bool | type(None)):
            shown = repr(v)  # what the renderer prints; replaced only when it holds a control character
            if printable(shown) is not shown:
                event_dict[k] = printable(shown, newlines=False)
    return event_dict


_MULTILINE = {"exception", "stack"}


def _renderers(fmt: LogFormat) -> list[structlog.types.Processor]:
    if fmt == "json":  # json.dumps escapes every control character itself (ensure_ascii)
        return [structlog.processors.JSONRenderer()]
    return [
        structlog.processors.format_exc_info,  # the traceback as text, so its control characters are escaped
        _printable_values,
        structlog.dev.ConsoleRenderer(colors=False, pad_event_to=0),
    ]


def configure(level: str = "warning", fmt: LogFormat = "console", stream: TextIO | None = None) -> None:
    """Route every log record of the process to ``stream`` (default: the current stderr) at ``level``."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}")
    num = getattr(logging, level.upper())
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        shared.append(structlog.processors.format_exc_info)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(num),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream or _Stderr())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *_renderers(fmt)],
        )
    )
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_voicepipe", False):
            root.removeHandler(h)
    handler._voicepipe = True  # type: ignore[attr-defined]  # marks our handler: a second configure() replaces it
    root.addHandler(handler)
    root.setLevel(num)
    quieter = num if num <= logging.DEBUG else min(logging.CRITICAL, num + 10)
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(quieter)
