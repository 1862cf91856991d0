"""A job's progress as the CLI shows it: rows done of total, tokens/s and an ETA from the job's own
rate so far (rows stored / seconds since the first shard started)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RUNNING = ("in_progress", "finalizing", "cancelling")


@dataclass(frozen=True)
class JobProgress:
    status: str
    rows_done: int
    rows_total: int
    tokens_per_s: float
    eta_s: float | None  # None: not running, or no rate yet

    @classmethod
    def of(cls, job: dict[str, Any], metrics: dict[str, Any] | None) -> JobProgress:
        counts = job["request_counts"]
        done = counts["completed"] + counts["failed"]
        tokens_per_s = float(metrics.get("tokens_per_second", 0.0)) if metrics else 0.0
        rows_per_s = float(metrics.get("rows_per_second", 0.0)) if metrics else 0.0
        eta = None
        if job["status"] in RUNNING and rows_per_s > 0:
            eta = max(counts["total"] - done, 0) / rows_per_s
        return cls(job["status"], done, counts["total"], tokens_per_s, eta)

    def postfix(self) -> str:
        parts = [self.status]
        if self.status in RUNNING or self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        if self.eta_s is not None:
            parts.append(f"ETA {format_duration(self.eta_s)}")
        return ", ".join(parts)

    def line(self, width: int = 30) -> str:
        """rows [#########.........] 30% 120/400, in_progress, 1,234 tok/s, ETA 0:42"""
        fraction = self.rows_done / self.rows_total if self.rows_total else 0.0
        filled = round(fraction * width)
        bar = "#" * filled + "." * (width - filled)
        return f"rows [{bar}] {fraction:4.0%} {self.rows_done}/{self.rows_total}, {self.postfix()}"


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
