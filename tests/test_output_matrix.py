"""Every output flag works on every command that accepts it (issue 26 item 5).

Each command runs once (in this process) with every file flag it has; each (command, flag) pair then
checks its file exists, is non-empty and parses: JSON lines parse, CSV has a header and rows, HTML has the
section that command's report is about, OTel is the OTLP/JSON voicepipe writes (it parses into the
``opentelemetry-proto`` message and back into spans). Virtual-time commands do most of the work; the live
ones (``run``, ``compare``) are one turn each on the embedded broker.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from tests.conftest import tiny_scenario
from voicepipe.cli import app
from voicepipe.report.export import otel_proto, read_otel

FAST = ["--set", "agent.backend=cerebras-llama-3.1-8b", "--set", "client.playout=first_audio"]
# command -> (arguments before the flags, {flag: file name})
COMMANDS: dict[str, tuple[list[str], dict[str, str]]] = {
    "predict": (["predict", "{sc}", *FAST], {"--json": "p.jsonl"}),
    "capacity": (
        ["capacity", "{sc}", *FAST, "--sessions", "1,2", "--jobs", "1"],
        {"--json": "k.jsonl", "--csv": "k.csv", "--report": "k.html"},
    ),
    "compare-predict": (
        ["compare", "--predict", "{sc}", *FAST, "--vary", "agent.prompt_tokens=100,200"],
        {"--json": "cp.jsonl", "--csv": "cp.csv", "--report": "cp.html", "--otel": "cp.otel"},
    ),
    "run": (
        ["run", "{sc}", *FAST, "-n", "1"],
        {
            "--json": "r.jsonl",
            "--summary-json": "r.sum.json",
            "--csv": "r.csv",
            "--report": "r.html",
            "--otel": "r.otel",
        },
    ),
    "compare-live": (
        ["compare", "{sc}", *FAST, "-n", "1", "--vary", "client.words_per_minute=150"],
        {"--json": "cl.jsonl", "--csv": "cl.csv", "--report": "cl.html", "--otel": "cl.otel"},
    ),
}
# what each command's HTML report is about (its own section, not only a page frame)
HTML_SECTION = {
    "capacity": "p90 against load",
    "compare-predict": 'id="summary"',
    "run": 'id="summary"',
    "compare-live": 'id="summary"',
}
PAIRS = [(cmd, flag) for cmd, (_, flags) in COMMANDS.items() for flag in flags]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, Path]]:
    tmp = tmp_path_factory.mktemp("matrix")
    sc = tmp / "tiny.yaml"
    sc.write_text(yaml.safe_dump(tiny_scenario(turns=1).model_dump(mode="json")))
    done: dict[str, tuple[int, str, Path]] = {}
    for cmd, (args, flags) in COMMANDS.items():
        out = tmp / cmd
        out.mkdir()
        argv = [a.format(sc=sc) for a in args] + [x for f, name in flags.items() for x in (f, str(out / name))]
        r = CliRunner().invoke(app, argv, env={"COLUMNS": "160"})
        if r.exception and not isinstance(r.exception, SystemExit):
            raise r.exception
        done[cmd] = (r.exit_code, r.stderr, out)
    return done


def test_the_matrix_covers_every_export_flag_each_command_has():
    """The table above is the commands' real option lists (a new export flag must join the matrix)."""
    exports = {"--json", "--csv", "--report", "--otel", "--summary-json"}
    group = typer.main.get_command(app)
    for cmd, (args, flags) in COMMANDS.items():
        opts = {o for p in group.commands[args[0]].params for o in p.opts}  # type: ignore[attr-defined]
        assert exports & opts == set(flags), cmd


@pytest.mark.parametrize(("cmd", "flag"), PAIRS)
def test_each_output_flag_writes_a_file_that_parses(outputs, cmd, flag):
    rc, stderr, out = outputs[cmd]
    assert rc == 0, stderr
    path = out / COMMANDS[cmd][1][flag]
    assert path.is_file() and path.stat().st_size > 0, f"{cmd} {flag}: nothing written ({stderr})"
    text = path.read_text(encoding="utf-8")
    if flag == "--json":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        assert rows and all(isinstance(r, dict) for r in rows)
    elif flag == "--summary-json":
        assert isinstance(json.loads(text), dict)
    elif flag == "--csv":
        rows = list(csv.reader(text.splitlines()))
        assert len(rows) >= 2 and all(len(r) == len(rows[0]) for r in rows), rows[:3]
    elif flag == "--report":
        assert text.lstrip().lower().startswith("<!doctype html") and text.rstrip().endswith("</html>")
        assert HTML_SECTION[cmd] in text
    elif flag == "--otel":
        doc = json.loads(text)
        assert otel_proto(doc).resource_spans  # the OTLP/JSON mapping of ExportTraceServiceRequest
        spans = read_otel(path)
        assert any(s["name"] == "turn" for s in spans)
    else:  # pragma: no cover - a flag the matrix does not know how to read
        raise AssertionError(flag)


