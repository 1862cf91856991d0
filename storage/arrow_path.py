"""A file as pyarrow sees it: a filesystem and a path on it, so pyarrow.parquet reads a job file the same
way from a local folder or an S3 bucket (only the footer and the row groups asked for are fetched)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq


class ArrowPath(NamedTuple):
    filesystem: pafs.FileSystem
    path: str  # "/abs/path/name" on the local filesystem, "bucket/prefix/name" on S3

    @classmethod
    def local(cls, path: Path) -> ArrowPath:
        return cls(pafs.LocalFileSystem(), str(Path(path).absolute()))

    @property
    def local_path(self) -> Path | None:
        """The file on this machine's disk, when it is one (a download is then served by sendfile)."""
        return Path(self.path) if isinstance(self.filesystem, pafs.LocalFileSystem) else None


# Callers that only ever saw a local file (tests, `freight run`) keep passing a Path.
ParquetSource = Path | ArrowPath


def as_arrow(source: ParquetSource) -> ArrowPath:
    return source if isinstance(source, ArrowPath) else ArrowPath.local(source)


def parquet_file(source: ParquetSource) -> pq.ParquetFile:
    where = as_arrow(source)
    return pq.ParquetFile(where.path, filesystem=where.filesystem)


def read_schema(source: ParquetSource) -> pa.Schema:
    where = as_arrow(source)
    return pq.read_schema(where.path, filesystem=where.filesystem)


def file_size(source: ParquetSource) -> int:
    """Bytes of the file; FileNotFoundError when there is none."""
    where = as_arrow(source)
    info = where.filesystem.get_file_info(where.path)
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(where.path)
    return info.size
