"""Workers that share nothing but Postgres, Redis and the bucket: `freight api` and two `freight worker`s,
each with a local FREIGHT_HOME / FREIGHT_DATA_DIR of its own, and the job files in the session's S3
server (SeaweedFS, tests/s3_server.py). Faults on the store: the server stopped and started again
mid-job (retries, not rows), and a worker SIGKILLed while it writes the results (no partial object).

Short timeouts as in test_faults.py: a 5 s shard lease, a 1 s broker visibility timeout, 2 attempts per
shard (so an outage that used up attempts would show as error rows)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from jobs.cli.client import FreightClient
from tests.s3_server import S3Server
from tests.service.fault_helpers import ServiceDB, assert_one_result_per_row, sigkill, wait_for
from tests.service.fixtures import (
    Process,
    ServiceEnv,
    create_api_key,
    make_service_env,
    start_api,
    start_worker,
)

pytestmark = pytest.mark.slow


@dataclass
class Cluster:
    server: S3Server
    store: str  # bucket/prefix of the job files
    api_env: ServiceEnv
    worker_envs: list[ServiceEnv]
    workers: list[Process]
    client: FreightClient
    db: ServiceDB

    def local_folders(self) -> list[Path]:
        """Every host's FREIGHT_HOME and FREIGHT_DATA_DIR."""
        return [
            Path(env.env[name]) for env in (self.api_env, *self.worker_envs)
            for name in ("FREIGHT_HOME", "FREIGHT_DATA_DIR")
        ]  # fmt: skip

    def objects(self, job_id: str) -> dict[str, int]:
        """The job's objects in the bucket, by the admin's listing: {name: size}."""
        selector = pafs.FileSelector(f"{self.store}/jobs/{job_id}", recursive=True, allow_not_found=True)
        infos = self.server.filesystem().get_file_info(selector)
        return {info.base_name: info.size for info in infos if info.type == pafs.FileType.File}


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
    s3_server: S3Server,
    pg_url: str,
    redis_url: str,
    queue_prefix: str,
    tiny_llama_dir: Path,
) -> Iterator[Cluster]:
    store = f"{s3_server.bucket}/share-{secrets.token_hex(4)}"
    common = dict(
        FREIGHT_STORAGE_URL=f"s3://{store}",
        FREIGHT_S3_ENDPOINT_URL=s3_server.endpoint_url,
        FREIGHT_SHARD_SIZE="2",
        FREIGHT_MAX_MODEL_LEN="2048",
        FREIGHT_RESULT_CHUNK_ROWS="1",
        FREIGHT_SHARD_LEASE_SECONDS="5",
        FREIGHT_BROKER_VISIBILITY_TIMEOUT="1",
        FREIGHT_SHARD_MAX_ATTEMPTS="2",
        FREIGHT_RECOVERY_INTERVAL_SECONDS="2",
    )
    # One temp folder per host: make_service_env puts FREIGHT_HOME and FREIGHT_DATA_DIR inside it.
    envs = [
        make_service_env(
            tmp_path_factory.mktemp(f"host-{name}"), pg_url, redis_url, f"{queue_prefix}-share",
            str(tiny_llama_dir), **common,
        )
        for name in ("api", "w1", "w2")
    ]  # fmt: skip
    logs = tmp_path_factory.mktemp("share-nothing-logs")
    api, base_url = start_api(envs[0], logs)
    with ThreadPoolExecutor(2) as pool:  # the two model loads overlap
        workers = list(pool.map(lambda i: start_worker(envs[i], logs, f"share-w{i}"), (1, 2)))
    db = ServiceDB(envs[0])
    try:
        with FreightClient(base_url, create_api_key(envs[0], "share")) as client:
            yield Cluster(s3_server, store, envs[0], envs[1:], workers, client, db)
    finally:
        db.close()
        for process in workers:
            process.stop()
        api.stop()


