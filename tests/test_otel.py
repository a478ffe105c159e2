"""OTLP/HTTP push: the SDK exporter's request arrives at a local collector endpoint as GenAI spans."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.test_report import make_record
from voicepipe.errors import UserError
from voicepipe.report.export import push_otlp, traces_url


class Collector:
    """A minimal OTLP/HTTP trace receiver on 127.0.0.1: keeps every request it gets (path, parsed body)."""

    def __init__(self, status: int = 200) -> None:
        self.got: list[tuple[str, str, ExportTraceServiceRequest]] = []
        self.status = status
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.got.append(
                    (self.path, self.headers["Content-Type"], ExportTraceServiceRequest.FromString(body))
                )
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(outer.status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def spans(self) -> list:
        return [
            sp
            for _, _, req in self.got
            for rs in req.resource_spans
            for ss in rs.scope_spans
            for sp in ss.spans
        ]


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    c.thread.start()
    yield c
    c.server.shutdown()
    c.server.server_close()


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


def test_traces_url() -> None:
    assert traces_url("http://h:4318") == "http://h:4318/v1/traces"
    assert traces_url("http://h:4318/") == "http://h:4318/v1/traces"
    assert traces_url("http://h:4318/v1/traces") == "http://h:4318/v1/traces"


def test_push_arrives_as_genai_spans(collector: Collector) -> None:
    recs = [make_record(i, session="s1") for i in range(3)]
    n = push_otlp(recs, collector.url)
    assert n == sum(2 + len(r.spans) for r in recs)
    ((path, ctype, req),) = collector.got
    assert path == "/v1/traces" and ctype == "application/x-protobuf"
    res = {kv.key: kv.value.string_value for kv in req.resource_spans[0].resource.attributes}
    assert res["service.name"] == "voicepipe" and res["voicepipe.run.id"] == "run-test"
    spans = collector.spans()
    assert len(spans) == n
    llm = [s for s in spans if s.name.startswith("chat ")]
    assert len(llm) == 3
    for s in llm:
        assert s.kind == s.SPAN_KIND_CLIENT
        a = attrs(s)
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.request.model"] == "sonnet-empirical"
        assert a["gen_ai.response.time_to_first_chunk"] > 0  # seconds, not ms
        assert a["gen_ai.response.time_to_first_chunk"] < 5
    roots = [s for s in spans if s.name == "turn"]
    assert len(roots) == 3 and all(not s.parent_span_id for s in roots)
    assert all(s.kind == s.SPAN_KIND_INTERNAL for s in spans if not s.name.startswith("chat "))


def test_refused_push_is_one_user_error() -> None:
    c = Collector(status=400)  # a collector that rejects the request: not retried by the exporter
    c.thread.start()
    try:
        with pytest.raises(UserError) as exc:
            push_otlp([make_record(0)], c.url, timeout_s=5)
        assert "--otlp-endpoint" in str(exc.value)
    finally:
        c.server.shutdown()
        c.server.server_close()
