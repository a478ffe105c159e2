"""The one guard every file voicepipe reads goes through: a user's file can be refused, never hang or crash us.

Contract (each refusal is one :class:`~voicepipe.errors.UserError` line naming the file, and the field
when the caller gives one; the CLI prints it and exits 2):

* **Regular files only.** The path is ``stat``-ed before it is opened, so a FIFO, a device (``/dev/zero``,
  a terminal), a socket or a directory is refused without being opened; the file is then opened with
  ``O_NONBLOCK`` and ``fstat``-ed again, so a path swapped for a FIFO in between cannot block the open.
* **Size before content.** A file larger than the caller's limit is refused from its ``stat`` size before a
  byte is read, and the read itself stops at ``limit + 1`` bytes, so a file that grows while it is read
  (or lies about its size) still cannot exceed the limit.
* **Text** is strict UTF-8.
* **JSON** (:func:`read_json`): strict JSON whose nesting is at most
  :data:`~voicepipe.limits.MAX_JSON_DEPTH` levels; a document deep enough to exhaust the parser's recursion
  (``[[[[...`` 200,000 deep) is the same one line, as are integers too long to convert.
* **YAML** (:func:`read_yaml_mapping`): the restricted loader of :mod:`voicepipe.safeyaml` (core types only,
  alias bombs and depth bounded by :data:`~voicepipe.limits.MAX_YAML_VALUES` and
  :data:`~voicepipe.limits.MAX_YAML_DEPTH`).
* **WAV** (:func:`read_wav`): a RIFF/WAVE file parsed here (not by :mod:`wave`, whose errors are not one line)
  of at most :data:`~voicepipe.limits.MAX_WAV_BYTES`; it must be exactly the audio the bus carries, 16 kHz
  mono 16-bit PCM (format tag 1): any other rate, channel count, sample width or encoding is refused by name.
* Files the tool only hands to another library by name (TLS certificates for :mod:`ssl`) get the same
  type and size check without being read here (:func:`check_file`).

The limits, and why each is where it is, live in :mod:`voicepipe.limits`. Data shipped inside the package
(the hardware catalog, empirical profiles, templates) is not user input and is read directly.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

from voicepipe.errors import UserError
from voicepipe.limits import MAX_FILE_BYTES, MAX_JSON_DEPTH, MAX_WAV_BYTES
from voicepipe.safeyaml import YamlRejected, load

_KINDS = (
    (stat.S_ISDIR, "is a directory, not a file"),
    (stat.S_ISFIFO, "not a regular file (a FIFO)"),
    (stat.S_ISCHR, "not a regular file (a character device)"),
    (stat.S_ISBLK, "not a regular file (a block device)"),
    (stat.S_ISSOCK, "not a regular file (a socket)"),
)


def _where(path: str | Path, field: str | None) -> str:
    return f"{field}: {path}" if field else str(path)


def _why(exc: BaseException) -> str:
    return f"cannot read ({getattr(exc, 'strerror', None) or exc})"


def _check_stat(st: os.stat_result, where: str, limit: int) -> None:
    for test, msg in _KINDS:
        if test(st.st_mode):
            raise UserError(where, msg)
    if not stat.S_ISREG(st.st_mode):
        raise UserError(where, "not a regular file")
    if st.st_size > limit:
        raise UserError(where, f"{st.st_size:,} bytes: {_too_big(limit)}")


def _too_big(limit: int) -> str:
    return f"larger than {limit:,} bytes (the limit for this file)"


def check_file(path: str | Path, limit: int = MAX_FILE_BYTES, field: str | None = None) -> None:
    """Refuse ``path`` unless it is an existing regular file of at most ``limit`` bytes (nothing is read)."""
    where = _where(path, field)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(where, "no such file") from None
    except (OSError, ValueError) as exc:
        raise UserError(where, _why(exc)) from None
    _check_stat(st, where, limit)


def read_bytes(path: str | Path, limit: int = MAX_FILE_BYTES, field: str | None = None) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (see the module docstring)."""
    where = _where(path, field)
    check_file(path, limit, field)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise UserError(where, "no such file") from None
    except (OSError, ValueError) as exc:
        raise UserError(where, _why(exc)) from None
    try:
        _check_stat(os.fstat(fd), where, limit)  # the path may have been replaced since the stat
        chunks: list[bytes] = []
        left = limit + 1  # one byte more than allowed: tells "at the limit" from "grew past it"
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise UserError(where, _why(exc)) from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > limit:
        raise UserError(where, _too_big(limit))
    return raw


