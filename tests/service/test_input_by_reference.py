"""Inputs by reference through real processes: Parquet files in a real S3 server (SeaweedFS), named by
s3:// URI to `freight api` (FREIGHT_INPUT_ALLOW), validated and sharded in place on row-group ranges,
run by a `freight worker` that reads only its shard's row groups; refused URIs are 4xx with nothing
stored. The job files themselves live in the same S3 server (FREIGHT_STORAGE_URL=s3://...)."""

from __future__ import annotations

import io
import json
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from sqlalchemy import delete, select

from jobs.cli.client import FreightAPIError, FreightClient
from storage.db import make_engine, make_session_factory
from storage.models import Job, Shard, ThroughputProfile
from storage.profile_store import ShardWork, record_shard
from tests.s3_server import S3Server
from tests.service.fixtures import (
    FREIGHT_BIN,
    PARKED_MODEL,
    ServiceEnv,
    create_api_key,
    make_service_env,
    start_api,
    start_worker,
)

ROW_GROUP_ROWS = 3


@dataclass
class RefService:
    env: ServiceEnv
    client: FreightClient
    server: S3Server
    allowed: str  # bucket/prefix the service may read
    store_prefix: str  # bucket/prefix of the job files
    api_url: str
    api_key: str


@pytest.fixture(scope="module")
def ref_service(
    tmp_path_factory: pytest.TempPathFactory,
    s3_server: S3Server,
    pg_url: str,
    redis_url: str,
    queue_prefix: str,
    tiny_llama_dir: Path,
) -> Iterator[RefService]:
    """An API and a worker of their own (own queues: the session's worker has no S3 credentials), with
    s3://<bucket>/allowed-<token> readable and the job files under s3://<bucket>/store-<token>."""
    token = secrets.token_hex(4)
    allowed, store = f"{s3_server.bucket}/allowed-{token}", f"{s3_server.bucket}/store-{token}"
    env = make_service_env(
        tmp_path_factory.mktemp("by-reference"),
        pg_url,
        redis_url,
        f"{queue_prefix}-ref",
        str(tiny_llama_dir),
        FREIGHT_INPUT_ALLOW=f'["s3://{allowed}"]',
        FREIGHT_STORAGE_URL=f"s3://{store}",
        FREIGHT_S3_ENDPOINT_URL=s3_server.endpoint_url,
        FREIGHT_SHARD_SIZE="4",
    )
    logs = tmp_path_factory.mktemp("by-reference-logs")
    api, base_url = start_api(env, logs)
    worker = start_worker(env, logs, "by-reference")
    try:
        key = create_api_key(env, "refs")
        with FreightClient(base_url, key) as client:
            yield RefService(env, client, s3_server, allowed, store, base_url, key)
    finally:
        worker.stop()
        api.stop()


def _put_parquet(server: S3Server, path: str, table: pa.Table) -> None:
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=ROW_GROUP_ROWS)
    with server.filesystem().open_output_stream(path) as out:
        out.write(sink.getvalue())


def _jobs_stored(env: ServiceEnv) -> list[tuple[str, int]]:
    engine = make_engine(env.settings.resolved_database_url)
    try:
        with make_session_factory(engine)() as session:
            return list(session.execute(select(Job.id, Job.num_shards).where(Job.tenant == "refs")))
    finally:
        engine.dispose()


def _job_folders(service: RefService) -> set[str]:
    """The job folders in the store (a refused submission must leave none)."""
    selector = pafs.FileSelector(f"{service.store_prefix}/jobs", recursive=True, allow_not_found=True)
    return {info.path.split("/")[-2] for info in service.server.filesystem().get_file_info(selector)
            if info.type == pafs.FileType.File}  # fmt: skip


def _pieces(env: ServiceEnv, job_id: str) -> list[list[dict]]:
    engine = make_engine(env.settings.resolved_database_url)
    try:
        with make_session_factory(engine)() as session:
            query = select(Shard.pieces).where(Shard.job_id == job_id).order_by(Shard.shard_index)
            return list(session.scalars(query))
    finally:
        engine.dispose()


