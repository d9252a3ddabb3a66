"""ruff (pyproject.toml, [tool.ruff]) passes on the package, tests, benchmarks, experiments and examples."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["trl_rollout_corr", "tests", "benchmarks", "experiments", "examples"]


def ruff_command() -> list[str] | None:
    """ruff next to this interpreter (the dev extra installs it into the venv), else on PATH."""
    local = Path(sys.executable).with_name("ruff")
    if local.exists():
        return [str(local)]
    found = shutil.which("ruff")
    return [found] if found else None


@pytest.mark.skipif(ruff_command() is None, reason="ruff is not installed (pip install -e '.[dev]' installs it)")
def test_ruff_passes():
    proc = subprocess.run([*ruff_command(), "check", "--no-cache", *PATHS], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"ruff check {' '.join(PATHS)}:\n{proc.stdout}{proc.stderr}"
