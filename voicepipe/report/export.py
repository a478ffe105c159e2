"""Exports: turn records as CSV, and per-turn spans as OpenTelemetry (OTLP/JSON) traces.

CSV: one row per turn, one column per scalar :class:`TurnRecord` field; list fields (``breakdown``,
``spans``) are JSON strings, so :func:`read_csv` gives back equal records. ``stage_ms.<stage>`` columns are
added for spreadsheets and ignored when reading.

OTel: one trace per turn, id derived from (run, label, session, turn) so re-exports are stable. A root span
``turn`` covers end of speech → first reply audio; one child per span of the turn's causal chain, named
``{stage}.{what}``. Timestamps are Unix epoch ns (monotonic + ``clock_offset_ns``) as strings, the OTLP/JSON
encoding of 64-bit integers. POST the dict to a collector's ``/v1/traces`` or load the file in a backend.
"""

from __future__ import annotations

import csv
import hashlib
import json
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from voicepipe.messages import Span
from voicepipe.records import TurnRecord
from voicepipe.report.svg import stage_sort_key

STAGE_COL_PREFIX = "stage_ms."
SERVICE = "voicepipe"
SPAN_KIND_INTERNAL = 1
STATUS_OK, STATUS_ERROR = 1, 2


def conventional_name(stage: str, what: str) -> str | None:
    """The usual attribute name for a well-known part: an LLM's time to first token (``ttft``) and a TTS
    engine's time to first audio byte (``ttfb``); ``None`` for anything else."""
    w = what.lower()
    if stage in ("agent", "council") and w == "ttft":
        return "ttft"
    if stage == "tts" and (w in ("ttfa", "ttfb") or "first audio" in w or "first byte" in w):
        return "ttfb"
    return None


def _json_field(annotation: Any) -> bool:
    return get_origin(annotation) in (list, dict)


def _optional(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)


_FIELDS = list(TurnRecord.model_fields)
_JSON_FIELDS = {n for n, f in TurnRecord.model_fields.items() if _json_field(f.annotation)}
_OPTIONAL_FIELDS = {n for n, f in TurnRecord.model_fields.items() if _optional(f.annotation)}


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def write_csv(records: Iterable[TurnRecord], path: str | Path) -> None:
    """One row per turn; list fields as JSON; extra ``stage_ms.<stage>`` convenience columns."""
    recs = list(records)
    stages = sorted({p.stage for r in recs for p in r.breakdown}, key=stage_sort_key)
    header = [*_FIELDS, *(STAGE_COL_PREFIX + s for s in stages)]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        for r in recs:
            data = r.model_dump(mode="json")
            row = [
                json.dumps(data[n], separators=(",", ":")) if n in _JSON_FIELDS else _cell(getattr(r, n))
                for n in _FIELDS
            ]
            per_stage = r.stage_ms()
            row += [_cell(round(per_stage[s], 3)) if s in per_stage else "" for s in stages]
            w.writerow(row)


def read_csv(path: str | Path) -> list[TurnRecord]:
    """Records written by :func:`write_csv` (unknown columns ignored, missing ones take their defaults)."""
    out = []
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            d: dict[str, Any] = {}
            for n in _FIELDS:
                if n not in row:
                    continue
                v = row[n]
                if n in _JSON_FIELDS:
                    d[n] = json.loads(v) if v else []
                elif v == "" and n in _OPTIONAL_FIELDS:
                    d[n] = None
                else:
                    d[n] = v
            out.append(TurnRecord.model_validate(d))
    return out


# --- OpenTelemetry ---------------------------------------------------------------------------------------


def _hex_id(key: str, nbytes: int) -> str:
    h = hashlib.sha256(key.encode()).hexdigest()[: nbytes * 2]
    return h if int(h, 16) else "0" * (nbytes * 2 - 1) + "1"  # all-zero ids are invalid in OTel


def trace_id(r: TurnRecord) -> str:
    return _hex_id(f"trace|{r.run}|{r.label}|{r.session}|{r.turn}", 16)


