"""What every benchmark records beside its numbers: which code it measured and on what machine.

Benchmarks run as scripts (``python bench/NAME.py``), so this folder is on their path: ``from benchinfo
import code_rev, machine``.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path


def code_rev() -> str:
    """The short git revision of the voicepipe that is imported (an older checkout put first on
    PYTHONPATH names its own, where it is a git checkout), or "?"."""
    import voicepipe

    with contextlib.suppress(Exception):
        where = Path(voicepipe.__file__).resolve().parent.parent
        return subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return "?"


def machine() -> dict[str, object]:
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}
