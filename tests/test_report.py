"""Report and exports: HTML structure and self-containment, headless render, CSV and OTel round-trips."""

from __future__ import annotations

import io
import random
import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path
from typing import ClassVar

import pytest
from rich.console import Console

from voicepipe.messages import Span
from voicepipe.records import BreakdownPart, TurnRecord
from voicepipe.report import otel_json, read_csv, read_otel, render_html, write_csv, write_otel
from voicepipe.report.advice import Advice, Candidate
from voicepipe.report.export import otel_proto, span_name
from voicepipe.report.svg import esc, nice_ticks, stage_colour
from voicepipe.report.table import print_summary, print_turns

BUDGET = 800.0
EPOCH_OFFSET = 1_700_000_000_000_000_000
SECTIONS = ("summary", "waterfall", "cdf", "breakdown", "missed", "tax", "config")
CHART_SECTIONS = ("summary", "waterfall", "cdf", "breakdown", "tax")

# (stage, what, modelled, typical ms) along a plausible causal chain after the end of speech
CHAIN = (
    ("transport", "uplink", True, 40.0),
    ("asr", "endpoint wait", True, 220.0),
    ("bus", "hop", False, 3.0),
    ("router", "route", True, 8.0),
    ("bus", "hop", False, 3.0),
    ("agent", "ttft", True, 300.0),
    ("agent", "decode to first clause", True, 90.0),
    ("bus", "hop", False, 3.0),
    ("tts", "first audio", True, 120.0),
    ("transport", "downlink", True, 45.0),
)


def make_record(
    turn: int,
    *,
    label: str = "",
    session: str = "s1",
    seed: int = 0,
    slow: float = 1.0,
    timeout: bool = False,
    path: str = "agent",
) -> TurnRecord:
    """A plausible turn: spans laid end to end after the end of speech; breakdown sums to measured."""
    rng = random.Random(f"{label}|{session}|{turn}|{seed}")
    t0 = 5_000_000_000 + turn * 10_000_000_000
    spans = [Span(stage="asr", what="partial", start_ns=t0 - 400_000_000, dur_ns=150_000_000)]
    parts: list[BreakdownPart] = []
    t = t0
    chain = CHAIN[:6] if timeout else CHAIN
    for stage, what, modelled, ms in chain:
        d_ms = ms * rng.uniform(0.6, 1.5) * (slow if stage == "agent" else 1.0)
        d_ns = round(d_ms * 1e6)
        spans.append(Span(stage=stage, what=what, start_ns=t, dur_ns=d_ns, modelled=modelled))
        parts.append(BreakdownPart(stage=stage, what=what, ms=d_ns / 1e6, modelled=modelled))
        t += d_ns
    measured = (t - t0) / 1e6
    predicted = sum(p.ms for p in parts if p.modelled)
    return TurnRecord(
        run="run-test",
        label=label,
        scenario="weather" if turn % 2 else "smalltalk",
        session=session,
        turn=turn,
        user_text=f"what's the weather like in Paris on day {turn} <b>&</b>",
        reply_text="It will be sunny.",
        backend="sonnet-empirical",
        status="timeout" if timeout else "ok",
        measured_ms=None if timeout else measured,
        predicted_ms=None if timeout else predicted,
        tax_ms=None if timeout else measured - predicted,
        budget_ms=BUDGET,
        within_budget=not timeout and measured <= BUDGET,
        breakdown=parts,
        spans=spans,
        end_of_speech_ns=t0,
        first_audio_ns=None if timeout else t,
        clock_offset_ns=EPOCH_OFFSET,
        path=path,  # type: ignore[arg-type]
        input_tokens=120,
        output_tokens=40,
        cost_usd=0.0012 * slow,
        quality=0.8 if label == "council" else None,
    )


def make_runs(n: int = 12) -> dict[str, list[TurnRecord]]:
    base = [make_record(i, label="baseline", session=f"s{i % 3}") for i in range(n)]
    base.append(make_record(n, label="baseline", timeout=True))
    slow = [make_record(i, label="council", slow=2.0, path="council") for i in range(n)]
    return {"baseline": base, "council": slow}


