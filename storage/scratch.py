"""Local scratch files whose names never outlive the code that made them.

A scratch file (the partial results of a running job, written for one download) is named only inside a
`with scratch_file(...)` block: the name is removed when the block ends, on every path, an exception
included. A reader that must go on after the block (a response streamed to the client) opens the file
inside the block and keeps the open handle: on POSIX the bytes stay readable until it is closed, and
no name is left in the temp folder whether the response completes, fails or the client goes away."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


@contextmanager
def scratch_file(prefix: str, suffix: str = "", folder: Path | None = None) -> Iterator[Path]:
    """An empty file's path in `folder` (default: the temp folder), removed when the block ends."""
    handle, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=folder)
    os.close(handle)
    try:
        yield Path(name)
    finally:
        with suppress(FileNotFoundError):
            os.unlink(name)
