"""Job files (inputs, results, metrics) on a local or shared filesystem, under server-chosen names."""

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

# Names are built by the server from job ids; anything else is refused rather than resolved.
_NAME = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


class UploadTooLarge(Exception):
    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"upload is larger than the limit of {limit_bytes // (1024 * 1024)} MB")
        self.limit_bytes = limit_bytes


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


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, name: str) -> Path:
        if not _NAME.match(name) or any(part in (".", "..") for part in name.split("/")):
            raise ValueError(f"invalid blob name {name!r}")
        return self.root / name

    def exists(self, name: str) -> bool:
        return self.path(name).is_file()

    @contextmanager
    def atomic_path(self, name: str) -> Iterator[Path]:
        """A temporary path in the same folder that replaces `name` only if the block succeeds."""
        final = self.path(name)
        final.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(dir=final.parent, prefix=".tmp-", suffix=final.suffix)
        os.close(handle)
        try:
            yield Path(temp)
            os.replace(temp, final)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)

    def write_stream(self, name: str, source: BinaryIO, max_bytes: int, chunk_bytes: int = 1 << 20) -> int:
        """Copy `source` into `name`, refusing more than max_bytes; returns the size written."""
        written = 0
        with self.atomic_path(name) as temp, open(temp, "wb") as sink:
            while chunk := source.read(chunk_bytes):
                written += len(chunk)
                if written > max_bytes:
                    raise UploadTooLarge(max_bytes)
                sink.write(chunk)
        return written

    def rename(self, source: str, target: str) -> None:
        """Rename `source` to `target` (one filesystem: atomic)."""
        final = self.path(target)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.path(source), final)

    def stale(self, folder: str, older_than_s: float) -> list[str]:
        """Names of the files in `folder` last changed more than `older_than_s` seconds ago."""
        root = self.path(folder)
        if not root.is_dir():
            return []
        cutoff = time.time() - older_than_s
        return [f"{folder}/{entry.name}" for entry in root.iterdir() if entry.is_file() and entry.stat().st_mtime < cutoff]

    def copy_in(self, name: str, source_path: Path) -> None:
        with self.atomic_path(name) as temp:
            shutil.copyfile(source_path, temp)

    def write_text(self, name: str, text: str) -> None:
        with self.atomic_path(name) as temp:
            temp.write_text(text, encoding="utf-8")

    def read_text(self, name: str) -> str:
        return self.path(name).read_text(encoding="utf-8")

    def delete(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)

    def delete_job(self, job_id: str) -> None:
        shutil.rmtree(self.path(f"jobs/{job_id}"), ignore_errors=True)