CONFIGS = {
    "baseline": {"budget_ms": 800, "broker": {"url": "mqtt://localhost:1883"}, "agents": {"main": "sonnet"}},
    "council": {"budget_ms": 800, "council": {"members": 3, "mode": "first"}},
}


class _Collector(HTMLParser):
    """Tracks sections and what each contains; records mismatched nesting."""

    VOID: ClassVar[frozenset[str]] = frozenset({"meta", "br", "img", "input", "link", "hr", "wbr", "source"})

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.section: str | None = None
        self.sections: dict[str, dict[str, int]] = {}
        self.attrs: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for k, v in attrs:
            self.attrs.append((tag, k, v or ""))
        if tag == "section":
            self.section = dict(attrs).get("id") or "?"
            self.sections[self.section] = {"svg": 0, "budget": 0}
        if self.section:
            if tag == "svg":
                self.sections[self.section]["svg"] += 1
            if "budget-line" in (dict(attrs).get("class") or "").split():
                self.sections[self.section]["budget"] += 1
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unexpected </{tag}> with open {self.stack[-3:]}")
            return
        self.stack.pop()
        if tag == "section":
            self.section = None


def wide_only(doc: str) -> str:
    """The page with its narrow chart variants removed (every chart is drawn at two widths)."""
    return re.sub(r'<div class="chart-narrow"><svg .*?</svg></div>', "", doc)


def narrow_only(doc: str) -> str:
    return re.sub(r'<div class="chart-wide"><svg .*?</svg></div>', "", doc)


def _parse(doc: str) -> _Collector:
    p = _Collector()
    p.feed(doc)
    p.close()
    return p


@pytest.fixture(scope="module")
def report() -> str:
    return render_html(make_runs(), CONFIGS, title="test report", budget_ms=BUDGET)


def test_html_parses_and_has_sections(report: str) -> None:
    assert _parse(report).errors == [] and _parse(report).stack == []
    p = _parse(wide_only(report))
    assert p.errors == []
    assert p.stack == [], f"unclosed tags: {p.stack}"
    assert _parse(narrow_only(report)).sections == p.sections  # the same charts at the other width
    assert set(SECTIONS) <= set(p.sections)
    for sid in CHART_SECTIONS:
        assert p.sections[sid]["svg"] >= 1, sid
        assert p.sections[sid]["budget"] >= 1, sid
    # there are misses (the timeout and slow council turns), so the missed section draws them too
    assert p.sections["missed"]["svg"] == 1 and p.sections["missed"]["budget"] == 1
    for heading in (
        "Per-turn waterfall",
        "Latency distribution",
        "Where the milliseconds go",
        "Configuration",
    ):
        assert heading in report


def test_html_is_self_contained(report: str) -> None:
    p = _parse(report)
    loading = {"src", "href", "xlink:href", "srcset", "data", "poster", "action", "background"}
    for tag, k, v in p.attrs:
        assert k not in loading, f"<{tag} {k}={v!r}> may load something"
    assert tag_free(report, "script") and tag_free(report, "link") and tag_free(report, "iframe")
    for m in re.finditer(r"url\(\s*['\"]?([^)'\"]*)", report):
        assert m.group(1).startswith("#"), f"external url({m.group(1)})"
    assert "@import" not in report


def tag_free(doc: str, tag: str) -> bool:
    return re.search(rf"<{tag}\b", doc, re.I) is None


def test_html_content_escapes_and_reports(report: str) -> None:
    assert "<b>&</b>" not in report  # user text is escaped
    assert esc("<b>&</b>") in report
    assert "mqtt://localhost:1883" in report  # config shown as text
    assert "timeout" in report
    assert "quality (modelled)" in report
    assert "800 ms budget" in report and "200 ms" in report


def test_html_handles_empty_and_plain_run() -> None:
    doc = render_html({"": []}, {}, budget_ms=BUDGET)
    assert _parse(doc).errors == []
    recs = [make_record(i) for i in range(3)]
    doc = render_html({"": recs}, {"": {"budget_ms": 800}})
    p = _parse(doc)
    assert p.errors == [] and set(SECTIONS) <= set(p.sections)
    assert "quality (modelled)" not in doc
    assert "run-test" in doc


