"""Read one shard's rows from the job's input Parquet, one row group at a time."""

from __future__ import annotations

from typing import Any

import numpy as np

from storage.arrow_path import ParquetSource, parquet_file


def read_rows(source: ParquetSource, row_indices: list[int], columns: list[str]) -> dict[int, dict[str, Any]]:
    """{row_index: {column: value}} for the given rows, touching only the row groups that hold them
    (on S3: ranged reads of the footer and of those row groups)."""
    parquet = parquet_file(source)
    metadata = parquet.metadata
    group_starts = np.cumsum([0] + [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)])
    wanted = np.sort(np.asarray(row_indices, dtype=np.int64))
    groups = np.searchsorted(group_starts, wanted, side="right") - 1  # [len(wanted)] row group of each row
    rows: dict[int, dict[str, Any]] = {}
    for group in np.unique(groups):
        in_group = wanted[groups == group]
        table = parquet.read_row_group(int(group), columns=columns).take(in_group - group_starts[group])
        for index, record in zip(in_group.tolist(), table.to_pylist(), strict=True):
            rows[index] = record
    return rows
