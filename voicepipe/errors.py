"""User-facing errors: one line naming the file and the field; the CLI exits 2 on them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError


class UserError(Exception):
    """Bad input. ``str(err)`` is the one line the CLI prints."""

    def __init__(self, where: str, msg: str) -> None:
        super().__init__(f"{where}: {msg}" if where else msg)


def from_validation(source: str, exc: ValidationError, prefix: str = "") -> UserError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    field = ".".join(p for p in (prefix, loc) if p)
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    return UserError(source, f"{field}: {msg}" if field else msg)


def read_yaml_mapping(path: Path, what: str = "a mapping") -> dict[str, Any]:
    """A YAML file's top-level mapping (empty file = {}); errors name the file and the line."""
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(source, "not UTF-8 text") from None
    except OSError as exc:
        raise UserError(source, f"cannot read ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise UserError(source, f"{where}invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(source, f"top level must be {what}")
    return data
