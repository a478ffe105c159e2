"""Exports: turn records as CSV, and per-turn spans as OpenTelemetry (OTLP/JSON) traces.

CSV: one row per turn, one column per scalar :class:`TurnRecord` field; list fields (``breakdown``,
``spans``) are JSON strings, so :func:`read_csv` gives back equal records. ``stage_ms.<stage>`` columns are
added for spreadsheets and ignored when reading.

OTel: spans are built as OpenTelemetry SDK ``ReadableSpan`` objects (:func:`turn_spans`) and either pushed
with the SDK's OTLP/HTTP exporter (:func:`push_otlp`, ``--otlp-endpoint``) or written as OTLP/JSON
(:func:`write_otel`, ``--otel FILE``) from the exporter's own protobuf encoding. One trace per turn, ids
derived from (run, label, session, turn) so re-exports are stable:

* root ``turn`` (INTERNAL): end of speech → first reply audio heard; ``voicepipe.*`` attributes, latencies
  in seconds (``voicepipe.measured_s``, ``voicepipe.ttft_s`` ... as Pipecat and LiveKit report them);
* ``chat {model}`` (CLIENT) per LLM call on the chain, following the OTel GenAI semantic conventions:
  ``gen_ai.operation.name``, ``gen_ai.provider.name`` (``voicepipe.simulated``: no real provider was
  called), ``gen_ai.request.model``, ``gen_ai.usage.input_tokens``/``output_tokens``,
  ``gen_ai.response.time_to_first_chunk`` (s), ``gen_ai.conversation.id`` (the session); it spans the
  call's part on the chain (queue → first spoken clause), with its ``{stage}.queue/ttft/decode`` children;
* ``{stage}.{what}`` (INTERNAL, snake case, e.g. ``asr.endpoint_wait``) for every other span.

The resource carries ``service.name``, ``service.version``, ``voicepipe.run.id`` and
``voicepipe.config.label``. Timestamps are Unix epoch ns (monotonic + ``clock_offset_ns``).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import types
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin

from voicepipe import __version__
from voicepipe.errors import UserError
from voicepipe.files import read_json, read_text
from voicepipe.limits import MAX_EXPORT_BYTES
from voicepipe.messages import Span
from voicepipe.records import LLM_STAGES, METRICS, TurnRecord
from voicepipe.report.svg import stage_sort_key

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan

STAGE_COL_PREFIX = "stage_ms."
SERVICE = "voicepipe"


def conventional_name(stage: str, what: str) -> str | None:
    """The usual attribute name for a well-known part: an LLM's time to first token (``ttft``) and a TTS
    engine's time to first audio byte (``ttfb``); ``None`` for anything else."""
    w = what.lower()
    if stage in ("agent", "council") and w == "ttft":
        return "ttft"
    if stage == "tts" and (w in ("ttfa", "ttfb") or "first audio" in w or "first byte" in w):
        return "ttfb"
    return None


def _optional(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)


def _json_field(annotation: Any) -> bool:
    """A list, dict or tuple field (optional or not): a JSON cell."""
    args = get_args(annotation) if _optional(annotation) else (annotation,)
    return any(get_origin(a) in (list, dict, tuple) for a in args)


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
    text = read_text(path, MAX_EXPORT_BYTES)  # the file guard: a regular file, size-bounded
    for row in csv.DictReader(io.StringIO(text, newline="")):
        d: dict[str, Any] = {}
        for n in _FIELDS:
            if n not in row:
                continue
            v = row[n]
            if n in _JSON_FIELDS:
                d[n] = json.loads(v) if v else (None if n in _OPTIONAL_FIELDS else [])
            elif v == "" and n in _OPTIONAL_FIELDS:
                d[n] = None
            else:
                d[n] = v
        out.append(TurnRecord.model_validate(d))
    return out


# --- OpenTelemetry ---------------------------------------------------------------------------------------

GEN_AI_PROVIDER = "voicepipe.simulated"  # no real provider was called: the LLM is a modelled backend
_SNAKE = re.compile(r"[^0-9a-z]+")


def _hex_id(key: str, nbytes: int) -> str:
    h = hashlib.sha256(key.encode()).hexdigest()[: nbytes * 2]
    return h if int(h, 16) else "0" * (nbytes * 2 - 1) + "1"  # all-zero ids are invalid in OTel


def trace_id(r: TurnRecord) -> str:
    return _hex_id(f"trace|{r.run}|{r.label}|{r.session}|{r.turn}", 16)


def span_name(stage: str, what: str) -> str:
    """``{stage}.{what}`` in snake case, e.g. ``asr.endpoint_wait`` (no spaces: tracing UIs search names)."""
    return f"{stage}.{_SNAKE.sub('_', what.lower()).strip('_')}"


