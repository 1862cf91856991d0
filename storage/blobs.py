"""Job files (inputs, results, metrics, OpenAI files) under server-chosen names, in a local folder or an
S3 bucket (`FREIGHT_STORAGE_URL`, storage/storage_url.py), both through a pyarrow filesystem: pyarrow is
already a dependency and its S3 client is the AWS C++ SDK, so no package is added and nothing is signed
by hand.

Every writer is atomic: a name holds its previous content or the complete new one, never a part.
- In a folder, a temp file beside the target is renamed over it (one filesystem: atomic).
- On S3 an object appears only when its upload completes, but pyarrow's output stream completes the
  upload whenever it is closed (its destructor too) and Python cannot abort it: a writer that fails
  halfway would publish what it wrote. So a writer fills a local spool file, and only a finished one is
  uploaded, by one pyarrow call (pyarrow.fs.copy_files) that no Python signal interrupts. A process
  killed during the upload leaves an incomplete multipart upload that no reader sees (a bucket
  lifecycle rule, AbortIncompleteMultipartUpload, reclaims its space).

Readers stream: open_input() reads front to back, and arrow() hands pyarrow.parquet the (filesystem,
path) pair, so only a file's footer and the row groups asked for are fetched."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.fs as pafs

from storage.arrow_path import ArrowPath
from storage.storage_url import parse_storage_url, s3_filesystem

# Names are built by the server from job ids; anything else is refused rather than resolved.
_NAME = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")
# Temp files of the file backend's writers sit beside their target under this prefix.
TEMP_PREFIX = ".tmp-"


class UploadTooLarge(Exception):
    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"upload is larger than the limit of {limit_bytes // (1024 * 1024)} MB")
        self.limit_bytes = limit_bytes


class NoLocalPath(RuntimeError):
    """A caller asked for a job file's local path, and job files are in an object store."""


def input_name(job_id: str) -> str:
    return f"jobs/{job_id}/input.parquet"


def staging_name(job_id: str) -> str:
    """Where a submission's upload waits while it is validated: no job row points here, so a file left
    by an API that died mid-submission is swept by its age (jobs/domain/recovery.py)."""
    return f"staging/{job_id}.parquet"


def results_name(job_id: str) -> str:
    return f"jobs/{job_id}/results.parquet"


def metrics_name(job_id: str) -> str:
    return f"jobs/{job_id}/metrics.json"


# How pyarrow words an S3 request that failed on the way rather than on its content ("AWS Error
# NETWORK_CONNECTION during GetObject operation: curlCode: 7, ..."): the store is down or restarting.
_UNREACHABLE = re.compile(
    r"AWS Error (NETWORK_CONNECTION|SERVICE_UNAVAILABLE|SLOW_DOWN|THROTTLING|REQUEST_TIMEOUT|INTERNAL_FAILURE)"
    r"|AWS Error \w+ \(HTTP status 5\d\d\)|curlCode: \d+"
)


def store_unreachable(exc: BaseException) -> bool:
    """True when `exc`, or an error it was raised from, is the object store being unreachable (refused,
    reset or timed-out connections, a 5xx while it restarts): a retry later can succeed, so it is not
    the job's fault. A missing or unreadable object is not this."""
    seen: BaseException | None = exc
    for _ in range(16):  # a chain can loop back on itself
        if seen is None:
            return False
        if isinstance(seen, OSError) and _UNREACHABLE.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def check_name(name: str) -> str:
    # fullmatch: `$` would let a trailing newline through
    if not _NAME.fullmatch(name) or any(part in (".", "..") for part in name.split("/")):
        raise ValueError(f"invalid blob name {name!r}")
    return name


