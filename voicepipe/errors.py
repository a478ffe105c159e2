"""User-facing errors: one line naming the file and the field; the CLI exits 2 on them.

Every user file is read through :mod:`voicepipe.files` (regular files only, size-limited before anything is
read, bounded depth for JSON and YAML), so every way a file can be bad ends as one :class:`UserError`; its
line has control characters escaped (:func:`voicepipe.safeprint.printable`), line breaks included.
"""

from __future__ import annotations

import difflib
import re
import typing
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError

from voicepipe.limits import MAX_RUN_ID
from voicepipe.safeprint import printable


class UnsupportedSetting(ValueError):
    """A run setting (``eager``, ``scheduler_steps``) a served system's stack or device has no switch for
    (raised by :class:`voicepipe.hardware.system.System`; the CLI names its option, a config its key)."""

    def __init__(self, setting: str, why: str) -> None:
        super().__init__(f"{setting}: {why}")
        self.setting = setting
        self.why = why


class UserError(Exception):
    """Bad input. ``str(err)`` is the one line the CLI prints (line breaks and other control characters in
    names and values are escaped)."""

    def __init__(self, where: str, msg: str) -> None:
        line = f"{where}: {msg}" if where else msg
        super().__init__(printable(line, newlines=False))


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
    elif err["type"] == "model_type" and model is not None and err["loc"]:
        msg = _mapping_wanted(model, tuple(err["loc"]), err) or msg
    return UserError(source, f"{field}: {msg}" if field else msg)


_KINDS = {bool: "true/false", int: "a number", float: "a number", str: "a string", list: "a list"}


def _mapping_wanted(model: type[BaseModel], loc: tuple[int | str, ...], err: Any) -> str:
    """``a mapping with fields median, p90 (got a number)`` for pydantic's "Input should be a valid
    dictionary or instance of TTFT", which names a class the file's writer never sees ("" when the model
    at ``loc`` is not that class). The input is named by its kind only: a wrong value can be a secret."""
    want = (err.get("ctx") or {}).get("class_name")
    here = [model]
    for part in loc:  # as fields_at walks: list indices skipped, a dict key keeps its value's model
        if not isinstance(part, int):
            nxt = [m for c in here if part in c.model_fields for m in _models_in(c.model_fields[part].annotation)]
            here = nxt or here
    if not want or [m.__name__ for m in here] != [want]:
        return ""
    got = "nothing" if err.get("input") is None else _KINDS.get(type(err.get("input")), "not a mapping")
    return f"a mapping with fields {', '.join(here[0].model_fields)} (got {got})"


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


_RUN_ID = re.compile(r"[A-Za-z0-9_.-]+")


def check_run_id(run_id: str, where: str = "--run-id") -> str:
    """``run_id`` if it is safe in an MQTT topic level (see :data:`voicepipe.limits.MAX_RUN_ID`), else a
    one-line :class:`UserError` naming ``where``."""
    if len(run_id) > MAX_RUN_ID:
        raise UserError(where, f"{len(run_id):,} characters: a run id is at most {MAX_RUN_ID}")
    allowed = "letters, digits, '-', '_' and '.'"
    if not run_id:
        raise UserError(where, f"a run id cannot be empty (use {allowed})")
    bad = next((c for c in run_id if not _RUN_ID.fullmatch(c)), None)
    if bad is not None:
        raise UserError(where, f"{run_id!r}: {bad!r} is not allowed (use {allowed})")
    return run_id