def _time_window(r: TurnRecord) -> tuple[int, int]:
    """Monotonic (start, end) of the root span: end of speech → first audio, falling back to the spans."""
    starts = [s.start_ns for s in r.spans]
    ends = [s.end_ns for s in r.spans]
    start = r.end_of_speech_ns if r.end_of_speech_ns is not None else min(starts, default=0)
    # a timeout has no first audio: the root then runs to the end of the last recorded work
    end = r.first_audio_ns if r.first_audio_ns is not None else max([start, *ends])
    return start, max(start, end)


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def _clean(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if v is not None and v != ""}


def _model_of(backend: str) -> str:
    """The model a backend label names: ``groq-lpu/llama-3.1-8b`` → ``llama-3.1-8b``; a profile name as is."""
    return backend.rsplit("/", 1)[-1] if backend else "unknown"


def _llm_calls(spans: Sequence[Span]) -> list[list[int]]:
    """Indices of each LLM call's spans on the chain: a run of agent/council queue → ttft → decode spans."""
    calls: list[list[int]] = []
    for i, s in enumerate(spans):
        if s.stage not in LLM_STAGES or s.what not in ("queue", "ttft", "decode"):
            continue
        prev = calls[-1] if calls else None
        if (
            prev is not None
            and spans[prev[-1]].stage == s.stage
            and s.what != "queue"
            and not (s.what == "ttft" and any(spans[j].what == "ttft" for j in prev))
        ):
            prev.append(i)  # the same call goes on (a second ttft starts another call)
        else:
            calls.append([i])
    return calls


def turn_spans(r: TurnRecord, resource: Resource | None = None) -> list[ReadableSpan]:
    """The turn as OpenTelemetry SDK spans: a root ``turn`` span (end of speech → first audio heard), one
    GenAI ``chat {model}`` CLIENT span per LLM call on the chain (over its queue/ttft/decode children), and
    one INTERNAL ``{stage}.{what}`` span per other span. Ids derive from (run, label, session, turn)."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    res = resource or resource_for(r.run, r.label)
    scope = InstrumentationScope(SERVICE, __version__)
    tid = trace_id(r)
    off = r.clock_offset_ns

    def ctx(key: str) -> SpanContext:
        return SpanContext(int(tid, 16), int(_hex_id(f"span|{tid}|{key}", 8), 16), False, TraceFlags(1))

    def span(name: str, c: SpanContext, parent: SpanContext | None, start: int, end: int, attrs: dict[str, Any],
             kind: SpanKind = SpanKind.INTERNAL, status: Status | None = None) -> ReadableSpan:  # fmt: skip
        return ReadableSpan(
            name=name, context=c, parent=parent, resource=res, attributes=_clean(attrs), kind=kind,
            instrumentation_scope=scope, status=status or Status(StatusCode.OK), start_time=start + off,
            end_time=end + off,
        )  # fmt: skip

    start, end = _time_window(r)
    root_ctx = ctx("root")
    root_attrs: dict[str, Any] = {
        "gen_ai.conversation.id": r.session,
        "voicepipe.scenario": r.scenario,
        "voicepipe.session": r.session,
        "voicepipe.turn": r.turn,
        "voicepipe.run.id": r.run,
        "voicepipe.config.label": r.label,
        "voicepipe.status": r.status,
        "voicepipe.path": r.path,
        "voicepipe.route": r.route,
        "voicepipe.backend": r.backend,
        "voicepipe.measured_s": _seconds(r.measured_ms),
        "voicepipe.predicted_s": _seconds(r.predicted_ms),
        "voicepipe.tax_s": _seconds(r.tax_ms),
        "voicepipe.budget_s": _seconds(r.budget_ms),
        "voicepipe.within_budget": r.within_budget,
        "voicepipe.cost_usd": r.cost_usd,
        "voicepipe.quality_modelled": r.quality,
        "voicepipe.user_text": r.user_text,
        **{f"voicepipe.{m.removesuffix('_ms')}_s": _seconds(getattr(r, m)) for m in METRICS},
    }
    status = Status(StatusCode.OK) if r.status == "ok" else Status(StatusCode.ERROR, r.status)
    out = [span("turn", root_ctx, None, start, end, root_attrs, status=status)]
    in_call: dict[int, SpanContext] = {}
    for n, idx in enumerate(_llm_calls(r.spans)):
        first, last = r.spans[idx[0]], r.spans[idx[-1]]
        model = _model_of(r.backend)
        ttft_ns = sum(r.spans[i].dur_ns for i in idx if r.spans[i].what in ("queue", "ttft"))
        c = ctx(f"llm{n}")
        llm_attrs = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": GEN_AI_PROVIDER,
            "gen_ai.request.model": model,
            "gen_ai.conversation.id": r.session,
            "gen_ai.usage.input_tokens": r.input_tokens or None,
            "gen_ai.usage.output_tokens": r.output_tokens or None,
            "gen_ai.response.time_to_first_chunk": ttft_ns / 1e9,
            "voicepipe.stage": first.stage,
            "voicepipe.backend": r.backend,
            "voicepipe.modelled": all(r.spans[i].modelled for i in idx),
            "voicepipe.tpot_s": _seconds(r.tpot_ms),
        }
        out.append(
            span(f"chat {model}", c, root_ctx, first.start_ns, last.end_ns, llm_attrs, SpanKind.CLIENT)
        )
        in_call.update(dict.fromkeys(idx, c))
    for i, s in enumerate(r.spans):
        attrs: dict[str, Any] = {
            "voicepipe.stage": s.stage,
            "voicepipe.what": s.what,
            "voicepipe.modelled": s.modelled,
            "voicepipe.duration_s": s.dur_ns / 1e9,
        }
        if conventional_name(s.stage, s.what) == "ttfb":
            attrs["voicepipe.ttfb_s"] = s.dur_ns / 1e9
        out.append(
            span(
                span_name(s.stage, s.what),
                ctx(f"s{i}"),
                in_call.get(i, root_ctx),
                s.start_ns,
                s.end_ns,
                attrs,
            )
        )
    return out


def resource_for(run: str, label: str = "") -> Resource:
    """The OTel resource of a run (one per configuration label in a compare)."""
    from opentelemetry.sdk.resources import Resource

    return Resource(
        _clean(
            {
                "service.name": SERVICE,
                "service.version": __version__,
                "voicepipe.run.id": run,
                "voicepipe.config.label": label,
            }
        )
    )


def sdk_spans(records: Iterable[TurnRecord]) -> list[ReadableSpan]:
    """Every turn's spans, one resource per (run, configuration label)."""
    resources: dict[tuple[str, str], Resource] = {}
    out: list[ReadableSpan] = []
    for r in records:
        key = (r.run, r.label)
        if key not in resources:
            resources[key] = resource_for(*key)
        out += turn_spans(r, resources[key])
    return out


