"""Build shim: ship the repository's scenarios/ inside the package (voicepipe/scenarios in a wheel), so an
installed voicepipe finds its scenarios and templates as a checkout does (voicepipe.scenario.shipped_dir).
Everything else is configured in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithScenarios(build_py):
    def run(self) -> None:
        super().run()
        source = Path(__file__).resolve().parent / "scenarios"
        shutil.copytree(source, Path(self.build_lib) / "voicepipe" / "scenarios", dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildWithScenarios})
