"""Runs the Triton-under-interpreter cases in a fresh process when this one cannot (see helpers.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels._triton import interpreter_enabled, triton_available
from tests.kernels.helpers import INTERPRETER_READY
from tests.kernels.prebuilt import built_here, prebuilt_env

KERNEL_TESTS = Path(__file__).resolve().parent
REPO_ROOT = KERNEL_TESTS.parents[1]


@pytest.mark.skipif(
    INTERPRETER_READY or not (triton_available() and interpreter_enabled()),
    reason="the interpreter cases run in this process, or TRITON_INTERPRET is off",
)
def test_triton_kernels_match_references_in_a_fresh_process():
    # --confcutdir skips tests/conftest.py: these cases need nothing from the app.
    built_here()  # the subprocess loads these builds and compiles none (under its timeout)
    command = ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--confcutdir", str(KERNEL_TESTS)]
    result = subprocess.run(
        [sys.executable, *command, "-k", "interpret", str(KERNEL_TESTS)],
        cwd=REPO_ROOT,
        env={**prebuilt_env(), "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) >= 20, report
    assert "skipped" not in result.stdout, report