def otel_json(records: Iterable[TurnRecord]) -> dict[str, Any]:
    """All turns as one OTLP/JSON ``ExportTraceServiceRequest``: the SDK's protobuf encoding (the same
    bytes ``--otlp-endpoint`` sends) in the OTLP/JSON mapping (hex ids, integer enums)."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    doc = MessageToDict(encode_spans(sdk_spans(records)), use_integers_for_enums=True)
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for sp in ss.get("spans", []):
                for k in ("traceId", "spanId", "parentSpanId"):
                    if k in sp:
                        sp[k] = base64.b64decode(sp[k]).hex()
    return doc


def otel_proto(doc: dict[str, Any]) -> Any:
    """Parse an OTLP/JSON document into the ``opentelemetry-proto`` message (raises on schema errors)."""
    from google.protobuf.json_format import ParseDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    doc = json.loads(json.dumps(doc))
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for sp in ss.get("spans", []):
                for k in ("traceId", "spanId", "parentSpanId"):
                    if k in sp:
                        sp[k] = base64.b64encode(bytes.fromhex(sp[k])).decode()
    return ParseDict(doc, ExportTraceServiceRequest())


def write_otel(records: Iterable[TurnRecord], path: str | Path) -> None:
    Path(path).write_text(json.dumps(otel_json(records), indent=1) + "\n", encoding="utf-8")


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP base URL (``OTEL_EXPORTER_OTLP_ENDPOINT`` style) or a full ``.../v1/traces`` URL."""
    return endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"


def push_otlp(records: Iterable[TurnRecord], endpoint: str, timeout_s: float = 10.0) -> int:
    """Send every turn's spans to an OTLP/HTTP collector with the SDK's exporter; the number of spans sent.

    Raises :class:`UserError` (``--otlp-endpoint``) when the collector cannot be reached or refuses."""
    import logging

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    spans = sdk_spans(records)
    if not spans:
        return 0
    url = traces_url(endpoint)
    exporter = OTLPSpanExporter(endpoint=url, timeout=timeout_s)
    exp_log = logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    level = exp_log.level
    exp_log.setLevel(logging.CRITICAL)  # its own retry warnings; the failure is reported once, below
    try:
        result = exporter.export(spans)
    finally:
        exp_log.setLevel(level)
        exporter.shutdown()
    if result != SpanExportResult.SUCCESS:
        raise UserError(
            "--otlp-endpoint", f"{url}: the collector did not accept the traces (unreachable or refused)"
        )
    return len(spans)


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
    return parse_otel(read_json(path, MAX_EXPORT_BYTES))
