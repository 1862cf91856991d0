"""Issue 28's property tests as a matrix: each class of hostile input (rows) over each route that takes
input (columns), every cell a hypothesis test or a reason it does not apply (MATRIX, the same table as
docs/input-rules.md#property-tests). The cells the earlier rounds left open are tested here, through
the module's own `freight api` process (httptools) on Postgres and Redis, no worker: each answer is a 4xx
in Freight's one error shape naming where (field, row and column, JSONL line, query parameter), comes
in under 2 s, keeps the API process under its memory bound (sampled through the whole module; the last
test checks it), and leaves no rows, files or queue messages (a batch whose lines are refused is stored,
failed, as the OpenAI API does: it holds no job and queues nothing). Each route is a parameter, so every
cell runs every time; FREIGHT_MATRIX_EXAMPLES (default 8) sets the examples per cell for a deeper sweep."""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs.domain.constraint_limits import MAX_REGEX_REPEAT, MAX_SCHEMA_BOUND, MAX_SCHEMA_DEPTH
from jobs.domain.json_limits import JsonLimits
from tests.service.fixtures import PARKED_MODEL, Process, ServiceEnv, create_api_key, start_api
from tests.service.hostile_helpers import Leftovers, RawConnection, error_of, parquet_bytes

TENANT = "hostile-matrix"
NETWORK = settings(
    max_examples=int(os.environ.get("FREIGHT_MATRIX_EXAMPLES", "8")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
FAST_S = 2.0
LIMITS = JsonLimits()
# What the API process may grow by while answering the whole matrix: its parsers are bounded (JSON limits,
# multipart and Parquet streamed to disk), so hostile input costs it transient buffers, never the body's size
# times anything. Measured: a few MB (the last test prints it).
MEMORY_GROWTH_BOUND_MB = 128

ROUTES = ("jobs", "quote", "by-reference", "files", "batches", "jsonl line", "parquet cell", "query")
CLASSES = ("text", "unbounded", "duplicate keys", "constraint", "framing")
H2, H3, HERE = "test_hostile_inputs_2", "test_hostile_inputs_3", "test_hostile_matrix"
# (class, route) -> the property test ("module::function" under tests/service) or why the cell is empty.
MATRIX: dict[tuple[str, str], str] = {
    ("text", "jobs"): f"{H2}::test_bad_text_anywhere_in_params_is_a_422_naming_it",
    ("text", "quote"): f"{HERE}::test_bad_text_in_quote_and_by_reference_bodies",
    ("text", "by-reference"): f"{HERE}::test_bad_text_in_quote_and_by_reference_bodies",
    ("text", "files"): f"{H3}::test_any_hostile_value_in_any_form_field_is_a_fast_4xx_that_leaves_nothing",
    ("text", "batches"): f"{H2}::test_bad_text_anywhere_in_a_batch_body_is_a_422_before_anything_is_stored",
    ("text", "jsonl line"): f"{H3}::test_invalid_utf8_in_one_jsonl_line_is_that_lines_error_and_is_stored_nowhere",
    ("text", "parquet cell"): f"{H3}::test_invalid_utf8_in_any_parquet_string_cell_is_a_422_naming_row_and_column",
    ("text", "query"): f"{HERE}::test_bad_text_in_any_query_parameter",
    ("unbounded", "jobs"): f"{HERE}::test_unbounded_json_anywhere",
    ("unbounded", "quote"): f"{HERE}::test_unbounded_json_anywhere",
    ("unbounded", "by-reference"): f"{HERE}::test_unbounded_json_anywhere",
    ("unbounded", "files"): "n/a: the fields are plain text (size limits: the form-field test); the file's lines are the jsonl line column",
    ("unbounded", "batches"): f"{HERE}::test_unbounded_json_anywhere",
    ("unbounded", "jsonl line"): f"{HERE}::test_unbounded_json_anywhere",
    ("unbounded", "parquet cell"): f"{HERE}::test_unbounded_json_anywhere",
    ("unbounded", "query"): f"{HERE}::test_unbounded_query_values",
    ("duplicate keys", "jobs"): f"{HERE}::test_duplicate_keys_anywhere",
    ("duplicate keys", "quote"): f"{HERE}::test_duplicate_keys_anywhere",
    ("duplicate keys", "by-reference"): f"{HERE}::test_duplicate_keys_anywhere",
    ("duplicate keys", "files"): "n/a: no JSON; a repeated part is refused (test_hostile_inputs_2::test_files_multipart_is_as_strict_as_jobs)",
    ("duplicate keys", "batches"): f"{HERE}::test_duplicate_keys_anywhere",
    ("duplicate keys", "jsonl line"): f"{HERE}::test_duplicate_keys_anywhere",
    ("duplicate keys", "parquet cell"): f"{HERE}::test_duplicate_keys_anywhere",
    ("duplicate keys", "query"): "n/a: no JSON in a query string",
    ("constraint", "jobs"): f"{HERE}::test_constraints_over_a_limit_anywhere",
    ("constraint", "quote"): f"{HERE}::test_constraints_over_a_limit_anywhere",
    ("constraint", "by-reference"): f"{HERE}::test_constraints_over_a_limit_anywhere",
    ("constraint", "files"): "n/a: a file's constraints are its lines' (checked when a batch is made of it)",
    ("constraint", "batches"): "n/a: a batch body holds no constraint; its lines are the jsonl line column",
    ("constraint", "jsonl line"): f"{HERE}::test_constraints_over_a_limit_anywhere",
    ("constraint", "parquet cell"): f"{HERE}::test_constraints_over_a_limit_anywhere",
    ("constraint", "query"): "n/a: no query parameter is a constraint",
    ("framing", "jobs"): f"{HERE}::test_broken_framing_on_every_route",
    ("framing", "quote"): f"{HERE}::test_broken_framing_on_every_route",
    ("framing", "by-reference"): f"{HERE}::test_broken_framing_on_every_route",
    ("framing", "files"): f"{HERE}::test_broken_framing_on_every_route",
    ("framing", "batches"): f"{HERE}::test_broken_framing_on_every_route",
    ("framing", "jsonl line"): "n/a: inside a body whose framing is the route's (files)",
    ("framing", "parquet cell"): "n/a: inside a body whose framing is the route's (jobs)",
    ("framing", "query"): f"{HERE}::test_broken_framing_on_every_route",
}
# The time budget of a constraint that is within every limit but slow to compile: test_hostile_inputs_3
# (test_a_schema_slow_to_compile_is_a_422_over_the_budget_wherever_it_is_sent), as params, row and line.


def test_the_matrix_has_every_cell_and_names_tests_that_exist() -> None:
    assert set(MATRIX) == {(kind, route) for kind in CLASSES for route in ROUTES}
    for cell, where in MATRIX.items():
        if where.startswith("n/a: "):
            continue
        module, function = where.split("::")
        assert callable(getattr(importlib.import_module(f"tests.service.{module}"), function, None)), (cell, where)


# ---- the routes ----------------------------------------------------------------------------------------

GOOD = parquet_bytes(pa.table({"prompt": ["Say 1", "Say 2"]}))
JSON = {"Content-Type": "application/json"}
REFERENCE_URI = "s3://freight-nowhere/in.parquet"  # never read: every refusal here comes before the input


class RssSampler:
    """The resident memory of one process, sampled from /proc every 20 ms in a thread: its start and its peak."""

    def __init__(self, pid: int) -> None:
        self.status = Path(f"/proc/{pid}/status")
        self.start_mb = self.peak_mb = self.read_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def read_mb(self) -> float:
        for line in self.status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError(f"no VmRSS in {self.status}")

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak_mb = max(self.peak_mb, self.read_mb())
            except (FileNotFoundError, ProcessLookupError):  # the process ended: the last test says so
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def api(service_env: ServiceEnv, log_dir: Path) -> Iterator[tuple[Process, RssSampler, str]]:
    """This module's own API process (the session's serves other modules too), its memory sampled throughout."""
    process, url = start_api(service_env, log_dir)
    sampler = RssSampler(process.popen.pid)
    yield process, sampler, url
    sampler.stop()
    process.stop()


@pytest.fixture(scope="module")
def api_url(api: tuple[Process, RssSampler, str]) -> str:
    return api[2]


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


@pytest.fixture(scope="module")
def batch_file(api_url: str, key: str) -> str:
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {key}"}) as client:
        line = json.dumps(chat_line("ok", "hello")) + "\n"
        response = client.post("/v1/files", files={"file": ("in.jsonl", line)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def chat_line(custom_id: str, content: str, **body: object) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": PARKED_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}], **body},
    }


def post_params(http: httpx.Client, route: str, raw_params: str, content: bytes = GOOD) -> httpx.Response:
    """`raw_params` (JSON text, sent as written) as the params of an upload, a quote or a job by reference."""
    if route == "by-reference":
        body = '{"input_uri": "' + REFERENCE_URI + '", "params": ' + raw_params + "}"
        return http.post("/v1/jobs/by-reference", content=body.encode("utf-8", "surrogatepass"), headers=JSON)
    path = "/v1/jobs/quote" if route == "quote" else "/v1/jobs"
    return http.post(path, files={"file": ("in.parquet", content)}, data={"params": raw_params})


def batch_of_lines(http: httpx.Client, lines: list[bytes]) -> dict:
    upload = http.post("/v1/files", files={"file": ("in.jsonl", b"\n".join(lines) + b"\n")}, data={"purpose": "batch"})
    assert upload.status_code == 200, upload.text
    body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    response = http.post("/v1/batches", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def cell_table(column: str, cell: object) -> bytes:
    """A two-row file whose row 1 holds `cell` in `column`."""
    return parquet_bytes(pa.table({"prompt": ["a", "b"], column: [None, cell]}))


def answered(send: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = send()
    return response, time.monotonic() - started


def refused(response: httpx.Response, took: float, *any_of: str) -> dict:
    """A 4xx in the one shape, in time, whose message holds one of `any_of` (where, or which limit)."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = error_of(response.content)
    assert took < FAST_S, took
    if any_of:
        assert any(word in error["message"] for word in any_of), (any_of, error)
    return error


def line_refused(http: httpx.Client, leftovers: Leftovers, line: bytes, *any_of: str) -> None:
    """A bad JSONL line is that line's error, named by its number; a batch of only that line fails and
    makes no job (a good line beside it would run: the rest of a batch goes on)."""
    started = time.monotonic()
    batch = batch_of_lines(http, [line])
    assert time.monotonic() - started < FAST_S * 2  # two requests: the upload and the batch
    assert batch["status"] == "failed" and batch["request_counts"]["failed"] == 1, batch
    [error] = batch["errors"]["data"]
    assert error["line"] == 1, error
    if any_of:
        assert any(word in error["message"] for word in any_of), (any_of, error)
    after = leftovers.snapshot()
    assert (after.rows["jobs"], after.messages) == (leftovers.before.rows["jobs"], leftovers.before.messages)
    assert after.rows["shards"] == leftovers.before.rows["shards"]


# ---- text that is not valid Unicode, or NUL --------------------------------------------------------

surrogate = st.integers(0xD800, 0xDFFF).map(chr)
plain = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E, blacklist_characters='"\\'), max_size=8)


@st.composite
def bad_text(draw: st.DrawFn) -> str:
    return draw(plain) + draw(st.one_of(surrogate, st.just("\x00"))) + draw(plain)


TEXT_PLACES: dict[str, Callable[[str], dict]] = {
    "metadata key": lambda bad: {"metadata": {bad: "v"}},
    "metadata value": lambda bad: {"metadata": {"k": bad}},
    "template": lambda bad: {"template": "Say {prompt} " + bad},
    "stop": lambda bad: {"stop": ["ok", bad]},
    "json_schema": lambda bad: {"json_schema": {"type": "string", "description": bad}},
}


@pytest.mark.parametrize("route", ["quote", "by-reference"])
@NETWORK
@given(bad=bad_text(), data=st.data())
def test_bad_text_in_quote_and_by_reference_bodies(
    http: httpx.Client, leftovers: Leftovers, route: str, bad: str, data: st.DataObject
) -> None:
    leftovers.before = leftovers.snapshot()  # per example: one fixture serves them all
    place = data.draw(st.sampled_from([*sorted(TEXT_PLACES), *(["input_uri"] if route == "by-reference" else [])]))
    if place == "input_uri":
        body = json.dumps({"input_uri": REFERENCE_URI + bad, "params": {"model": PARKED_MODEL}})
        response, took = answered(lambda: http.post("/v1/jobs/by-reference", content=body, headers=JSON))
    else:
        params = json.dumps({"model": PARKED_MODEL, **TEXT_PLACES[place](bad)})  # surrogates as \\ud800 escapes
        response, took = answered(lambda: post_params(http, route, params))
    refused(response, took, "lone surrogate", "NUL")
    leftovers.assert_none()


QUERY_ROUTES = ["/v1/jobs", "/v1/files", "/v1/batches", "/v1/jobs/job_x/events", "/v1/files/file_x/content"]


@pytest.mark.parametrize("path", QUERY_ROUTES)
@NETWORK
@given(
    name=st.sampled_from(["after", "status", "purpose", "limit", "anything"]),
    raw=st.sampled_from(["%00", "a%00", "%ff", "%ed%a0%80", "%c3", "x%80y"]),
    named=st.booleans(),
)
def test_bad_text_in_any_query_parameter(http: httpx.Client, path: str, name: str, raw: str, named: bool) -> None:
    """NUL or bytes that are not UTF-8, in a query parameter's value or in its name: a 4xx naming it,
    or (bytes that are not UTF-8, where the parameter is free text) read with U+FFFD in their place and
    never stored: a GET is never a 500."""
    query = f"{raw}=1" if named else f"{name}={raw}"
    response, took = answered(lambda: http.get(f"{path}?{query}"))
    assert response.status_code < 500 and took < FAST_S, (path, query, response.status_code, response.text)
    if "%00" in raw:
        error = refused(response, took, "NUL")
        assert "query parameter" in error["message"], error
    elif response.status_code >= 400:
        error_of(response.content)


# ---- unbounded structures: nesting, number size, key count --------------------------------------------

SHAPES = ("deep", "digits", "keys")


def unbounded_value(shape: str, size: int) -> str:
    """JSON text over one limit: nested `size` deep, a `size`-digit number, or an object of `size` keys."""
    if shape == "deep":
        return "[" * size + "]" * size
    if shape == "digits":
        return "9" * size
    return "{" + ",".join(f'"k{i}":0' for i in range(size)) + "}"


def shape_size(shape: str) -> st.SearchStrategy[int]:
    over = {"deep": LIMITS.max_depth, "digits": LIMITS.max_number_chars, "keys": LIMITS.max_keys}[shape]
    return st.integers(over + 1, over + {"deep": 12_000, "digits": 6_000, "keys": 2_000}[shape])


LIMIT_WORDS = {"deep": ("max_depth",), "digits": ("max_number_chars",), "keys": ("max_keys",)}


def schema_over(shape: str, size: int) -> str:
    """A json_schema text over the schema limits the same way (its own, smaller, limits)."""
    if shape == "deep":
        return '{"items":' * size + "{}" + "}" * size
    if shape == "digits":
        return '{"type":"string","maxLength":' + "9" * size + "}"
    return '{"type":"object","properties":{' + ",".join(f'"p{i}":{{}}' for i in range(size)) + "}}"


@pytest.mark.parametrize("route", ["jobs", "quote", "by-reference", "batches", "jsonl line", "parquet cell"])
@NETWORK
@given(data=st.data())
def test_unbounded_json_anywhere(
    http: httpx.Client, leftovers: Leftovers, batch_file: str, route: str, data: st.DataObject
) -> None:
    leftovers.before = leftovers.snapshot()  # per example: one fixture serves them all
    shape = data.draw(st.sampled_from(SHAPES))
    size = data.draw(shape_size(shape))
    value = unbounded_value(shape, size)
    if route in ("jobs", "quote", "by-reference"):
        params = '{"model": "' + PARKED_MODEL + '", "metadata": {"k": ' + value + "}}"
        response, took = answered(lambda: post_params(http, route, params))
        refused(response, took, *LIMIT_WORDS[shape])
    elif route == "batches":
        body = (
            f'{{"input_file_id": "{batch_file}", "endpoint": "/v1/chat/completions", "completion_window": "24h", '
            f'"metadata": {{"k": {value}}}}}'
        )
        response, took = answered(lambda: http.post("/v1/batches", content=body, headers=JSON))
        refused(response, took, *LIMIT_WORDS[shape])
    elif route == "jsonl line":
        line = json.dumps(chat_line("x", "hi"))[:-2] + ', "metadata": ' + value + "}}"
        line_refused(http, leftovers, line.encode(), *LIMIT_WORDS[shape])
        return
    else:  # a row's json_schema cell: the schema limits (smaller than a document's)
        size = {"deep": MAX_SCHEMA_DEPTH + 1 + size % 200, "digits": size, "keys": 2_001 + size % 500}[shape]
        content = cell_table("json_schema", schema_over(shape, size))
        response, took = answered(lambda: post_params(http, "jobs", json.dumps({"model": PARKED_MODEL}), content))
        error = refused(response, took, "row 1")
        assert (error["row"], error["column"]) == (1, "json_schema"), error
    leftovers.assert_none()


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/files", "/v1/batches"])
@NETWORK
@given(
    name=st.sampled_from(["limit", "after"]),
    size=st.integers(LIMITS.max_number_chars + 1, 60_000),
)
def test_unbounded_query_values(http: httpx.Client, path: str, name: str, size: int) -> None:
    """A query value of up to 60 KB (a huge number for `limit`, a huge cursor for `after`): a 4xx naming
    it. A request target of 64 KB or more is a malformed request (400) before any route: the 100 KB URL
    of test_hostile_inputs_2.py."""
    response, took = answered(lambda: http.get(f"{path}?{name}={'9' * size}"))
    error = refused(response, took)
    assert name in error["message"] or error["param"] == name, error


# ---- duplicate JSON keys -----------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["jobs", "quote", "by-reference", "batches", "jsonl line", "parquet cell"])
@NETWORK
@given(
    key_name=st.sampled_from(["model", "max_tokens", "metadata", "k"]),
    nested=st.booleans(),
)
def test_duplicate_keys_anywhere(
    http: httpx.Client, leftovers: Leftovers, batch_file: str, route: str, key_name: str, nested: bool
) -> None:
    """The same key twice in one object, at the top or nested: a 4xx naming the key (last one wins
    would let two readers of one body see two values)."""
    leftovers.before = leftovers.snapshot()  # per example: one fixture serves them all
    twice = f'"{key_name}": 1, "{key_name}": 2'
    if route in ("jobs", "quote", "by-reference"):
        params = (
            '{"model": "' + PARKED_MODEL + '", "metadata": {' + twice + "}}" if nested else "{" + twice + "}"
        )
        if route == "by-reference" and not nested:
            body = '{"input_uri": "' + REFERENCE_URI + '", "input_uri": "' + REFERENCE_URI + '", "params": {}}'
            response, took = answered(lambda: http.post("/v1/jobs/by-reference", content=body, headers=JSON))
        else:
            response, took = answered(lambda: post_params(http, route, params))
        refused(response, took, "repeats the key")
    elif route == "batches":
        inner = f'"metadata": {{{twice}}}' if nested else f'"input_file_id": "{batch_file}"'
        body = (
            f'{{"input_file_id": "{batch_file}", "endpoint": "/v1/chat/completions", "completion_window": "24h", '
            f"{inner}}}"
        )
        response, took = answered(lambda: http.post("/v1/batches", content=body, headers=JSON))
        refused(response, took, "repeats the key")
    elif route == "jsonl line":
        line = json.dumps(chat_line("x", "hi"))[:-2] + (f', "metadata": {{{twice}}}}}}}' if nested else ', "seed": 1, "seed": 2}}')
        line_refused(http, leftovers, line.encode(), "repeats the key")
        return
    else:
        schema = '{"type": "object", "properties": {' + twice.replace("1", "{}").replace("2", "{}") + "}}"
        if not nested:
            schema = '{"type": "object", "type": "string"}'
        content = cell_table("json_schema", schema)
        response, took = answered(lambda: post_params(http, "jobs", json.dumps({"model": PARKED_MODEL}), content))
        error = refused(response, took, "repeats the key")
        assert (error["row"], error["column"]) == (1, "json_schema"), error
    leftovers.assert_none()


# ---- constraints over a structural limit (refused before any grammar is compiled) ----------------------


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


CONSTRAINTS: dict[str, Callable[[int], tuple[str, object]]] = {
    # name -> (kind, value) over a limit; `n` varies the value
    "deep schema": lambda n: ("json_schema", deep_schema(MAX_SCHEMA_DEPTH + n % 300)),
    "lookahead pattern": lambda n: ("json_schema", {"type": "string", "pattern": "a" * (n % 5) + "(?=x)[a-z]+"}),
    "huge maxLength": lambda n: ("json_schema", {"type": "string", "maxLength": MAX_SCHEMA_BOUND + 1 + n}),
    "lookbehind regex": lambda n: ("regex", "a" * (n % 5) + "(?<=a)b"),
    "huge repeat": lambda n: ("regex", f"[a-z]{{0,{MAX_REGEX_REPEAT + 1 + n}}}"),
    "too many choices": lambda n: ("choice", [f"c{i}" for i in range(1025 + n % 50)]),
}


@pytest.mark.parametrize("route", ["jobs", "quote", "by-reference", "jsonl line", "parquet cell"])
@NETWORK
@given(
    name=st.sampled_from(sorted(CONSTRAINTS)),
    n=st.integers(0, 10_000),
)
def test_constraints_over_a_limit_anywhere(
    http: httpx.Client, leftovers: Leftovers, route: str, name: str, n: int
) -> None:
    leftovers.before = leftovers.snapshot()  # per example: one fixture serves them all
    kind, value = CONSTRAINTS[name](n)
    if route in ("jobs", "quote", "by-reference"):
        # a schema as JSON text: its own limits apply (as an object, params' depth limit may come first)
        params = json.dumps({"model": PARKED_MODEL, kind: json.dumps(value) if kind == "json_schema" else value})
        response, took = answered(lambda: post_params(http, route, params))
        refused(response, took, kind)
    elif route == "jsonl line":
        if kind != "json_schema":  # an OpenAI line's only constraint is its response_format's schema
            return
        format_ = {"type": "json_schema", "json_schema": {"name": "s", "schema": value}}
        line_refused(http, leftovers, json.dumps(chat_line("x", "hi", response_format=format_)).encode())
        return
    else:
        cell = json.dumps(value) if kind == "json_schema" else value
        content = cell_table(kind, cell)
        response, took = answered(lambda: post_params(http, "jobs", json.dumps({"model": PARKED_MODEL}), content))
        error = refused(response, took, "row 1")
        assert (error["row"], error["column"]) == (1, kind), error
    leftovers.assert_none()


# ---- hostile HTTP framing, on every route that takes a body (and in the request line) ------------------

POST_PATHS = ["/v1/jobs", "/v1/jobs/quote", "/v1/jobs/by-reference", "/v1/files", "/v1/batches"]
FRAMINGS: dict[str, Callable[[str, str], bytes]] = {
    "bad Content-Length": lambda path, auth: f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: abc\r\n\r\n".encode(),
    "negative Content-Length": lambda path, auth: f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: -1\r\n\r\n".encode(),
    "repeated Content-Length": lambda path, auth: (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 1\r\nContent-Length: 2\r\n\r\nab".encode()
    ),
    "Content-Length with chunked": lambda path, auth: (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".encode()
    ),
    "bad chunk size": lambda path, auth: (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\nzz\r\n\r\n".encode()
    ),
    "space in the request target": lambda path, auth: f"POST {path} x?q=1 HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode(),
    "NUL in the request target": lambda path, auth: f"POST {path}?purpose=\x00 HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode(),
}


@pytest.mark.parametrize("path", POST_PATHS)
@NETWORK
@given(framing=st.sampled_from(sorted(FRAMINGS)), authorized=st.booleans())
def test_broken_framing_on_every_route(
    api_url: str, key: str, leftovers: Leftovers, path: str, framing: str, authorized: bool
) -> None:
    """A 400 `malformed HTTP request` in the one shape, `Connection: close`, and a clean close (EOF)."""
    leftovers.before = leftovers.snapshot()  # per example: one fixture serves them all
    auth = f"Authorization: Bearer {key}\r\n" if authorized else ""
    connection = RawConnection(api_url, timeout=5)
    try:
        started = time.monotonic()
        connection.send_raw(FRAMINGS[framing](path, auth))
        status, headers, body = connection.response()
        assert time.monotonic() - started < FAST_S
        assert status == 400 and headers["content-type"] == "application/json", (framing, status, body)
        assert "malformed HTTP request" in error_of(body)["message"]
        assert headers["connection"] == "close" and connection.closed_by_server()
    finally:
        connection.close()
    leftovers.assert_none()


def test_the_api_stayed_under_its_memory_bound(api: tuple[Process, RssSampler, str]) -> None:
    """Last in the module (pytest runs a file in order): the API answered every hostile request above within
    MEMORY_GROWTH_BOUND_MB of what it held when it started serving."""
    process, sampler, _ = api
    assert process.alive(), process.output()[-2000:]
    growth = sampler.peak_mb - sampler.start_mb
    print(f"API RSS: {sampler.start_mb:.0f} MB at the start, {sampler.peak_mb:.0f} MB at the peak (+{growth:.0f})")
    assert growth < MEMORY_GROWTH_BOUND_MB, (sampler.start_mb, sampler.peak_mb)
