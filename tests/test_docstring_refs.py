"""Docstrings state the contract: a cross-reference (``:func:`voicepipe.x.y```) names something that exists,
and the hardware model's module, which states the formulas and re-exports them, names every module it
re-exports from (a function that moves must take its references with it)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import voicepipe
from voicepipe.hardware import model as hm

ROOT = Path(voicepipe.__file__).parent
REF = re.compile(r":(?:func|class|mod|attr|data|meth|exc):`~?(voicepipe(?:\.\w+)+)`")


def _resolves(path: str) -> bool | None:
    """True if ``path`` names a module or an attribute of one; None when the module needs an extra that is
    not installed here (not this test's concern)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj: object = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not exc.name.startswith("voicepipe"):
                return None
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_cross_reference_names_something_that_exists():
    broken = []
    for f in sorted(ROOT.rglob("*.py")):
        text = f.read_text()
        for m in REF.finditer(text):
            if _resolves(m.group(1)) is False:
                broken.append(f"{f.relative_to(ROOT.parent)}:{text.count(chr(10), 0, m.start()) + 1} {m.group(1)}")
    assert not broken, broken


def test_the_model_module_names_every_module_it_re_exports_from():
    tree = ast.parse(Path(hm.__file__).read_text())
    sources = {
        node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("voicepipe.hardware.")
        and any(alias.name in hm.__all__ for alias in node.names)
    }  # fmt: skip
    assert sources >= {"voicepipe.hardware.system", "voicepipe.hardware.sizing", "voicepipe.hardware.step"}
    doc = hm.__doc__ or ""
    assert all(f":mod:`{m}`" in doc for m in sources), sorted(m for m in sources if f":mod:`{m}`" not in doc)
