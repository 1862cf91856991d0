"""The API's edge: what every request passes before and after a route, in Freight's one error shape.

- `check_query_text`: the text rule (jobs/domain/text_rule.py) for every query parameter (a NUL in
  `?purpose=` never reaches the database).
- `parse_json_input`: the bounded JSON parser (jobs/domain/json_limits.py) as a 4xx naming the limit.
- `BodyTimeout`: a request body that stops arriving is answered 408 and the connection closed.
- `InternalErrors`: an unexpected exception is a JSON 500, and the keep-alive connection stays usable.
  uvicorn sees an ordinary response and discards whatever of the body the route did not read. Closing
  instead (`Connection: close`, as uvicorn does after an exception it sees) resets the connection when
  part of the body is still unread, so the client can lose the answer itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import Request

from jobs.domain.errors import InputError, clip, error_body
from jobs.domain.json_limits import JsonLimits, JsonRefused, parse_json
from jobs.domain.text_rule import text_problem

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def check_query_text(request: Request) -> None:
    """Every query parameter name and value follows the text rule; else a 422 naming it."""
    for name, value in request.query_params.multi_items():
        problem = text_problem(name) or text_problem(value)
        if problem is not None:
            shown = clip(name.replace("\x00", "\\x00"), 64)
            raise InputError(f"query parameter {shown!r} {problem}", field=shown)


def parse_json_input(raw: str | bytes, where: str, limits: JsonLimits) -> Any:
    """`raw` parsed within `limits`, or a 422 whose message names the limit (or the syntax error)."""
    try:
        return parse_json(raw, where, limits)
    except JsonRefused as exc:
        code = {"json": "invalid_json", "text": "invalid_text"}.get(exc.limit, "json_limit")
        raise InputError(exc.message, field=where, code=code) from exc


def json_response(status: int, message: str, *, close: bool) -> tuple[Message, Message]:
    """The two ASGI messages of an error answer in the one shape."""
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    return (
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": body},
    )


class BodyTimedOut(Exception):
    pass


class BodyTimeout:
    """Each chunk of a request body must arrive within `idle_seconds` of the previous one (uvicorn has
    no such timeout: a client that promises 2 MB and sends 1 KB would hold its connection and a
    worker thread for ever). On a timeout the route fails where it reads, and the client gets a 408
    with `Connection: close` (what is left of its body will never be read)."""

    def __init__(self, app: ASGIApp, idle_seconds: float) -> None:
        self.app = app
        self.idle_seconds = idle_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        timed_out = False
        started = False

        async def timed_receive() -> Message:
            nonlocal timed_out
            try:
                return await asyncio.wait_for(receive(), self.idle_seconds)
            except TimeoutError:
                timed_out = True
                raise BodyTimedOut from None

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if timed_out and not started:
                return  # the route's own answer to the failed read is replaced by the 408 below
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, tracked_send)
        except Exception:
            if not timed_out:
                raise
        if timed_out and not started:
            message = f"the request body stopped arriving (nothing for {self.idle_seconds:g} s)"
            for part in json_response(408, message, close=True):
                await send(part)


class InternalErrors:
    """An exception no handler answered: logged, and a JSON 500 on a connection that stays usable (see
    the module's docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception:
            if started:
                raise  # too late for an answer: uvicorn closes the connection
            log.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            for part in json_response(500, "internal error: the request could not be completed", close=False):
                await send(part)
