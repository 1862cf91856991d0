"""Read one shard's rows from the job's input Parquet, one row group at a time: the uploaded file, or the
files the job names by reference (storage/input_set.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jobs.domain.settings import Settings
from storage.arrow_path import ParquetSource, parquet_file
from storage.blobs import BlobStore
from storage.input_set import InputSet, JobInput, is_manifest, iter_input_rows
from storage.models import Shard
from storage.storage_url import s3_filesystem


def open_job_input(blobs: BlobStore, settings: Settings, input_name: str) -> JobInput:
    """The job's input: its uploaded file in the store, or the referenced files its manifest lists (read
    with the store's S3 settings, FREIGHT_S3_ENDPOINT_URL and the AWS_* credentials)."""
    if not is_manifest(input_name):
        return blobs.arrow(input_name)
    return InputSet.from_json(blobs.read_text(input_name), s3_filesystem(settings.s3_endpoint_url))


def shard_rows(shard: Shard) -> list[int]:
    """The shard's input rows: its row indices, or the rows of its row-group pieces (by reference)."""
    if not shard.pieces:
        return list(shard.row_indices)
    return [index for piece in shard.pieces for index in range(*piece["rows"])]


def read_rows(source: JobInput, row_indices: list[int], columns: list[str]) -> dict[int, dict[str, Any]]:
    """{row_index: {column: value}} for the given rows, touching only the row groups that hold them
    (on S3: ranged reads of the footer and of those row groups)."""
    if isinstance(source, InputSet):
        return dict(iter_input_rows(source, row_indices, columns))
    return _read_file_rows(source, row_indices, columns)


def _read_file_rows(
    source: ParquetSource, row_indices: list[int], columns: list[str]
) -> dict[int, dict[str, Any]]:
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
