"""Hostile input through a real `freight api` over loopback (issue 13): duplicated columns, NUL in ids
and cursors, multipart bodies cut short or with repeated parts, loose types, out-of-range sampling
values, echoes of huge input, a Content-Length that lies, and one error shape for every 4xx. Malformed
bodies are written by hand and sent over raw sockets or as raw httpx content."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pyarrow as pa
import pytest

from jobs.cli.client import FreightAPIError, FreightClient
from tests.service.fixtures import PARKED_MODEL, ServiceEnv, create_api_key
from tests.service.hostile_helpers import RawConnection
from tests.service.test_bad_input import Leftovers, parquet_bytes, prompts, submit

TENANT = "hostile"
BOUNDARY = "freight-hostile-boundary"
GOOD = parquet_bytes(prompts())
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def key(service_env: ServiceEnv) -> str:
    return create_api_key(service_env, TENANT)


@pytest.fixture
def http(api_url: str, key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        yield client


def assert_error_shape(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert ERROR_KEYS <= set(body["error"]), body
    assert body["error"]["message"] and body["error"]["type"] and body["error"]["code"], body
    return body["error"]


def part(name: str, content: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + content + b"\r\n"


def multipart(*parts: bytes, close: bool = True) -> bytes:
    return b"".join(parts) + (f"--{BOUNDARY}--\r\n".encode() if close else b"")


def post_raw(http: httpx.Client, body: bytes) -> httpx.Response:
    return http.post(
        "/v1/jobs", content=body, headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    )


def duplicated(names: list[str], columns: list[pa.Array]) -> bytes:
    return parquet_bytes(pa.Table.from_arrays(columns, names=names))


MESSAGES = pa.array([[{"role": "user", "content": "hi"}]])
DUPLICATE_COLUMNS = [
    ("prompt", duplicated(["prompt", "prompt"], [pa.array(["a"]), pa.array(["b"])]), {}),
    (
        "custom_id",
        duplicated(["prompt", "custom_id", "custom_id"], [pa.array(["a"]), pa.array(["x"]), pa.array(["y"])]),
        {},
    ),
    (
        "max_tokens",
        duplicated(["prompt", "max_tokens", "max_tokens"], [pa.array(["a"]), pa.array([2]), pa.array([3])]),
        {},
    ),
    ("messages", duplicated(["messages", "messages"], [MESSAGES, MESSAGES]), {}),
    ("text", duplicated(["text", "text"], [pa.array(["a"]), pa.array(["b"])]), {"template": "Say {text}"}),
]


@pytest.mark.parametrize(
    ("column", "content", "params"),
    [case for case in DUPLICATE_COLUMNS],
    ids=[case[0] for case in DUPLICATE_COLUMNS],
)
def test_duplicated_columns_get_a_422_and_the_connection_stays_usable(
    http: httpx.Client,
    service_env: ServiceEnv,
    api_url: str,
    key: str,
    column: str,
    content: bytes,
    params: dict,
) -> None:
    leftovers = Leftovers(http, service_env)
    body = multipart(
        part("file", content, "in.parquet"),
        part("params", json.dumps({"model": PARKED_MODEL, **params}).encode()),
    )
    connection = RawConnection(api_url, key)
    try:
        connection.send(
            "POST", "/v1/jobs", body, {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
        )
        status, headers, answer = connection.response()
        assert status == 422, answer
        assert headers.get("connection", "").lower() != "close"
        error = json.loads(answer)["error"]
        assert f"column {column!r} appears 2 times" in error["message"], error
        assert error["column"] == column and error["param"] == column
        # The same keep-alive connection answers the next request.
        connection.send("GET", "/v1/jobs?limit=1")
        status, _headers, answer = connection.response()
        assert status == 200, answer
    finally:
        connection.close()
    leftovers.assert_none()


@pytest.mark.parametrize(
    "path", ["/v1/jobs/%00", "/v1/jobs/job_%00", "/v1/jobs/%00/events", "/v1/jobs/%00/results"]
)
def test_nul_in_a_job_id_is_a_404(http: httpx.Client, path: str) -> None:
    response = http.get(path)
    assert response.status_code == 404, response.text
    assert "no job" in assert_error_shape(response)["message"]


def test_nul_in_cancel_and_cursor(http: httpx.Client) -> None:
    response = http.post("/v1/jobs/%00/cancel")
    assert response.status_code == 404, response.text
    assert_error_shape(response)
    response = http.get("/v1/jobs", params={"after": "\x00"})
    assert response.status_code == 422, response.text
    error = assert_error_shape(response)
    # the text rule for query parameters (issue 28) answers before the cursor is looked at
    assert "query parameter 'after' contains a NUL" in error["message"] and error["param"] == "after"


def test_a_body_without_its_closing_boundary_is_a_400(http: httpx.Client, service_env: ServiceEnv) -> None:
    leftovers = Leftovers(http, service_env)
    params = json.dumps({"model": PARKED_MODEL, "max_tokens": 3}).encode()
    cut = multipart(part("file", GOOD, "in.parquet"), part("params", params), close=False)
    response = post_raw(http, cut)
    assert response.status_code == 400, response.text
    assert "closing boundary" in assert_error_shape(response)["message"]
    cut_in_params = multipart(part("file", GOOD, "in.parquet"), close=False) + part("params", params)[:-2]
    response = post_raw(http, cut_in_params)
    assert response.status_code == 400, response.text
    leftovers.assert_none()
    # The complete body is accepted, with its params.
    response = post_raw(http, multipart(part("file", GOOD, "in.parquet"), part("params", params)))
    assert response.status_code == 201, response.text
    assert response.json()["params"]["max_tokens"] == 3


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"max_tokens": True}, "max_tokens: Input should be a valid integer"),
        ({"max_tokens": "8"}, "max_tokens: Input should be a valid integer"),
        ({"max_tokens": 8.0}, "max_tokens: Input should be a valid integer"),
        ({"chat": "yes"}, "chat: Input should be a valid boolean"),
        ({"truncate": 1}, "truncate: Input should be a valid boolean"),
        ({"temperature": "0.5"}, "temperature: Input should be a valid number"),
        ({"seed": "1"}, "seed: Input should be a valid integer"),
        ({"temperature": 1e308}, "temperature: Input should be less than or equal to 2"),
        ({"temperature": 2.01}, "temperature: Input should be less than or equal to 2"),
        ({"top_p": 1.01}, "top_p: Input should be less than or equal to 1"),
        ("", "params is empty"),
    ],
    ids=lambda value: json.dumps(value) if isinstance(value, dict) else None,
)
def test_params_types_are_strict_and_sampling_values_bounded(
    http: httpx.Client, params: dict | str, fragment: str
) -> None:
    response = submit(http, GOOD, params)
    assert response.status_code == 422, response.text
    error = assert_error_shape(response)
    assert fragment in error["message"] and error["param"] == "params", error


def test_bounds_are_inclusive_and_an_int_is_a_float(http: httpx.Client) -> None:
    response = submit(http, GOOD, {"temperature": 2, "top_p": 1, "max_tokens": 8, "chat": False})
    assert response.status_code == 201, response.text
    assert response.json()["params"]["temperature"] == 2.0


@pytest.mark.parametrize(
    ("name", "values", "fragment"),
    [
        ("temperature", [0.5, 2.5], "row 1: temperature is 2.5; it must be between 0 and 2"),
        ("temperature", [1e308], "row 0: temperature is 1e+308; it must be between 0 and 2"),
        ("top_p", [1.5], "row 0: top_p is 1.5; it must be in (0, 1]"),
    ],
)
def test_row_overrides_are_bounded(http: httpx.Client, name: str, values: list, fragment: str) -> None:
    table = pa.table({"prompt": ["a"] * len(values), name: values})
    response = submit(http, parquet_bytes(table), {})
    assert response.status_code == 422, response.text
    error = assert_error_shape(response)
    assert fragment in error["message"] and error["column"] == name, error


@pytest.mark.parametrize("name", ["file", "params"])
def test_repeated_parts_are_refused(http: httpx.Client, service_env: ServiceEnv, name: str) -> None:
    leftovers = Leftovers(http, service_env)
    params = json.dumps({"model": PARKED_MODEL}).encode()
    parts = [part("file", GOOD, "in.parquet"), part("params", params)]
    parts.append(
        part("file", GOOD, "again.parquet") if name == "file" else part("params", b'{"max_tokens": 2}')
    )
    response = post_raw(http, multipart(*parts))
    assert response.status_code == 422, response.text
    error = assert_error_shape(response)
    assert f"2 `{name}` parts" in error["message"] and error["param"] == name, error
    leftovers.assert_none()


def test_error_bodies_do_not_echo_large_input(http: httpx.Client) -> None:
    upload = b"PAR1" + b"A" * 10_000
    response = post_raw(http, multipart(part("file", upload), part("params", b"{}")))  # no filename
    assert response.status_code == 422, response.text
    error = assert_error_shape(response)
    assert error["param"] == "file" and "file part" in error["message"]
    assert b"AAAAAAAAAA" not in response.content and len(response.content) < 1000

    long_id = "job_" + "a" * 10_000
    response = http.get(f"/v1/jobs/{long_id}")
    assert response.status_code == 404, response.text
    assert_error_shape(response)
    assert len(response.content) < 1000 and "more characters" in response.text

    response = http.get("/v1/jobs", params={"after": "x" * 10_000})
    assert response.status_code == 422 and len(response.content) < 1000, response.text

    response = submit(http, GOOD, {"metadata": {"k": "v" * 10_000}})
    assert response.status_code == 422 and len(response.content) < 1000, response.text


def test_a_content_length_that_lies_gets_a_413_at_once(api_url: str, key: str) -> None:
    connection = RawConnection(api_url, key, timeout=10)
    try:
        started = time.monotonic()
        connection.send(
            "POST",
            "/v1/jobs",
            f"--{BOUNDARY}\r\n".encode(),
            {
                "Content-Type": f"multipart/form-data; boundary={BOUNDARY}",
                "Content-Length": "1000000000000",
            },
        )
        status, headers, answer = connection.response()
        assert time.monotonic() - started < 5
    finally:
        connection.close()
    assert status == 413, answer
    assert headers["connection"] == "close"
    error = json.loads(answer)["error"]
    assert "limit of 2 MB" in error["message"] and error["code"] == "upload_too_large"


def test_every_4xx_has_one_shape(api_url: str, http: httpx.Client) -> None:
    answers = [
        (httpx.get(f"{api_url}/v1/jobs"), 401),  # no key (an HTTPException)
        (http.get("/v1/jobs", params={"limit": 0}), 422),  # a query parameter (RequestValidationError)
        (http.get("/v1/jobs", params={"status": "bogus"}), 422),
        (http.get("/v1/nothing-here"), 404),  # no such route
        (http.delete("/v1/jobs"), 405),
        (http.get(f"/v1/jobs/job_{'0' * 32}"), 404),
        (http.post("/v1/jobs", data={"params": "{}"}), 415),  # not multipart
        (post_raw(http, multipart(part("params", b"{}"))), 422),  # no file part
        (post_raw(http, multipart(part("file", GOOD, "x.parquet"), part("paramz", b"{}"))), 422),
        (submit(http, GOOD, {"max_tokens": 0}), 422),
    ]
    for response, status in answers:
        assert response.status_code == status, (response.request.url, response.text)
        error = assert_error_shape(response)
        assert "detail" not in response.text, response.text
        if status == 422:
            assert error["param"], error
    limit = assert_error_shape(answers[1][0])
    assert (
        limit["param"] == "limit" and "limit: Input should be greater than or equal to 1" in limit["message"]
    )


def test_the_python_client_reads_the_error_shape(api_url: str, key: str) -> None:
    with FreightClient(api_url, key) as client:
        with pytest.raises(FreightAPIError) as caught:
            client.submit(prompts(), model=PARKED_MODEL, max_tokens="8")
        assert caught.value.status_code == 422 and caught.value.param == "params"
        assert caught.value.code == "invalid_value" and "max_tokens" in str(caught.value)
        with pytest.raises(FreightAPIError) as caught:
            client.get_job("job_nope")
        assert caught.value.status_code == 404 and caught.value.type == "not_found_error"
        job = client.submit(prompts(), model=PARKED_MODEL, max_tokens=4, temperature=1, chat=True)
        assert job["params"]["max_tokens"] == 4 and job["params"]["chat"] is True
