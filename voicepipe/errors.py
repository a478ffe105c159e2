"""User-facing errors: one line naming the file and the field; the CLI exits 2 on them."""

from __future__ import annotations

from pydantic import ValidationError


class UserError(Exception):
    """Bad input. ``str(err)`` is the one line the CLI prints."""

    def __init__(self, where: str, msg: str) -> None:
        super().__init__(f"{where}: {msg}" if where else msg)


def from_validation(source: str, exc: ValidationError, prefix: str = "") -> UserError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    field = ".".join(p for p in (prefix, loc) if p)
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    return UserError(source, f"{field}: {msg}" if field else msg)
