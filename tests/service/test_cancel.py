"""Cancelling through the API with a real `freight worker`: cancelling, then cancelled within seconds
(workers check between engine steps); finished rows stay downloadable, the rest are `cancelled`;
no shard runs the engine after the cancel lands; a finished job answers 409."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pyarrow as pa
import pytest
from celery import Celery

from jobs.cli.client import FreightAPIError, FreightClient
from jobs.domain.broker import celery_config
from tests.service.fault_helpers import ServiceDB, wait_for
from tests.service.fixtures import Process, ServiceEnv

pytestmark = pytest.mark.slow
CANCEL_WITHIN_S = 5


@pytest.fixture
def db(service_env: ServiceEnv) -> Iterator[ServiceDB]:
    view = ServiceDB(service_env)
    yield view
    view.close()


def active_tasks(service_env: ServiceEnv, hostname: str) -> list:
    control = Celery("freight-test-inspect", set_as_current=False)
    control.conf.update(celery_config(service_env.settings))
    try:
        return (control.control.inspect(destination=[hostname], timeout=2).active() or {}).get(hostname, [])
    finally:
        control.close()


def test_cancel_a_running_job(
    client: FreightClient, worker: Process, service_env: ServiceEnv, db: ServiceDB
) -> None:
    rows = 40  # 10 shards of 4, each about a second of decoding
    table = pa.table(
        {"custom_id": [f"c{i}" for i in range(rows)], "prompt": [f"Count to {i}." for i in range(rows)]}
    )
    job = client.submit(table, max_tokens=480)
    wait_for(lambda: db.stored_rows(job["id"]) >= 2, 60, "the first rows")

    cancelling = client.cancel(job["id"])
    asked = time.monotonic()
    assert cancelling["status"] == "cancelling"
    done = wait_for(
        lambda: (j := client.get_job(job["id"]))["status"] == "cancelled" and j,
        CANCEL_WITHIN_S + 5,
        "cancelled",
        poll=0.1,
    )
    assert time.monotonic() - asked < CANCEL_WITHIN_S, "the workers took too long to notice"

    results = client.results_table(job["id"]).to_pylist()
    assert [r["custom_id"] for r in results] == [f"c{i}" for i in range(rows)]
    finished = [r for r in results if r["finish_reason"] in ("stop", "length")]
    cancelled = [r for r in results if r["finish_reason"] == "cancelled"]
    assert finished and cancelled and len(finished) + len(cancelled) == rows
    assert all(r["output_text"] == "" and r["error"] == "cancelled before this row ran" for r in cancelled)
    assert done["request_counts"]["completed"] == len(finished)
    assert client.metrics(job["id"])["rows_cancelled"] == len(cancelled)

    # Nothing of the job is still running, and the worker is idle again.
    shards = db.shards(job["id"])
    assert all(s.status in ("done", "cancelled") for s in shards), shards
    assert any(s.status == "cancelled" for s in shards)
    wait_for(lambda: active_tasks(service_env, worker.hostname) == [], 10, "an idle worker", poll=0.5)

    with pytest.raises(FreightAPIError) as conflict:
        client.cancel(job["id"])
    assert conflict.value.status_code == 409 and "cancelled" in str(conflict.value)


def test_cancelling_a_completed_job_is_a_409(client: FreightClient, worker: Process) -> None:
    job = client.submit(pa.table({"prompt": ["Hi"]}), max_tokens=1)
    assert client.wait(job["id"], poll_seconds=0.2, timeout=120)["status"] == "completed"
    with pytest.raises(FreightAPIError) as conflict:
        client.cancel(job["id"])
    assert conflict.value.status_code == 409
    assert "completed; only a queued or running job can be cancelled" in str(conflict.value)
    assert client.get_job(job["id"])["status"] == "completed"