def test_compare_predict_exports_say_they_are_predictions(outputs):
    _, _, out = outputs["compare-predict"]
    assert "PREDICTED on virtual time" in (out / "cp.html").read_text()
    rows = list(csv.DictReader((out / "cp.csv").read_text().splitlines()))
    assert {r["run"] for r in rows} == {"predict"} and all(r["measured_ms"] == "" for r in rows)
    assert all(r["predicted_ms"] for r in rows)
    spans = read_otel(out / "cp.otel")
    assert {s["attributes"].get("voicepipe.run.id") for s in spans if s["name"] == "turn"} == {"predict"}
    assert not any("voicepipe.measured_s" in s["attributes"] for s in spans)
    # the modelled stage spans travel too, not only one root per turn
    assert len(spans) > 2 * sum(1 for s in spans if s["name"] == "turn")


# the other commands that write a file a flag names
OTHER_WRITERS = [
    (["hardware", "sweep", "--hardware", "h100-sxm", "--model", "llama-3.1-8b"], "--json"),
    (["hardware", "validate"], "--json"),
    (["calibrate", "http://127.0.0.1:9/v1", "--model", "m"], "--out"),
    (["profile", "import", "results.json"], "--out"),
]


@pytest.mark.parametrize(
    ("args", "flag"),
    [(COMMANDS[c][0], f) for c, f in PAIRS] + OTHER_WRITERS,
    ids=[f"{c} {f}" for c, f in PAIRS] + [f"{' '.join(a[:2])} {f}" for a, f in OTHER_WRITERS],
)
def test_an_output_path_in_a_missing_folder_is_refused_before_anything_runs(tmp_path, args, flag):
    """A live run would measure for minutes and then lose its outputs at the write: the path is checked
    first, one line naming the flag, exit 2, nothing written."""
    sc = tmp_path / "tiny.yaml"
    sc.write_text(yaml.safe_dump(tiny_scenario(turns=1).model_dump(mode="json")))
    target = tmp_path / "no-such-folder" / "out.file"
    argv = [a.format(sc=sc) for a in args] + [flag, str(target)]
    r = CliRunner().invoke(app, argv, env={"COLUMNS": "160"})
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert flag in r.output and "does not exist" in r.output
    assert "Traceback" not in r.output and not target.parent.exists()


def test_an_output_path_that_is_a_directory_is_refused(tmp_path):
    r = CliRunner().invoke(app, ["predict", "cafe-order", "--json", str(tmp_path)], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "is a directory" in r.output


@pytest.mark.parametrize(
    ("cmd", "flag"),
    [("predict", "--json"), ("capacity", "--csv"), ("compare-predict", "--report"), ("run", "--summary-json")],
)
def test_an_output_the_disk_refuses_is_one_line_exit_2_and_the_others_are_written(tmp_path, cmd, flag):
    """/dev/full takes the open and refuses the write (as a full disk does): the command names the output,
    writes every other one it was asked for, and exits 2 — not an internal error (5)."""
    args, flags = COMMANDS[cmd]
    sc = tmp_path / "tiny.yaml"
    sc.write_text(yaml.safe_dump(tiny_scenario(turns=1).model_dump(mode="json")))
    files = {f: ("/dev/full" if f == flag else str(tmp_path / name)) for f, name in flags.items()}
    argv = [a.format(sc=sc) for a in args] + [x for f, path in files.items() for x in (f, path)]
    r = CliRunner().invoke(app, argv, env={"COLUMNS": "200"})
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert f"{flag} /dev/full: could not be written" in r.output and "internal error" not in r.output
    for f, path in files.items():
        if f != flag:
            assert Path(path).stat().st_size > 0, f"{f} was not written"


def test_a_live_run_whose_json_the_disk_refuses_ends_stderr_with_that_line(tmp_path):
    """--json is written turn by turn, so its failure is said as it happens, above the turns and summary;
    stderr still ends with the line saying why the exit is 2 (as the exit-code table promises)."""
    sc = tmp_path / "tiny.yaml"
    sc.write_text(yaml.safe_dump(tiny_scenario(turns=1).model_dump(mode="json")))
    r = CliRunner().invoke(app, ["run", str(sc), *FAST, "-n", "1", "--json", "/dev/full"], env={"COLUMNS": "200"})
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    said = "error: --json /dev/full: could not be written"
    assert lines[-1].startswith(said), lines[-3:]
    assert lines[0].startswith(said) and len(lines) > 2  # said when it happened, too
