"""A job file as an HTTP response: a file on this machine's disk by FileResponse (sendfile, ranges), a
file in an object store streamed a chunk at a time, so the API never holds a whole file in memory."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi.responses import FileResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.responses import Response

from storage.arrow_path import ArrowPath, file_size

CHUNK_BYTES = 1 << 20


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
