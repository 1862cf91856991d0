"""Shared by the issue-28 service tests: what a refused request must not leave behind (rows in any table,
files under the data folder, messages in the model's queue), raw HTTP on a socket, and request bodies
written by hand; `served`, the app on uvicorn in a thread of the test's process."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import redis
import uvicorn
from sqlalchemy import func, select

from jobs.api.app import create_app
from jobs.domain.broker import TASK_RUN_SHARD, message_work, queue_for_model
from jobs.domain.settings import Settings
from storage.db import make_engine, make_session_factory
from storage.models import Job, JobEvent, OpenAIBatch, OpenAIFile, Shard
from tests.service.fixtures import PARKED_MODEL, ServiceEnv, free_port

BOUNDARY = "freight-issue28-boundary"


def parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def part(name: str, content: bytes, filename: str | None = None, *, raw_name: bytes | None = None) -> bytes:
    name_bytes = raw_name if raw_name is not None else name.encode()
    disposition = b'form-data; name="' + name_bytes + b'"' + (f'; filename="{filename}"'.encode() if filename else b"")
    return f"--{BOUNDARY}\r\n".encode() + b"Content-Disposition: " + disposition + b"\r\n\r\n" + content + b"\r\n"


def multipart(*parts: bytes, close: bool = True, preamble: bytes = b"") -> bytes:
    return preamble + b"".join(parts) + (f"--{BOUNDARY}--\r\n".encode() if close else b"")


MULTIPART = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


@dataclass(frozen=True)
class Snapshot:
    rows: dict[str, int]
    files: frozenset[Path]
    messages: int


class Leftovers:
    """Counts everything a tenant's requests could leave: rows of every table a submission writes,
    every file under the data folder, and the shard messages in the parked model's queue."""

    def __init__(self, service: ServiceEnv, tenant: str) -> None:
        self.service = service
        self.tenant = tenant
        self.engine = make_engine(service.settings.resolved_database_url)
        self.sessions = make_session_factory(self.engine)
        self.redis = redis.Redis.from_url(service.settings.broker_url)
        self.queue = queue_for_model(service.settings, PARKED_MODEL)
        self.before = self.snapshot()

    def close(self) -> None:
        self.redis.close()
        self.engine.dispose()

    def snapshot(self) -> Snapshot:
        with self.sessions() as session:
            job_ids = select(Job.id).where(Job.tenant == self.tenant)
            rows = {
                "jobs": session.scalar(select(func.count()).select_from(Job).where(Job.tenant == self.tenant)),
                "shards": session.scalar(select(func.count()).select_from(Shard).where(Shard.job_id.in_(job_ids))),
                "events": session.scalar(
                    select(func.count()).select_from(JobEvent).where(JobEvent.job_id.in_(job_ids))
                ),
                "batches": session.scalar(
                    select(func.count()).select_from(OpenAIBatch).where(OpenAIBatch.tenant == self.tenant)
                ),
                "files": session.scalar(
                    select(func.count()).select_from(OpenAIFile).where(OpenAIFile.tenant == self.tenant)
                ),
            }
        data = self.service.settings.resolved_data_dir
        files = frozenset(path for path in data.rglob("*") if path.is_file()) if data.exists() else frozenset()
        return Snapshot(rows, files, self.messages())

    def messages(self, job_id: str | None = None) -> int:
        count = 0
        for raw in self.redis.lrange(self.queue, 0, -1):
            work = message_work(raw)
            if work is not None and work[0] == TASK_RUN_SHARD and (job_id is None or work[1] == job_id):
                count += 1
        return count

    def assert_none(self) -> None:
        after = self.snapshot()
        assert after.rows == self.before.rows, (self.before.rows, after.rows)
        assert after.files == self.before.files, sorted(map(str, after.files ^ self.before.files))
        assert after.messages == self.before.messages


class RawConnection:
    """One keep-alive HTTP/1.1 connection on a plain socket: what is sent is exactly what is written."""

    def __init__(self, api_url: str, key: str | None = None, timeout: float = 15) -> None:
        url = urlsplit(api_url)
        self.host = f"{url.hostname}:{url.port}"
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}
        self.sock = socket.create_connection((url.hostname, url.port), timeout=timeout)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        head = {"Host": self.host, **self.auth, "Content-Length": str(len(body)), **(headers or {})}
        lines = [f"{method} {path} HTTP/1.1", *(f"{name}: {value}" for name, value in head.items())]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buffer += chunk

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
        length = int(headers.get("content-length", "0"))
        while len(self.buffer) < length:
            self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, body

    def closed_by_server(self) -> bool:
        """True when the server closed its end cleanly (EOF, not a reset) with nothing more to read."""
        if self.buffer:
            return False
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return False


def error_of(body: bytes) -> dict:
    """The `error` object of a response body in Freight's one shape (asserts the shape)."""
    payload = json.loads(body)
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert {"message", "type", "param", "code"} <= set(error) and error["message"], error
    return error


@contextmanager
def served(settings: Settings, protocol: type) -> Iterator[str]:
    """The real app on `settings`, served by uvicorn with `protocol` on a thread of this process."""
    port = free_port()
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, http=protocol, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"api-{protocol.__name__}", daemon=True)
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
