"""The tree stays ruff clean (lint and format), checked where CI can see it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (ROOT / ".venv/bin/ruff").exists(),
    reason="ruff not installed",
)
@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args):
    ruff = shutil.which("ruff") or str(ROOT / ".venv/bin/ruff")
    out = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_planner_imports_without_torch():
    code = (
        "import sys, service.buckets, service.cli, service.config; "
        "assert 'torch' not in sys.modules, 'planner pulled in torch'"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
