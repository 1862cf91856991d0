"""Fixtures for service tests: a fresh Postgres database and an isolated Redis namespace per test
session, service settings, and real `freight api` / `freight worker` / `freight flower` processes
on loopback. Registered for the whole suite by `pytest_plugins` in tests/conftest.py. Without Postgres or Redis the tests skip locally and fail in CI (CI=true)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from jobs.cli.client import FreightClient
from jobs.domain.settings import Settings

PG_ADMIN_URL = os.environ.get("FREIGHT_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_BASE_URL = os.environ.get("FREIGHT_TEST_REDIS_URL", "redis://127.0.0.1:6379")
FREIGHT_BIN = str(Path(sys.executable).with_name("freight"))
# A model name the API accepts but no test worker serves: jobs sent there wait in their queue.
PARKED_MODEL = "parked-model"


def unavailable(message: str) -> None:
    """Fail in CI (a missing service there is a broken setup), skip on a developer machine."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """SQLAlchemy URL of a new, migrated database, dropped at the end of the session."""
    import psycopg

    from storage.db import upgrade

    name = f"freight_test_{secrets.token_hex(6)}"
    try:
        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        unavailable(f"PostgreSQL is not reachable at {PG_ADMIN_URL}: {exc}")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    url = f"{base}/{name}"
    upgrade(url)
    yield url
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis database number picked at random; queue names carry a unique prefix as well."""
    import redis

    db = secrets.randbelow(14) + 2  # 0 and 1 are left to whatever else uses this Redis
    url = f"{REDIS_BASE_URL}/{db}"
    client = redis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        unavailable(f"Redis is not reachable at {REDIS_BASE_URL}: {exc}")
    yield url
    client.close()


@pytest.fixture(scope="session")
def queue_prefix(redis_url: str) -> Iterator[str]:
    import redis

    prefix = f"freight-test-{secrets.token_hex(4)}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"*{prefix}*"):
        client.delete(key)
    client.close()


@dataclass
class ServiceEnv:
    """Settings of one test service, and the same as FREIGHT_* variables for subprocesses."""

    settings: Settings
    env: dict[str, str] = field(default_factory=dict)

    def subprocess_env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, **self.env, **extra}


def make_service_env(
    tmp: Path,
    pg: str,
    redis: str,
    prefix: str,
    model: str,
    other_models: tuple[str, ...] = (),
    **overrides: str,
) -> ServiceEnv:
    values = {
        "FREIGHT_HOME": str(tmp / "home"),
        "FREIGHT_DATABASE_URL": pg,
        "FREIGHT_BROKER_URL": redis,
        "FREIGHT_DATA_DIR": str(tmp / "data"),
        "FREIGHT_QUEUE_PREFIX": prefix,
        "FREIGHT_DEFAULT_MODEL": model,
        "FREIGHT_MODELS": json.dumps([model, PARKED_MODEL, *other_models]),
        "FREIGHT_SHARD_SIZE": "4",
        "FREIGHT_MAX_MODEL_LEN": "512",
        "FREIGHT_MAX_NUM_SEQS": "16",
        "FREIGHT_MAX_NUM_BATCHED_TOKENS": "1024",
        "FREIGHT_KV_CACHE_MEMORY_GB": "0.25",
        "FREIGHT_NUM_THREADS": "1",
        "FREIGHT_RESULT_CHUNK_ROWS": "2",
        "FREIGHT_MAX_UPLOAD_MB": "2",
        **overrides,
    }
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        settings = Settings()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return ServiceEnv(settings, values)


class Process:
    """A `freight ...` subprocess whose output goes to a log file (shown when a test fails)."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [FREIGHT_BIN, *args], env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        if self.alive():
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self.log.close()


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, process: Process | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and not process.alive():
            raise AssertionError(f"{what}: the process exited early:\n{process.output()[-4000:]}")
        try:
            if condition():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.2)
    tail = f"\n{process.output()[-4000:]}" if process is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{tail}")


def start_api(service: ServiceEnv, log_dir: Path) -> tuple[Process, str]:
    port = free_port()
    process = Process(["api", "--port", str(port)], service.subprocess_env(), log_dir / f"api-{port}.log")
    base_url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200, 60, "the API", process)
    return process, base_url


def start_worker(service: ServiceEnv, log_dir: Path, name: str, *extra: str) -> Process:
    """A `freight worker` process, returned once Celery answers its ping (the model is loaded)."""
    from celery import Celery

    from jobs.domain.broker import celery_config

    hostname = f"{name}-{secrets.token_hex(3)}@test"
    metrics_port = free_port()  # each worker serves its Prometheus metrics on its own port
    process = Process(
        ["worker", "--hostname", hostname, "--loglevel", "INFO", "--metrics-port", str(metrics_port), *extra],
        service.subprocess_env(),
        log_dir / f"worker-{name}.log",
    )
    control = Celery("freight-test-control", set_as_current=False)
    control.conf.update(celery_config(service.settings))
    try:
        wait_until(
            lambda: bool(control.control.ping(destination=[hostname], timeout=0.5)),
            180,
            f"worker {name}",
            process,
        )
    finally:
        control.close()
    process.hostname = hostname
    process.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    return process


def create_api_key(service: ServiceEnv, tenant: str) -> str:
    from storage.db import make_engine, make_session_factory
    from storage.keys import create_key

    engine = make_engine(service.settings.resolved_database_url)
    try:
        with make_session_factory(engine)() as session:
            return create_key(session, tenant).key
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def service_env(
    tmp_path_factory: pytest.TempPathFactory,
    pg_url: str,
    redis_url: str,
    queue_prefix: str,
    tiny_llama_dir: Path,
    smollm2_path: Path,
) -> ServiceEnv:
    """Settings for the session's service: the tiny model is the default; the real one is accepted too."""
    tmp = tmp_path_factory.mktemp("service")
    return make_service_env(tmp, pg_url, redis_url, queue_prefix, str(tiny_llama_dir), (str(smollm2_path),))


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def api_url(service_env: ServiceEnv, log_dir: Path) -> Iterator[str]:
    process, base_url = start_api(service_env, log_dir)
    yield base_url
    process.stop()


@pytest.fixture(scope="session")
def api_keys(service_env: ServiceEnv) -> dict[str, str]:
    """One key for each of two tenants."""
    return {tenant: create_api_key(service_env, tenant) for tenant in ("acme", "globex")}


@pytest.fixture
def client(api_url: str, api_keys: dict[str, str]) -> Iterator[FreightClient]:
    with FreightClient(api_url, api_keys["acme"]) as freight:
        yield freight


@pytest.fixture(scope="session")
def worker(service_env: ServiceEnv, log_dir: Path) -> Iterator[Process]:
    """One `freight worker` serving the tiny model for the whole session."""
    process = start_worker(service_env, log_dir, "main")
    yield process
    process.stop()
