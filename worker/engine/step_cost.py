"""What a step of a given number of rows costs: the speculator's price list.

Read off the engine's small-batch measurement (plan/small_batch.py: one pass over the model's INT8
projections at each of its ROWS, by the faster of our kernel and the library GEMM). A few
rows cost about as much as one (the pass is bound by reading the weights); many rows cost about their
number (bound by arithmetic). Between measured sizes the cost is interpolated linearly; past the largest,
extrapolated with the last segment's slope. Costs are made non-decreasing, so noise in the measurement
never prices an extra row below zero.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    rows: tuple[int, ...]  # measured batch sizes, ascending
    seconds: tuple[float, ...]  # one pass over the projections at each size, non-decreasing

    @classmethod
    def from_measurement(cls, seconds: dict[int, float]) -> StepCost | None:
        """From {rows: seconds} (SmallBatchChoice.fastest()); None with fewer than two sizes measured."""
        if len(seconds) < 2:
            return None
        rows = tuple(sorted(seconds))
        ascending, top = [], 0.0
        for r in rows:
            top = max(top, seconds[r])
            ascending.append(top)
        return cls(rows, tuple(ascending))

    def __call__(self, rows: int) -> float:
        """Seconds of a step of `rows` rows (a relative price: only ratios of it are used)."""
        xs, ys = self.rows, self.seconds
        if rows <= xs[0]:
            return ys[0]
        i = min(bisect_left(xs, rows), len(xs) - 1)  # the segment [xs[i - 1], xs[i]], or the last one
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
