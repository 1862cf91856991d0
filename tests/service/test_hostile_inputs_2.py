"""Hostile inputs, second round (issue 28), through a real `freight api` process over loopback on Postgres
and Redis, no worker: every class of input the probe found (text that is not valid Unicode, unbounded
structures, NUL in query parameters, unbounded constraints, loose multipart and JSON bodies, protocol
errors, slow bodies) is a fast 4xx in the one error shape that leaves no row, file or queue message,
generated with hypothesis over every route that takes the value; plus one regression test per named
defect. Reads of stored hostile values and atomic submission: test_atomic_submission.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from jobs.api.app import create_app
from jobs.api.server import http_protocol
from jobs.domain.json_limits import JsonLimits
from storage.models import Job, OpenAIBatch
from tests.service.fixtures import (
    PARKED_MODEL,
    Process,
    ServiceEnv,
    create_api_key,
    free_port,
    make_service_env,
    start_api,
)
from tests.service.hostile_helpers import (
    BOUNDARY,
    MULTIPART,
    Leftovers,
    RawConnection,
    error_of,
    multipart,
    parquet_bytes,
    part,
)

TENANT = "hostile-2"
BODY_IDLE_S = 1.5
GOOD = parquet_bytes(pa.table({"prompt": ["Say 1", "Say 2", "Say 3"]}))
NETWORK = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
surrogate = st.integers(0xD800, 0xDFFF).map(chr)
plain = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=8)


@st.composite
def bad_text(draw: st.DrawFn, nul: bool = True) -> str:
    """A string that breaks the text rule: a lone surrogate (or NUL) somewhere in plain text."""
    bad = draw(st.one_of(surrogate, st.just("\x00"))) if nul else draw(surrogate)
    return draw(plain) + bad + draw(plain)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, pg_url: str, redis_url: str, queue_prefix: str) -> ServiceEnv:
    """The session's database and Redis; its own API settings: a short body timeout."""
    return make_service_env(
        tmp_path_factory.mktemp("hostile2"),
        pg_url,
        redis_url,
        queue_prefix,
        PARKED_MODEL,
        FREIGHT_BODY_IDLE_TIMEOUT_SECONDS=str(BODY_IDLE_S),
    )


@pytest.fixture(scope="module")
def api(env: ServiceEnv, log_dir: Path) -> Iterator[tuple[Process, str]]:
    process, url = start_api(env, log_dir)
    yield process, url
    process.stop()


@pytest.fixture(scope="module")
def api_url(api: tuple[Process, str]) -> str:
    return api[1]


@pytest.fixture(scope="module")
def key(env: ServiceEnv) -> str:
    return create_api_key(env, TENANT)


