"""Hostile inputs, third round (issue 28's remaining gaps), through the session's `freight api` process (the
one test_hostile_inputs.py uses) on Postgres and Redis, no worker; plus two in-process servers of the
same app on uvicorn (threads of this process, no new service process): one on the h11 fallback
protocol, one with a short grammar budget.

1. The h11 fallback's own protocol errors: JSON, and the connection closed cleanly; route 4xx/5xx keep it.
2. Invalid UTF-8 in one JSONL line (uploaded with /v1/files, then /v1/batches): that line's error, named,
   and its bytes in no job; in any Parquet string cell, nested ones included: a 422 naming row and column.
3. Every form field of the multipart routes, with hypothesis: always a fast 4xx that leaves nothing.
4. The grammar time budget end to end: a schema within every structural limit that the engine is slow
   to build is a 422 over the budget, as a job's schema, a row's schema and an OpenAI line's schema;
   waiting for the checker's process to start is not counted against a schema that compiles at once."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from jobs.api.multipart import MAX_FIELD_BYTES, MAX_PART_HEADER_BYTES
from jobs.api.server import FreightH11Protocol, http_protocol
from storage.models import Job, OpenAIBatch
from tests.service.fixtures import PARKED_MODEL, ServiceEnv, create_api_key
from tests.service.hostile_helpers import (
    BOUNDARY,
    MULTIPART,
    Leftovers,
    RawConnection,
    error_of,
    multipart,
    parquet_bytes,
    part,
    served,
)

TENANT = "hostile-3"
GOOD = parquet_bytes(pa.table({"prompt": ["Say 1", "Say 2"]}))
QUICK = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
INVALID_UTF8 = [b"\xff", b"\x80", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf5\x80\x80\x80", b"\xe2\x82"]


@pytest.fixture(scope="module")
def key(service_env: ServiceEnv) -> str:
    return create_api_key(service_env, TENANT)


@pytest.fixture
def http(api_url: str, key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        yield client


@pytest.fixture
def leftovers(service_env: ServiceEnv) -> Iterator[Leftovers]:
    view = Leftovers(service_env, TENANT)
    yield view
    view.close()


def submit(http: httpx.Client, params: dict, content: bytes = GOOD) -> httpx.Response:
    raw = json.dumps({"model": PARKED_MODEL, "max_tokens": 2, **params})
    return http.post("/v1/jobs", files={"file": ("in.parquet", content)}, data={"params": raw})


def chat_line(custom_id: str, content: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": PARKED_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}], **body},
    }


def refused(response: httpx.Response, *fragments: str) -> dict:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = error_of(response.content)
    for fragment in fragments:
        assert fragment in error["message"], error
    return error


def create_batch(http: httpx.Client, data: bytes) -> dict:
    """`data` uploaded as a batch input file (/v1/files), then a batch of it (/v1/batches)."""
    upload = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    assert upload.status_code == 200, upload.text
    body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    response = http.post("/v1/batches", json=body)
    assert response.status_code == 200, response.text
    return response.json()


# ---- 1. the h11 fallback's protocol errors ------------------------------------------------------


@pytest.fixture(scope="module")
def h11_api(service_env: ServiceEnv) -> Iterator[str]:
    """The app on FreightH11Protocol: what `freight api` runs where httptools is not installed (it is a
    dependency, so the session's API runs httptools: test_hostile_inputs_2.py covers that one)."""
    with served(service_env.settings, FreightH11Protocol) as url:
        yield url


H11_PROTOCOL_ERRORS = {
    "garbage request line": b"\x16\x03\x01 hello there\r\n\r\n",
    "non-ASCII request target": b"GET /v1/jobs/\xff HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad Content-Length": b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    "negative Content-Length": b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "repeated Content-Length": b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    "Content-Length with chunked": (
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "a bad chunk size": b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n",
}


def test_the_h11_fallback_answers_protocol_errors_in_json_and_closes_cleanly(h11_api: str) -> None:
    """Each malformed request is a 400 `malformed HTTP request` in the one shape with `Connection: close`,
    and the server then closes (EOF, not a reset). Content-Length with chunked was read as chunked and
    the connection kept before the fallback refused it (jobs/api/server.py)."""
    for name, raw in H11_PROTOCOL_ERRORS.items():
        connection = RawConnection(h11_api, timeout=5)
        try:
            connection.send_raw(raw)
            status, headers, body = connection.response()
            assert status == 400 and headers["content-type"] == "application/json", (name, status, body)
            assert "malformed HTTP request" in error_of(body)["message"], (name, body)
            assert headers["connection"] == "close" and connection.closed_by_server(), name
        finally:
            connection.close()


@pytest.mark.parametrize("where", ["url", "header"])
def test_the_h11_fallback_answers_a_100_kb_url_or_header_in_json(h11_api: str, key: str, where: str) -> None:
    """h11 parses a 100 KB request that arrives whole (its 16 KB limit is on a request still incomplete),
    so the app answers: a 4xx in the one shape, and the connection goes on, or is closed cleanly."""
    connection = RawConnection(h11_api, timeout=10)
    try:
        big = "a" * 100_000
        path, extra = (f"/v1/jobs/job_{big}", {}) if where == "url" else ("/v1/jobs/x", {"X-Big": big})
        connection.send("GET", path, headers={"Authorization": f"Bearer {key}", **extra})
        status, headers, body = connection.response()
        assert 400 <= status < 500 and headers["content-type"] == "application/json", (status, body)
        assert len(body) < 1000 and error_of(body)
        if headers.get("connection", "").lower() == "close":
            assert connection.closed_by_server()
        else:
            connection.send("GET", "/v1/jobs?limit=1", headers={"Authorization": f"Bearer {key}"})
            assert connection.response()[0] == 200
    finally:
        connection.close()


@pytest.mark.parametrize("server", ["h11", "httptools"])
def test_a_protocol_error_answered_mid_request_closes_cleanly(
    h11_api: str, api_url: str, key: str, server: str
) -> None:
    """A request whose framing is broken is answered at once (400) while its body is still arriving; the
    client's bytes still in flight must not turn the close into a reset that can destroy that answer: the
    server ends its side after the answer and drops the rest (lingering close)."""
    connection = RawConnection(h11_api if server == "h11" else api_url, timeout=10)
    try:
        # 2 MB: more than the server reads at once, so some is still unread when it answers
        connection.send_raw(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n" + b"a" * 2_000_000)
        status, headers, body = connection.response()
        assert status == 400 and headers["content-type"] == "application/json", (status, body)
        assert error_of(body)
        connection.send_raw(b"b" * 50_000 + b"\r\n\r\n")  # the rest arrives after the answer
        time.sleep(0.3)
        assert connection.closed_by_server()  # EOF, not a reset
    finally:
        connection.close()


def test_the_h11_fallback_keeps_the_connection_after_a_route_4xx_or_500(
    h11_api: str, key: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    connection = RawConnection(h11_api)
    try:
        body = multipart(part("file", GOOD, "in.parquet"), part("params", b'{"model": "\\ud800"}'))
        connection.send("POST", "/v1/jobs", body, {**auth, **MULTIPART})
        status, headers, answer = connection.response()
        assert status == 422 and headers.get("connection", "").lower() != "close", answer
        error_of(answer)
        with monkeypatch.context() as patch:
            patch.setattr("jobs.domain.service.JobService.list", _fail)
            connection.send("GET", "/v1/jobs?limit=1", headers=auth)
            status, headers, answer = connection.response()
        assert status == 500 and "internal error" in error_of(answer)["message"], answer
        assert headers.get("connection", "").lower() != "close"
        connection.send("GET", "/v1/jobs?limit=1", headers=auth)
        assert connection.response()[0] == 200
    finally:
        connection.close()
    # Answered before its body was read (no key: 401), then a chunk that cannot be parsed: the answer
    # stands and the connection is closed (uvicorn's h11 protocol tried to frame a second answer: h11
    # raised, and asyncio logged a fatal transport error and dropped the connection).
    connection = RawConnection(h11_api, timeout=5)
    try:
        connection.send_raw(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        status, _headers, answer = connection.response()
        assert status == 401 and error_of(answer)
        connection.send_raw(b"zz\r\n\r\n")
        assert connection.closed_by_server()
    finally:
        connection.close()
    fatal = [record.getMessage() for record in caplog.records if record.name == "asyncio"]
    assert not fatal, fatal


def _fail(*_args: object, **_kwargs: object) -> None:
    raise RuntimeError("injected failure")


# ---- 2. invalid UTF-8 in a JSONL line and in any Parquet string cell -------------------------------


def _line_with(where: str, raw: bytes) -> bytes:
    """A chat line of custom_id "bad" with the bytes `raw` inside its `where`."""
    line = json.dumps(chat_line("bad", "hello there")).encode()
    target = {"custom_id": b'"bad"', "content": b'"hello there"', "key": b'"model"', "role": b'"user"'}[where]
    return line.replace(target, target[:2] + raw + target[2:], 1)


@settings(QUICK, max_examples=6)
@given(where=st.sampled_from(["custom_id", "content", "key", "role"]), raw=st.sampled_from(INVALID_UTF8))
def test_invalid_utf8_in_one_jsonl_line_is_that_lines_error_and_is_stored_nowhere(
    http: httpx.Client, leftovers: Leftovers, service_env: ServiceEnv, where: str, raw: bytes
) -> None:
    """docs/input-rules.md: on the OpenAI routes a bad line is that line's error, naming the line, and the
    other lines go on. The line's bytes reach neither the job's input nor any listing."""
    lines = [json.dumps(chat_line("a", "one")).encode(), _line_with(where, raw), json.dumps(chat_line("c", "3")).encode()]
    batch = create_batch(http, b"\n".join(lines) + b"\n")
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 1}, batch
    with leftovers.sessions() as session:
        stored = session.scalars(select(OpenAIBatch).where(OpenAIBatch.id == batch["id"])).one()
        [error] = stored.line_errors  # what the batch's error file is written from
        input_name = session.scalars(select(Job.input_name).where(Job.id == stored.job_id)).one()
    assert error["line"] == 2 and error["message"].startswith("line 2:") and "UTF-8" in error["message"], error
    table = pq.read_table(service_env.settings.resolved_data_dir / input_name)
    assert table["custom_id"].to_pylist() == ["a", "c"]
    for path in ("/v1/batches", "/v1/files", f"/v1/batches/{batch['id']}"):
        assert http.get(path, params={"limit": 5}).status_code == 200


def test_a_jsonl_file_whose_only_line_is_not_utf8_runs_nothing(http: httpx.Client, leftovers: Leftovers) -> None:
    batch = create_batch(http, _line_with("content", b"\xff") + b"\n")
    assert batch["status"] == "failed" and batch["request_counts"]["failed"] == 1, batch
    assert "line 1:" in batch["errors"]["data"][0]["message"]
    after = leftovers.snapshot()
    for table in ("jobs", "shards", "events"):  # the batch and its file are the tenant's record of it
        assert after.rows[table] == leftovers.before.rows[table], (table, after.rows)
    assert after.messages == leftovers.before.messages


def _strings(values: list[bytes], *, large: bool = False) -> pa.Array:
    """A string array holding `values` as they are: pyarrow and Parquet do not check UTF-8."""
    binary = pa.array(values, pa.large_binary() if large else pa.binary())
    return pa.Array.from_buffers(pa.large_string() if large else pa.string(), len(values), binary.buffers())


def _cell_table(column: str, row: int, raw: bytes) -> tuple[pa.Table, dict]:
    """A 3-row table (and its job params) whose `column` holds `raw` in row `row`."""

    def texts(good: list[str], *, large: bool = False) -> pa.Array:
        values = [value.encode() for value in good]
        values[row] = values[row][:1] + raw + values[row][1:]
        return _strings(values, large=large)

    prompts = pa.array(["a", "b", "c"])
    if column in ("messages.role", "messages.content"):
        role = texts(["user"] * 3) if column == "messages.role" else pa.array(["user"] * 3)
        content = texts(["hi", "ho", "hu"]) if column == "messages.content" else pa.array(["hi", "ho", "hu"])
        messages = pa.ListArray.from_arrays(
            pa.array([0, 1, 2, 3], pa.int32()), pa.StructArray.from_arrays([role, content], ["role", "content"])
        )
        return pa.table({"messages": messages}), {}
    if column == "choice":
        flat = texts(["yes", "no", "maybe"])
        return pa.table({"prompt": prompts, "choice": pa.ListArray.from_arrays(pa.array([0, 1, 2, 3], pa.int32()), flat)}), {}
    if column == "prompt (large_string)":
        return pa.table({"prompt": texts(["a", "b", "c"], large=True)}), {}
    if column == "prompt (dictionary)":
        dictionary = pa.DictionaryArray.from_arrays(pa.array([0, 1, 2], pa.int32()), texts(["ab", "cd", "ef"]))
        return pa.table({"prompt": dictionary}), {}
    if column == "json_schema":
        return pa.table({"prompt": prompts, "json_schema": texts(['{"type": "string"}'] * 3)}), {}
    if column == "regex":
        return pa.table({"prompt": prompts, "regex": texts(["[a-z]+"] * 3)}), {}
    good = {"custom_id": ["x", "y", "z"], "topic": ["t1", "t2", "t3"]}[column]
    params = {"template": "Say {topic}"} if column == "topic" else {}
    return pa.table({"prompt": prompts, column: texts(good)}), params


CELL_COLUMNS = [
    "messages.role", "messages.content", "choice", "prompt (large_string)", "prompt (dictionary)",
    "json_schema", "regex", "custom_id", "topic",
]  # fmt: skip


@settings(QUICK, max_examples=5)
@given(row=st.integers(0, 2), raw=st.sampled_from(INVALID_UTF8))
def test_invalid_utf8_in_any_parquet_string_cell_is_a_422_naming_row_and_column(
    http: httpx.Client, leftovers: Leftovers, row: int, raw: bytes
) -> None:
    for column in CELL_COLUMNS:  # every string column a job reads, nested and encoded ones included
        table, params = _cell_table(column, row, raw)
        error = refused(submit(http, params, parquet_bytes(table)), f"row {row}", "UTF-8")
        assert error["row"] == row and error["column"] == column.split(".")[0].split(" ")[0], (column, error)
    leftovers.assert_none()


# ---- 3. every form field of the multipart routes ------------------------------------------------

_surrogate = st.integers(0xD800, 0xDFFF).map(lambda point: chr(point).encode("utf-8", "surrogatepass"))
BAD_PIECE = st.one_of(_surrogate, st.just(b"\x00"), st.sampled_from(INVALID_UTF8))
# Filler of header values (part and file names): any text but what ends a quoted header value.
HEADER_TEXT = st.text(
    st.characters(blacklist_categories=["Cs"], blacklist_characters='\x00"\\\r\n'), max_size=24
).map(str.encode)
FIELD_FILLER = st.one_of(st.binary(max_size=64), st.text(max_size=24).map(lambda text: text.encode("utf-8", "surrogatepass")))

# (route, place) -> (is it a header value, the size of a value too large for it)
PLACES = {
    ("/v1/jobs", "params"): (False, MAX_FIELD_BYTES + 1),
    ("/v1/jobs", "file content"): (False, 2 * 1024 * 1024 + 1),  # over the service's FREIGHT_MAX_UPLOAD_MB
    ("/v1/jobs", "file name"): (True, MAX_PART_HEADER_BYTES + 1),
    ("/v1/jobs", "part name"): (True, MAX_PART_HEADER_BYTES + 1),
    ("/v1/files", "purpose"): (False, MAX_FIELD_BYTES + 1),
    ("/v1/files", "file name"): (True, MAX_PART_HEADER_BYTES + 1),
    ("/v1/files", "part name"): (True, MAX_PART_HEADER_BYTES + 1),
}


@st.composite
def hostile_values(draw: st.DrawFn) -> tuple[bytes, bytes, bool]:
    """(a header value, a field value, huge): filler with one bad piece (a lone surrogate, a NUL or bytes
    that are not UTF-8) at a random place; `huge`: send each place a value over its size limit instead."""
    piece = draw(BAD_PIECE)
    spliced = []
    for filler in (draw(HEADER_TEXT), draw(FIELD_FILLER)):
        at = draw(st.integers(0, len(filler)))
        spliced.append(filler[:at] + piece + filler[at:])
    return spliced[0], spliced[1], draw(st.integers(0, 5)) == 0


def _form(route: str, place: str, value: bytes) -> bytes:
    jsonl = json.dumps(chat_line("a", "hi")).encode() + b"\n"
    if route == "/v1/jobs":
        file_name, content = ("in.parquet", GOOD)
        parts = {"params": part("params", json.dumps({"model": PARKED_MODEL}).encode())}
    else:
        file_name, content = ("in.jsonl", jsonl)
        parts = {"purpose": part("purpose", b"batch")}
    if place in ("params", "purpose"):
        parts[place] = part(place, value)
    file_part = (
        b"--" + BOUNDARY.encode() + b'\r\nContent-Disposition: form-data; name="file"; filename="'
        + (value if place == "file name" else file_name.encode()) + b'"\r\n\r\n'
        + (value if place == "file content" else content) + b"\r\n"
    )  # fmt: skip
    extra = [part("", b"1", raw_name=value)] if place == "part name" else []
    return multipart(file_part, *parts.values(), *extra)


@settings(QUICK, max_examples=8)
@given(values=hostile_values())
def test_any_hostile_value_in_any_form_field_is_a_fast_4xx_that_leaves_nothing(
    http: httpx.Client, leftovers: Leftovers, values: tuple[bytes, bytes, bool]
) -> None:
    header_value, field_value, huge = values
    for (route, place), (is_header, too_big) in PLACES.items():
        value = b"x" * too_big if huge else header_value if is_header else field_value
        started = time.monotonic()
        response = http.post(route, content=_form(route, place, value), headers=MULTIPART)
        took = time.monotonic() - started
        event(f"{route} {place}: {response.status_code}")  # --hypothesis-show-statistics shows the spread
        assert 400 <= response.status_code < 500, (route, place, value[:80], response.status_code, response.text)
        error_of(response.content)
        assert took < 2.0, (route, place, took)
        leftovers.assert_none()


# ---- 4. the grammar time budget, end to end ------------------------------------------------------

BUDGET_S = 1.0
# Within every structural limit (3,900 characters, one pattern, counts of 1,000), and cheap as a bare
# regex, but xgrammar expands each {0,1000} of a schema pattern into the JSON string grammar: about
# 0.06 s each on a 2-core runner, some 20 s in all.
SLOW_PATTERN = "[a-z]{0,1000}" * 300
SLOW_SCHEMA = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": SLOW_PATTERN}},
    "required": ["code"],
}
OVER_BUDGET = "could not be checked within the time budget"


@pytest.fixture(scope="module")
def budget_api(service_env: ServiceEnv) -> Iterator[str]:
    """The app with FREIGHT_GRAMMAR_BUDGET_SECONDS=1 (10 by default: a test would wait that long)."""
    with served(service_env.settings.model_copy(update={"grammar_budget_seconds": BUDGET_S}), http_protocol()) as url:
        yield url


def test_a_schema_slow_to_compile_is_a_422_over_the_budget_wherever_it_is_sent(
    budget_api: str, key: str, leftovers: Leftovers
) -> None:
    with httpx.Client(base_url=budget_api, headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        # The first constrained submission waits for the checker's process to start (seconds): that wait
        # is not the constraints' time. A schema with a pattern (two questions) was refused over budget.
        fine = {"type": "object", "properties": {"code": {"type": "string", "pattern": "[a-z]{2,8}"}}}
        accepted = submit(http, {"json_schema": fine})
        assert accepted.status_code == 201, accepted.text
        leftovers = Leftovers(leftovers.service, TENANT)  # from here on nothing may be stored
        error = refused(submit(http, {"json_schema": SLOW_SCHEMA}), "json_schema", OVER_BUDGET, f"({BUDGET_S:g} s,")
        assert error["param"] == "json_schema" and error["code"] == "invalid_value", error
        # The same schema again, as JSON text and in a row's json_schema column: the same refusal, at once
        # (the engine is not asked again).
        compact = json.dumps(SLOW_SCHEMA, separators=(",", ":"))
        for params, content in (
            ({"json_schema": compact}, GOOD),
            ({}, parquet_bytes(pa.table({"prompt": ["a"], "json_schema": [compact]}))),
        ):
            started = time.monotonic()
            refused(submit(http, params, content), "json_schema", OVER_BUDGET, f"({BUDGET_S:g} s,")
            assert time.monotonic() - started < 2
        # As an OpenAI line's response_format: that line's error, with the same reason.
        format_ = {"type": "json_schema", "json_schema": {"name": "slow", "schema": SLOW_SCHEMA}}
        lines = [chat_line("slow", "hi", response_format=format_)]
        batch = create_batch(http, b"".join(json.dumps(line).encode() + b"\n" for line in lines))
        assert batch["status"] == "failed", batch
        [line_error] = batch["errors"]["data"]
        assert line_error["line"] == 1 and OVER_BUDGET in line_error["message"], line_error
        after = leftovers.snapshot()
        assert (after.rows["jobs"], after.messages) == (leftovers.before.rows["jobs"], leftovers.before.messages)
        leftovers.close()
    # The pattern as a bare regex: the engine builds it without that expansion, at once, so it is
    # accepted (docs/input-rules.md: the budget measures the engine's work on the constraint as sent).
    with httpx.Client(base_url=budget_api, headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        started = time.monotonic()
        assert submit(http, {"regex": SLOW_PATTERN}).status_code == 201
        assert time.monotonic() - started < 2
