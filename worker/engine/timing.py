"""Timing and cache-file helpers shared by the load-time measurements (path_plan.py, attention_plan.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

MAX_REPEATS = 3
REPEAT_SECONDS = 0.15  # stop repeating a timing once this much time went into it


def best_seconds(fn: Callable[[], object], limit: float = REPEAT_SECONDS) -> float:
    """Fastest of up to MAX_REPEATS runs after one warm-up; a slow first run ends the repeats early."""
    started = time.perf_counter()
    fn()
    first = time.perf_counter() - started
    best = float("inf")
    spent = 0.0
    for _ in range(MAX_REPEATS):
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        best = min(best, elapsed)
        spent += elapsed
        if spent + first > limit:
            break
    return best


def write_json_atomically(path: Path, payload: dict) -> None:
    """Readers see the old file or the whole new one, never a half-written one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps(payload, indent=1))
    partial.replace(path)
