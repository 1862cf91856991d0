"""A job input named by reference: Parquet files that stay where the tenant keeps them (s3://...), read in
place. The API records them at submission in a small manifest, `jobs/<job id>/inputs.json` in the job's
store, with each file's row groups as their footers said; workers and finalize read the files through
it, fetching only the footer and the row groups a shard needs (ranged reads)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage.arrow_path import ArrowPath, ParquetSource, as_arrow

MANIFEST_FILE = "inputs.json"


def manifest_name(job_id: str) -> str:
    return f"jobs/{job_id}/{MANIFEST_FILE}"


def is_manifest(input_name: str) -> bool:
    """A job whose input_name is its manifest reads its input by reference."""
    return input_name.endswith(f"/{MANIFEST_FILE}")


class InputChanged(RuntimeError):
    """A referenced file's row groups are not the ones validated at submission (it was replaced)."""


@dataclass(frozen=True)
class InputFile:
    uri: str  # s3://bucket/key
    size: int
    group_rows: tuple[int, ...]  # rows of each row group, as the footer said at submission

    @property
    def path(self) -> str:
        """bucket/key: the path on a pyarrow S3 filesystem."""
        return self.uri.removeprefix("s3://")

    @property
    def num_rows(self) -> int:
        return sum(self.group_rows)


@dataclass(frozen=True)
class InputSet:
    files: tuple[InputFile, ...]
    filesystem: pafs.FileSystem | None = field(default=None, compare=False)  # where to read them

    @property
    def num_rows(self) -> int:
        return sum(item.num_rows for item in self.files)

    def arrow(self, index: int) -> ArrowPath:
        assert self.filesystem is not None, "open the manifest with the filesystem that reads the files"
        return ArrowPath(self.filesystem, self.files[index].path)

    def to_json(self) -> str:
        return json.dumps(
            {"files": [{"uri": f.uri, "size": f.size, "group_rows": list(f.group_rows)} for f in self.files]}
        )

    @classmethod
    def from_json(cls, text: str, filesystem: pafs.FileSystem) -> InputSet:
        files = json.loads(text)["files"]
        return cls(
            tuple(InputFile(f["uri"], int(f["size"]), tuple(int(n) for n in f["group_rows"])) for f in files),
            filesystem,
        )


JobInput = ParquetSource | InputSet  # an uploaded file, or files by reference


def input_sources(job_input: JobInput) -> list[ArrowPath]:
    """The job's Parquet files in row order (row indices run on from one file to the next)."""
    if isinstance(job_input, InputSet):
        return [job_input.arrow(index) for index in range(len(job_input.files))]
    return [as_arrow(job_input)]


def input_schema(job_input: JobInput) -> pa.Schema:
    """The columns (submission checked that every referenced file has the same ones)."""
    where = input_sources(job_input)[0]
    return pq.read_schema(where.path, filesystem=where.filesystem)


def open_checked(job_input: InputSet, index: int) -> pq.ParquetFile:
    """The file's reader, refused when its row groups are no longer the validated ones."""
    where, expected = job_input.arrow(index), job_input.files[index]
    parquet = pq.ParquetFile(where.path, filesystem=where.filesystem)
    metadata = parquet.metadata
    found = tuple(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))
    if found != expected.group_rows:
        raise InputChanged(f"{expected.uri} changed after the job was submitted (its row groups differ)")
    return parquet


def iter_input_rows(
    job_input: InputSet, row_indices: Sequence[int], columns: list[str]
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row index, {column: value}) for the given rows, reading only the row groups that hold them and
    opening only the files they are in."""
    group_rows = [rows for item in job_input.files for rows in item.group_rows]
    group_file = np.repeat(np.arange(len(job_input.files)), [len(item.group_rows) for item in job_input.files])
    group_starts = np.cumsum([0, *group_rows])  # global first row of each row group, over all files
    first_group = np.cumsum([0, *(len(item.group_rows) for item in job_input.files)])
    wanted = np.sort(np.asarray(row_indices, dtype=np.int64))
    groups = np.searchsorted(group_starts, wanted, side="right") - 1  # [len(wanted)] global row group
    opened: dict[int, pq.ParquetFile] = {}
    for group in np.unique(groups):
        file_index = int(group_file[group])
        if file_index not in opened:
            opened.clear()  # rows come in file order: one reader open at a time
            opened[file_index] = open_checked(job_input, file_index)
        in_group = wanted[groups == group]
        local = int(group - first_group[file_index])
        table = opened[file_index].read_row_group(local, columns=columns).take(in_group - group_starts[group])
        yield from zip(in_group.tolist(), table.to_pylist(), strict=True)
