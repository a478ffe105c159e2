"""Reports and exports of turn records: HTML report, terminal tables, CSV and OpenTelemetry JSON."""

from voicepipe.report.export import otel_json, read_csv, read_otel, write_csv, write_otel
from voicepipe.report.html import render_html

__all__ = ["otel_json", "read_csv", "read_otel", "render_html", "write_csv", "write_otel"]
