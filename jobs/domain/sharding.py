"""Cut a job into shards of rows of similar length, so each shard batches with little padding."""

from __future__ import annotations

import numpy as np


def cut_shards(prompt_chars: np.ndarray, shard_size: int) -> list[list[int]]:
    """Row indices sorted by prompt length (characters; the worker re-sorts by exact tokens), in runs
    of `shard_size`. Every row lands in exactly one shard."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    order = np.argsort(prompt_chars, kind="stable")  # [num_rows]
    return [order[start : start + shard_size].tolist() for start in range(0, len(order), shard_size)]