def test_waterfall_caps_bars() -> None:
    recs = [make_record(i) for i in range(150)]
    doc = render_html({"big": recs}, {})
    p = _parse(doc)
    assert "big 60 of 150" in doc
    wf = wide_only(doc)
    wf = wf[wf.index('id="waterfall"') : wf.index('id="cdf"')]
    assert wf.count('class="bar"') == 60
    assert p.errors == []


def test_svg_helpers() -> None:
    assert nice_ticks(830)[-1] >= 830 and nice_ticks(830)[0] == 0
    assert len(nice_ticks(830)) <= 8
    assert stage_colour("agent") != stage_colour("tts")
    assert stage_colour("mystery") == stage_colour("mystery")


# --- exports --------------------------------------------------------------------------------------


def test_csv_round_trip(tmp_path: Path) -> None:
    runs = make_runs(5)
    recs = [r for rs in runs.values() for r in rs]
    path = tmp_path / "turns.csv"
    write_csv(recs, path)
    back = read_csv(path)
    assert back == recs
    header = path.read_text().splitlines()[0].split(",")
    assert "measured_ms" in header and "stage_ms.agent" in header


def test_csv_none_and_text_fields(tmp_path: Path) -> None:
    r = make_record(1, timeout=True).model_copy(update={"user_text": 'a, "quoted"\nline', "quality": None})
    write_csv([r], tmp_path / "t.csv")
    (back,) = read_csv(tmp_path / "t.csv")
    assert back.measured_ms is None and back.quality is None and back.user_text == r.user_text
    assert back.breakdown == r.breakdown and back.spans == r.spans


def test_otel_round_trip(tmp_path: Path) -> None:
    """OTLP/JSON from the SDK's encoder: parses as opentelemetry-proto, GenAI span for the LLM, snake-case
    names, seconds, resource attributes, stable ids."""
    recs = [make_record(i, session=f"s{i % 2}") for i in range(4)] + [make_record(9, timeout=True)]
    doc = otel_json(recs)
    req = otel_proto(doc)  # raises on anything that is not a valid ExportTraceServiceRequest
    assert len(req.resource_spans) == 1
    res = {a["key"]: a["value"] for a in doc["resourceSpans"][0]["resource"]["attributes"]}
    assert res["service.name"] == {"stringValue": "voicepipe"}
    assert res["voicepipe.run.id"] == {"stringValue": "run-test"} and "service.version" in res
    write_otel(recs, tmp_path / "t.json")
    spans = read_otel(tmp_path / "t.json")
    # root + one span per record span + one GenAI span per LLM call (one per turn here)
    assert len(spans) == sum(2 + len(r.spans) for r in recs)
    by_trace: dict[str, list[dict]] = {}
    for s in spans:
        assert re.fullmatch(r"[0-9a-f]{32}", s["trace_id"]) and int(s["trace_id"], 16)
        assert re.fullmatch(r"[0-9a-f]{16}", s["span_id"]) and int(s["span_id"], 16)
        assert s["end_ns"] >= s["start_ns"] > EPOCH_OFFSET
        by_trace.setdefault(s["trace_id"], []).append(s)
    assert len(by_trace) == len(recs)
    assert len({s["span_id"] for s in spans}) == len(spans)
    kinds = {
        sp["name"]: sp["kind"] for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for sp in ss["spans"]
    }
    for r in recs:
        tspans = next(v for v in by_trace.values() if v[0]["attributes"]["voicepipe.turn"] == r.turn)
        root = next(s for s in tspans if s["name"] == "turn")
        assert root["parent_span_id"] == ""
        llm = next(s for s in tspans if s["name"].startswith("chat "))
        assert llm["name"] == "chat sonnet-empirical" and kinds[llm["name"]] == 3  # SPAN_KIND_CLIENT
        a = llm["attributes"]
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "sonnet-empirical"
        assert a["gen_ai.provider.name"] == "voicepipe.simulated" and a["gen_ai.conversation.id"] == r.session
        ttft = next(s for s in tspans if s["name"] == "agent.ttft")
        assert ttft["parent_span_id"] == llm["span_id"]
        assert a["gen_ai.response.time_to_first_chunk"] == pytest.approx(
            (ttft["end_ns"] - ttft["start_ns"]) / 1e9
        )
        children = [s for s in tspans if s["name"] not in ("turn",) and not s["name"].startswith("chat ")]
        assert all(" " not in s["name"] for s in children)
        assert [c["name"] for c in children] == [span_name(s.stage, s.what) for s in r.spans]
        assert "asr.endpoint_wait" in [c["name"] for c in children]
        assert all(c["parent_span_id"] in (root["span_id"], llm["span_id"]) for c in children)
        assert root["start_ns"] == r.end_of_speech_ns + EPOCH_OFFSET
        for c, s in zip(children, r.spans, strict=True):
            assert c["start_ns"] == s.start_ns + EPOCH_OFFSET and c["end_ns"] == s.end_ns + EPOCH_OFFSET
            assert c["attributes"]["voicepipe.duration_s"] == pytest.approx(s.dur_ns / 1e9)
        ra = root["attributes"]
        assert ra["voicepipe.within_budget"] is r.within_budget and ra["voicepipe.scenario"] == r.scenario
        assert not any(k.startswith(("stage", "what", "e2e")) for k in ra)  # every custom key is namespaced
        if r.measured_ms is None:
            assert "voicepipe.measured_s" not in ra
        else:
            assert root["end_ns"] == r.first_audio_ns + EPOCH_OFFSET
            assert ra["voicepipe.measured_s"] == pytest.approx(r.measured_ms / 1e3)
            assert ra["voicepipe.tax_s"] == pytest.approx(r.tax_ms / 1e3) and ra["voicepipe.budget_s"] == 0.8
            assert (root["end_ns"] - root["start_ns"]) / 1e6 == pytest.approx(r.measured_ms)
    # deterministic ids: the same records give the same document
    assert otel_json(recs) == doc


