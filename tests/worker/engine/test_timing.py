"""Calibration measurements are cached only when the machine was not busy with other processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.engine.plan import timing
from worker.engine.plan.measure import CacheEntry
from worker.engine.plan.timing import ContentionMeter


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_busy_neighbour_is_seen() -> None:
    # one other process spinning on a core for the whole block
    neighbour = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)
        with ContentionMeter() as meter:
            spin(1.0)
    finally:
        neighbour.kill()
        neighbour.wait()
    assert meter.others_share >= 0.8 / (__import__("os").cpu_count() or 1)


def test_own_work_is_not_counted_as_others() -> None:
    with ContentionMeter() as meter:
        spin(0.5)
    own_share = 1 / (__import__("os").cpu_count() or 1)
    assert meter.others_share < own_share  # whatever else runs, our own spinning is not in it


def test_a_contended_measurement_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    entry = CacheEntry(tmp_path, "plan")
    monkeypatch.setattr(timing, "CONTENDED_SHARE", -1.0)  # any share of others counts as busy
    measured = entry.measure(lambda: {"a": 1.0})
    assert measured.contended and measured.source == "measured" and measured.seconds == {"a": 1.0}
    assert not entry.path.exists()
    assert "not caching plan.json" in caplog.text
    monkeypatch.setattr(timing, "CONTENDED_SHARE", float("inf"))
    assert not entry.measure(lambda: {"a": 2.0}).contended
    assert json.loads(entry.path.read_text())["seconds"] == {"a": 2.0}
    assert entry.measure(lambda: {"a": 3.0}).source == "cache"
