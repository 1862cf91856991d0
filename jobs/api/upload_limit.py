"""Refuse request bodies over the upload limit without storing them. FastAPI parses a multipart body
(spooling it to a temp file) before the route runs, so a check in the route comes too late to spare
the disk; this ASGI middleware answers 413 from the Content-Length header, and stops storing a body
sent without one (chunked) as soon as it passes the limit. The 413 is written at once; then the rest
of the refused body is read and dropped (up to DRAIN_BYTES, and only while it keeps coming) before
the response is finished and the connection closed, so that an ordinary client, which sends its whole
body before it reads the answer, sees the 413 rather than a reset connection, and a client whose
Content-Length claims more than it sends gets its answer without waiting."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from jobs.domain.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Multipart framing and the params field ride along with the file.
ENVELOPE_BYTES = 1024 * 1024
DRAIN_BYTES = 256 * 1024 * 1024
DRAIN_IDLE_SECONDS = 2.0  # stop draining when the client sends nothing for this long
DRAIN_SECONDS = 30.0  # and after this long in all


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
            await self._refuse(send, receive, 0)
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
                    if not message.get("more_body", False):
                        received = DRAIN_BYTES  # nothing is left to drain
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
            await self._refuse(send, receive, received)

    async def _refuse(self, send: Send, receive: Receive, received: int) -> None:
        body = json.dumps(error_body(413, self.message())).encode()
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
        # The whole answer goes out now; the response stays open (the server would stop handing over the
        # body once it is complete) while the rest of the body is drained, then ends with nothing more.
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await _drain(receive, received)
        await send({"type": "http.response.body", "body": b""})


async def _drain(receive: Receive, already: int) -> None:
    """Read and drop the rest of a refused body: up to DRAIN_BYTES in all, for at most DRAIN_SECONDS,
    and only while it keeps coming (a Content-Length can promise far more than is ever sent)."""
    drained = already
    deadline = time.monotonic() + DRAIN_SECONDS
    while drained < DRAIN_BYTES:
        wait = min(DRAIN_IDLE_SECONDS, deadline - time.monotonic())
        if wait <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), wait)
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