# --- terminal tables ------------------------------------------------------------------------------


def test_rich_tables_fit_and_mark_budget() -> None:
    runs = make_runs(4)
    buf = io.StringIO()
    con = Console(file=buf, width=100, color_system=None)
    print_turns(con, runs["baseline"] + runs["council"], BUDGET)
    print_summary(con, runs)
    out = buf.getvalue()
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "✓" in out and "timeout" in out and "path" in out
    assert "agent ttft" in out and "client's clock" in out
    assert "baseline" in out and "council" in out and "p99" in out


# --- headless render ------------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit non-interlaced RGB/RGBA PNG into rows of raw pixel bytes (no PIL)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, hdr = 8, b"", b""
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            hdr = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", hdr)
    assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
    bpp = 3 if ctype == 2 else 4
    raw = zlib.decompress(idat)
    stride = w * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return w, bpp, rows


@pytest.mark.skipif(_chromium() is None, reason="no chromium binary")
def test_renders_in_headless_chromium(tmp_path: Path, report: str) -> None:
    html_path = tmp_path / "report.html"
    html_path.write_text(report, encoding="utf-8")
    png = tmp_path / "shot.png"
    cmd = [
        str(_chromium()),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={png}",
        "--window-size=1280,2000",
        html_path.as_uri(),
    ]
    subprocess.run(cmd, capture_output=True, timeout=60, check=False)
    assert png.exists() and png.stat().st_size > 1000
    w, bpp, rows = png_pixels(png.read_bytes())
    colours: set[bytes] = set()
    for row in rows[::7]:
        for x in range(0, w * bpp, bpp * 5):
            colours.add(row[x : x + 3])
    assert len(colours) > 20, f"only {len(colours)} colours: blank render?"
    assert stage_colour("agent").lstrip("#") in {c.hex() for c in colours}  # the waterfall drew agent bars


def test_axis_cut_keeps_outliers_from_squashing() -> None:
    recs = [make_record(i) for i in range(20)]
    slow = recs[3]
    extra = BreakdownPart(stage="agent", what="cold start", ms=20_000.0 - (slow.measured_ms or 0.0))
    recs[3] = slow.model_copy(update={"measured_ms": 20_000.0, "breakdown": [*slow.breakdown, extra]})
    doc = render_html({"": recs}, {})
    cdf = doc[doc.index('id="cdf"') : doc.index('id="breakdown"')]
    assert "The axis is cut at" in cdf and ">20,000<" not in cdf
    assert "20000 ms ✗" in doc  # the clipped bar still states its true latency


