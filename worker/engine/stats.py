"""Engine statistics, and a bounded time series of them for reports."""

from __future__ import annotations

import time

from worker.engine.outputs import EngineStats

MAX_TIMELINE_POINTS = 512


class StatsRecorder:
    """Adds each step to EngineStats and samples a timeline that never grows past MAX_TIMELINE_POINTS.

    When the timeline is full, every other point is dropped and the sampling interval doubles, so
    a run of any length keeps an even picture of itself.
    """

    def __init__(self, stats: EngineStats, interval_s: float = 0.5) -> None:
        self.stats = stats
        self.interval_s = interval_s
        self._origin = time.monotonic()
        self._last_sample = float("-inf")
        self._tokens_since = 0
        self._seconds_since = 0.0

    def record_step(
        self, *, num_tokens: int, running: int, kv_blocks_used: int, peak_kv_blocks_used: int, seconds: float
    ) -> None:
        s = self.stats
        s.steps += 1
        s.computed_tokens += num_tokens
        s.batch_size_sum += running
        s.busy_seconds += seconds
        s.peak_kv_blocks_used = max(s.peak_kv_blocks_used, peak_kv_blocks_used)
        self._tokens_since += num_tokens
        self._seconds_since += seconds
        now = time.monotonic()
        if now - self._last_sample < self.interval_s:
            return
        s.timeline.append(
            {
                "t": round(now - self._origin, 3),
                "tokens_per_s": round(self._tokens_since / self._seconds_since, 1) if self._seconds_since else 0.0,
                "running": running,
                "kv_blocks_used": kv_blocks_used,
            }
        )
        self._last_sample = now
        self._tokens_since, self._seconds_since = 0, 0.0
        if len(s.timeline) >= MAX_TIMELINE_POINTS:
            s.timeline[:] = s.timeline[::2]
            self.interval_s *= 2
