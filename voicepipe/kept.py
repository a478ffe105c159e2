"""Results kept on disk between processes, keyed by what computed them (:func:`kept`).

Some answers take minutes and depend on nothing but this package: the held-out validation
(``voicepipe hardware validate``, every modelled number's printed error) re-fits the constants once per
publisher family. :func:`kept` computes such an answer once and keeps it as JSON under the cache folder, in a
file named by a digest of every file of the installed ``voicepipe`` package (code and data) and the Python and
numpy versions: any change to them is a different file, so nothing stale is ever read. Processes that ask at
the same time wait on one lock, and one computes. A file that cannot be read or written is ignored (the answer
is computed, as with no cache).

Where: ``$VOICEPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/voicepipe``, else ``~/.cache/voicepipe``;
``VOICEPIPE_CACHE_DIR=off`` keeps nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")
ENV = "VOICEPIPE_CACHE_DIR"
OFF = ("off", "0", "no", "false")
KEEP = 4  # answers kept per name: a few installs or versions side by side
# files the package writes into itself from kept answers (``update_doc``): outside the digest, or writing them
# would make the answer they were written from look stale
OUTPUTS = ("hardware/data/validation-accuracy.json",)


def cache_dir() -> Path | None:
    """The cache folder (None when ``VOICEPIPE_CACHE_DIR`` turns it off)."""
    raw = os.environ.get(ENV)
    if raw is not None and raw.strip().lower() in OFF:
        return None
    if raw:
        return Path(raw)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "voicepipe"


@cache
def package_digest() -> str:
    """sha256 over every file of the installed package (relative path and bytes; compiled files and
    :data:`OUTPUTS` excepted) and the Python and numpy versions: what a kept answer was computed by."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256(f"{platform.python_version()} numpy {np.__version__}\n".encode())
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo") and rel not in OUTPUTS:
            h.update(rel.encode() + b"\0")
            h.update(p.read_bytes())
    return h.hexdigest()[:24]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no advisory locks (Windows): each process computes for itself
        yield
        return
    try:
        f = open(path, "a")  # noqa: SIM115 - closed below, after the lock is released
    except OSError:  # a folder this process may not write to: no lock, computed here
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # no locks on this file system (NFS without lockd, some FUSE mounts): unlocked
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, data: Any) -> None:
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)  # readers see the old file or the whole new one
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def kept(name: str, compute: Callable[[], T], dump: Callable[[T], Any], load: Callable[[Any], T]) -> T:
    """``compute()``, or the answer an earlier process kept under ``name`` for this package's content.

    ``dump`` turns the answer into JSON-able data, ``load`` turns that back (and may raise on data it does not
    recognise: the answer is then computed again)."""
    folder = cache_dir()
    if folder is None:
        return compute()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        return compute()
    path = folder / f"{name}-{package_digest()}.json"
    got = _loaded(path, load)
    if got is not None:
        return got[0]
    with _locked(path.with_suffix(".lock")):  # per version: another version's computing never holds this up
        got = _loaded(path, load)  # computed by the process that held the lock meanwhile
        if got is not None:
            return got[0]
        out = compute()
        _write(path, dump(out))
        _prune(folder, name)
        return out


def _loaded(path: Path, load: Callable[[Any], T]) -> tuple[T] | None:
    """(the kept answer,) or None when there is none usable (missing, unreadable, another shape)."""
    data = _read(path)
    if data is None:
        return None
    try:
        return (load(data),)
    except Exception:  # whatever an unexpected shape raises: compute again
        return None


def _prune(folder: Path, name: str, keep: int = KEEP) -> None:
    """Keep the ``keep`` newest answers under ``name`` (other installs and versions of the package)."""
    with contextlib.suppress(OSError):
        files = sorted(folder.glob(f"{name}-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in files[keep:]:
            old.unlink(missing_ok=True)
            old.with_suffix(".lock").unlink(missing_ok=True)
