"""One answer per request on both HTTP protocols `freight api` can run (jobs/api/server.py, issue 28):
after an early answer (a 401, or a 413 for a body over the limit, sent while the body was still
arriving), bytes of that body that do not parse must not bring a second answer (uvicorn's httptools
protocol wrote a 400 after the 413 on the same connection); the connection is closed cleanly (EOF, not
a reset) after the answer already given. A broken request not yet answered still gets its one JSON 400,
and so does a broken request that follows a completed one.

Raw sockets over loopback against the real app on uvicorn (a thread of this process), once per protocol,
on the session's Postgres and Redis; no worker."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from jobs.api.server import FreightH11Protocol, FreightHttpToolsProtocol
from tests.service.fixtures import ServiceEnv, create_api_key
from tests.service.hostile_helpers import BOUNDARY, RawConnection, error_of, part, served

TENANT = "one-answer"
UPLOAD_MB = 1  # the limit of the app under test: a body over it is 2 MB (with the 1 MB envelope)
PROTOCOLS = {"httptools": FreightHttpToolsProtocol, "h11": FreightH11Protocol}
BROKEN_CHUNK = b"zz\r\n\r\n"  # not a chunk size: the parser fails on it


@pytest.fixture(scope="module")
def key(service_env: ServiceEnv) -> str:
    return create_api_key(service_env, TENANT)


@pytest.fixture(scope="module", params=sorted(PROTOCOLS))
def api(request: pytest.FixtureRequest, service_env: ServiceEnv) -> Iterator[str]:
    settings = service_env.settings.model_copy(update={"max_upload_mb": UPLOAD_MB})
    with served(settings, PROTOCOLS[request.param]) as url:
        yield url


@pytest.fixture
def connection(api: str) -> Iterator[RawConnection]:
    connection = RawConnection(api, timeout=10)
    yield connection
    connection.close()


@pytest.fixture(autouse=True)
def no_transport_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A second answer h11 cannot frame raised inside the protocol: asyncio logged a fatal error."""
    caplog.set_level(logging.WARNING, logger="asyncio")
    yield
    fatal = [record.getMessage() for record in caplog.records if record.name == "asyncio"]
    assert not fatal, fatal


def chunked_post(path: str, headers: dict[str, str], first_chunk: bytes) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: x", "Transfer-Encoding: chunked", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + b"%x\r\n" % len(first_chunk) + first_chunk + b"\r\n"


def only_answer_then_eof(connection: RawConnection) -> None:
    """Nothing after the answer already read: no second response, and an EOF rather than a reset."""
    time.sleep(0.3)  # a second answer, if any, is written at once
    assert connection.closed_by_server(), connection.buffer[:200]


MULTIPART = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


def test_an_early_401_then_a_broken_chunk_is_one_answer(connection: RawConnection) -> None:
    connection.send_raw(chunked_post("/v1/jobs", MULTIPART, part("file", b"x" * 1000, "in.parquet")))
    status, _headers, body = connection.response()
    assert status == 401 and error_of(body)
    connection.send_raw(BROKEN_CHUNK)
    only_answer_then_eof(connection)


def test_an_early_413_then_a_broken_chunk_is_one_answer(connection: RawConnection, key: str) -> None:
    """The 413 goes out while the refused body is drained; the broken chunk ends the drain, not a 400."""
    too_large = part("file", b"x" * (2 * UPLOAD_MB + 1) * 1024 * 1024, "in.parquet")
    connection.send_raw(chunked_post("/v1/jobs", {**MULTIPART, "Authorization": f"Bearer {key}"}, too_large))
    status, headers, body = connection.response()
    assert status == 413 and "larger than the limit" in error_of(body)["message"], body
    assert headers["connection"] == "close"
    connection.send_raw(BROKEN_CHUNK)
    only_answer_then_eof(connection)


def test_a_broken_request_not_yet_answered_gets_one_json_400(connection: RawConnection, key: str) -> None:
    """The route is reading the body when its framing breaks: the 400 is its one answer (the route's
    own, were it to come, is dropped)."""
    start = part("file", b"x" * 1000, "in.parquet")
    connection.send_raw(chunked_post("/v1/jobs", {**MULTIPART, "Authorization": f"Bearer {key}"}, start))
    time.sleep(0.3)  # the route is running, waiting for the rest of the body
    connection.send_raw(BROKEN_CHUNK)
    status, headers, body = connection.response()
    assert status == 400 and headers["content-type"] == "application/json", body
    assert "malformed HTTP request" in error_of(body)["message"]
    only_answer_then_eof(connection)


def test_a_broken_request_after_a_completed_one_gets_its_400(connection: RawConnection, key: str) -> None:
    connection.send("GET", "/v1/jobs?limit=1", headers={"Authorization": f"Bearer {key}"})
    assert connection.response()[0] == 200
    connection.send_raw(b"\x16\x03\x01 hello there\r\n\r\n")
    status, headers, body = connection.response()
    assert status == 400 and "malformed HTTP request" in error_of(body)["message"], body
    assert headers["connection"] == "close"
    only_answer_then_eof(connection)


def test_a_broken_request_pipelined_behind_a_running_one_gets_its_400_after_that_answer(
    connection: RawConnection, key: str
) -> None:
    """One write holds a request and broken bytes behind it: the parser meets the broken bytes while the
    first request runs (its task starts only after this read), so its answer is still owed. That answer goes
    out whole first, then the 400 (HTTP/1.1 answers pipelined requests in order), then EOF."""
    head = f"GET /v1/jobs?limit=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
    connection.send_raw(head + b"\x16\x03\x01 hello there\r\n\r\n")
    status, _headers, body = connection.response()
    assert status == 200 and "data" in body.decode(), body
    status, headers, body = connection.response()
    assert status == 400 and "malformed HTTP request" in error_of(body)["message"], body
    assert headers["connection"] == "close"
    only_answer_then_eof(connection)
