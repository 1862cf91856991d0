"""Input URIs by reference: `s3://bucket/key` parsed strictly, and FREIGHT_INPUT_ALLOW's entries; no
request is made here (jobs/domain/input_refs.py reads what a URI names)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from jobs.domain.errors import clip_repr

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
GLOB = re.compile(r"[*?\[]")
_REFUSED_CHARS = re.compile(r"[\x00-\x1f\x7f-\U0010ffff\\%#]")


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str  # no leading or trailing "/"; "" for the whole bucket

    @property
    def path(self) -> str:
        """bucket/key, as a pyarrow S3 filesystem names it."""
        return f"{self.bucket}/{self.key}" if self.key else self.bucket

    def under(self, allowed: S3Location) -> bool:
        return self.bucket == allowed.bucket and (
            not allowed.key or self.key == allowed.key or self.key.startswith(f"{allowed.key}/")
        )


def parse_s3_uri(uri: str, *, globs: bool) -> tuple[S3Location, bool]:
    """(location, is_folder) of `s3://bucket/key` (a trailing "/" names a folder); ValueError naming the
    problem for anything else. A glob is allowed only in the last segment, and only when `globs`."""
    if not uri.startswith("s3://"):
        scheme = uri.split("://", 1)[0] if "://" in uri else ""
        what = f"the scheme {clip_repr(scheme)}" if scheme else "no scheme"
        raise ValueError(f"{what}: only s3://bucket/key URIs can be read by reference")
    if _REFUSED_CHARS.search(uri):
        raise ValueError("control characters, backslashes, '%' and '#' are not allowed in a URI")
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(f"{clip_repr(bucket)} is not a bucket name (lowercase letters, digits, '.', '-')")
    is_folder = key.endswith("/")
    key = key.removesuffix("/")
    parts = key.split("/") if key else []
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError("the key has an empty, '.' or '..' segment")
    if any(GLOB.search(part) for part in parts[:-1]) or (parts and GLOB.search(parts[-1]) and not globs):
        raise ValueError("a glob ('*', '?', '[') is allowed only in the last segment of an input URI")
    return S3Location(bucket, key), is_folder


def parse_allow_list(entries: Sequence[str]) -> list[S3Location]:
    """FREIGHT_INPUT_ALLOW's entries; ValueError naming the bad one (checked when the settings load)."""
    allowed = []
    for entry in entries:
        try:
            allowed.append(parse_s3_uri(entry, globs=False)[0])
        except ValueError as exc:
            raise ValueError(f"FREIGHT_INPUT_ALLOW entry {entry!r}: {exc}") from None
    return allowed
