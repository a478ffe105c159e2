"""User-facing errors: one line naming the file and the field; the CLI exits 2 on them.

Every user file is read by :func:`read_text` (size-limited before anything parses it, regular files only,
strict UTF-8) and YAML files by :func:`read_yaml_mapping` (the restricted loader in
:mod:`voicepipe.safeyaml`), so every way a file can be bad ends as one :class:`UserError`.
"""

from __future__ import annotations

import difflib
import stat
import typing
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError

from voicepipe.limits import MAX_FILE_BYTES
from voicepipe.safeyaml import YamlRejected, load


class UserError(Exception):
    """Bad input. ``str(err)`` is the one line the CLI prints (line breaks in names are escaped)."""

    def __init__(self, where: str, msg: str) -> None:
        line = f"{where}: {msg}" if where else msg
        super().__init__(line.replace("\r", "\\r").replace("\n", "\\n"))


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest of ``choices`` (difflib), else an empty string."""
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]


def fields_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The field names the model nested at ``loc`` (list indices and dict keys skipped) accepts."""
    current = [model]
    for part in loc:
        if isinstance(part, int):
            continue
        nxt = [m for c in current if part in c.model_fields for m in _models_in(c.model_fields[part].annotation)]
        current = nxt or current  # a dict key (e.g. a backend's name) keeps the value's model
    return sorted({k for c in current for k in c.model_fields})


def from_validation(
    source: str, exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None
) -> UserError:
    """One line from a pydantic error; with ``model``, an unknown field names the nearest known one."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    field = ".".join(p for p in (prefix, loc) if p)
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
        if model is not None and err["loc"]:
            msg += did_you_mean(str(err["loc"][-1]), fields_at(model, tuple(err["loc"][:-1])))
    return UserError(source, f"{field}: {msg}" if field else msg)


def read_text(path: Path, limit: int = MAX_FILE_BYTES) -> str:
    """A user file's text: a regular file, at most ``limit`` bytes (checked before reading it all), UTF-8."""
    source = str(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UserError(source, "no such file") from None
    except (OSError, ValueError) as exc:
        raise UserError(source, f"cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise UserError(source, "is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise UserError(source, "not a regular file")
    too_big = f"larger than {limit:,} bytes (the limit for a file voicepipe reads)"
    if st.st_size > limit:
        raise UserError(source, f"{st.st_size:,} bytes: {too_big}")
    try:
        with path.open("rb") as fh:
            raw = fh.read(limit + 1)  # it may have grown since stat
    except OSError as exc:
        raise UserError(source, f"cannot read ({exc.strerror or exc})") from None
    if len(raw) > limit:
        raise UserError(source, too_big)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(source, f"not UTF-8 text (byte {exc.start})") from None


def read_yaml_mapping(path: Path, what: str = "a mapping") -> dict[str, Any]:
    """A YAML file's top-level mapping (empty or comments-only file = {}); errors name the file and line."""
    source = str(path)
    try:
        data = load(read_text(path))
    except YamlRejected as exc:
        raise UserError(source, str(exc)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(source, f"top level must be {what}")
    return data


def redact_url(url: str) -> str:
    """``url`` with any password in it replaced by ``***`` (for messages and reports)."""
    try:
        parts = urlsplit(url if "://" in url else f"mqtt://{url}")
    except ValueError:
        return "<unparseable URL>"
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return url.replace(parts.netloc, f"{user}:***@{hostport}", 1)
