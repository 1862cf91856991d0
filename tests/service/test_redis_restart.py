"""Redis restarted mid-job, on a Redis of this test's own (the shared one on 6379 serves other tests).
It runs without persistence, so the restart loses every queued shard message: the worker must
reconnect, and the API's recovery sweep must notice the shards nobody will run and send them again."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from jobs.cli.client import FreightAPIError, FreightClient
from tests.service.fault_helpers import ServiceDB, assert_one_result_per_row, staggered_table, wait_for
from tests.service.fixtures import (
    ServiceEnv,
    create_api_key,
    free_port,
    make_service_env,
    start_api,
    start_worker,
)

pytestmark = pytest.mark.slow


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.popen = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        wait_for(lambda: _pings(client), 10, "redis-server")
        client.close()

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def restart_env(
    tmp_path_factory: pytest.TempPathFactory, pg_url: str, own_redis: RedisServer, tiny_llama_dir: Path
) -> ServiceEnv:
    return make_service_env(
        tmp_path_factory.mktemp("redis-restart"),
        pg_url,
        own_redis.url,
        "freight-restart",
        str(tiny_llama_dir),
        FREIGHT_MAX_MODEL_LEN="2048",
        FREIGHT_SHARD_LEASE_SECONDS="5",
        FREIGHT_RESULT_CHUNK_ROWS="1",
        FREIGHT_RECOVERY_INTERVAL_SECONDS="2",
    )


def test_redis_restarted_mid_job_loses_its_queue_and_the_job_still_completes(
    restart_env: ServiceEnv, own_redis: RedisServer, log_dir: Path
) -> None:
    api, url = start_api(restart_env, log_dir)
    worker = start_worker(restart_env, log_dir, "restart")
    db = ServiceDB(restart_env)
    try:
        table = staggered_table(16, (100, 400, 700, 1000))  # 4 shards, one worker: they queue up
        with FreightClient(url, create_api_key(restart_env, "restart")) as client:
            job = client.submit(table, max_tokens=8)
            wait_for(lambda: db.stored_rows(job["id"]) > 0, 60, "the first rows")

            own_redis.stop()
            # While the broker is down a submission is refused clearly, and nothing is left queued.
            with pytest.raises(FreightAPIError) as refused:
                client.submit(table, max_tokens=8)
            assert refused.value.status_code == 503 and "queue is unavailable" in str(refused.value)
            ready = httpx.get(f"{url}/readyz", timeout=10)
            assert ready.status_code == 503 and ready.json()["broker"].startswith("unreachable")
            own_redis.start()  # empty: the queued shard messages are gone

            done = client.wait(job["id"], poll_seconds=0.3, timeout=180)
            assert done["status"] == "completed", done
            assert_one_result_per_row(client, job["id"], table)
            # submission is atomic: the refused one left no job behind (not even a failed one)
            assert [j["id"] for j in client.iter_jobs()] == [job["id"]]
        assert all(shard.status == "done" and shard.attempts == 1 for shard in db.shards(job["id"]))
        assert "re-sent freight.run_shard" in api.output()
    finally:
        db.close()
        worker.stop()
        api.stop()
