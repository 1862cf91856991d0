"""Timing a load-time measurement, and telling whether other processes disturbed it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

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


# Other processes using more than this share of the machine's CPU time while a measurement ran make it
# unfit to keep: on 2 cores one busy neighbour slows an OpenMP product by 2-30x (its threads wait on each
# other), and a cached plan measured so would steer every later start (seen: float32 measured 13x faster
# than the INT8 scheme that runs 1.8x faster on a quiet machine).
CONTENDED_SHARE = 0.2


def _machine_busy_seconds() -> float | None:
    """CPU seconds every process on the machine has used (Linux /proc/stat; None elsewhere)."""
    try:
        first_line = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in first_line[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class ContentionMeter:
    """Measures, around a block, the share of the machine's CPU capacity that other processes (or the
    hypervisor, as steal time) used: `with ContentionMeter() as meter: ...; meter.contended`."""

    others_share: float = 0.0

    def __enter__(self) -> ContentionMeter:
        self._start = (_machine_busy_seconds(), time.process_time(), time.perf_counter())
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        busy, own, wall = _machine_busy_seconds(), time.process_time(), time.perf_counter()
        busy0, own0, wall0 = self._start
        if busy is None or busy0 is None or wall <= wall0:
            return
        others = max(0.0, (busy - busy0) - (own - own0))
        self.others_share = others / ((wall - wall0) * (os.cpu_count() or 1))

    @property
    def contended(self) -> bool:
        return self.others_share > CONTENDED_SHARE