# Runs in the page after load: the document's scroll width, and every element (outside a .scroll box,
# which scrolls on purpose, and inside SVGs only the SVG itself) that sticks out of its section card.
OVERFLOW_PROBE = """<script>
window.addEventListener('load', () => {
  const bad = [];
  document.querySelectorAll('section').forEach(sec => {
    const r = sec.getBoundingClientRect();
    sec.querySelectorAll('*').forEach(el => {
      if (el.closest('.scroll') && !el.classList.contains('scroll')) return;
      if (el.closest('svg') && el.tagName.toLowerCase() !== 'svg') return;
      const e = el.getBoundingClientRect();
      if (e.width > 0 && (e.right > r.right + 1 || e.left < r.left - 1)) bad.push(sec.id + ' ' + el.tagName);
    });
  });
  document.body.setAttribute('data-probe', JSON.stringify(
    {scroll: document.documentElement.scrollWidth, client: document.documentElement.clientWidth, bad: bad}));
});
</script>"""


def layout_probe(html: str, width: int, tmp_path: Path) -> dict:
    """Load ``html`` in headless Chromium at ``width`` px and return OVERFLOW_PROBE's findings."""
    import json

    page = tmp_path / f"probe-{width}.html"
    page.write_text(html.replace("</body>", OVERFLOW_PROBE + "</body>"), encoding="utf-8")
    cmd = [
        str(_chromium()), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},1600", "--virtual-time-budget=3000",
        "--dump-dom", page.as_uri(),
    ]  # fmt: skip
    dom = subprocess.run(cmd, capture_output=True, timeout=90, check=False, text=True).stdout
    m = re.search(r'data-probe="([^"]*)"', dom)
    assert m, "the probe did not run"
    return json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))


LONG = "support-call-with-a-very-long-configuration-name"


@pytest.mark.skipif(_chromium() is None, reason="no chromium binary")
@pytest.mark.parametrize("width", [700, 1280])
def test_report_has_no_horizontal_overflow(tmp_path: Path, width: int) -> None:
    """At 700 px (a half-screen window) and 1280 px nothing sticks out of the page or of its card: tables
    scroll inside their card, charts scale. Long labels and sessions are the hard case."""
    runs = make_runs()
    runs = {
        f"{LONG}-{k}": [r.model_copy(update={"session": f"{LONG}-{r.session}"}) for r in v]
        for k, v in runs.items()
    }
    html = render_html(runs, {k: {} for k in runs}, budget_ms=BUDGET)
    got = layout_probe(html, width, tmp_path)
    assert got["scroll"] <= got["client"], got
    assert got["bad"] == [], got["bad"][:10]


def _x_axes(svg_html: str) -> list[list[tuple[str, str]]]:
    """Per chart: the (x position, label) of every x-axis tick."""
    axes = re.findall(r'<g class="axis x-axis">(.*?)</g>', svg_html)
    return [re.findall(r'<text x="([\d.]+)"[^>]*>([^<]*)</text>', a)[:-1] for a in axes]


def test_waterfalls_share_one_x_scale() -> None:
    """The council run is twice as slow; both waterfalls still put every tick at the same pixel."""
    runs = make_runs()
    runs["a-much-longer-configuration-label-than-the-other"] = runs.pop("baseline")
    html = render_html(runs, {}, budget_ms=BUDGET)
    for page in (wide_only(html), narrow_only(html)):
        section = page[page.index('<section id="waterfall"') : page.index('<section id="cdf"')]
        axes = _x_axes(section)
        assert len(axes) == 2 and axes[0] == axes[1] and len(axes[0]) >= 3
    assert "one x scale" in section


