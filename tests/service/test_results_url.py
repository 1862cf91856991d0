"""Results as a pre-signed S3 URL (`GET /v1/jobs/{id}/results/url`, storage/presign.py) through real
processes: `freight api` and `freight worker` with the job files in the session's S3 server (SeaweedFS),
the URL fetched by a plain HTTP client with no credentials; another tenant gets a 404, an expired URL
is refused by the server, and a store in a local folder is a 409 that says why."""

from __future__ import annotations

import contextlib
import io
import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.cli.client import FreightAPIError, FreightClient
from jobs.cli.main import main as freight_main
from tests.s3_server import S3Server
from tests.service.fixtures import (
    PARKED_MODEL,
    ServiceEnv,
    create_api_key,
    make_service_env,
    start_api,
    start_worker,
)

pytestmark = pytest.mark.slow


@dataclass
class UrlService:
    env: ServiceEnv
    api_url: str
    server: S3Server
    store: str  # bucket/prefix of the job files


@pytest.fixture(scope="module")
def url_service(
    tmp_path_factory: pytest.TempPathFactory,
    s3_server: S3Server,
    pg_url: str,
    redis_url: str,
    queue_prefix: str,
    tiny_llama_dir: Path,
) -> Iterator[UrlService]:
    store = f"{s3_server.bucket}/urls-{secrets.token_hex(4)}"
    env = make_service_env(
        tmp_path_factory.mktemp("results-url"),
        pg_url,
        redis_url,
        f"{queue_prefix}-urls",
        str(tiny_llama_dir),
        FREIGHT_STORAGE_URL=f"s3://{store}",
        FREIGHT_S3_ENDPOINT_URL=s3_server.endpoint_url,
    )
    logs = tmp_path_factory.mktemp("results-url-logs")
    api, base_url = start_api(env, logs)
    worker = start_worker(env, logs, "results-url")
    try:
        yield UrlService(env, base_url, s3_server, store)
    finally:
        worker.stop()
        api.stop()


def test_a_presigned_url_hands_the_results_to_their_tenant_only(url_service: UrlService) -> None:
    service = url_service
    owner_key, other_key = create_api_key(service.env, "url-owner"), create_api_key(service.env, "url-other")
    with (
        FreightClient(service.api_url, owner_key) as owner,
        FreightClient(service.api_url, other_key) as other,
    ):
        # Before the job is final there is no results file to sign: a 409 that says so.
        parked = owner.submit(pa.table({"prompt": ["never run"]}), model=PARKED_MODEL, max_tokens=1)
        with pytest.raises(FreightAPIError) as early:
            owner.results_url(parked["id"])
        assert early.value.status_code == 409 and "queued" in early.value.message, early.value.detail
        owner.cancel(parked["id"])

        job = owner.submit(pa.table({"prompt": [f"Count to {i}." for i in range(5)]}), max_tokens=2)
        done = owner.wait(job["id"], poll_seconds=0.5, timeout=300)
        assert done["status"] == "completed", done
        before = datetime.now(UTC)
        answer = owner.results_url(job["id"], expires_in=120)
        assert answer["expires_in"] == 120
        expires_at = datetime.fromisoformat(answer["expires_at"])
        assert before + timedelta(seconds=110) < expires_at < before + timedelta(seconds=130)
        url = answer["url"]
        assert url.startswith(
            f"{service.server.endpoint_url}/{service.store}/jobs/{job['id']}/results.parquet?"
        )
        assert "X-Amz-Signature=" in url and "X-Amz-Expires=120" in url
        # A plain HTTP client with no API key and no AWS credentials gets the very bytes the API serves.
        fetched = httpx.get(url, timeout=30)
        assert fetched.status_code == 200, fetched.text[:500]
        assert fetched.content == owner.results_bytes(job["id"])
        assert pq.read_table(io.BytesIO(fetched.content)).num_rows == 5
        # The signature covers the key: the same query on another object is refused by the server.
        other_object = url.replace("/results.parquet?", "/metrics.json?")
        assert httpx.get(other_object, timeout=30).status_code == 403

        # Another tenant: the job does not exist for it, so no URL either.
        with pytest.raises(FreightAPIError) as foreign:
            other.results_url(job["id"])
        assert foreign.value.status_code == 404

        # Expiry: bounds are checked by the API; a URL past its expiry is refused by the S3 server.
        for bad in (0, 7 * 24 * 3600 + 1):
            with pytest.raises(FreightAPIError) as refused:
                owner.results_url(job["id"], expires_in=bad)
            assert refused.value.status_code == 422 and "expires_in" in refused.value.message
        short = owner.results_url(job["id"], expires_in=1)["url"]
        time.sleep(2.5)
        expired = httpx.get(short, timeout=30)
        assert expired.status_code == 403, (expired.status_code, expired.text[:300])

        # The CLI prints the same answer as JSON.
        out = io.StringIO()
        args = ["results-url", job["id"], "--api-url", service.api_url, "--api-key", owner_key]
        with contextlib.redirect_stdout(out):
            assert freight_main([*args, "--expires-in", "60"]) == 0
        printed = json.loads(out.getvalue())
        assert (
            printed["expires_in"] == 60 and httpx.get(printed["url"], timeout=30).content == fetched.content
        )


def test_a_store_in_a_folder_has_no_presigned_url(client: FreightClient) -> None:
    """The session's service keeps job files in a local folder (the default): 409, naming the route
    that serves the results instead."""
    job = client.submit(pa.table({"prompt": ["hello"]}), model=PARKED_MODEL, max_tokens=1)
    try:
        with pytest.raises(FreightAPIError) as refused:
            client.results_url(job["id"])
        assert refused.value.status_code == 409
        assert (
            "local folder" in refused.value.message
            and f"/v1/jobs/{job['id']}/results" in refused.value.message
        )
    finally:
        client.cancel(job["id"])
