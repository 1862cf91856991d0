"""Where job files live, from one URL (`FREIGHT_STORAGE_URL`): `file:///path` or `s3://bucket/prefix`.

Both are opened as pyarrow filesystems (pyarrow.fs.LocalFileSystem, pyarrow.fs.S3FileSystem). pyarrow is
already a dependency of Freight (every job file is Parquet), its S3 client is the AWS C++ SDK (signing,
retries, multipart uploads, the standard credential chain), and pyarrow.parquet reads and writes through
the same filesystem objects, so no further package is needed and no S3 request is signed by hand."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pyarrow.fs as pafs

SCHEMES = ("file", "s3")


@dataclass(frozen=True)
class StorageLocation:
    scheme: str  # "file" or "s3"
    base: str  # the folder ("/abs/path") or "bucket/prefix" (no trailing slash) that names are under

    @property
    def local_root(self) -> Path | None:
        return Path(self.base) if self.scheme == "file" else None


def parse_storage_url(url: str) -> StorageLocation:
    """The location a storage URL names; ValueError for anything else (checked when settings load)."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"storage URL {url!r}: the scheme must be one of {', '.join(SCHEMES)}")
    if parts.query or parts.fragment:
        raise ValueError(f"storage URL {url!r}: no query or fragment is allowed")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"storage URL {url!r}: a file URL names a local folder (file:///path)")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ValueError(f"storage URL {url!r}: the folder must be an absolute path")
        return StorageLocation("file", str(Path(path)))
    bucket, prefix = parts.netloc, parts.path.strip("/")
    if not bucket:
        raise ValueError(f"storage URL {url!r}: name the bucket, s3://bucket/prefix")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"storage URL {url!r}: the prefix has an empty, '.' or '..' part")
    return StorageLocation("s3", f"{bucket}/{prefix}" if prefix else bucket)


def endpoint_parts(endpoint_url: str) -> tuple[str, str]:
    """(scheme, host[:port]) of an S3 endpoint URL; ValueError for anything else."""
    parts = urlsplit(endpoint_url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path.strip("/") or parts.query:
        raise ValueError(f"S3 endpoint URL {endpoint_url!r}: expected http(s)://host[:port]")
    return parts.scheme, parts.netloc


def s3_filesystem(endpoint_url: str | None) -> pafs.S3FileSystem:
    """An S3 filesystem whose credentials come from the AWS SDK's standard chain (AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, ~/.aws, instance metadata): Freight holds no secret."""
    # The SDK's own region lookup does not read AWS_REGION on every version; say it explicitly.
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
    if endpoint_url is None:
        return pafs.S3FileSystem(region=region)
    scheme, host = endpoint_parts(endpoint_url)
    # A non-AWS endpoint (MinIO, SeaweedFS, Ceph RGW, R2) serves buckets as paths, not as host names.
    return pafs.S3FileSystem(region=region or "us-east-1", endpoint_override=host, scheme=scheme)