@pytest.mark.slow
def test_job_by_reference_runs_every_row_once(ref_service: RefService) -> None:
    service, server = ref_service, ref_service.server
    folder = f"{service.allowed}/docs-{secrets.token_hex(3)}"
    # Two files of several row groups (3 rows each): 7 rows (3+3+1) and 5 rows (3+2); a stray non-Parquet
    # object beside them is not matched by the glob.
    first = pa.table({"custom_id": [f"a{i}" for i in range(7)], "prompt": [f"Count to {i}." for i in range(7)]})
    second = pa.table({"custom_id": [f"b{i}" for i in range(5)], "prompt": [f"Name {i} birds." for i in range(5)]})
    _put_parquet(server, f"{folder}/part-0.parquet", first)
    _put_parquet(server, f"{folder}/part-1.parquet", second)
    with server.filesystem().open_output_stream(f"{folder}/_SUCCESS") as out:
        out.write(b"")

    job = service.client.submit_by_reference(f"s3://{folder}/*.parquet", max_tokens=2)
    assert job["status"] == "queued" and job["request_counts"]["total"] == 12
    # Shards of 4 rows cut on row-group ranges in file order; the second piece of a shard may start
    # inside a row group (skip) when a group is split between shards.
    assert _pieces(service.env, job["id"]) == [
        [{"file": 0, "row_groups": [0, 2], "skip": 0, "rows": [0, 4]}],
        [{"file": 0, "row_groups": [1, 3], "skip": 1, "rows": [4, 7]},
         {"file": 1, "row_groups": [0, 1], "skip": 0, "rows": [7, 8]}],
        [{"file": 1, "row_groups": [0, 2], "skip": 1, "rows": [8, 12]}],
    ]  # fmt: skip
    done = service.client.wait(job["id"], poll_seconds=0.5, timeout=300)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    results = service.client.results_table(job["id"]).to_pylist()
    expected = first.column("custom_id").to_pylist() + second.column("custom_id").to_pylist()
    assert [row["custom_id"] for row in results] == expected  # every row, once, in file order
    assert [row["row_index"] for row in results] == list(range(12))
    assert all(row["output_tokens"] >= 1 and row["error"] is None for row in results)
    # The job's files are in the store; the input stayed where it was, uncopied.
    selector = pafs.FileSelector(f"{service.store_prefix}/jobs/{job['id']}")
    names = sorted(info.base_name for info in server.filesystem().get_file_info(selector))
    assert names == ["inputs.json", "metrics.json", "results.parquet"]


