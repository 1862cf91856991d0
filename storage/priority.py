"""Priority classes of jobs, highest first: a worker claims a shard of a higher class before any of a
lower one (storage/shard_store.py claim_next_shard; docs/scheduling.md)."""

from __future__ import annotations

from typing import Literal, get_args

PriorityName = Literal["high", "normal", "low"]  # highest first: the one list of the classes
PRIORITY_CLASSES: tuple[str, ...] = get_args(PriorityName)
DEFAULT_PRIORITY: PriorityName = "normal"
PRIORITY_RANK: dict[str, int] = {name: rank for rank, name in enumerate(PRIORITY_CLASSES)}


def at_or_above(priority: str) -> list[str]:
    """The classes whose shards go before or with `priority`'s."""
    return list(PRIORITY_CLASSES[: PRIORITY_RANK[priority] + 1])
