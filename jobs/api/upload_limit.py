"""Refuse request bodies over the upload limit without storing them. FastAPI parses a multipart body
(spooling it to a temp file) before the route runs, so a check in the route comes too late to spare
the disk; this ASGI middleware answers 413 from the Content-Length header, and stops storing a body
sent without one (chunked) as soon as it passes the limit. The refused body is read and dropped
(up to DRAIN_BYTES) so that an ordinary client, which sends its whole body before it reads the
answer, sees the 413 rather than a reset connection."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Multipart framing and the params field ride along with the file.
ENVELOPE_BYTES = 1024 * 1024
DRAIN_BYTES = 256 * 1024 * 1024


class BodyTooLarge(Exception):
    pass


class UploadLimit:
    def __init__(self, app: ASGIApp, max_upload_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_upload_bytes + ENVELOPE_BYTES
        self.limit_mb = max_upload_bytes // (1024 * 1024)

    def message(self) -> str:
        return f"upload is larger than the limit of {self.limit_mb} MB"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _drain(receive, 0)
            await self._refuse(send)
            return
        received = 0
        exceeded = False

        async def counted_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    exceeded = True
                    if message.get("more_body", False):
                        await _drain(receive, received)
                    # The body parser fails on this (however the app's middleware wraps it), so the
                    # route never runs; the answer it gives instead is replaced below.
                    raise BodyTooLarge(self.message())
            return message

        async def guarded_send(message: Message) -> None:
            if not exceeded:
                await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not exceeded:
                raise
        if exceeded:
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"error": {"message": self.message()}}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive, already: int) -> None:
    """Read and drop the rest of a refused body, up to DRAIN_BYTES in all."""
    drained = already
    while drained < DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
