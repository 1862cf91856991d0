"""What failed uploads and streamed writes leave on the API's host: nothing. A `freight api` with its job
files in the session's S3 server (so every write is spooled in FREIGHT_DATA_DIR/spool first) and a temp
folder of its own (TMPDIR) takes uploads that fail on every path: over the limit, not Parquet, a
multipart body cut short, a client gone mid-body, a quote of a bad file, an OpenAI file that is not
JSONL, a partial results download, and the store stopped during an upload. Afterwards the temp folder
holds what it held before, the spool holds no file, and the bucket no staged upload."""

from __future__ import annotations

import io
import os
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from jobs.cli.client import FreightAPIError, FreightClient
from tests.s3_server import S3Server
from tests.service.fixtures import PARKED_MODEL, ServiceEnv, create_api_key, make_service_env, start_api

pytestmark = pytest.mark.slow


@dataclass
class Host:
    env: ServiceEnv
    api_url: str
    key: str
    tmp: Path  # the API's TMPDIR
    server: S3Server
    store: str  # bucket/prefix of the job files

    def spool_files(self) -> list[Path]:
        spool = self.env.settings.spool_dir
        return [path for path in spool.rglob("*") if path.is_file()] if spool.exists() else []

    def temp_entries(self) -> set[str]:
        return {entry.name for entry in self.tmp.iterdir()}

    def staged(self) -> list[str]:
        selector = pafs.FileSelector(f"{self.store}/staging", recursive=True, allow_not_found=True)
        return [info.path for info in self.server.filesystem().get_file_info(selector)]


@pytest.fixture(scope="module")
def host(
    tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, pg_url: str, redis_url: str, queue_prefix: str,
    tiny_llama_dir: Path,
) -> Iterator[Host]:  # fmt: skip
    folder = tmp_path_factory.mktemp("scratch-host")
    (folder / "tmp").mkdir()
    store = f"{s3_server.bucket}/scratch-{secrets.token_hex(4)}"
    env = make_service_env(
        folder, pg_url, redis_url, f"{queue_prefix}-scratch", str(tiny_llama_dir),
        FREIGHT_STORAGE_URL=f"s3://{store}", FREIGHT_S3_ENDPOINT_URL=s3_server.endpoint_url,
        TMPDIR=str(folder / "tmp"),
    )  # fmt: skip
    api, base_url = start_api(env, tmp_path_factory.mktemp("scratch-logs"))
    try:
        yield Host(env, base_url, create_api_key(env, "scratch"), folder / "tmp", s3_server, store)
    finally:
        api.stop()


def _parquet(rows: int) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"prompt": [f"row {i}" for i in range(rows)]}), sink)
    return sink.getvalue()


def _raw_upload(api_url: str, key: str, body: bytes, boundary: str, length: int) -> bytes:
    """POST /v1/jobs with `body` sent as written under a Content-Length of `length`, then close at once
    when `length` is more than was sent (a client gone mid-body); the answer's first bytes otherwise."""
    parts = urlsplit(api_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        head = (
            f"POST /v1/jobs HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {length}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        if length > len(body):
            return b""
        return sock.recv(4096)


def test_failed_uploads_and_streamed_writes_leave_nothing(host: Host) -> None:
    limit = host.env.settings.max_upload_bytes
    with FreightClient(host.api_url, host.key) as client:
        # A quote that succeeds first: whatever the API's helpers keep in the temp folder for good (its
        # grammar check's child starts on the first request that needs it) is there before the snapshot.
        assert client.quote(_parquet(3), max_tokens=1)["rows"] == 3
        temp_before = host.temp_entries()
        cases = {
            "over the limit": lambda: client.submit(os.urandom(limit + 1024), max_tokens=1),
            "not parquet": lambda: client.submit(os.urandom(limit // 2), max_tokens=1),
            "quote, not parquet": lambda: client.quote(os.urandom(limit // 2), max_tokens=1),
            "quote, over the limit": lambda: client.quote(os.urandom(limit + 1024), max_tokens=1),
        }
        for what, call in cases.items():
            with pytest.raises(FreightAPIError) as refused:
                call()
            assert 400 <= refused.value.status_code < 500, (what, refused.value)

        # Multipart bodies cut short: the closing boundary missing, and a client gone mid-body.
        boundary = secrets.token_hex(8)
        part = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.parquet"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode() + _parquet(2000)
        answer = _raw_upload(host.api_url, host.key, part, boundary, len(part))
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
        _raw_upload(host.api_url, host.key, part, boundary, len(part) + 500_000)

        # The OpenAI surface: a file that is not JSONL becomes a failed batch; its rows file is temporary.
        http = httpx.Client(
            base_url=host.api_url, headers={"Authorization": f"Bearer {host.key}"}, timeout=60
        )
        with http:
            uploaded = http.post("/v1/files", files={"file": ("b.jsonl", b"not json\n" * 1000)},
                                 data={"purpose": "batch"})  # fmt: skip
            assert uploaded.status_code == 200, uploaded.text
            batch = http.post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                              "endpoint": "/v1/chat/completions", "completion_window": "24h"})  # fmt: skip
            assert batch.status_code == 200 and batch.json()["status"] == "failed", batch.text

        # A partial results download (the job waits for a model nobody serves) is a scratch file.
        job = client.submit(_parquet(3), model=PARKED_MODEL, max_tokens=1)
        partial = client.http.get(f"/v1/jobs/{job['id']}/results")
        assert partial.status_code == 200 and partial.headers["x-freight-results"] == "partial"
        assert int(partial.headers["content-length"]) == len(partial.content)
        assert pq.read_table(io.BytesIO(partial.content)).num_rows == 0
        client.cancel(job["id"])

        # The store stopped during an upload: the spooled write fails, and its spool file goes with it.
        host.server.stop()
        try:
            with pytest.raises(FreightAPIError) as down:
                client.submit(_parquet(3), max_tokens=1)
            assert down.value.status_code >= 500, down.value
        finally:
            host.server.restart()

    deadline = time.monotonic() + 10  # a response's cleanup may run just after the client has it
    while time.monotonic() < deadline and (host.temp_entries() != temp_before or host.spool_files()):
        time.sleep(0.2)
    assert host.temp_entries() == temp_before, sorted(host.temp_entries() - temp_before)
    assert host.spool_files() == []
    assert host.staged() == []
