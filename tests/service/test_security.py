"""Security on a real `freight api`: every /v1 route (read from the API's own OpenAPI document, so a new
route is covered the day it is added) needs a valid, unrevoked key, and another tenant's job is a 404
on each of them and absent from listings; keys are salted hashes compared in constant time and
revoked with `freight keys revoke`; a job file is only data to the worker."""

from __future__ import annotations

import hmac
import os
import pickle
import re
import subprocess
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import select

import storage.keys
from jobs.cli.client import FreightClient
from storage.db import make_engine, make_session_factory
from storage.keys import tenant_for_key
from storage.models import ApiKey
from tests.service.fixtures import FREIGHT_BIN, PARKED_MODEL, Process, ServiceEnv, create_api_key


def v1_routes(api_url: str) -> list[tuple[str, str]]:
    spec = httpx.get(f"{api_url}/openapi.json").json()
    return [
        (method.upper(), path)
        for path, operations in spec["paths"].items()
        if path.startswith("/v1/")
        for method in operations
    ]


def job_routes(api_url: str) -> list[tuple[str, str]]:
    routes = [(method, path) for method, path in v1_routes(api_url) if "{job_id}" in path]
    assert len(routes) >= 6  # get, events, cancel, results, metrics, and whatever came since
    return routes


def test_every_v1_route_refuses_missing_wrong_and_revoked_keys(
    api_url: str, service_env: ServiceEnv, tmp_path: Path
) -> None:
    env = service_env.subprocess_env()
    created = subprocess.run(
        [FREIGHT_BIN, "keys", "create", "--tenant", "soon-revoked"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    key = created.stdout.strip()
    key_id = re.search(r"key id (\w+)", created.stderr).group(1)
    assert httpx.get(f"{api_url}/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    revoked = subprocess.run([FREIGHT_BIN, "keys", "revoke", key_id], env=env, capture_output=True, text=True)
    assert revoked.returncode == 0 and "revoked" in revoked.stderr
    listing = subprocess.run(
        [FREIGHT_BIN, "keys", "list", "--tenant", "soon-revoked"], env=env, capture_output=True, text=True
    )
    assert key_id in listing.stdout and "revoked" in listing.stdout and key not in listing.stdout

    routes = v1_routes(api_url)
    assert {("GET", "/v1/jobs"), ("POST", "/v1/jobs")} <= set(routes)
    bad_headers = {
        "missing": {},
        "not bearer": {"Authorization": f"Basic {key}"},
        "malformed": {"Authorization": "Bearer nonsense"},
        "wrong secret": {"Authorization": f"Bearer {key[:-4]}AAAA"},
        "unknown id": {"Authorization": f"Bearer frk_{'0' * 16}_{key.split('_', 2)[2]}"},
        "revoked": {"Authorization": f"Bearer {key}"},
    }
    for method, path in routes:
        url = f"{api_url}{path.replace('{job_id}', 'job_0')}"
        for name, headers in bad_headers.items():
            response = httpx.request(method, url, headers=headers)
            assert response.status_code == 401, (method, path, name, response.text)
            assert response.headers["www-authenticate"] == "Bearer"


def test_another_tenants_job_is_a_404_on_every_route_and_absent_from_listings(
    api_url: str, service_env: ServiceEnv
) -> None:
    owner_key = create_api_key(service_env, "owner-co")
    other_key = create_api_key(service_env, "other-co")
    with FreightClient(api_url, owner_key) as owner:
        job = owner.submit(pa.table({"prompt": ["secret plans"]}), model=PARKED_MODEL, metadata={"k": "v"})
    other = {"Authorization": f"Bearer {other_key}"}
    mine = {"Authorization": f"Bearer {owner_key}"}
    for method, path in job_routes(api_url):
        url = f"{api_url}{path.replace('{job_id}', job['id'])}"
        response = httpx.request(method, url, headers=other)
        assert response.status_code == 404, (method, path, response.text)
        assert "secret" not in response.text and "owner-co" not in response.text
        # The same route works for the owner (so the 404 is about the tenant, not the route).
        if method == "GET":
            assert httpx.request(method, url, headers=mine).status_code in (200, 409), (method, path)
    listed = httpx.get(f"{api_url}/v1/jobs", headers=other, params={"limit": 100}).json()
    assert job["id"] not in {j["id"] for j in listed["data"]}
    for status in ("queued", "cancelling"):
        listed = httpx.get(
            f"{api_url}/v1/jobs", headers=other, params={"status": status, "limit": 100}
        ).json()
        assert job["id"] not in {j["id"] for j in listed["data"]}
    # Paging from another tenant's job id is the same answer as from an id that does not exist.
    cursor = httpx.get(f"{api_url}/v1/jobs", headers=other, params={"after": job["id"]})
    unknown = httpx.get(f"{api_url}/v1/jobs", headers=other, params={"after": "job_" + "0" * 32})
    assert cursor.status_code == unknown.status_code == 422
    assert cursor.json()["error"]["message"].replace(job["id"], "X") == unknown.json()["error"][
        "message"
    ].replace("job_" + "0" * 32, "X")
    # Cancelling another tenant's job did nothing.
    assert httpx.get(f"{api_url}/v1/jobs/{job['id']}", headers=mine).json()["status"] == "queued"


def test_keys_are_salted_hashes_compared_in_constant_time(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(pg_url)
    with make_session_factory(engine)() as session:
        new = storage.keys.create_key(session, "hash-check")
        secret = new.key.split("_", 2)[2]
        stored = session.scalars(select(ApiKey).where(ApiKey.key_id == new.key_id)).one()
        assert secret not in (stored.secret_hash + stored.salt) and len(stored.salt) == 32

        compared: list[tuple[str, str]] = []
        real_compare = hmac.compare_digest

        def spy(a: str, b: str) -> bool:
            compared.append((a, b))
            return real_compare(a, b)

        monkeypatch.setattr(storage.keys.hmac, "compare_digest", spy)
        assert tenant_for_key(session, new.key) == "hash-check"
        assert tenant_for_key(session, f"frk_{'f' * 16}_{secret}") is None  # unknown key id
        assert tenant_for_key(session, new.key[:-1] + ("x" if new.key[-1] != "x" else "y")) is None
        # Every lookup, known key id or not, went through one constant-time comparison of hashes.
        assert len(compared) == 3 and all(len(a) == len(b) == 64 for a, b in compared)
    engine.dispose()


class PickleBomb:
    """Unpickling this would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.slow
def test_a_job_file_is_only_data(client: FreightClient, worker: Process, tmp_path: Path) -> None:
    """Metadata that asks Arrow to unpickle an extension type, pandas metadata, and Jinja or format
    syntax in the prompts: none of it runs, anywhere (API, validator, worker, finalize)."""
    marker = tmp_path / "pwned"
    evil_field = pa.field(
        "extra",
        pa.binary(),
        metadata={
            b"ARROW:extension:name": b"arrow.py_extension_type",
            b"ARROW:extension:metadata": pickle.dumps(PickleBomb(marker)),
        },
    )
    prompts = ["{{ 7 * 7 }} {% for x in range(10**9) %}{% endfor %}", "{prompt.__class__} %s", "Say hi"]
    schema = pa.schema([pa.field("prompt", pa.string()), evil_field]).with_metadata(
        {b"pandas": b'{"index_columns": [{"kind": "range"}], "columns": "__import__(\'os\')"}'}
    )
    table = pa.table({"prompt": prompts, "extra": [b"x", b"y", b"z"]}, schema=schema)
    path = tmp_path / "evil.parquet"
    pq.write_table(table, path)
    job = client.submit(path, max_tokens=2)
    done = client.wait(job["id"], poll_seconds=0.3, timeout=120)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 3, done
    assert not marker.exists()
    assert not os.path.exists(marker)
