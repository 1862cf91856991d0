"""The HTTP API on a real `freight api` process, Postgres and Redis. Jobs here go to a model no worker
serves, so they stay queued: these tests cover submission, auth, tenancy, listing and bad input."""

from __future__ import annotations

import io
import os

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from jobs.cli.client import FreightAPIError, FreightClient
from jobs.domain.broker import queue_for_model
from tests.service.fixtures import PARKED_MODEL, ServiceEnv


def parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def small_table(rows: int = 6) -> pa.Table:
    return pa.table({"prompt": [f"question {i}: {'why ' * i}" for i in range(rows)]})


def test_health_and_readiness(api_url: str) -> None:
    assert httpx.get(f"{api_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{api_url}/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready", "database": "ok", "broker": "ok"}
    docs = httpx.get(f"{api_url}/openapi.json").json()
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/results"} <= set(docs["paths"])
    assert httpx.get(f"{api_url}/docs").status_code == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/jobs"),
        ("POST", "/v1/jobs"),
        ("GET", "/v1/jobs/job_x"),
        ("POST", "/v1/jobs/job_x/cancel"),
        ("GET", "/v1/jobs/job_x/results"),
        ("GET", "/v1/jobs/job_x/metrics"),
        ("GET", "/v1/jobs/job_x/report"),
    ],
)
def test_every_v1_route_needs_a_valid_key(api_url: str, method: str, path: str) -> None:
    assert httpx.request(method, f"{api_url}{path}").status_code == 401
    bad = {"Authorization": "Bearer frk_0000000000000000_nope"}
    response = httpx.request(method, f"{api_url}{path}", headers=bad)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"


def test_submit_records_the_job_and_enqueues_one_task_per_shard(
    client: FreightClient, service_env: ServiceEnv
) -> None:
    job = client.submit(small_table(10), model=PARKED_MODEL, max_tokens=5, metadata={"batch": "b1"})
    assert job["status"] == "queued" and job["id"].startswith("job_")
    assert job["request_counts"] == {"total": 10, "completed": 0, "failed": 0}
    assert job["metadata"] == {"batch": "b1"}
    assert job["params"]["max_tokens"] == 5 and job["params"]["model"] == PARKED_MODEL
    assert job["params"]["quantization"] == service_env.settings.quantization
    assert job["started_at"] is None and job["finished_at"] is None and job["error"] is None
    assert [event["status"] for event in client.events(job["id"])] == ["validating", "queued"]

    queue = queue_for_model(service_env.settings, PARKED_MODEL)
    broker = redis.Redis.from_url(service_env.settings.broker_url)
    messages = [m for m in broker.lrange(queue, 0, -1) if job["id"].encode() in m]
    assert len(messages) == 3  # 10 rows in shards of 4

    # Nothing ran yet: the results so far are an empty table with the results schema; metrics are zero.
    results = client.results_table(job["id"])
    assert results.num_rows == 0
    assert results.schema.names == [
        "row_index",
        "custom_id",
        "output_text",
        "prompt_tokens",
        "output_tokens",
        "finish_reason",
        "error",
        "cached",
    ]
    metrics = client.metrics(job["id"])
    assert metrics["rows"] == 10 and metrics["prompt_tokens"] == 0 and metrics["shards"] == 3


def test_tenants_see_only_their_own_jobs(api_url: str, api_keys: dict[str, str]) -> None:
    with (
        FreightClient(api_url, api_keys["acme"]) as acme,
        FreightClient(api_url, api_keys["globex"]) as globex,
    ):
        job = acme.submit(small_table(2), model=PARKED_MODEL)
        for call in (globex.get_job, globex.results_bytes, globex.metrics, globex.cancel, globex.events):
            with pytest.raises(FreightAPIError) as caught:
                call(job["id"])
            assert caught.value.status_code == 404
        assert job["id"] not in {j["id"] for j in globex.iter_jobs()}
        assert job["id"] in {j["id"] for j in acme.iter_jobs()}


def test_listing_follows_the_cursor_and_filters_by_status(api_url: str, service_env: ServiceEnv) -> None:
    from tests.service.fixtures import create_api_key

    with FreightClient(api_url, create_api_key(service_env, "lister")) as lister:
        ids = [lister.submit(small_table(1), model=PARKED_MODEL)["id"] for _ in range(5)]
        page = lister.list_jobs(limit=2)
        assert [j["id"] for j in page["data"]] == ids[::-1][:2] and page["has_more"]
        assert [j["id"] for j in lister.iter_jobs(page_size=2)] == ids[::-1]
        lister.cancel(ids[0])
        assert [j["id"] for j in lister.iter_jobs(status="cancelling")] == [ids[0]]
        assert len(list(lister.iter_jobs(status="queued"))) == 4
        with pytest.raises(FreightAPIError) as caught:
            lister.list_jobs(after="job_unknown")
        assert caught.value.status_code == 422


def test_cancel_of_a_queued_job(client: FreightClient) -> None:
    job = client.submit(small_table(3), model=PARKED_MODEL)
    assert client.cancel(job["id"])["status"] == "cancelling"
    assert client.cancel(job["id"])["status"] == "cancelling"  # asking twice is fine


@pytest.mark.parametrize(
    ("content", "params", "status", "fragment"),
    [
        (b"this is not parquet", "{}", 400, "not a readable Parquet file"),
        (b"", "{}", 400, "empty"),
        (None, "{not json", 422, "not valid JSON"),
        (None, '["a list"]', 422, "JSON object"),
        (None, '{"max_tokenz": 5}', 422, "max_tokenz"),
        (None, '{"temperature": -1}', 422, "temperature"),
        (None, '{"top_p": 0}', 422, "top_p"),
        (None, '{"max_tokens": 0}', 422, "max_tokens"),
        (None, '{"max_tokens": 100000}', 422, "below the model context"),
        (None, '{"model": "gpt-9"}', 422, "unknown model 'gpt-9'"),
        (None, '{"template": "{nope}"}', 422, "['nope']"),
    ],
)
def test_bad_submissions_get_a_clear_4xx_and_leave_nothing(
    api_url: str,
    api_keys: dict[str, str],
    service_env: ServiceEnv,
    content,
    params: str,
    status: int,
    fragment: str,
) -> None:
    content = parquet_bytes(small_table(2)) if content is None else content
    headers = {"Authorization": f"Bearer {api_keys['globex']}"}
    jobs_dir = service_env.settings.resolved_data_dir / "jobs"
    dirs_before = set(jobs_dir.glob("*"))
    before = httpx.get(f"{api_url}/v1/jobs", headers=headers, params={"limit": 100}).json()["data"]
    response = httpx.post(
        f"{api_url}/v1/jobs", headers=headers, files={"file": ("x.parquet", content)}, data={"params": params}
    )
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]["message"]
    after = httpx.get(f"{api_url}/v1/jobs", headers=headers, params={"limit": 100}).json()["data"]
    assert after == before
    assert set(jobs_dir.glob("*")) == dirs_before


def test_uploads_over_the_limit_are_refused_with_413(api_url: str, api_keys: dict[str, str]) -> None:
    big = parquet_bytes(pa.table({"prompt": [os.urandom(1500).hex() for _ in range(1000)]}))
    assert len(big) > 2 * 1024 * 1024
    response = httpx.post(
        f"{api_url}/v1/jobs",
        headers={"Authorization": f"Bearer {api_keys['acme']}"},
        files={"file": ("big.parquet", big)},
        data={"params": "{}"},
    )
    assert response.status_code == 413, response.text
    assert "2 MB" in response.json()["error"]["message"]