@pytest.fixture
def http(api_url: str, key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        yield client


@pytest.fixture
def leftovers(env: ServiceEnv) -> Iterator[Leftovers]:
    view = Leftovers(env, TENANT)
    yield view
    view.close()


@pytest.fixture(scope="module")
def batch_file(api_url: str, key: str) -> str:
    """One good batch input file of the tenant, for the batch-body tests."""
    line = chat_line("ok", "hello")
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {key}"}) as client:
        response = client.post("/v1/files", files={"file": ("in.jsonl", json.dumps(line) + "\n")}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def submit(http: httpx.Client, params: dict | str, content: bytes = GOOD) -> httpx.Response:
    raw = params if isinstance(params, str) else json.dumps({"model": PARKED_MODEL, **params})
    return http.post("/v1/jobs", files={"file": ("in.parquet", content)}, data={"params": raw})


def chat_line(custom_id: str, content: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": PARKED_MODEL, "messages": [{"role": "user", "content": content}], **body},
    }


def refused(response: httpx.Response, *fragments: str, param: str | None = None) -> dict:
    """A 4xx in the one shape whose message holds each fragment (and names `param` when given)."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = error_of(response.content)
    for fragment in fragments:
        assert fragment in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


def listings_work(http: httpx.Client) -> None:
    """The tenant's listings (and each listed object's GET) still answer."""
    for path in ("/v1/jobs", "/v1/batches", "/v1/files"):
        response = http.get(path, params={"limit": 100})
        assert response.status_code == 200, (path, response.text)
    for job in http.get("/v1/jobs", params={"limit": 3}).json()["data"]:
        assert http.get(f"/v1/jobs/{job['id']}").status_code == 200
    for batch in http.get("/v1/batches", params={"limit": 3}).json()["data"]:
        assert http.get(f"/v1/batches/{batch['id']}").status_code == 200


def batch_with_lines(http: httpx.Client, lines: list[bytes]) -> dict:
    """Upload `lines` as a batch file and create a batch of it: the batch object."""
    upload = http.post("/v1/files", files={"file": ("in.jsonl", b"\n".join(lines) + b"\n")}, data={"purpose": "batch"})
    assert upload.status_code == 200, upload.text
    body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    response = http.post("/v1/batches", json=body)
    assert response.status_code == 200, response.text
    return response.json()


# ---- 1. text that is not valid Unicode, everywhere a tenant puts a string ---------------------

PARAM_PLACES = {
    "metadata key": lambda bad: {"metadata": {bad: "v"}},
    "metadata value": lambda bad: {"metadata": {"k": bad}},
    "template": lambda bad: {"template": f"Say {{prompt}} {bad}"},
    "stop": lambda bad: {"stop": ["ok", bad]},
    "model": lambda bad: {"model": bad},
    "regex": lambda bad: {"regex": f"[a-z]{bad}"},
    "json_schema": lambda bad: {"json_schema": json.dumps({"type": "string", "description": bad})},
    "prompt_column": lambda bad: {"prompt_column": bad},
}


@NETWORK
@given(place=st.sampled_from(sorted(PARAM_PLACES)), bad=bad_text())
def test_bad_text_anywhere_in_params_is_a_422_naming_it(
    http: httpx.Client, leftovers: Leftovers, place: str, bad: str
) -> None:
    params = {"model": PARKED_MODEL, **PARAM_PLACES[place](bad)}
    response = submit(http, json.dumps(params))  # ensure_ascii: a surrogate travels as a \\ud800 escape
    error = refused(response, param="params")
    assert "lone surrogate" in error["message"] or "NUL" in error["message"]
    leftovers.assert_none()
    listings_work(http)


BATCH_PLACES = {
    "metadata key": lambda bad, file_id: {"metadata": {bad: "v"}},
    "metadata value": lambda bad, file_id: {"metadata": {"k": bad}},
    "input_file_id": lambda bad, file_id: {"input_file_id": file_id + bad},
    "endpoint": lambda bad, file_id: {"endpoint": "/v1/chat/completions" + bad},
    "completion_window": lambda bad, file_id: {"completion_window": bad},
}


@NETWORK
@given(place=st.sampled_from(sorted(BATCH_PLACES)), bad=bad_text())
def test_bad_text_anywhere_in_a_batch_body_is_a_422_before_anything_is_stored(
    http: httpx.Client, leftovers: Leftovers, batch_file: str, place: str, bad: str
) -> None:
    body = {"input_file_id": batch_file, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    body.update(BATCH_PLACES[place](bad, batch_file))
    response = http.post("/v1/batches", content=json.dumps(body), headers={"Content-Type": "application/json"})
    error = refused(response)
    assert "lone surrogate" in error["message"] or "NUL" in error["message"], error
    leftovers.assert_none()
    listings_work(http)


LINE_PLACES = {
    "custom_id": lambda bad: chat_line("id" + bad, "hello"),
    "message content": lambda bad: chat_line("x", "hello" + bad),
    "model": lambda bad: chat_line("x", "hello") | {"body": {**chat_line("x", "hi")["body"], "model": bad}},
    "stop": lambda bad: chat_line("x", "hello", stop=[bad]),
}


@settings(NETWORK, max_examples=8)
@given(place=st.sampled_from(sorted(LINE_PLACES)), bad=bad_text(nul=False))
def test_a_lone_surrogate_anywhere_in_a_jsonl_line_is_that_lines_error(
    http: httpx.Client, place: str, bad: str
) -> None:
    lines = [json.dumps(chat_line("good", "fine")).encode(), json.dumps(LINE_PLACES[place](bad)).encode()]
    batch = batch_with_lines(http, lines)
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 1}, batch
    listings_work(http)
    assert http.get(f"/v1/batches/{batch['id']}").status_code == 200


@NETWORK
@given(column=st.sampled_from(["custom_id", "prompt", "text"]), raw=st.sampled_from([b"\xff", b"\xed\xa0\x80", b"a\xc3"]))
def test_invalid_utf8_in_any_parquet_string_column_is_a_422_naming_row_and_column(
    http: httpx.Client, leftovers: Leftovers, column: str, raw: bytes
) -> None:
    binary = pa.array([b"fine", b"bad " + raw], pa.binary())
    invalid = pa.Array.from_buffers(pa.string(), 2, binary.buffers())
    columns = {"prompt": pa.array(["a", "b"]), "custom_id": pa.array(["x", "y"]), "text": pa.array(["c", "d"])}
    columns[column] = invalid
    params = {"template": "Say {text}"} if column == "text" else {}
    response = submit(http, params, parquet_bytes(pa.table(columns)))
    error = refused(response, "row 1", "UTF-8")
    assert error["row"] == 1 and error["column"] == column
    leftovers.assert_none()


@NETWORK
@given(
    path=st.sampled_from(["/v1/jobs", "/v1/files", "/v1/batches"]),
    name=st.sampled_from(["purpose", "after", "status", "anything"]),
    bad=st.sampled_from(["\x00", "a\x00b", "%00"]),
)
def test_a_nul_in_any_query_parameter_is_a_422_naming_it(http: httpx.Client, path: str, name: str, bad: str) -> None:
    url = f"{path}?{name}={bad}" if bad == "%00" else httpx.URL(path, params={name: bad})
    response = http.get(url)
    refused(response, f"query parameter '{name}'", "NUL", param=name)


def test_multipart_fields_and_names_follow_the_text_rule(http: httpx.Client, leftovers: Leftovers) -> None:
    bad_params = multipart(part("file", GOOD, "in.parquet"), part("params", b'{"model": "\xff"}'))
    refused(http.post("/v1/jobs", content=bad_params, headers=MULTIPART), "not valid UTF-8")
    bad_purpose = multipart(part("file", b"{}\n", "in.jsonl"), part("purpose", b"batch\x00"))
    refused(http.post("/v1/files", content=bad_purpose, headers=MULTIPART), "`purpose`", "NUL", param="purpose")
    nul_name = multipart(part("file", b"{}\n", "in\x00.jsonl"), part("purpose", b"batch"))
    refused(http.post("/v1/files", content=nul_name, headers=MULTIPART), "NUL")
    leftovers.assert_none()


def test_the_prompt_rule_nul_kept_surrogate_refused(http: httpx.Client, leftovers: Leftovers) -> None:
    """Prompt text may hold NUL (it never reaches the database); text that is not Unicode is refused,
    never repaired: docs/input-rules.md."""
    accepted = submit(http, {"max_tokens": 2}, parquet_bytes(pa.table({"prompt": ["a\x00b"]})))
    assert accepted.status_code == 201, accepted.text
    line = json.dumps(chat_line("s", "\ud800")).encode()  # a JSON escape of a lone surrogate
    batch = batch_with_lines(http, [line])
    assert batch["status"] == "failed" and "lone surrogate" in batch["errors"]["data"][0]["message"], batch


# ---- 2. unbounded structures ---------------------------------------------------------------------


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@NETWORK
@given(
    where=st.sampled_from(["params", "params value", "batch body", "schema string"]),
    shape=st.sampled_from(["deep", "digits", "duplicate"]),
    size=st.integers(JsonLimits().max_number_chars + 1, 12_000),  # over the limit: a number at it is allowed
)
def test_any_json_over_a_limit_is_a_4xx_naming_it(
    http: httpx.Client, leftovers: Leftovers, batch_file: str, where: str, shape: str, size: int
) -> None:
    inner = {"deep": deep(size), "digits": "9" * size, "duplicate": None}[shape]
    if where == "schema string":
        if shape == "digits":
            schema = '{"type": "string", "maxLength": ' + "9" * size + "}"
        elif shape == "deep":
            schema = '{"items":' * size + "{}" + "}" * size
        else:
            schema = '{"type": "string", "type": "integer"}'
        response = submit(http, {"json_schema": schema})
    elif where.startswith("params"):
        value = inner if shape != "duplicate" else None
        raw = (
            '{"model": "parked-model", "metadata": {"k": "v", "k": "w"}}'
            if shape == "duplicate"
            else '{"model": "parked-model", "extra": ' + value + "}"
            if where == "params value"
            else '{"model": "parked-model", "seed": ' + value + "}"
            if shape == "digits"
            else value
        )
        response = submit(http, raw)
    else:
        body = (
            f'{{"input_file_id": "{batch_file}", "endpoint": "/v1/chat/completions", "completion_window": "24h", '
            + ('"completion_window": "24h"}' if shape == "duplicate" else f'"metadata": {{"k": {inner}}}}}')
        )
        response = http.post("/v1/batches", content=body, headers={"Content-Type": "application/json"})
    error = refused(response)
    limit = {"deep": "max_depth|deep", "digits": "max_number_chars", "duplicate": "repeats the key"}[shape]
    if where == "schema string":
        limit += "|longer than"  # a deep schema past the schema's size limit is refused for its size
    assert any(word in error["message"] for word in limit.split("|")), error
    leftovers.assert_none()


@settings(NETWORK, max_examples=8)
@given(shape=st.sampled_from(["deep", "digits", "duplicate"]), size=st.integers(40, 12_000))
def test_a_jsonl_line_over_a_limit_is_that_lines_error(http: httpx.Client, shape: str, size: int) -> None:
    good = json.dumps(chat_line("good", "fine")).encode()
    line = {
        "deep": b'{"custom_id": "x", "method": "POST", "body": ' + deep(size).encode() + b"}",
        "digits": json.dumps(chat_line("x", "hi"))[:-2].encode() + b', "seed": ' + b"9" * size + b"}}",
        "duplicate": b'{"custom_id": "x", "custom_id": "y", "method": "POST"}',
    }[shape]
    batch = batch_with_lines(http, [good, line])
    assert batch["request_counts"]["failed"] == 1, batch
    listings_work(http)


# ---- regression tests, one per named defect ---------------------------------------------------


def test_defect_1_surrogate_metadata_is_refused_before_the_job_is_stored(
    http: httpx.Client, leftovers: Leftovers, batch_file: str
) -> None:
    refused(submit(http, '{"model": "parked-model", "metadata": {"k": "\\ud800"}}'), "metadata.k", "lone surrogate")
    body = '{"input_file_id": "%s", "endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {"k": "\\udfff"}}'
    response = http.post("/v1/batches", content=body % batch_file, headers={"Content-Type": "application/json"})
    refused(response, "metadata.k", "lone surrogate")
    refused(submit(http, '{"model": "parked-model", "template": "{prompt}\\ud800"}'), "template", "lone surrogate")
    refused(submit(http, '{"model": "parked-model", "stop": ["\\ud800"]}'), "stop[0]", "lone surrogate")
    leftovers.assert_none()
    listings_work(http)


def test_defect_1_parquet_custom_id_invalid_utf8_is_a_422(http: httpx.Client, leftovers: Leftovers) -> None:
    binary = pa.array([b"ok", b"\xed\xa0\x80"], pa.binary())  # a surrogate in UTF-8 form: not UTF-8
    table = pa.table({"prompt": ["a", "b"], "custom_id": pa.Array.from_buffers(pa.string(), 2, binary.buffers())})
    refused(submit(http, {}, parquet_bytes(table)), "row 1: custom_id is not valid UTF-8")
    leftovers.assert_none()


def test_defect_2_huge_integers_and_deep_nesting(http: httpx.Client, leftovers: Leftovers) -> None:
    refused(submit(http, '{"model": "parked-model", "max_tokens": ' + "1" * 5000 + "}"), "max_number_chars")
    refused(submit(http, deep(10_000)), "10000 deep", "max_depth")
    schema = '{"items":' * 5000 + "{}" + "}" * 5000  # 5,000 deep, under the schema's size limit
    refused(submit(http, {"json_schema": schema}), "json_schema", "5001 deep")
    leftovers.assert_none()
    batch = batch_with_lines(
        http,
        [json.dumps(chat_line("a", "hi"))[:-2].encode() + b', "seed": ' + b"1" * 5000 + b"}}", deep(10_000).encode()],
    )
    assert batch["status"] == "failed" and len(batch["errors"]["data"]) == 2, batch


def test_defect_3_nul_in_a_query_parameter(http: httpx.Client) -> None:
    refused(http.get("/v1/files?purpose=%00"), "query parameter 'purpose'", "NUL", param="purpose")


def test_defect_4_deep_schema_and_lookahead_pattern_are_refused_fast(http: httpx.Client, leftovers: Leftovers) -> None:
    schema: dict = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    started = time.monotonic()
    refused(submit(http, {"json_schema": json.dumps(schema)}), "json_schema", "deep")  # as JSON text
    refused(submit(http, {"json_schema": schema}), "deep", "max_depth")  # as an object: deeper than params may be
    assert time.monotonic() - started < 2
    lookahead = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)[a-z]+"}}}
    as_pattern = refused(submit(http, {"json_schema": lookahead}), "lookahead")
    as_regex = refused(submit(http, {"regex": "(?=x)[a-z]+"}), "lookahead")
    assert (as_pattern["code"], as_pattern["param"]) == (as_regex["code"], as_regex["param"])
    leftovers.assert_none()
    line = chat_line(
        "p", "hi", response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": lookahead}}
    )
    batch = batch_with_lines(http, [json.dumps(line).encode()])
    assert batch["status"] == "failed" and "lookahead" in batch["errors"]["data"][0]["message"], batch


# ---- weak answers ------------------------------------------------------------------------------


@pytest.mark.parametrize(("seed", "kind"), [(-5, pa.int64()), (2**64 - 1, pa.uint64())], ids=["-5", "2^64-1"])
def test_seed_out_of_range_is_refused_as_param_column_and_line(
    http: httpx.Client, leftovers: Leftovers, seed: int, kind: pa.DataType
) -> None:
    refused(submit(http, {"seed": seed}), "seed")
    table = pa.table({"prompt": ["a"], "seed": pa.array([seed], kind)})
    error = refused(submit(http, {}, parquet_bytes(table)), "row 0: seed")
    assert error["column"] == "seed"
    leftovers.assert_none()
    batch = batch_with_lines(http, [json.dumps(chat_line("s", "hi", seed=seed)).encode()])
    assert batch["status"] == "failed" and "seed" in batch["errors"]["data"][0]["message"]


def test_duplicate_keys_are_refused_in_params_and_batch_bodies(
    http: httpx.Client, leftovers: Leftovers, batch_file: str
) -> None:
    refused(submit(http, '{"model": "parked-model", "max_tokens": 4, "max_tokens": 8}'), '"max_tokens"', "repeats")
    body = f'{{"input_file_id": "{batch_file}", "input_file_id": "{batch_file}", "endpoint": "/v1/chat/completions", "completion_window": "24h"}}'
    refused(http.post("/v1/batches", content=body, headers={"Content-Type": "application/json"}), "repeats")
    leftovers.assert_none()


def test_dictionary_encoded_string_columns_are_accepted(http: httpx.Client) -> None:
    table = pa.table({
        "prompt": pa.array(["a", "b", "a"]).dictionary_encode(),
        "custom_id": pa.array(["x", "y", "z"]).dictionary_encode(),
    })  # fmt: skip
    response = submit(http, {"max_tokens": 2}, parquet_bytes(table))
    assert response.status_code == 201, response.text


def test_files_multipart_is_as_strict_as_jobs(http: httpx.Client, leftovers: Leftovers) -> None:
    jsonl = json.dumps(chat_line("a", "hi")).encode() + b"\n"
    cut = multipart(part("file", jsonl, "in.jsonl"), part("purpose", b"batch"), close=False)
    refused(http.post("/v1/files", content=cut, headers=MULTIPART), "closing boundary")
    twice = multipart(part("file", jsonl, "a.jsonl"), part("file", jsonl, "b.jsonl"), part("purpose", b"batch"))
    refused(http.post("/v1/files", content=twice, headers=MULTIPART), "2 `file` parts", param="file")
    long_name = multipart(part("x", b"1", raw_name=b"n" * 100_000), part("purpose", b"batch"))
    refused(http.post("/v1/files", content=long_name, headers=MULTIPART), "header is longer than")
    refused(http.post("/v1/files", content=multipart(part("purpose", b"batch")), headers=MULTIPART), "`file` part is missing")
    leftovers.assert_none()
    with_preamble = multipart(
        part("file", jsonl, "in.jsonl"), part("purpose", b"batch"), preamble=b"This is a preamble (RFC 2046).\r\n"
    )
    accepted = http.post("/v1/files", content=with_preamble, headers=MULTIPART)
    assert accepted.status_code == 200, accepted.text
    jobs_preamble = multipart(part("file", GOOD, "in.parquet"), preamble=b"preamble\r\n")
    assert http.post("/v1/jobs", content=jobs_preamble, headers=MULTIPART).status_code == 201


def test_batch_body_messages_are_clear(http: httpx.Client, batch_file: str) -> None:
    refused(http.post("/v1/batches", content=b"{not json", headers={"Content-Type": "application/json"}), "not valid JSON")
    body = json.dumps({"input_file_id": batch_file, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    no_type = http.post("/v1/batches", content=body, headers={"Content-Type": ""})
    assert no_type.status_code == 415
    refused(no_type, "Content-Type: application/json", "no Content-Type")
    refused(http.post("/v1/batches", content=b"[]", headers={"Content-Type": "application/json"}), "JSON object")
    refused(http.post("/v1/batches", json={"input_file_id": batch_file}), "endpoint", "Field required")


# ---- 6. the HTTP edge ----------------------------------------------------------------------------

PROTOCOL_ERRORS = {
    "garbage request line": b"\x16\x03\x01 hello there\r\n\r\n",
    "bad Content-Length": b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    "repeated Content-Length": b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    "Content-Length with chunked": (
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "negative Content-Length": b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
}


@pytest.mark.parametrize("name", sorted(PROTOCOL_ERRORS))
def test_protocol_errors_are_json_in_the_one_shape(api_url: str, name: str) -> None:
    connection = RawConnection(api_url, timeout=5)
    try:
        connection.send_raw(PROTOCOL_ERRORS[name])
        status, headers, body = connection.response()
        assert status == 400 and headers["content-type"] == "application/json", (status, headers, body)
        assert "malformed HTTP request" in error_of(body)["message"]
        assert headers["connection"] == "close" and connection.closed_by_server()
    finally:
        connection.close()


@pytest.mark.parametrize("where", ["url", "header"])
def test_a_100_kb_url_or_header_gets_a_json_answer(api_url: str, key: str, where: str) -> None:
    connection = RawConnection(api_url, timeout=10)
    try:
        big = "a" * 100_000
        path, extra = (f"/v1/jobs/job_{big}", {}) if where == "url" else ("/v1/jobs/x", {"X-Big": big})
        connection.send("GET", path, headers={"Authorization": f"Bearer {key}", **extra})
        status, headers, body = connection.response()
        assert 400 <= status < 500 and headers["content-type"] == "application/json", (status, body)
        assert len(body) < 1000 and error_of(body)
    finally:
        connection.close()


def test_a_body_that_stops_arriving_gets_a_408_and_a_clean_close(api_url: str, key: str, leftovers: Leftovers) -> None:
    for path, content_type in (("/v1/jobs", MULTIPART["Content-Type"]), ("/v1/batches", "application/json"), ("/v1/files", MULTIPART["Content-Type"])):
        connection = RawConnection(api_url, timeout=10)
        try:
            started = time.monotonic()
            head = (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: 2000000\r\n\r\n"
            )
            start = (
                b'{"input_file_id": "' if path == "/v1/batches"
                else b"--" + BOUNDARY.encode() + b'\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
            )  # fmt: skip
            connection.send_raw(head.encode() + start + b"x" * 1024)  # promises 2 MB, sends 1 KB, then nothing
            status, headers, body = connection.response()
            assert status == 408 and "stopped arriving" in error_of(body)["message"], body
            assert BODY_IDLE_S <= time.monotonic() - started < BODY_IDLE_S + 3
            assert headers["connection"] == "close" and connection.closed_by_server()
        finally:
            connection.close()
    leftovers.assert_none()


def test_after_a_4xx_the_keep_alive_connection_stays_usable(api_url: str, key: str) -> None:
    connection = RawConnection(api_url)
    auth = {"Authorization": f"Bearer {key}"}
    try:
        bad = b'{"model": "\\ud800"}'
        body = multipart(part("file", GOOD, "in.parquet"), part("params", bad))
        connection.send("POST", "/v1/jobs", body, {**auth, **MULTIPART})
        status, headers, _ = connection.response()
        assert status == 422 and headers.get("connection", "").lower() != "close"
        connection.send("GET", "/v1/jobs?purpose=%00", headers=auth)
        assert connection.response()[0] == 422
        connection.send("GET", "/v1/jobs?limit=1", headers=auth)
        assert connection.response()[0] == 200
    finally:
        connection.close()


# ---- 7. every hostile class: fast, bounded, nothing left behind ----------------------------------


def test_every_hostile_class_is_answered_in_under_2_s_and_leaves_nothing(
    api: tuple[Process, str], http: httpx.Client, leftovers: Leftovers, batch_file: str
) -> None:
    process, _url = api
    rss_before = psutil.Process(process.popen.pid).memory_info().rss
    schema_deep = '{"items":' * 5000 + "{}" + "}" * 5000
    nested = {"type": "string"}
    for _ in range(300):
        nested = {"type": "object", "properties": {"a": nested}}
    cases = {
        "surrogate metadata": lambda: submit(http, '{"model": "parked-model", "metadata": {"k": "\\ud800"}}'),
        "surrogate template": lambda: submit(http, '{"model": "parked-model", "template": "\\ud800{prompt}"}'),
        "surrogate batch metadata": lambda: http.post(
            "/v1/batches",
            content=f'{{"input_file_id": "{batch_file}", "endpoint": "/v1/chat/completions", '
            '"completion_window": "24h", "metadata": {"k": "\\ud800"}}',
            headers={"Content-Type": "application/json"},
        ),
        "5000-digit int": lambda: submit(http, '{"model": "parked-model", "seed": ' + "9" * 5000 + "}"),
        "10000-deep params": lambda: submit(http, deep(10_000)),
        "5000-deep schema": lambda: submit(http, {"json_schema": schema_deep}),
        "300-level schema": lambda: submit(http, {"json_schema": json.dumps(nested)}),
        "lookahead pattern": lambda: submit(http, {"json_schema": {"type": "string", "pattern": "(?!a)b"}}),
        "NUL query": lambda: http.get("/v1/files?purpose=%00"),
        "duplicate keys": lambda: submit(http, '{"model": "parked-model", "seed": 1, "seed": 2}'),
        "seed 2^64-1": lambda: submit(http, {"seed": 2**64 - 1}),
        "invalid UTF-8 custom_id": lambda: submit(
            http,
            {},
            parquet_bytes(
                pa.table({
                    "prompt": ["a"],
                    "custom_id": pa.Array.from_buffers(pa.string(), 1, pa.array([b"\xff"], pa.binary()).buffers()),
                })  # fmt: skip
            ),
        ),
        "cut multipart": lambda: http.post(
            "/v1/files", content=multipart(part("file", b"{}\n", "a.jsonl"), close=False), headers=MULTIPART
        ),
        "no Content-Type": lambda: http.post("/v1/batches", content=b"{}", headers={"Content-Type": ""}),
    }
    for name, send in cases.items():
        started = time.monotonic()
        response = send()
        took = time.monotonic() - started
        assert 400 <= response.status_code < 500, (name, response.status_code, response.text)
        error_of(response.content)
        assert took < 2.0, (name, took)
    leftovers.assert_none()
    listings_work(http)
    growth = psutil.Process(process.popen.pid).memory_info().rss - rss_before
    assert growth < 200 * 1024 * 1024, f"the API grew by {growth / 2**20:.0f} MB"


# ---- follow-ups: a 500's connection, NUL in JSONL lines, JSON limits of params and batch metadata -----


@pytest.fixture
def in_process_api(env: ServiceEnv) -> Iterator[str]:
    """The real app (create_app, on the session's Postgres and Redis) served by uvicorn with Freight's
    protocol classes, as `freight api` serves it, but in this process: a test can make a route fail.
    The module's `freight api` process answers everything else."""
    app = create_app(env.settings)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=http_protocol(), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="in-process-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process API did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _fail(*_args: object, **_kwargs: object) -> None:
    raise RuntimeError("injected failure")


FAILING_REQUESTS = {
    # (what fails, method, path, body, headers): the body read in full, in part, or not at all
    "list (no body)": ("jobs.domain.service.JobService.list", "GET", "/v1/jobs?limit=1", b"", {}),
    "submit (body read)": (
        "jobs.domain.service.JobService.submit", "POST", "/v1/jobs",
        multipart(part("file", GOOD, "in.parquet")), MULTIPART,
    ),
    "auth (body unread)": (
        "jobs.api.auth.tenant_for_key", "POST", "/v1/jobs",
        multipart(part("file", b"x" * 300_000, "in.parquet")), MULTIPART,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(FAILING_REQUESTS))
def test_after_a_500_the_keep_alive_connection_stays_usable(
    in_process_api: str, key: str, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The probe's weak answer: after a 500 the next request on the same connection was reset. Now the
    500 is JSON and the same connection answers the next requests, even when the failed route left its
    body unread (closing then would reset the connection, the 500 itself possibly lost)."""
    target, method, path, body, headers = FAILING_REQUESTS[name]
    auth = {"Authorization": f"Bearer {key}"}
    connection = RawConnection(in_process_api)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(target, _fail)
            connection.send(method, path, body, {**auth, **headers})
            status, answer_headers, answer = connection.response()
        assert status == 500 and answer_headers["content-type"] == "application/json", (status, answer)
        assert "internal error" in error_of(answer)["message"]
        assert "injected" not in answer.decode()  # the exception is logged, not shown
        assert answer_headers.get("connection", "").lower() != "close"
        for _ in range(2):  # the same connection: the next requests succeed
            connection.send("GET", "/v1/jobs?limit=1", headers=auth)
            status, answer_headers, answer = connection.response()
            assert status == 200, (status, answer)
    finally:
        connection.close()
    fresh = RawConnection(in_process_api)  # and so does a new one
    try:
        fresh.send("GET", "/v1/jobs?limit=1", headers=auth)
        assert fresh.response()[0] == 200
    finally:
        fresh.close()


def _line_errors(leftovers: Leftovers, batch_id: str) -> dict[int, dict]:
    with leftovers.sessions() as session:
        row = session.scalars(select(OpenAIBatch).where(OpenAIBatch.id == batch_id)).one()
        return {error["line"]: error for error in row.line_errors}


def test_a_nul_in_a_jsonl_custom_id_or_stop_is_that_lines_error_and_in_content_it_is_kept(
    http: httpx.Client, leftovers: Leftovers, env: ServiceEnv
) -> None:
    """docs/input-rules.md: custom_id and stop are stored, so a NUL in them is refused for that line,
    named; message content is prompt text, which may hold a NUL: kept as sent, never repaired."""
    lines = [
        chat_line("good", "fine"),
        chat_line("id\x00x", "fine"),
        chat_line("stop", "fine", stop=["a\x00b"]),
        chat_line("content", "a\x00b"),
    ]
    batch = batch_with_lines(http, [json.dumps(line).encode() for line in lines])  # NUL as \u0000
    assert batch["request_counts"]["total"] == 4 and batch["request_counts"]["failed"] == 2, batch
    errors = _line_errors(leftovers, batch["id"])
    assert sorted(errors) == [2, 3], errors
    assert errors[2]["param"] == "custom_id" and "NUL" in errors[2]["message"], errors[2]
    assert errors[2]["message"].startswith("line 2:")
    assert "stop[0]" in errors[3]["message"] and "NUL" in errors[3]["message"], errors[3]
    assert errors[3]["message"].startswith("line 3:") and errors[3]["custom_id"] == "stop", errors[3]
    # the accepted lines are the job's rows; the content with its NUL reached the job's input as sent
    with leftovers.sessions() as session:
        job_id = session.scalars(select(OpenAIBatch.job_id).where(OpenAIBatch.id == batch["id"])).one()
        input_name = session.scalars(select(Job.input_name).where(Job.id == job_id)).one()
    input_path = env.settings.resolved_data_dir / input_name
    table = pq.read_table(input_path)
    contents = {
        custom_id: messages[-1]["content"]
        for custom_id, messages in zip(table["custom_id"].to_pylist(), table["messages"].to_pylist(), strict=True)
    }
    assert contents == {"good": "fine", "content": "a\x00b"}, contents
    listings_work(http)


MAX_KEYS = JsonLimits().max_keys
MAX_BYTES = JsonLimits().max_bytes
TOO_MANY_KEYS = {f"k{index}": "v" for index in range(MAX_KEYS + 1)}
TOO_BIG = {"k": "x" * (MAX_BYTES + 10)}


@pytest.mark.parametrize(
    ("limit", "metadata"), [("max_keys", TOO_MANY_KEYS), ("max_bytes", TOO_BIG)], ids=["max_keys", "max_bytes"]
)
def test_params_and_batch_metadata_over_a_json_limit_are_a_4xx_naming_it_and_store_nothing(
    http: httpx.Client, leftovers: Leftovers, batch_file: str, limit: str, metadata: dict
) -> None:
    response = submit(http, {"metadata": metadata})
    if limit == "max_bytes":
        # `params` is a form field: the multipart parser stops it at the field limit (1 MiB, the default
        # max_bytes too) before the JSON parser sees it; the refusal names the part and that limit.
        assert response.status_code == 413, response.text
        refused(response, "`params` field is larger than 1048576 bytes", param="params")
    else:
        error = refused(response, f"params has more than {MAX_KEYS} object keys (max_keys)", param="params")
        assert error["code"] == "json_limit", error
    body = {
        "input_file_id": batch_file,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "metadata": metadata,
    }
    error = refused(http.post("/v1/batches", json=body), limit, param="the body")
    assert error["code"] == "json_limit", error
    leftovers.assert_none()
    listings_work(http)