def test_summary_legend_matches_bars_and_single_run_is_named_by_label() -> None:
    runs = make_runs()
    html = render_html(runs, {}, budget_ms=BUDGET)
    summary = html[html.index('<section id="summary"') : html.index("</section>", html.index('id="summary"'))]
    legend_fills = set(
        re.findall(r'<rect x="[\d.]+" y="[\d.]+" width="14" height="11" fill="(#[0-9a-f]{6})"', summary)
    )
    bar_fills = set(re.findall(r'<rect class="seg"[^>]*fill="(#[0-9a-f]{6})"', summary))
    assert bar_fills - {"#bbbbbb", "#bbb"} <= legend_fills
    one = render_html({"fast-lane": runs["baseline"]}, {}, budget_ms=BUDGET)
    assert "run-test</b>" not in one and "<b>fast-lane</b>" in one


def test_fix_panel_names_the_largest_part_of_the_misses() -> None:
    runs = make_runs()
    html = render_html(runs, {}, budget_ms=BUDGET)
    panel = html[html.index('<section id="fixes"') : html.index('<section id="waterfall"')]
    from voicepipe.report.advice import largest_part

    for label, recs in runs.items():
        (st, wh), ms, _ = largest_part([r for r in recs if not r.within_budget])
        assert f"{st} · {wh}, {ms:,.0f} ms" in panel, label


def test_report_layout_structure_holds_without_a_browser() -> None:
    """The structural half of the overflow check (runs where no browser is installed): every table sits in
    a box that scrolls sideways, every chart scales down with the page, and every bar label drawn fits its
    label column (cut with an ellipsis, the whole label kept as a tooltip)."""
    runs = make_runs()
    runs = {
        f"{LONG}-{k}": [r.model_copy(update={"session": f"{LONG}-{r.session}"}) for r in v]
        for k, v in runs.items()
    }
    html = render_html(runs, {k: {} for k in runs}, budget_ms=BUDGET)
    assert ".scroll { overflow-x:auto" in html
    assert html.count("<table") == html.count('<div class="scroll"><table') > 0
    svgs = re.findall(r"<svg [^>]*>", html)
    assert svgs and all("max-width:100%" in s for s in svgs)
    from voicepipe.report.svg import text_width

    for x, label in re.findall(
        r'<text x="([\d.]+)" y="[\d.]+" text-anchor="end" fill="#222">([^<]*)</text>', html
    ):
        assert text_width(label) <= float(x) + 1, label  # right-aligned at x: starts at or right of 0
    assert any(
        "…" in label for _, label in re.findall(r'<text x="([\d.]+)"[^>]*fill="#222">([^<]*)</text>', html)
    )


def test_wide_prints_every_column_whole_on_a_terminal_narrower_than_the_table() -> None:
    from voicepipe.report.term import Col, print_fitted

    cols = [
        Col("identifier", justify="left"),
        Col("value"),
        Col("extra", 2),
        Col("note", 3, "left", text=True),
    ]
    rows = [["a-rather-long-identifier-of-forty-chars", "12,345.6", "789", "some words that would wrap"]]
    buf = io.StringIO()
    con = Console(file=buf, width=40, color_system=None)
    print_fitted(con, cols, rows, wide=True)
    out = buf.getvalue()
    assert "…" not in out and "hidden at" not in out
    assert any("a-rather-long-identifier-of-forty-chars" in ln and "some words that would wrap" in ln
               for ln in out.splitlines())  # fmt: skip
    assert con.width == 40  # the console is left as it was


def _uncropped(cols, rows, width: int) -> str:
    """The fitted table as it really lays out (a console wide enough that nothing is cropped)."""
    from voicepipe.report.term import fitted_table

    table, _ = fitted_table(cols, rows, width)
    buf = io.StringIO()
    Console(file=buf, width=500, color_system=None).print(table)
    return buf.getvalue()


def test_a_text_column_wraps_between_words_and_drops_others_before_splitting_one() -> None:
    from voicepipe.report.term import Col, print_fitted

    cols = [Col("config", justify="left", text=True, min_width=8), Col("load", justify="left", text=True),
            Col("p50"), Col("extra", 1)]  # fmt: skip
    rows = [["cerebras-wse3/llama-3.1-8b", "100 sessions", "701", "12345678901234"]]
    buf = io.StringIO()
    print_fitted(Console(file=buf, width=46, color_system=None), cols, rows)
    out = buf.getvalue()
    assert "cerebras-wse3/llama-3.1-8b" in out  # whole, though the column's minimum is 8
    assert "hidden at 46 columns: extra" in out  # a column dropped to make room
    assert max(len(line.rstrip()) for line in _uncropped(cols, rows, 46).splitlines()) <= 46