def _attr(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        v: dict[str, Any] = {"boolValue": value}
    elif isinstance(value, int):
        v = {"intValue": str(value)}
    elif isinstance(value, float):
        v = {"doubleValue": value}
    else:
        v = {"stringValue": str(value)}
    return {"key": key, "value": v}


def _attrs(pairs: Iterable[tuple[str, Any]]) -> list[dict[str, Any]]:
    return [_attr(k, v) for k, v in pairs if v is not None]


def _time_window(r: TurnRecord) -> tuple[int, int]:
    """Monotonic (start, end) of the root span: end of speech → first audio, falling back to the spans."""
    starts = [s.start_ns for s in r.spans]
    ends = [s.end_ns for s in r.spans]
    start = r.end_of_speech_ns if r.end_of_speech_ns is not None else min(starts, default=0)
    # a timeout has no first audio: the root then runs to the end of the last recorded work
    end = r.first_audio_ns if r.first_audio_ns is not None else max([start, *ends])
    return start, max(start, end)


def _child(r: TurnRecord, tid: str, parent: str, i: int, s: Span) -> dict[str, Any]:
    ms = s.dur_ns / 1e6
    pairs: list[tuple[str, Any]] = [("stage", s.stage), ("what", s.what), ("modelled", s.modelled)]
    pairs.append(("duration_ms", ms))
    conv = conventional_name(s.stage, s.what)
    if conv:
        pairs.append((conv, ms))
    if s.stage in ("agent", "council") and r.backend:
        pairs.append(("backend", r.backend))
    return {
        "traceId": tid,
        "spanId": _hex_id(f"span|{tid}|{i}", 8),
        "parentSpanId": parent,
        "name": f"{s.stage}.{s.what}",
        "kind": SPAN_KIND_INTERNAL,
        "startTimeUnixNano": str(s.start_ns + r.clock_offset_ns),
        "endTimeUnixNano": str(s.end_ns + r.clock_offset_ns),
        "attributes": _attrs(pairs),
        "status": {"code": STATUS_OK},
    }


def turn_spans(r: TurnRecord) -> list[dict[str, Any]]:
    """The OTLP spans of one turn: the root ``turn`` span first, then one child per record span."""
    tid = trace_id(r)
    root_id = _hex_id(f"span|{tid}|root", 8)
    start, end = _time_window(r)
    root_attrs = _attrs(
        [
            ("e2e_latency", r.measured_ms),
            ("predicted", r.predicted_ms),
            ("tax", r.tax_ms),
            ("budget", r.budget_ms),
            ("within_budget", r.within_budget),
            ("scenario", r.scenario),
            ("session", r.session),
            ("turn", r.turn),
            ("backend", r.backend or None),
            ("path", r.path),
            ("route", r.route),
            ("run", r.run),
            ("label", r.label or None),
            ("status", r.status),
            ("cost_usd", r.cost_usd),
            ("input_tokens", r.input_tokens),
            ("output_tokens", r.output_tokens),
            ("quality", r.quality),
            ("user_text", r.user_text or None),
        ]
    )
    status: dict[str, Any] = (
        {"code": STATUS_OK} if r.status == "ok" else {"code": STATUS_ERROR, "message": r.status}
    )
    root = {
        "traceId": tid,
        "spanId": root_id,
        "parentSpanId": "",
        "name": "turn",
        "kind": SPAN_KIND_INTERNAL,
        "startTimeUnixNano": str(start + r.clock_offset_ns),
        "endTimeUnixNano": str(end + r.clock_offset_ns),
        "attributes": root_attrs,
        "status": status,
    }
    return [root, *(_child(r, tid, root_id, i, s) for i, s in enumerate(r.spans))]


def otel_json(records: Iterable[TurnRecord]) -> dict[str, Any]:
    """All turns as one OTLP/JSON ``ExportTraceServiceRequest``."""
    spans = [sp for r in records for sp in turn_spans(r)]
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": [_attr("service.name", SERVICE)]},
                "scopeSpans": [{"scope": {"name": SERVICE}, "spans": spans}],
            }
        ]
    }


def write_otel(records: Iterable[TurnRecord], path: str | Path) -> None:
    Path(path).write_text(json.dumps(otel_json(records), indent=1) + "\n", encoding="utf-8")


def _value(v: dict[str, Any]) -> Any:
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    return v.get("stringValue")


def parse_otel(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Flatten an OTLP/JSON document to spans: ids, name, start_ns/end_ns as ints, attributes as a dict."""
    out = []
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for sp in ss.get("spans", []):
                out.append(
                    {
                        "trace_id": sp["traceId"],
                        "span_id": sp["spanId"],
                        "parent_span_id": sp.get("parentSpanId", ""),
                        "name": sp["name"],
                        "start_ns": int(sp["startTimeUnixNano"]),
                        "end_ns": int(sp["endTimeUnixNano"]),
                        "attributes": {a["key"]: _value(a["value"]) for a in sp.get("attributes", [])},
                    }
                )
    return out


def read_otel(path: str | Path) -> list[dict[str, Any]]:
    """Minimal reader of a :func:`write_otel` file (see :func:`parse_otel`)."""
    return parse_otel(json.loads(Path(path).read_text(encoding="utf-8")))
