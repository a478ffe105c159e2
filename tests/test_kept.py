"""Answers kept on disk between processes (voicepipe.kept): computed once per package content, recomputed
whenever the content differs or the file is unusable, one computer among processes that ask together, and
nothing kept when turned off. The held-out validation report survives the round trip exactly."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from voicepipe import kept as kp
from voicepipe.hardware.validate import Report, Row, points
from voicepipe.hardware.validate.fit import _dump, _load


def _counting(calls: list[int], value: object):
    def compute():
        calls.append(1)
        return value

    return compute


def _keep(name: str, compute):
    return kp.kept(name, compute, lambda v: {"v": v}, lambda d: d["v"])


def test_an_answer_is_computed_once_then_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv(kp.ENV, str(tmp_path))
    calls: list[int] = []
    assert _keep("x", _counting(calls, [1.5, None, "a"])) == [1.5, None, "a"]
    assert _keep("x", _counting(calls, "other")) == [1.5, None, "a"]
    assert len(calls) == 1
    assert [p.name for p in tmp_path.glob("x-*.json")] == [f"x-{kp.package_digest()}.json"]


def test_other_package_content_is_another_answer(tmp_path, monkeypatch):
    monkeypatch.setenv(kp.ENV, str(tmp_path))
    calls: list[int] = []
    _keep("x", _counting(calls, 1))
    monkeypatch.setattr(kp, "package_digest", lambda: "f" * 24)
    assert _keep("x", _counting(calls, 2)) == 2
    assert len(calls) == 2


def test_an_unreadable_or_unrecognised_file_is_computed_again(tmp_path, monkeypatch):
    monkeypatch.setenv(kp.ENV, str(tmp_path))
    path = tmp_path / f"x-{kp.package_digest()}.json"
    calls: list[int] = []
    path.write_text("{not json")
    assert _keep("x", _counting(calls, 3)) == 3
    path.write_text(json.dumps({"w": 1}))  # load raises KeyError
    assert _keep("x", _counting(calls, 4)) == 4
    assert len(calls) == 2 and json.loads(path.read_text()) == {"v": 4}


def test_turned_off_or_unwritable_it_computes_every_time(tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setenv(kp.ENV, "off")
    _keep("x", _counting(calls, 1))
    _keep("x", _counting(calls, 1))
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(kp.ENV, str(tmp_path / "a-file" / "below"))  # a folder that cannot be made
    assert _keep("x", _counting(calls, 5)) == 5
    assert len(calls) == 3


def test_only_the_newest_few_answers_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(kp.ENV, str(tmp_path))
    for i in range(kp.KEEP + 3):
        monkeypatch.setattr(kp, "package_digest", lambda i=i: f"{i:024x}")
        _keep("x", lambda i=i: i)
    assert len(list(tmp_path.glob("x-*.json"))) == kp.KEEP


def test_processes_asking_together_compute_once(tmp_path):
    log = tmp_path / "computed"
    code = textwrap.dedent(f"""
        import time
        from voicepipe.kept import kept
        def compute():
            with open({str(log)!r}, "a") as f:
                f.write("x")
            time.sleep(0.5)
            return 42
        assert kept("y", compute, lambda v: v, int) == 42
    """)
    env = {"VOICEPIPE_CACHE_DIR": str(tmp_path / "c"), "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(3)]
    assert [p.wait(120) for p in procs] == [0, 0, 0]
    assert log.read_text() == "x"


def test_the_validation_report_survives_the_round_trip_exactly():
    pts = points()
    rows = tuple(Row(p, None if i % 7 == 0 else p.value * (1 + i / 997), "why" if i % 7 == 0 else "")
                 for i, p in enumerate(pts))  # fmt: skip
    rep = Report(rows, {"eta_mem": 0.844, "layer_s": 3.67e-05}, 31, 29)
    assert _load(json.loads(json.dumps(_dump(rep)))) == rep
    other = _dump(rep)
    other["rows"] = other["rows"][1:]
    with pytest.raises(ValueError):
        _load(other)


def test_a_file_system_without_locks_still_computes(tmp_path, monkeypatch):
    import fcntl

    def no_locks(*_a):
        raise OSError(37, "No locks available")

    monkeypatch.setenv(kp.ENV, str(tmp_path))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    calls: list[int] = []
    assert _keep("x", _counting(calls, 6)) == 6
    assert _keep("x", _counting(calls, 7)) == 6  # kept all the same
    assert len(calls) == 1


def test_a_kept_answer_of_another_shape_is_computed_again(tmp_path, monkeypatch):
    monkeypatch.setenv(kp.ENV, str(tmp_path))
    (tmp_path / f"x-{kp.package_digest()}.json").write_text("[]")
    got = kp.kept("x", lambda: 8, lambda v: {"v": v}, lambda d: d.get("v"))  # [] has no .get: AttributeError
    assert got == 8


def test_a_kept_answer_is_read_while_another_process_computes(tmp_path):
    import fcntl

    folder = tmp_path / "c"
    env = {"VOICEPIPE_CACHE_DIR": str(folder), "PATH": "/usr/bin:/bin"}
    code = "from voicepipe.kept import kept; print(kept('z', lambda: 9, lambda v: v, int))"
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert first.stdout.strip() == "9"
    lock = next(folder.glob("z-*.lock"))
    with open(lock, "a") as held:  # this version's lock held (another process computing): the answer is read
        fcntl.flock(held, fcntl.LOCK_EX)
        again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert again.stdout.strip() == "9"


def test_what_the_package_writes_from_a_kept_answer_is_outside_its_digest(monkeypatch):
    assert kp.OUTPUTS and all((Path(kp.__file__).parent / o).is_file() for o in kp.OUTPUTS)
    monkeypatch.setattr(kp, "OUTPUTS", ())
    assert kp.package_digest.__wrapped__() != kp.package_digest()
