"""The built wheel carries what an installed voicepipe reads at run time: the shipped scenarios, configs
and templates (setup.py copies scenarios/ into the package) and the hardware data files."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_scenarios_templates_and_data(tmp_path: Path) -> None:
    # build from a copy: setuptools writes build/ and *.egg-info next to the sources
    src = tmp_path / "src"
    skip = (".git", ".venv", "build", "*.egg-info", ".*cache", ".hypothesis", "__pycache__", ".ci-wheels")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*skip))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("voicepipe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {
        f"voicepipe/scenarios/{p.relative_to(ROOT / 'scenarios').as_posix()}"
        for p in (ROOT / "scenarios").rglob("*.yaml")
    }
    assert shipped and shipped <= names, sorted(shipped - names)
    assert "voicepipe/scenarios/templates/starter.yaml" in names
    data = {f"voicepipe/hardware/data/{p.name}" for p in (ROOT / "voicepipe/hardware/data").iterdir()}
    assert data <= names, sorted(data - names)