def test_refused_inputs_store_nothing(ref_service: RefService, tmp_path: Path) -> None:
    service, server = ref_service, ref_service.server
    outside = f"{server.bucket}/outside-{secrets.token_hex(3)}"
    _put_parquet(server, f"{outside}/x.parquet", pa.table({"prompt": ["hi"]}))
    with server.filesystem().open_output_stream(f"{service.allowed}/notes.txt") as out:
        out.write(b"not parquet at all")
    (tmp_path / "local.parquet").write_bytes(b"")
    # custom_id must be unique over all the files of a job, not only within each.
    _put_parquet(server, f"{service.allowed}/dup/a.parquet", pa.table({"custom_id": ["x", "y"], "prompt": ["1", "2"]}))
    _put_parquet(server, f"{service.allowed}/dup/b.parquet", pa.table({"custom_id": ["z", "x"], "prompt": ["3", "4"]}))
    before, folders_before = _jobs_stored(service.env), _job_folders(service)
    cases = {
        f"s3://{outside}/x.parquet": (403, "FREIGHT_INPUT_ALLOW"),
        f"s3://{service.allowed}-evil/x.parquet": (403, "FREIGHT_INPUT_ALLOW"),  # a sibling, not under it
        f"s3://{service.allowed}/../{outside.split('/')[1]}/x.parquet": (422, "'..'"),
        f"file://{tmp_path}/local.parquet": (422, "only s3://"),
        "http://169.254.169.254/latest/meta-data/": (422, "only s3://"),
        f"s3://{service.allowed}/missing.parquet": (400, "no such object"),
        f"s3://{service.allowed}/notes.txt": (400, "not a readable Parquet file"),
        f"s3://{service.allowed}/dup/": (422, "custom_id must be unique; repeated: 'x'"),
    }
    for uri, (status, words) in cases.items():
        with pytest.raises(FreightAPIError) as refused:
            service.client.submit_by_reference(uri, model=PARKED_MODEL, max_tokens=1)
        assert refused.value.status_code == status, (uri, refused.value.detail)
        message = refused.value.detail["message"]
        assert uri[:60] in message and words in message, (uri, message)
    # The CLI takes URIs the same way and says why the service refused them.
    cli = subprocess.run(
        [FREIGHT_BIN, "submit", f"s3://{outside}/x.parquet", "--max-tokens", "1"],
        env=service.env.subprocess_env(FREIGHT_API_URL=service.api_url, FREIGHT_API_KEY=service.api_key),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cli.returncode != 0 and "FREIGHT_INPUT_ALLOW" in cli.stderr, cli.stderr
    assert _jobs_stored(service.env) == before
    assert _job_folders(service) == folders_before


PROFILE_CLASS = "by-reference-deadline-test"


def test_by_reference_jobs_are_quoted_and_warned_of_their_deadline(ref_service: RefService) -> None:
    """A job by reference gets the quote's deadline check as an upload does (a warning, or a 422 with
    strict_deadline), and POST /v1/jobs/quote takes the same JSON body: the files checked in place, the
    counts summed over them, the shards the submission makes."""
    service, server = ref_service, ref_service.server
    folder = f"{service.allowed}/late-{secrets.token_hex(3)}"
    prompts = [f"Write {i} lines about the sea." for i in range(40)]
    _put_parquet(server, f"{folder}/a.parquet", pa.table({"prompt": prompts[:25]}))
    _put_parquet(server, f"{folder}/b.parquet", pa.table({"prompt": prompts[25:]}))
    uri = f"s3://{folder}/*.parquet"
    late = dict(model=PARKED_MODEL, max_tokens=200, completion_window="1m")
    engine = make_engine(service.env.settings.resolved_database_url)
    sessions = make_session_factory(engine)
    # Nobody serves the parked model: a measured 0.1 s per output token prices 40 x 200 tokens far past
    # the one-minute window (tests/service/test_scheduling.py does the same for uploads).
    with sessions() as session:
        record_shard(session, model=PARKED_MODEL, worker_class=PROFILE_CLASS, work=ShardWork(4, 40, 800, 80.0, 800))
    try:
        quote = service.client.quote_by_reference(uri, **late)
        assert quote["rows"] == 40 and quote["rows_to_run"] == 40
        assert quote["prompt_chars"] == sum(len(text) for text in prompts)  # summed over both files
        assert quote["deadline_met"] is False and "after its deadline" in quote["deadline_warning"]
        before = _jobs_stored(service.env)
        with pytest.raises(FreightAPIError) as refused:
            service.client.submit_by_reference(uri, strict_deadline=True, **late)
        assert refused.value.status_code == 422 and "strict_deadline" in refused.value.message
        assert _jobs_stored(service.env) == before  # nothing stored
        job = service.client.submit_by_reference(uri, **late)
        assert "after its deadline" in job["deadline_warning"]
        stored = dict(_jobs_stored(service.env))
        assert stored[job["id"]] == quote["shards"] == 10  # 40 rows in shards of 4
        service.client.cancel(job["id"])  # parked: nobody would run it
        # The quote refuses what the submission refuses, with the same answer.
        outside = f"s3://{server.bucket}/outside-{secrets.token_hex(3)}/x.parquet"
        for call in (service.client.quote_by_reference, service.client.submit_by_reference):
            with pytest.raises(FreightAPIError) as denied:
                call(outside, max_tokens=1)
            assert denied.value.status_code == 403 and "FREIGHT_INPUT_ALLOW" in denied.value.message
    finally:
        with sessions() as session:
            session.execute(delete(ThroughputProfile).where(ThroughputProfile.worker_class == PROFILE_CLASS))
            session.commit()
        engine.dispose()
    # The CLI quotes URIs as it submits them.
    cli = subprocess.run(
        [FREIGHT_BIN, "quote", uri, "--model", PARKED_MODEL, "--max-tokens", "1"],
        env=service.env.subprocess_env(FREIGHT_API_URL=service.api_url, FREIGHT_API_KEY=service.api_key),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["rows"] == 40 and "40 rows" in cli.stderr
