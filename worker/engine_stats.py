"""A shard's share of the engine's cumulative stats: counters before and after, and the timeline
samples taken while it ran (thinned to a bounded number of points). `spent_since` is the same share
taken while an attempt is still running (what its shard_attempts row stores)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.engine import EngineStats

COUNTERS = (
    "steps",
    "prompt_tokens",
    "output_tokens",
    "computed_tokens",
    "cached_prompt_tokens",
    "draft_tokens",
    "accepted_draft_tokens",
    "padding_tokens",
    "preemptions",
    "batch_size_sum",
    "busy_seconds",
)


@dataclass(frozen=True)
class StatsSnapshot:
    counters: dict[str, float]
    last_t: float  # time of the newest timeline sample before the shard started


def snapshot(stats: EngineStats) -> StatsSnapshot:
    last_t = stats.timeline[-1]["t"] if stats.timeline else float("-inf")
    return StatsSnapshot({name: getattr(stats, name) for name in COUNTERS}, last_t)


def spent_since(before: StatsSnapshot, after: EngineStats) -> dict[str, float]:
    """What the engine spent since `before` (one attempt at a shard, so far): each counter's
    difference, and the peak KV use over the same span."""
    return _spent(before, after, _samples_since(before, after))


def shard_stats(before: StatsSnapshot, after: EngineStats, max_points: int) -> dict[str, Any]:
    timeline = [dict(point) for point in _samples_since(before, after)]  # copies: stored with the shard
    engine: dict[str, Any] = _spent(before, after, timeline)
    engine["num_kv_blocks"] = after.num_kv_blocks
    engine["tier"], engine["paths"] = after.tier, dict(after.paths)  # the machine and op paths it ran on
    engine["parameters"], engine["active_parameters"] = after.parameters, after.active_parameters
    if len(timeline) > max_points:
        stride = -(-len(timeline) // max_points)
        timeline = timeline[::stride]
    return {"engine": engine, "timeline": timeline}


def _samples_since(before: StatsSnapshot, after: EngineStats) -> list[dict[str, float]]:
    return [point for point in after.timeline if point["t"] > before.last_t]


def _spent(before: StatsSnapshot, after: EngineStats, timeline: list[dict[str, float]]) -> dict[str, float]:
    spent = {name: getattr(after, name) - before.counters[name] for name in COUNTERS}
    spent["busy_seconds"] = round(spent["busy_seconds"], 4)
    if after.num_kv_blocks and timeline:
        spent["peak_kv_utilization"] = round(
            max(p["kv_blocks_used"] for p in timeline) / after.num_kv_blocks, 4
        )
    else:
        # No sample fell inside this span (a very short one): the engine's lifetime peak bounds it.
        spent["peak_kv_utilization"] = round(after.peak_kv_utilization, 4)
    return spent
