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


def cut_piece_shards(file_group_rows: list[tuple[int, ...]], shard_size: int) -> list[list[dict]]:
    """Shards of an input by reference, from its files' footers alone: runs of whole row groups, in file
    order, until a shard holds `shard_size` rows; a row group larger than that is split into slices.
    Each shard is a list of pieces, {"file": i, "row_groups": [first, end), "skip": rows of the first
    group before the piece, "rows": [first, end) row indices}, and every row lands in exactly one."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    shards: list[list[dict]] = []
    current: list[dict] = []
    filled = 0
    row = 0  # row index of the next row, over all files in order
    for file_index, group_rows in enumerate(file_group_rows):
        for group, rows in enumerate(group_rows):
            skip = 0
            while skip < rows:
                take = min(rows - skip, shard_size - filled)
                last = current[-1] if current else None
                extends = last is not None and last["file"] == file_index and last["row_groups"][1] == group
                if extends and skip == 0:
                    last["row_groups"][1] = group + 1  # the next whole group extends the piece
                    last["rows"][1] += take
                else:
                    piece = {"file": file_index, "row_groups": [group, group + 1], "skip": skip}
                    current.append({**piece, "rows": [row, row + take]})
                skip, row, filled = skip + take, row + take, filled + take
                if filled == shard_size:
                    shards.append(current)
                    current, filled = [], 0
    if current:
        shards.append(current)
    return shards