class BlobStore:
    def __init__(self, root: Path) -> None:
        """Job files in the local folder `root` (the file backend, the embedded default)."""
        self._setup(pafs.LocalFileSystem(), str(Path(root).absolute()), root=Path(root), spool_dir=None)

    @classmethod
    def on_s3(cls, filesystem: pafs.FileSystem, base: str, spool_dir: Path) -> BlobStore:
        """Job files under `base` ("bucket/prefix") of an S3 filesystem; writers spool in `spool_dir`."""
        store = cls.__new__(cls)
        store._setup(filesystem, base.rstrip("/"), root=None, spool_dir=Path(spool_dir))
        return store

    @classmethod
    def from_url(cls, url: str, *, endpoint_url: str | None, spool_dir: Path) -> BlobStore:
        """The store `FREIGHT_STORAGE_URL` names (`FREIGHT_S3_ENDPOINT_URL` for a non-AWS S3)."""
        location = parse_storage_url(url)
        if location.local_root is not None:
            return cls(location.local_root)
        return cls.on_s3(s3_filesystem(endpoint_url), location.base, spool_dir)

    def _setup(
        self, filesystem: pafs.FileSystem, base: str, *, root: Path | None, spool_dir: Path | None
    ) -> None:
        self.filesystem = filesystem
        self.base = base
        self.root = root  # None on S3
        self.spool_dir = spool_dir

    @property
    def is_local(self) -> bool:
        return self.root is not None

    @property
    def url(self) -> str:
        """The storage URL this store was (or could have been) opened from."""
        return Path(self.base).as_uri() if self.root is not None else f"s3://{self.base}"

    def __repr__(self) -> str:
        return f"BlobStore({self.url})"

    # ---- where a name lives --------------------------------------------------------------------

    def key(self, name: str) -> str:
        """The name's path on self.filesystem."""
        return f"{self.base}/{check_name(name)}"

    def path(self, name: str) -> Path:
        """The name's local path: the file backend only (callers not yet moved to arrow()/open_input())."""
        check_name(name)
        if self.root is None:
            raise NoLocalPath(f"job files are in s3://{self.base}: {name} has no local path")
        return self.root / name

    def arrow(self, name: str) -> ArrowPath:
        """(filesystem, path) for pyarrow: pq.ParquetFile(where.path, filesystem=where.filesystem)."""
        return ArrowPath(self.filesystem, self.key(name))

    # ---- reading -------------------------------------------------------------------------------

    def _info(self, name: str) -> pafs.FileInfo:
        return self.filesystem.get_file_info(self.key(name))

    def exists(self, name: str) -> bool:
        return self._info(name).type == pafs.FileType.File

    def size(self, name: str) -> int:
        info = self._info(name)
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(name)
        return info.size

    def open_input(self, name: str) -> pa.NativeFile:
        """A stream of the file's bytes, front to back (one GET on S3); FileNotFoundError when missing."""
        return self.filesystem.open_input_stream(self.key(name))

    def read_text(self, name: str) -> str:
        with self.open_input(name) as source:
            return source.read().decode("utf-8")

    def _files(self, folder: str, recursive: bool) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(self.key(folder), recursive=recursive, allow_not_found=True)
        return [info for info in self.filesystem.get_file_info(selector) if info.type == pafs.FileType.File]

    def _name_of(self, info: pafs.FileInfo) -> str:
        return info.path[len(self.base) + 1 :]

    def list(self, prefix: str) -> list[str]:
        """Names of the files under the folder `prefix`, sorted (writes in progress are not files yet)."""
        return sorted(
            self._name_of(info)
            for info in self._files(prefix, recursive=True)
            if not info.base_name.startswith(TEMP_PREFIX)
        )

    def stale(self, folder: str, older_than_s: float) -> list[str]:
        """Names of the files directly in `folder` last changed more than `older_than_s` seconds ago
        (a dead writer's temp file included: it is swept the same way)."""
        cutoff_ns = (time.time() - older_than_s) * 1e9
        return [
            self._name_of(info) for info in self._files(folder, recursive=False) if info.mtime_ns < cutoff_ns
        ]

    # ---- writing -------------------------------------------------------------------------------

    @contextmanager
    def atomic_path(self, name: str) -> Iterator[Path]:
        """A local temp path that becomes `name` only if the block succeeds (see the module docstring)."""
        key = self.key(name)
        if self.root is not None:
            final = Path(key)
            final.parent.mkdir(parents=True, exist_ok=True)
            folder = final.parent
        else:
            assert self.spool_dir is not None
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            folder = self.spool_dir
        handle, temp = tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX, suffix=Path(name).suffix)
        os.close(handle)
        try:
            yield Path(temp)
            if self.root is not None:
                os.replace(temp, key)
            else:
                self._upload(Path(temp), key)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)

    def _upload(self, source: Path, key: str) -> None:
        # One C++ call: the object is completed only after every byte of the finished file is sent.
        pafs.copy_files(
            str(source), key, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.filesystem
        )

    @contextmanager
    def open_output(self, name: str) -> Iterator[BinaryIO]:
        """A binary file whose content becomes `name` when the block succeeds, and is dropped otherwise."""
        with self.atomic_path(name) as temp, open(temp, "wb") as sink:
            yield sink

    def write_stream(self, name: str, source: BinaryIO, max_bytes: int, chunk_bytes: int = 1 << 20) -> int:
        """Copy `source` into `name`, refusing more than max_bytes; returns the size written."""
        written = 0
        with self.open_output(name) as sink:
            while chunk := source.read(chunk_bytes):
                written += len(chunk)
                if written > max_bytes:
                    raise UploadTooLarge(max_bytes)
                sink.write(chunk)
        return written

    def copy_in(self, name: str, source_path: Path) -> None:
        if self.root is None:
            self._upload(Path(source_path), self.key(name))  # the source is complete: no spool needed
            return
        with self.atomic_path(name) as temp:
            shutil.copyfile(source_path, temp)

    def write_text(self, name: str, text: str) -> None:
        with self.open_output(name) as sink:
            sink.write(text.encode("utf-8"))

    def rename(self, source: str, target: str) -> None:
        """Give the file `source` the name `target`. A folder renames it (atomic); S3 copies it on the
        server (the target appears whole, as with any write) and then deletes the source."""
        if self.root is not None:
            final = self.path(target)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.path(source), final)
            return
        self.filesystem.move(self.key(source), self.key(target))

    # ---- deleting ------------------------------------------------------------------------------

    def delete(self, name: str) -> None:
        """Remove `name`; nothing to remove is fine."""
        try:
            self.filesystem.delete_file(self.key(name))
        except FileNotFoundError:
            pass

    def delete_job(self, job_id: str) -> None:
        """Remove every file of the job (its folder, or every object under its prefix)."""
        try:
            self.filesystem.delete_dir(self.key(f"jobs/{job_id}"))
        except FileNotFoundError:
            pass