def _table(rows: int, tag: str, max_tokens: list[int]) -> pa.Table:
    return pa.table(
        {
            "custom_id": [f"{tag}-{i:03d}" for i in range(rows)],
            "prompt": [f"{tag} row {i}: tell a story." for i in range(rows)],
            "max_tokens": pa.array([max_tokens[i % len(max_tokens)] for i in range(rows)], pa.int64()),
        }
    )


def _local_files(folders: list[Path]) -> list[Path]:
    """Every file under the hosts' folders but a worker's kernel calibration cache (FREIGHT_HOME/calibration:
    per host by design, no job's)."""
    return [
        path for folder in folders if folder.exists() for path in folder.rglob("*")
        if path.is_file() and "calibration" not in path.relative_to(folder).parts[:1]
    ]  # fmt: skip


def test_hosts_share_only_the_store_and_survive_its_restart(cluster: Cluster) -> None:
    table = _table(16, "share", [1, 150])  # 8 shards of 2 rows; greedy, so every run alike
    job = cluster.client.submit(table, max_tokens=4, reuse_results=False)  # rows say their own
    job_id = job["id"]
    # Some shards done, some to go: stop the store, keep it down a few seconds, start it again.
    wait_for(lambda: any(s.status == "done" for s in cluster.db.shards(job_id)), 60, "a shard done")
    cluster.server.stop()
    try:
        time.sleep(3)
    finally:
        cluster.server.restart()
    done = cluster.client.wait(job_id, poll_seconds=0.3, timeout=120)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 16, "completed": 16, "failed": 0}
    rows = assert_one_result_per_row(cluster.client, job_id, table)  # through the API, from the bucket
    assert all(row["error"] is None for row in rows)

    attempts = cluster.db.attempts(job_id)
    # The outage cost retries (shards that started while the store was down), no shard's attempts.
    assert any(a.outcome == "retry" for a in attempts), [(a.shard_index, a.outcome) for a in attempts]
    assert all(s.status == "done" and s.attempts == 1 for s in cluster.db.shards(job_id))
    # Both hosts ran shards.
    pids = {int(a.owner.split(":")[1]) for a in attempts if a.outcome == "done"}
    assert pids == {process.popen.pid for process in cluster.workers}

    # The job's files are in the bucket, and no host keeps one (the spool is empty again).
    assert set(cluster.objects(job_id)) == {"input.parquet", "results.parquet", "metrics.json"}
    assert _local_files(cluster.local_folders()) == []


def test_worker_killed_while_writing_results_leaves_no_partial_object(cluster: Cluster) -> None:
    # One shard: a row stored at once, then one that runs for seconds, so the store can be frozen
    # before the shard ends; the worker's finalize then blocks on the store inside the results writer
    # (its spool file made, nothing uploaded yet), where it is killed.
    table = _table(2, "kill", [1, 1500])
    job_id = cluster.client.submit(table, max_tokens=4, reuse_results=False)["id"]  # rows say their own
    wait_for(lambda: cluster.db.stored_rows(job_id) == 1, 60, "the first row stored")
    cluster.server.freeze()
    try:
        spools = [env.settings.spool_dir for env in cluster.worker_envs]
        writing = wait_for(
            lambda: [i for i, spool in enumerate(spools) if spool.exists() and any(spool.iterdir())],
            60,
            "a worker writing results.parquet",
        )
        victim = cluster.workers[writing[0]]
        sigkill(victim)
    finally:
        cluster.server.thaw()
    # Whatever reached the bucket is whole: every object there opens.
    for name in cluster.objects(job_id):
        path = f"{cluster.store}/jobs/{job_id}/{name}"
        with cluster.server.filesystem().open_input_file(path) as source:
            if name.endswith(".parquet"):
                pq.read_metadata(source)
            else:
                json.loads(source.read())
    # The other worker finalizes the job.
    done = cluster.client.wait(job_id, poll_seconds=0.3, timeout=120)
    assert done["status"] == "completed", done
    assert_one_result_per_row(cluster.client, job_id, table)
    assert set(cluster.objects(job_id)) == {"input.parquet", "results.parquet", "metrics.json"}
