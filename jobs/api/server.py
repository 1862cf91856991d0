"""How `freight api` runs the app: uvicorn, with its HTTP protocol's own error answers in Freight's one
error shape. A request uvicorn cannot parse (a garbage request line, a bad or repeated Content-Length,
Content-Length with chunked, an oversized header block) never reaches the app: uvicorn answers it
with a 400 of its own, plain text. These protocol classes answer the same 400 as
`{"error": {"message", "type", "param", "code"}}`, and still close the connection (after a framing
error nothing more on it can be trusted).

A connection carries one answer per request. Where the app has already answered the request whose bytes
turn out broken (an early answer: a 401, or a 413 for a body over the limit, sent before the body was
read), a 400 would be a second answer nobody asked for (uvicorn's httptools protocol sent one): the
connection is then only closed, cleanly, after the answer already given. Where the broken bytes begin a new
request pipelined behind answers still owed (a request still running, an answer still streaming), those
answers go out first and the 400 after them, as HTTP/1.1 orders pipelined answers; then the connection
closes. (h11 parses nothing past a request until its answer is complete, so its fallback gets there alone.)

httptools is installed with uvicorn[standard] (a dependency), so `freight api` runs
FreightHttpToolsProtocol; the h11 fallback runs only where httptools cannot be installed. h11 alone
reads a request with both Content-Length and chunked Transfer-Encoding as chunked and keeps the
connection (a request-smuggling vector, RFC 9112 section 6.1): the fallback refuses it as httptools does."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from jobs.domain.errors import error_body

# How long a connection closed after a protocol error keeps reading (and dropping) what the client still sends.
LINGER_S = 2.0


def protocol_error_body(message: str) -> bytes:
    return json.dumps(error_body(400, f"malformed HTTP request: {message}", code="bad_request")).encode()


class _LingeringClose:
    """Closing a socket whose request bytes were not all read makes the kernel send a reset, which can
    destroy the 400 still on its way (the client sees "connection reset"). So after a protocol error's
    answer: end our side (FIN after the answer), drop whatever still arrives, and close on the client's
    EOF or after LINGER_S, as web servers' lingering close does."""

    transport: asyncio.Transport
    cycle: Any  # uvicorn's RequestResponseCycle of the latest request (None before the first)
    lingering = False

    def close_after_answer(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The app's answer (started or not) can no longer go out whole: it is dropped, and a route
            # still reading the body is told the client is gone.
            cycle.disconnected = True
            cycle.message_event.set()
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.lingering = True
        self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if not self.lingering:  # after the answer, the rest of a broken request is dropped unread
            super().data_received(data)  # type: ignore[misc]


class FreightHttpToolsProtocol(_LingeringClose, HttpToolsProtocol):
    """uvicorn's httptools protocol (its default where httptools is installed) with JSON 400s, and at most
    one answer per request (see the module's docstring)."""

    reading_body = False  # the latest request's headers are parsed and its body is not complete yet
    deferred_400: str | None = None  # a broken request's 400, owed after the answers queued before it

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self.reading_body = True

    def on_message_complete(self) -> None:
        self.reading_body = False
        super().on_message_complete()

    def may_answer(self) -> bool:
        """Whether a 400 for bytes that do not parse is this connection's next answer: no request is
        waiting for its answer (the broken bytes begin a new request), or the broken request is the one
        being read and nothing of its answer has gone out (and no earlier request is still queued)."""
        cycle = self.cycle
        if cycle is None or (cycle.response_complete and not self.reading_body):
            return True
        return self.reading_body and not cycle.response_started and not self.pipeline

    def send_400_response(self, msg: str) -> None:
        if not self.may_answer():
            if not self.reading_body:  # the broken bytes begin a request pipelined behind answers still owed
                self.deferred_400 = msg
                self.lingering = True  # nothing after them can be parsed: dropped unread
                return
            self.close_after_answer()  # the answer already given (or on its way) stays the only one
            return
        self._write_400(msg)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        owed = self.pipeline or (self.cycle is not None and not self.cycle.response_complete)
        if self.deferred_400 is not None and not owed and not self.transport.is_closing():
            msg, self.deferred_400 = self.deferred_400, None
            self._write_400(msg)

    def _write_400(self, msg: str) -> None:
        body = protocol_error_body(msg)
        content = [b"HTTP/1.1 400 Bad Request\r\n"]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                b"connection: close\r\n",
                b"\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(content))
        self.close_after_answer()


class _StrictH11Connection(h11.Connection):
    """h11's server connection that also refuses Content-Length together with Transfer-Encoding (see the
    module's docstring), raised where h11 raises its own protocol errors, so uvicorn answers it the same way."""

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name.lower() for name, _value in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                raise h11.RemoteProtocolError("Content-Length together with Transfer-Encoding", error_status_hint=400)
        return event


class FreightH11Protocol(_LingeringClose, H11Protocol):
    """uvicorn's h11 protocol with JSON 400s (the fallback without httptools)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        limit = config.h11_max_incomplete_event_size
        self.conn = _StrictH11Connection(h11.SERVER, DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if limit is None else limit)

    def send_400_response(self, msg: str) -> None:
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            # The app has answered this request already (its body was still arriving): no second answer
            # can be framed, so the connection is only closed (h11 would raise, and asyncio reset it).
            self.close_after_answer()
            return
        body = protocol_error_body(msg)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode("ascii")),
            (b"connection", b"close"),
        ]
        self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.close_after_answer()


def http_protocol() -> type:
    """httptools where installed (uvicorn's own choice), else h11."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return FreightH11Protocol
    return FreightHttpToolsProtocol
