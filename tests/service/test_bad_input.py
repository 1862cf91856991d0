"""Bad input through a real `freight api`: every problem is a 4xx that names what is wrong and where,
never a 500, and leaves no job and no file behind. Odd but valid input (path tricks in names, control
characters, quotes and SQL in custom_id and metadata, huge cells) is stored and returned verbatim or
becomes per-row errors; `truncate` cuts long prompts instead."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.cli.client import FreightClient
from tests.service.fixtures import PARKED_MODEL, Process, ServiceEnv, create_api_key

TENANT = "bad-input"
ODD_TEXT = [
    "quote ' and \" and `backtick`",
    "'); DROP TABLE jobs; --",
    "tab\there, newline\nhere, bell\x07, escape\x1b[31m, DEL\x7f",
    "../../etc/passwd",
    "ünïcödé ✓ 🚀 \u202e reversed",
    "%s %(name)s {0} {prompt}",
]


def parquet_bytes(table: pa.Table, **kwargs) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, **kwargs)
    return sink.getvalue()


def prompts(rows: int = 3) -> pa.Table:
    return pa.table({"prompt": [f"Say {i}" for i in range(rows)]})


@pytest.fixture(scope="module")
def key(service_env: ServiceEnv) -> str:
    return create_api_key(service_env, TENANT)


@pytest.fixture
def http(api_url: str, key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        yield client


class Leftovers:
    """What a refused submission must not leave: a job in the listing or a folder of job files."""

    def __init__(self, http: httpx.Client, service: ServiceEnv) -> None:
        self.http = http
        self.jobs_dir = service.settings.resolved_data_dir / "jobs"
        self.before = self.snapshot()

    def snapshot(self) -> tuple[list[str], set[Path]]:
        jobs = [job["id"] for job in self.http.get("/v1/jobs", params={"limit": 100}).json()["data"]]
        return jobs, set(self.jobs_dir.glob("*"))

    def assert_none(self) -> None:
        assert self.snapshot() == self.before


def submit(
    http: httpx.Client, content: bytes, params: dict | str, filename: str = "in.parquet"
) -> httpx.Response:
    raw = params if isinstance(params, str) else json.dumps({"model": PARKED_MODEL, **params})
    return http.post("/v1/jobs", files={"file": (filename, content)}, data={"params": raw})


GOOD = parquet_bytes(prompts())
TRUNCATED = GOOD[: len(GOOD) // 2]
BAD_FILES = [
    ("not parquet", b"prompt\nhello\n", {}, 400, "not a readable Parquet file", {}),
    ("empty file", b"", {}, 400, "the file is empty", {}),
    ("truncated", TRUNCATED, {}, 400, "not a readable Parquet file", {}),
    ("zero rows", parquet_bytes(pa.table({"prompt": pa.array([], pa.string())})), {}, 422, "no rows", {}),
    ("no prompt column", parquet_bytes(pa.table({"text": ["a"]})), {}, 422, "no prompt", {}),
    (
        "int prompt",
        parquet_bytes(pa.table({"prompt": [1, 2]})),
        {},
        422,
        "expected string",
        {"column": "prompt"},
    ),
    (
        "binary prompt, invalid UTF-8",
        parquet_bytes(pa.table({"prompt": pa.array([b"\xff\xfe"], pa.binary())})),
        {},
        422,
        "has type binary; expected string",
        {"column": "prompt"},
    ),
    (
        "nested prompt",
        parquet_bytes(pa.table({"prompt": [["a", "b"]]})),
        {},
        422,
        "has type list<element: string>; expected string",
        {"column": "prompt"},
    ),
    (
        "struct prompt",
        parquet_bytes(pa.table({"prompt": [{"text": "a"}]})),
        {},
        422,
        "expected string",
        {"column": "prompt"},
    ),
    (
        "duplicate custom_id",
        parquet_bytes(pa.table({"prompt": ["a", "b", "c", "d"], "custom_id": ["x", "y", "x", "y"]})),
        {},
        422,
        "custom_id must be unique; repeated: 'x', 'y'",
        {"column": "custom_id"},
    ),
    (
        "NUL in custom_id",
        parquet_bytes(pa.table({"prompt": ["a", "b"], "custom_id": ["ok", "n\x00l"]})),
        {},
        422,
        "row 1: custom_id contains a NUL character",
        {"row": 1, "column": "custom_id"},
    ),
    (
        "huge custom_id",
        parquet_bytes(pa.table({"prompt": ["a"], "custom_id": ["x" * 100_000]})),
        {},
        422,
        "row 0: custom_id is longer than 1024 characters",
        {"row": 0},
    ),
    (
        "template names a missing column",
        parquet_bytes(pa.table({"text": ["a"]})),
        {"template": "{text} {title}"},
        422,
        "template names column(s) ['title']",
        {"field": "template"},
    ),
    (
        "template over a nested column",
        parquet_bytes(pa.table({"text": [["a"]]})),
        {"template": "{text}"},
        422,
        "a template needs text",
        {"column": "text"},
    ),
    (
        "template attribute access",
        parquet_bytes(pa.table({"text": ["a"]})),
        {"template": "{text.__class__.__mro__}"},
        422,
        "must be a column name",
        {},
    ),
    (
        "prompt_column with a path",
        GOOD,
        {"prompt_column": "../../etc/passwd"},
        422,
        "prompt_column '../../etc/passwd' is not in the file",
        {},
    ),
    (
        "row max_tokens 0",
        parquet_bytes(pa.table({"prompt": ["a", "b"], "max_tokens": [3, 0]})),
        {},
        422,
        "row 1: max_tokens is 0",
        {"row": 1, "column": "max_tokens"},
    ),
    (
        "row max_tokens over the context",
        parquet_bytes(pa.table({"prompt": ["a"], "max_tokens": [512]})),
        {},
        422,
        "between 1 and 511",
        {"row": 0},
    ),
    (
        "row temperature infinite",
        parquet_bytes(pa.table({"prompt": ["a", "b"], "temperature": [0.5, float("inf")]})),
        {},
        422,
        "row 1: temperature is inf; it must be between 0 and 2",
        {"row": 1},
    ),
    (
        "row top_p 0",
        parquet_bytes(pa.table({"prompt": ["a"], "top_p": [0.0]})),
        {},
        422,
        "row 0: top_p is 0.0; it must be in (0, 1]",
        {"row": 0},
    ),
]


@pytest.mark.parametrize(
    ("content", "params", "status", "fragment", "where"),
    [case[1:] for case in BAD_FILES],
    ids=[case[0] for case in BAD_FILES],
)
def test_bad_files_get_a_4xx_that_names_the_problem(
    http: httpx.Client,
    service_env: ServiceEnv,
    content: bytes,
    params: dict,
    status: int,
    fragment: str,
    where: dict,
) -> None:
    leftovers = Leftovers(http, service_env)
    response = submit(http, content, params)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"], error
    assert {name: error.get(name) for name in where} == where
    leftovers.assert_none()


BAD_PARAMS = [
    ("invalid JSON", "{max_tokens: 5", "params is not valid JSON"),
    ("not an object", "[1, 2]", "params must be a JSON object"),
    ("unknown param", {"max_tokenz": 5}, "max_tokenz: Extra inputs are not permitted"),
    ("unknown model", {"model": "gpt-9"}, "unknown model 'gpt-9'"),
    ("model path", {"model": "../../../etc/passwd"}, "unknown model '../../../etc/passwd'"),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
    ("max_tokens negative", {"max_tokens": -3}, "max_tokens"),
    ("max_tokens over the context", {"max_tokens": 512}, "below the model context of 512"),
    ("max_tokens not a number", {"max_tokens": "many"}, "max_tokens"),
    ("temperature negative", {"temperature": -0.1}, "temperature"),
    ("temperature infinite", '{"temperature": Infinity}', "temperature: Input should be a finite number"),
    ("temperature NaN", '{"temperature": NaN}', "temperature"),
    ("top_p 0", {"top_p": 0}, "top_p: Input should be greater than 0"),
    ("top_p over 1", {"top_p": 1.5}, "top_p: Input should be less than or equal to 1"),
    ("seed negative", {"seed": -1}, "seed"),
    ("seed too big", {"seed": 2**70}, "seed"),
    ("empty stop string", {"stop": [""]}, "stop string"),
    ("metadata not strings", {"metadata": {"a": 1}}, "metadata.a"),
    ("metadata too many", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("metadata value too long", {"metadata": {"k": "v" * 513}}, "longer than 512 characters"),
    ("metadata NUL", {"metadata": {"k": "a\x00b"}}, "NUL character"),
    ("quantization unknown", {"quantization": "int4"}, "quantization"),
]


@pytest.mark.parametrize(
    ("params", "fragment"), [case[1:] for case in BAD_PARAMS], ids=[c[0] for c in BAD_PARAMS]
)
def test_bad_params_get_a_422_that_names_the_field(
    http: httpx.Client, service_env: ServiceEnv, params: dict | str, fragment: str
) -> None:
    leftovers = Leftovers(http, service_env)
    response = submit(http, GOOD, params)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["field"] in ("params", "model", "max_tokens"), error
    leftovers.assert_none()


def test_oversized_uploads_get_413_with_or_without_a_length(
    http: httpx.Client, service_env: ServiceEnv
) -> None:
    leftovers = Leftovers(http, service_env)
    big = parquet_bytes(pa.table({"prompt": [os.urandom(1500).hex() for _ in range(1500)]}))
    assert len(big) > 3 * 1024 * 1024  # the limit is 2 MB (plus 1 MB of multipart envelope)
    response = submit(http, big, {})
    assert response.status_code == 413 and "limit of 2 MB" in response.json()["error"]["message"]

    # Chunked, with no Content-Length: the body is counted as it arrives.
    boundary = "freight-test-boundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="x.parquet"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()

    def chunks() -> Iterator[bytes]:
        yield head
        for start in range(0, len(big), 256 * 1024):
            yield big[start : start + 256 * 1024]
        yield tail

    response = http.post(
        "/v1/jobs", content=chunks(), headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}
    )
    assert "content-length" not in response.request.headers
    assert response.status_code == 413, response.text
    assert "limit of 2 MB" in response.text
    leftovers.assert_none()


def test_names_from_the_client_never_become_paths(
    http: httpx.Client, service_env: ServiceEnv, tmp_path: Path
) -> None:
    data_dir = service_env.settings.resolved_data_dir
    for filename in ("../../../../evil.parquet", "/tmp/evil-absolute.parquet", "..\\..\\evil.parquet"):
        response = submit(http, GOOD, {}, filename=filename)
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
        assert sorted(p.name for p in (data_dir / "jobs" / job_id).iterdir()) == ["input.parquet"]
    assert not list(data_dir.parent.parent.rglob("evil*.parquet"))
    assert not Path("/tmp/evil-absolute.parquet").exists()
    for path in (
        "/v1/jobs/..%2F..%2Fetc%2Fpasswd",
        "/v1/jobs/%2Fetc%2Fpasswd/results",
        "/v1/jobs/../jobs/x/metrics",
    ):
        response = http.get(path)
        assert response.status_code == 404, (path, response.text)


def test_odd_text_in_metadata_is_stored_and_returned_verbatim(http: httpx.Client) -> None:
    metadata = {f"k{i}": text for i, text in enumerate(ODD_TEXT)} | {"'; SELECT 1; --": "key too"}
    response = submit(http, GOOD, {"metadata": metadata})
    assert response.status_code == 201, response.text
    job = http.get(f"/v1/jobs/{response.json()['id']}").json()
    assert job["metadata"] == metadata


@pytest.mark.slow
def test_odd_custom_ids_huge_cells_and_truncate_through_a_worker(
    api_url: str, key: str, worker: Process, service_env: ServiceEnv
) -> None:
    huge = os.urandom(300_000).hex()  # one 600,000-character cell
    table = pa.table(
        {
            "custom_id": [*ODD_TEXT, "huge", "null", "blank", "long"],
            "prompt": [*(f"Say {i}" for i in range(len(ODD_TEXT))), huge, None, "  \n ", "word " * 800],
        }
    )
    with FreightClient(api_url, key) as client:
        plain = client.submit(table, max_tokens=2)
        truncated = client.submit(table.slice(len(ODD_TEXT)), max_tokens=2, truncate=True)
        long_docs = pa.table({"text": ["word " * 800, "short"]})
        chat = client.submit(long_docs, max_tokens=2, template="Summarize:\n\n{text}", truncate=True)
        for job in (plain, truncated, chat):
            assert client.wait(job["id"], poll_seconds=0.3, timeout=120)["status"] == "completed"
        rows = {row["custom_id"]: row for row in client.results_table(plain["id"]).to_pylist()}
        cut = {row["custom_id"]: row for row in client.results_table(truncated["id"]).to_pylist()}
        chat_rows = client.results_table(chat["id"]).to_pylist()

    assert list(rows) == table.column("custom_id").to_pylist()  # verbatim, in order
    assert all(rows[text]["finish_reason"] in ("stop", "length") for text in ODD_TEXT)
    assert "the model's context is 512 tokens" in rows["huge"]["error"]
    assert rows["null"]["error"] == "prompt column 'prompt' is null"
    assert rows["blank"]["error"] == "empty prompt"
    assert "the model's context is 512 tokens" in rows["long"]["error"]

    # With truncate the long prompts keep their first 510 tokens and leave 2 for the output.
    for name in ("huge", "long"):
        assert cut[name]["finish_reason"] in ("stop", "length") and cut[name]["prompt_tokens"] == 510
    assert cut["null"]["finish_reason"] == cut["blank"]["finish_reason"] == "error"
    assert [row["finish_reason"] in ("stop", "length") for row in chat_rows] == [True, True]
    assert 480 < chat_rows[0]["prompt_tokens"] <= 510 and chat_rows[1]["prompt_tokens"] < 40
