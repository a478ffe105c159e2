"""What is released carries what an installed voicepipe reads at run time: the sdist holds scenarios/
(MANIFEST.in), the wheel built from it holds them inside the package (setup.py copies them to
voicepipe/scenarios) with the hardware data files, and the installed package finds them there."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, cwd: Path) -> None:
    out = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-1000:] + out.stderr[-2000:]


def test_sdist_then_wheel_ship_scenarios_templates_and_data(tmp_path: Path) -> None:
    # the files git would release (tracked, or new and not ignored), copied: building writes next to them
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    src = tmp_path / "src"
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    _run(sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "sdist"), cwd=src)
    (sdist,) = (tmp_path / "sdist").glob("voicepipe-*.tar.gz")
    with tarfile.open(sdist) as tar:
        assert any(n.endswith("/scenarios/cafe-order.yaml") for n in tar.getnames())
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "-w",
        str(tmp_path / "whl"),
        str(sdist),
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "whl").glob("voicepipe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"voicepipe/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / "scenarios").rglob("*.yaml")}
    assert "voicepipe/scenarios/templates/starter.yaml" in shipped and shipped <= names, sorted(
        shipped - names
    )
    data = {f"voicepipe/hardware/data/{p.name}" for p in (ROOT / "voicepipe/hardware/data").iterdir()}
    assert data <= names, sorted(data - names)
    # installed (the wheel's files first on the path), voicepipe finds its scenarios inside itself
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); from voicepipe import scenario; "
        "print(scenario.shipped_dir()); print(len(scenario.shipped())); "
        "from voicepipe.config import load_config; from voicepipe.shipped import resolve_config; "
        "print(resolve_config('fast-lane')); print(load_config('fast-lane').agent.backend)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(site)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    where, count, config, backend = out.stdout.split()
    # shipped configs by name, from the installed package, in a folder that has none
    assert Path(config) == site / "voicepipe" / "scenarios" / "configs" / "fast-lane.yaml"
    assert backend == "cerebras-wse3/llama-3.1-8b"
    assert Path(where) == site / "voicepipe" / "scenarios" and int(count) == len(
        list((ROOT / "scenarios").glob("*.yaml"))
    )
