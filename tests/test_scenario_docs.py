"""docs/scenarios.md and `voicepipe schema scenario` state the same bounds for every field."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from voicepipe.cli import app

DOC = Path(__file__).resolve().parent.parent / "docs" / "scenarios.md"
BOUND = re.compile(r"(≥|>)\s*(\d+(?:\.\d+)?)|(\d+(?:\.\d+)?)\s*[–-]\s*(\d+(?:\.\d+)?)")


def doc_bounds() -> dict[str, tuple[str, float, float | None]]:
    """field -> (">=" or ">", lower, upper or None) from the field tables' type and default cells."""
    out: dict[str, tuple[str, float, float | None]] = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\|\s*`([a-z_]+)`\s*\|(.*)", line)
        if not m:
            continue
        cells = [c.strip() for c in m.group(2).split("|")]
        text = " ".join(c for c in cells[:3] if "`" not in c)  # type (and unit/default) columns, no code
        b = BOUND.search(text)
        if b is None:
            continue
        if b.group(1):
            out[m.group(1)] = (">=" if b.group(1) == "≥" else ">", float(b.group(2)), None)
        else:
            out[m.group(1)] = (">=", float(b.group(3)), float(b.group(4)))
    return out


def schema_bounds() -> dict[str, tuple[str, float, float | None]]:
    res = CliRunner().invoke(app, ["schema", "scenario"])
    assert res.exit_code == 0, res.output
    schema = json.loads(res.output)
    out: dict[str, tuple[str, float, float | None]] = {}
    for model in [schema, *schema["$defs"].values()]:
        for name, prop in model.get("properties", {}).items():
            merged = dict(prop)
            for alt in prop.get("anyOf", []):
                merged.update(alt)
            if "minimum" in merged:
                out[name] = (">=", float(merged["minimum"]), merged.get("maximum"))
            elif "exclusiveMinimum" in merged:
                out[name] = (">", float(merged["exclusiveMinimum"]), merged.get("maximum"))
            elif merged.get("minItems"):
                out[name] = (">=", float(merged["minItems"]), None)
    return out


def test_docs_and_schema_state_the_same_bounds():
    docs, schema = doc_bounds(), schema_bounds()
    assert {"words_per_minute", "gap_ms", "turns", "questions"} <= set(docs)
    for field, (op, low, high) in docs.items():
        assert field in schema, f"docs bound {field}, the schema does not"
        s_op, s_low, s_high = schema[field]
        assert (op, low) == (s_op, s_low), f"{field}: docs say {op} {low:g}, schema {s_op} {s_low:g}"
        if high is not None:
            assert s_high == high, f"{field}: docs say at most {high:g}, schema {s_high}"
    assert set(schema) <= set(docs), f"schema bounds the docs do not state: {set(schema) - set(docs)}"
