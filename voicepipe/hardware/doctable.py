"""Generated tables inside docs/hardware-model.md: one way to replace the text between two markers."""

from __future__ import annotations

from pathlib import Path


def write_between(path: str | Path, begin: str, end: str, body: str) -> None:
    """Replace what stands between the ``begin`` and ``end`` markers of ``path`` with ``body``."""
    doc = Path(path)
    head, _, rest = doc.read_text().partition(begin)
    _, _, tail = rest.partition(end)
    doc.write_text(f"{head}{begin}\n{body}\n{end}{tail}")
