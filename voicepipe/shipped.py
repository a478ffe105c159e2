"""What ships with voicepipe: the scenarios, the demonstration configs and the starter template.

Inside the package in a wheel (setup.py copies scenarios/ to voicepipe/scenarios), else the checkout's
scenarios/ folder beside the package. A name the user gives is a path first; where no such file exists,
a shipped scenario or config of that name (with or without ``.yaml``), found from any working folder.
An unknown name is one :class:`UserError` with the nearest shipped names ("did you mean").
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from voicepipe.errors import UserError, did_you_mean


def shipped_dir() -> Path:
    """The scenarios installed inside the package, else the checkout's scenarios/ folder."""
    inside = Path(str(resources.files("voicepipe"))) / "scenarios"
    if inside.is_dir():
        return inside
    return Path(__file__).resolve().parent.parent / "scenarios"


def configs_dir() -> Path:
    return shipped_dir() / "configs"


def shipped_scenarios() -> list[Path]:
    return sorted(shipped_dir().glob("*.yaml"))


def shipped_configs() -> list[Path]:
    return sorted(configs_dir().glob("*.yaml"))


def resolve(name_or_path: str, folder: Path, what: str) -> Path:
    """The file given, else ``folder/NAME`` or ``folder/NAME.yaml``. Something that exists but is not a
    file (a directory, a FIFO) is returned as is, so the reader says what is wrong with it."""
    p = Path(name_or_path)
    try:
        if p.is_file():
            return p
        for cand in (folder / name_or_path, folder / f"{name_or_path}.yaml"):
            if cand.is_file():
                return cand
        if p.exists():
            return p
    except (OSError, ValueError) as exc:
        raise UserError(name_or_path, f"cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    names = [q.stem for q in sorted(folder.glob("*.yaml"))]
    hint = did_you_mean(p.name.removesuffix(".yaml"), names)
    raise UserError(name_or_path, f"no such file or shipped {what}{hint} (see `voicepipe scenarios`)")


def resolve_config(name_or_path: str | Path) -> Path:
    """A pipeline config path: the file given, else a shipped config (``fast-lane``)."""
    return resolve(str(name_or_path), configs_dir(), "config")


def short_name(path: str | Path) -> str | None:
    """The name a shipped config is given by (``fast-lane``), or None for any other file."""
    p = Path(path)
    try:
        if p.resolve().parent == configs_dir().resolve() and p.suffix == ".yaml" and p.is_file():
            return p.stem
    except OSError:
        return None
    return None


def config_summaries() -> list[list[str]]:
    """[name, description] of each shipped config: the description is its leading comment lines."""
    rows = []
    for p in shipped_configs():
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            rows.append([p.stem, f"cannot read ({exc})"])
            continue
        head = []
        for line in lines:
            if not line.startswith("#"):
                break
            head.append(line.lstrip("#").strip())
        rows.append([p.stem, " ".join(h for h in head if h)])
    return rows