def test_when_the_kept_columns_cannot_hold_whole_words_a_word_folds_and_no_number_is_cut() -> None:
    from voicepipe.report.term import Col

    cols = [Col("config", justify="left", text=True, min_width=8), Col("load", justify="left", text=True),
            Col("p50"), Col("p90"), Col("within"), Col("extra", 1)]  # fmt: skip
    rows = [["cerebras-wse3/llama-3.1-8b", "10 sessions", "700", "773", "96%", "x"],
            ["h100-sxm/llama-3.1-8b", "10 sessions", "759", "838", "81%", "y"]]  # fmt: skip
    for width in range(36, 90):
        out = _uncropped(cols, rows, width)
        assert max(len(line.rstrip()) for line in out.splitlines()) <= width, width
        for number in ("700", "773", "96%", "838", "81%", "within"):
            assert number in out, (width, number)


def test_a_predicted_report_calls_its_latencies_predicted_and_claims_no_tax() -> None:
    """compare --predict's page: nothing was measured, so no section calls a latency measured and the
    summary's tax column (measured - predicted) is empty rather than 0 ms."""
    doc = render_html(make_runs(), CONFIGS, budget_ms=BUDGET, predicted=True)
    assert "measured latency" not in doc and "<th>measured</th>" not in doc.replace(' class="num"', "")
    assert "the number is the predicted latency" in doc and "mean predicted latency" in doc
    summary = doc.split('id="summary"', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr>(.*?)</tr>", summary, re.S)[1:]
    tax_col = [re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)[8] for row in rows]
    assert tax_col and all(re.sub(r"<[^>]+>", "", c) == "—" for c in tax_col), tax_col
    live = render_html(make_runs(), CONFIGS, budget_ms=BUDGET)
    assert "the number is the measured latency" in live


def test_the_fix_panel_names_the_talked_over_endpoint_its_advice_acts_on() -> None:
    """When the misses are mostly talk-over, the advice changes the endpointing: the report says that is
    why (as the terminal does), not that some other largest part is to blame."""
    runs = make_runs()
    fix = Candidate("smart endpointing", None, ("asr.endpointing=smart",))
    advice = Advice(
        5, 6, BUDGET, ("asr", "endpoint wait"), 200.0, 600.0, fix, 425.0, 0.83, 572.0, 0.17,
        "voicepipe run x --set asr.endpointing=smart", talked_over=5,
    )  # fmt: skip
    doc = render_html(runs, CONFIGS, budget_ms=BUDGET, fixes={"baseline": advice, "council": None})
    panel = re.sub(r"<[^>]+>", "", doc.split('id="fixes"', 1)[1].split("</section>", 1)[0])
    baseline = panel.split("baseline:", 1)[1].split("council:", 1)[0]
    assert "talked over the user" in baseline and "asr · endpoint wait, 200 ms" in baseline
    assert "largest part" not in baseline and "Try smart endpointing" in baseline
    assert "largest part" in panel.split("council:", 1)[1]


def test_the_cache_line_gives_a_hit_p50_only_when_there_were_hits():
    from rich.console import Console

    from voicepipe.report.table import print_paths

    def cache_line(records: list[TurnRecord]) -> str:
        con = Console(record=True, width=200)
        print_paths(con, records)
        return next(line for line in con.export_text().splitlines() if line.startswith("cache:"))

    misses = [make_record(i, path="agent").model_copy(update={"route": "agent (cache miss)"}) for i in range(3)]
    misses.append(make_record(5, path="council"))  # two paths, so the table and its cache line print
    assert "hit p50" not in cache_line(misses) and "0 hits" in cache_line(misses)
    hits = [*misses, make_record(9, path="cache")]
    assert "hit p50" in cache_line(hits) and "1 hits" in cache_line(hits)
