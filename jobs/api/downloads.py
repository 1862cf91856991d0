"""A job file as an HTTP response: a file on this machine's disk by FileResponse (sendfile, ranges), a
file in an object store streamed a chunk at a time, so the API never holds a whole file in memory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import BinaryIO

from fastapi.responses import FileResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.responses import Response

from storage.arrow_path import ArrowPath, file_size

# each read of an S3 object is one ranged GET: against SeaweedFS 16 MB reads ran 2.8x the 1 MB rate
# (docs/benchmarks.md#object-store-libraries); 8 MB (not measured) holds half the memory per download in flight
CHUNK_BYTES = 8 << 20


def file_response(
    where: ArrowPath,
    *,
    media_type: str,
    filename: str | None = None,
    headers: dict[str, str] | None = None,
    background: BackgroundTask | None = None,
) -> Response:
    local = where.local_path
    if local is not None:
        return FileResponse(
            local, media_type=media_type, filename=filename, headers=headers, background=background
        )
    headers = {**(headers or {}), "content-length": str(file_size(where))}
    if filename is not None:  # server-made names (ids): plain ASCII, nothing to quote
        headers["content-disposition"] = f'attachment; filename="{filename}"'
    source = where.filesystem.open_input_stream(where.path)

    def chunks() -> Iterator[bytes]:
        with source:
            while chunk := source.read(CHUNK_BYTES):
                yield chunk

    return StreamingResponse(chunks(), media_type=media_type, headers=headers, background=background)


def open_file_response(
    handle: BinaryIO, *, media_type: str, filename: str | None = None, headers: dict[str, str] | None = None
) -> Response:
    """An open local file streamed a chunk at a time and closed at the end: a scratch file whose name is
    already gone (storage/scratch.py), so nothing is left behind whether the response completes or not."""
    headers = {**(headers or {}), "content-length": str(os.fstat(handle.fileno()).st_size)}
    if filename is not None:
        headers["content-disposition"] = f'attachment; filename="{filename}"'

    def chunks() -> Iterator[bytes]:
        with handle:
            while chunk := handle.read(CHUNK_BYTES):
                yield chunk

    return StreamingResponse(chunks(), media_type=media_type, headers=headers)
