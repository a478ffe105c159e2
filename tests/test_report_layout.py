"""Reading the HTML reports: chart text never under 10 px at 700 or 1280 px, labels that tell turns and
lines apart, latency notes clear of the budget line, the summary reflowing instead of scrolling, and a
configuration section that shows what differs. Pure checks on the SVG, and the same measured in headless
Chromium where one is installed."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.test_report import BUDGET, CONFIGS, LONG, _chromium, make_runs, narrow_only, wide_only
from voicepipe.capacity import Level, Load
from voicepipe.cli.capacity import p90_chart, report_html
from voicepipe.report import render_html
from voicepipe.report.blocks import NARROW_W, WIDE_W
from voicepipe.report.configdiff import config_diff
from voicepipe.report.svg import MIN_FONT_PX, text_width


def long_named_runs() -> dict:
    runs = make_runs()
    return {
        f"{LONG}-{k}": [r.model_copy(update={"session": f"{LONG}-{r.session}"}) for r in v]
        for k, v in runs.items()
    }


def content_width(window: float) -> float:
    """The width a section's content gets (the report's CSS: main max 1040 px, paddings per breakpoint)."""
    main_pad, sec_pad = (24, 22 + 1) if window > 760 else (10, 12 + 1)
    return min(1040, window) - 2 * main_pad - 2 * sec_pad


def _fonts(svg: str) -> list[float]:
    return [float(x) for x in re.findall(r'font-size="([\d.]+)"', svg)]


def test_every_chart_is_drawn_at_a_width_that_shows_its_text_at_10_px_or_more() -> None:
    html = render_html(long_named_runs(), {}, budget_ms=BUDGET)
    # the variant each window shows is not scaled down there (CSS switches at 1040 px)
    assert content_width(1280) >= WIDE_W and content_width(700) >= NARROW_W
    for page, w in ((wide_only(html), WIDE_W), (narrow_only(html), NARROW_W)):
        svgs = re.findall(r"<svg .*?</svg>", page)
        assert len(svgs) >= 6
        for svg in svgs:
            assert f'width="{w:.0f}"' in svg.split(">")[0]
            assert min(_fonts(svg)) >= MIN_FONT_PX
    assert ".chart-narrow { display:none; }" in html and "@media (max-width: 1040px)" in html


def _budget_xs(svg: str) -> list[float]:
    return [float(x) for x in re.findall(r'<g class="budget-line"><line x1="([\d.]+)"', svg)]


def test_latency_notes_never_cross_the_budget_line() -> None:
    html = render_html(long_named_runs(), {}, budget_ms=BUDGET)
    checked = 0
    for svg in re.findall(r"<svg .*?</svg>", html):
        lines = _budget_xs(svg)
        for x, note in re.findall(r'<text class="note" x="([\d.]+)"[^>]*>([^<]*)</text>', svg):
            left, right = float(x), float(x) + text_width(note, 11) * 1.1
            for line in lines:
                assert not left - 2 < line < right + 2, (note, left, line)
                checked += 1
    assert checked > 50


def test_missed_turn_labels_name_the_session_turn_and_configuration() -> None:
    runs = long_named_runs()
    html = render_html(runs, {}, budget_ms=BUDGET)
    for page in (wide_only(html), narrow_only(html)):
        sec = page[page.index('<section id="missed"') : page.index('<section id="tax"')]
        labels = re.findall(r'<text x="[\d.]+" y="[\d.]+" text-anchor="end" fill="#222">([^<]*)</text>', sec)
        assert len(labels) >= 10 and len(set(labels)) == len(labels), labels  # each row its own label
        for lb in labels:
            assert re.search(r" · t\d+ · ", lb) and lb.endswith(("ne", "il")), lb  # the config's tail


def test_the_summary_table_reflows_into_cards_on_a_narrow_page() -> None:
    html = render_html(long_named_runs(), {}, budget_ms=BUDGET)
    summary = html[html.index('<section id="summary"') : html.index("</section>", html.index('id="summary"'))]
    assert '<table class="reflow">' in summary
    assert 'data-label="p90"' in summary and "table.reflow thead { display:none; }" in html


def test_the_configuration_section_shows_what_differs_and_folds_each_whole_config() -> None:
    a = {"budget_ms": 800, "asr": {"model": "whisper", "endpoint_ms": 200}, "agent": {"backend": "sonnet"}}
    b = {"budget_ms": 800, "asr": {"model": "whisper", "endpoint_ms": 300}, "agent": {"backend": "sonnet"},
         "council": {"members": 3}}  # fmt: skip
    assert config_diff([a, b]) == (["asr.endpoint_ms", "council.members"], 3)
    runs = make_runs()
    html = render_html(runs, {"baseline": a, "council": b}, budget_ms=BUDGET)
    sec = html[html.index('<section id="config"') : html.index("</section>", html.index('id="config"'))]
    diff = sec[sec.index('<table class="diff">') : sec.index("</table>")]
    assert "asr.<wbr>endpoint_ms" in diff and "council.<wbr>members" in diff and "not set" in diff
    assert "budget_ms" not in diff and "model" not in diff
    assert sec.count("<details>") == 2 and "endpoint_ms: 300" in sec  # the whole YAML, folded
    one = render_html({"": runs["baseline"]}, {"": CONFIGS["baseline"]}, budget_ms=BUDGET)
    sec = one[one.index('<section id="config"') :]
    assert "<details>" in sec and "mqtt://localhost:1883" in sec and "differ" not in sec


def _levels() -> list[Level]:
    def lv(label: str, n: int, p90: float) -> Level:
        return Level(label=label, load=Load("sessions", n), conversations=n, turns=100, answered=100,
                     p50_ms=p90 * 0.8, p90_ms=p90, p99_ms=p90 * 1.1, within_budget=0.9,
                     cost_per_hour_usd=1.0, window_s=60.0)  # fmt: skip

    out = []
    for n, a, b, c in [(1, 610, 640, 300), (10, 650, 690, 320), (50, 760, 775, 400), (200, 806, 812, 795)]:
        out += [lv("baseline", n, a), lv("fast-lane", n, b), lv("cerebras-wse3/llama-3.1-8b", n, c)]
    return out


def test_capacity_lines_are_labelled_at_their_ends_apart_and_clear_of_the_budget_label() -> None:
    svg = p90_chart(_levels(), 800.0)
    ends = re.findall(r'<text class="end-label" x="([\d.]+)" y="([\d.]+)"[^>]*>([^<]*)</text>', svg)
    assert sorted(lb for _, _, lb in ends) == ["baseline", "cerebras-wse3/llama-3.1-8b", "fast-lane"]
    ys = sorted(float(y) for _, y, _ in ends)
    assert all(b - a >= 12 for a, b in itertools.pairwise(ys))  # three lines within 17 ms, apart
    bx, by = (float(v) for v in re.search(r'class="budget-label" x="([\d.]+)" y="([\d.]+)"', svg).groups())
    for x, y, _ in ends:  # the budget label sits at the left end, the line labels past the right end
        assert float(x) > bx + text_width("800 ms budget") or abs(float(y) - by) >= 12
    width = float(re.search(r'width="([\d.]+)"', svg).group(1))
    assert width <= content_width(700) + 20 and min([12.0, *_fonts(svg)]) >= MIN_FONT_PX


# --- measured in headless Chromium -------------------------------------------------------------------

PROBE = """<script>
window.addEventListener('load', () => {
  const vis = el => el.getClientRects().length > 0;
  let minFont = 99, clipped = [], crossing = [], svgs = 0;
  document.querySelectorAll('svg').forEach(svg => {
    if (!vis(svg)) return;
    svgs += 1;
    const s = svg.getBoundingClientRect(), scale = s.width / svg.viewBox.baseVal.width;
    const lines = [...svg.querySelectorAll('.budget-line line')].map(l => l.getBoundingClientRect())
      .filter(r => r.height > r.width);
    svg.querySelectorAll('text').forEach(t => {
      const f = parseFloat(getComputedStyle(t).fontSize) * scale, b = t.getBoundingClientRect();
      if (!t.textContent.trim()) return;
      minFont = Math.min(minFont, f);
      if (b.left < s.left - 1 || b.right > s.right + 1) clipped.push(t.textContent);
      if (t.classList.contains('note')) lines.forEach(l => {
        if (b.left < l.left + l.width && b.right > l.left && b.top < l.bottom && b.bottom > l.top)
          crossing.push(t.textContent);
      });
    });
  });
  const tables = [...document.querySelectorAll('#summary .scroll')].map(d => [d.scrollWidth, d.clientWidth]);
  document.body.setAttribute('data-probe', JSON.stringify({minFont, clipped, crossing, svgs, tables}));
});
</script>"""


def probe(html: str, width: int, tmp_path: Path) -> dict:
    page = tmp_path / f"layout-{width}.html"
    page.write_text(html.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    cmd = [
        str(_chromium()), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},1600",
        "--virtual-time-budget=3000", "--dump-dom", page.as_uri(),
    ]  # fmt: skip
    dom = subprocess.run(cmd, capture_output=True, timeout=90, check=False, text=True).stdout
    m = re.search(r'data-probe="([^"]*)"', dom)
    assert m, "the probe did not run"
    return json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))


@pytest.mark.skipif(_chromium() is None, reason="no chromium binary")
@pytest.mark.parametrize("width", [700, 1280])
def test_in_chromium_chart_text_is_legible_unclipped_and_clear_of_the_budget_line(
    tmp_path: Path, width: int
) -> None:
    got = probe(render_html(long_named_runs(), {}, budget_ms=BUDGET), width, tmp_path)
    assert got["svgs"] >= 6, got  # one variant of each chart is shown
    assert got["minFont"] >= MIN_FONT_PX - 0.1, got["minFont"]
    assert got["clipped"] == [], got["clipped"][:5]
    assert got["crossing"] == [], got["crossing"][:5]
    assert got["tables"] and all(sw <= cw for sw, cw in got["tables"]), got["tables"]  # no sideways scroll


@pytest.mark.skipif(_chromium() is None, reason="no chromium binary")
@pytest.mark.parametrize("width", [700, 1280])
def test_in_chromium_the_capacity_chart_text_is_10_px_or_more(tmp_path: Path, width: int) -> None:
    got = probe(report_html(_levels(), [], 800.0, "capacity"), width, tmp_path)
    assert got["svgs"] == 1 and got["minFont"] >= MIN_FONT_PX - 0.1 and got["clipped"] == [], got
