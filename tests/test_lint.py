"""The tree stays ruff clean (lint and format), checked where CI can see it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# the ruff of the environment running the tests (the `test` extra installs it), wherever that
# environment lives; never skipped: a missing ruff is a broken test install
RUFF = Path(sys.executable).parent / "ruff"


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args):
    assert RUFF.exists(), f"{RUFF} missing: install the test extra (pip install -e '.[test]')"
    out = subprocess.run([RUFF, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
