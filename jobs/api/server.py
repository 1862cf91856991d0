"""How `freight api` runs the app: uvicorn, with its HTTP protocol's own error answers in Freight's one
error shape. A request uvicorn cannot parse (a garbage request line, a bad or repeated Content-Length,
Content-Length with chunked, an oversized header block) never reaches the app: uvicorn answers it
with a 400 of its own, plain text. These protocol classes answer the same 400 as
`{"error": {"message", "type", "param", "code"}}`, and still close the connection (after a framing
error nothing more on it can be trusted)."""

from __future__ import annotations

import json

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from jobs.domain.errors import error_body


def protocol_error_body(message: str) -> bytes:
    return json.dumps(error_body(400, f"malformed HTTP request: {message}", code="bad_request")).encode()


class FreightHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (its default where httptools is installed) with JSON 400s."""

    def send_400_response(self, msg: str) -> None:
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
        self.transport.close()


class FreightH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with JSON 400s (the fallback without httptools)."""

    def send_400_response(self, msg: str) -> None:
        import h11

        body = protocol_error_body(msg)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode("ascii")),
            (b"connection", b"close"),
        ]
        self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()


def http_protocol() -> type:
    """httptools where installed (uvicorn's own choice), else h11."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return FreightH11Protocol
    return FreightHttpToolsProtocol
