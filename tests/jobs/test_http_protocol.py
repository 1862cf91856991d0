"""Which HTTP protocol `freight api` runs (jobs/api/server.py), and the h11 fallback's framing rule, without a
server: tests/service/test_hostile_inputs_3.py drives both over sockets."""

from __future__ import annotations

import sys

import h11
import pytest

from jobs.api.server import FreightH11Protocol, FreightHttpToolsProtocol, _StrictH11Connection, http_protocol


def test_httptools_runs_where_installed_and_the_h11_fallback_where_not(monkeypatch: pytest.MonkeyPatch) -> None:
    assert http_protocol() is FreightHttpToolsProtocol  # uvicorn[standard] installs httptools
    monkeypatch.setitem(sys.modules, "httptools", None)  # an install without it: the import fails
    assert http_protocol() is FreightH11Protocol


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Length: 3\r\nTransfer-Encoding: chunked",
        b"Transfer-Encoding: chunked\r\nContent-Length: 0",
        b"content-length: 5\r\ntransfer-encoding: chunked",
    ],
)
def test_the_fallback_refuses_content_length_with_transfer_encoding(head: bytes) -> None:
    """h11 alone reads such a request as chunked and keeps the connection (request smuggling)."""
    plain = h11.Connection(h11.SERVER)
    strict = _StrictH11Connection(h11.SERVER)
    for connection in (plain, strict):
        connection.receive_data(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n\r\n0\r\n\r\n")
    assert isinstance(plain.next_event(), h11.Request)
    with pytest.raises(h11.RemoteProtocolError, match="Content-Length together with Transfer-Encoding"):
        strict.next_event()
    ok = _StrictH11Connection(h11.SERVER)
    ok.receive_data(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab")
    assert isinstance(ok.next_event(), h11.Request) and ok.next_event() == h11.Data(data=b"ab")