def read_text(path: str | Path, limit: int = MAX_FILE_BYTES, field: str | None = None) -> str:
    """A regular file's UTF-8 text, at most ``limit`` bytes."""
    raw = read_bytes(path, limit, field)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(_where(path, field), f"not UTF-8 text (byte {exc.start})") from None


def _depth_at_most(data: Any, bound: int) -> bool:
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, dict | list):
            if depth > bound:
                return False
            stack.extend((v, depth + 1) for v in (obj.values() if isinstance(obj, dict) else obj))
    return True


def read_json(path: str | Path, limit: int, field: str | None = None) -> Any:
    """A JSON file's data: at most ``limit`` bytes, nested at most ``MAX_JSON_DEPTH`` levels."""
    where = _where(path, field)
    text = read_text(path, limit, field)
    deep = f"nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(where, f"line {exc.lineno}: invalid JSON ({exc.msg})") from None
    except RecursionError:  # the C scanner counts its recursion: a deep document ends here, cleanly
        raise UserError(where, deep) from None
    except ValueError as exc:  # an integer longer than Python converts (4,300 digits)
        why = "an integer has too many digits" if "digits" in str(exc) else str(exc).split(";")[0]
        raise UserError(where, f"invalid JSON ({why})") from None
    if not _depth_at_most(data, MAX_JSON_DEPTH):
        raise UserError(where, deep)
    return data


def read_yaml_mapping(path: str | Path, what: str = "a mapping", field: str | None = None) -> dict[str, Any]:
    """A YAML file's top-level mapping (empty or comments-only file = {}); errors name the file and line."""
    where = _where(path, field)
    try:
        data = load(read_text(path, MAX_FILE_BYTES, field))
    except YamlRejected as exc:
        raise UserError(where, str(exc)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(where, f"top level must be {what}")
    return data


WAV_RATE = 16_000  # the bus's audio (voicepipe.audio.RATE; not imported: files.py sits below every package)


def parse_wav(raw: bytes) -> bytes:
    """The s16le samples of a 16 kHz mono 16-bit PCM WAV held in ``raw``, else ValueError (one line)."""
    if len(raw) < 12 or raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise ValueError("not a WAV file (no RIFF/WAVE header)")
    pos, fmt, data = 12, None, None
    while pos + 8 <= len(raw) and (fmt is None or data is None):
        cid, size = raw[pos : pos + 4], struct.unpack("<I", raw[pos + 4 : pos + 8])[0]
        body = raw[pos + 8 : pos + 8 + size]
        if cid == b"fmt ":
            if len(body) < 16:
                raise ValueError("the fmt chunk is truncated")
            fmt = struct.unpack("<HHIIHH", body[:16])
        elif cid == b"data":
            data = body  # a streamed WAV's size field may overstate: take what is there
        pos += 8 + size + (size & 1)
    if fmt is None:
        raise ValueError("no fmt chunk")
    tag, channels, rate, _, _, bits = fmt
    if tag == 0xFFFE and bits == 16:  # WAVE_FORMAT_EXTENSIBLE with 16-bit samples: PCM in practice
        tag = 1
    if tag != 1:
        raise ValueError(f"encoding {tag:#x} is not PCM; expected 16 kHz mono 16-bit PCM")
    if rate != WAV_RATE:
        raise ValueError(f"sample rate {rate} Hz; expected {WAV_RATE} Hz mono 16-bit PCM")
    if channels != 1:
        raise ValueError(f"{channels} channels; expected mono (1) 16 kHz 16-bit PCM")
    if bits != 16:
        raise ValueError(f"{bits}-bit samples; expected 16-bit 16 kHz mono PCM")
    if data is None:
        raise ValueError("no data chunk")
    return data[: len(data) // 2 * 2]


def read_wav(path: str | Path, field: str | None = None, limit: int = MAX_WAV_BYTES) -> bytes:
    """The samples (s16le bytes) of a 16 kHz mono 16-bit PCM WAV file of at most ``limit`` bytes."""
    raw = read_bytes(path, limit, field)
    try:
        pcm = parse_wav(raw)
    except (ValueError, struct.error) as exc:
        raise UserError(_where(path, field), str(exc)) from None
    if not pcm:
        raise UserError(_where(path, field), "the WAV holds no samples")
    return pcm
