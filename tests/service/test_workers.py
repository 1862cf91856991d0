"""Celery workers as separate `freight worker` processes: two workers split one job's shards and the
job completes once; `freight flower` on the same Redis lists the workers and the shard tasks; the
shard tasks send progress events on that broker."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
from celery import Celery

from jobs.cli.client import FreightClient
from jobs.domain.broker import TASK_FINALIZE_JOB, TASK_RUN_SHARD, celery_config, queue_for_model
from storage import job_store
from storage.db import make_engine, make_session_factory
from storage.shard_store import shards_of
from storage.status import JobStatus
from tests.service.fixtures import Process, ServiceEnv, free_port, start_worker, wait_until

pytestmark = pytest.mark.slow


def prompts(rows: int) -> pa.Table:
    return pa.table({"prompt": [f"Item {i}: " + "lorem ipsum " * (i % 5) for i in range(rows)]})


@pytest.fixture
def second_worker(service_env: ServiceEnv, log_dir: Path, worker: Process) -> Iterator[Process]:
    process = start_worker(service_env, log_dir, "second", "--pool", "solo")
    yield process
    process.stop()


def test_two_workers_split_the_shards_and_the_job_completes_once(
    client: FreightClient,
    worker: Process,
    second_worker: Process,
    service_env: ServiceEnv,
) -> None:
    job = client.submit(prompts(32), max_tokens=48)  # 8 shards of 4
    done = client.wait(job["id"], poll_seconds=0.5, timeout=300)
    assert done["status"] == "completed" and done["request_counts"] == {
        "total": 32,
        "completed": 32,
        "failed": 0,
    }
    results = client.results_table(job["id"])
    assert results.column("row_index").to_pylist() == list(range(32))

    engine = make_engine(service_env.settings.resolved_database_url)
    with make_session_factory(engine)() as session:
        shards = shards_of(session, job["id"])
        statuses = [event.status for event in job_store.events(session, job["id"])]
    engine.dispose()
    owner_pids = {int(shard.owner.split(":")[1]) for shard in shards}
    assert owner_pids == {worker.popen.pid, second_worker.popen.pid}, owner_pids
    assert all(shard.status == "done" for shard in shards)
    assert statuses.count(JobStatus.FINALIZING) == 1 and statuses.count(JobStatus.COMPLETED) == 1
    assert statuses[-1] == JobStatus.COMPLETED


@pytest.fixture(scope="module")
def flower_url(service_env: ServiceEnv, log_dir: Path) -> Iterator[str]:
    port = free_port()
    env = service_env.subprocess_env(FLOWER_UNAUTHENTICATED_API="true")
    process = Process(["flower", "--port", str(port)], env, log_dir / "flower.log")
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/healthcheck", timeout=2).status_code == 200, 60, "flower", process)
    yield url
    process.stop()


class ProgressEvents:
    """Listens on the broker for the shard tasks' custom task-progress events."""

    def __init__(self, service: ServiceEnv) -> None:
        self.app = Celery("freight-test-events", set_as_current=False)
        self.app.conf.update(celery_config(service.settings))
        self.events: list[dict] = []
        self.ready = threading.Event()
        self.receiver = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        with self.app.connection() as connection:
            self.receiver = self.app.events.Receiver(
                connection, handlers={"task-progress": self.events.append}
            )
            self.ready.set()
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def stop(self) -> None:
        self.receiver.should_stop = True
        self.thread.join(5)


def test_flower_shows_the_workers_and_the_shard_tasks(
    flower_url: str,
    client: FreightClient,
    worker: Process,
    service_env: ServiceEnv,
) -> None:
    listener = ProgressEvents(service_env)
    job = client.submit(prompts(8), max_tokens=8, priority="high", completion_window="2h")
    assert client.wait(job["id"], poll_seconds=0.5, timeout=300)["status"] == "completed"

    def shard_tasks() -> list[dict]:
        tasks = httpx.get(f"{flower_url}/api/tasks", params={"taskname": TASK_RUN_SHARD}, timeout=5).json()
        return [task for task in tasks.values() if job["id"] in task["args"]]

    wait_until(
        lambda: [t["state"] for t in shard_tasks()] == ["SUCCESS", "SUCCESS"], 30, "shard tasks in flower"
    )
    tasks = shard_tasks()
    assert sorted(json.loads(t["args"].replace("'", '"'))[1] for t in tasks) == [0, 1]
    assert {t["worker"] for t in tasks} == {worker.hostname}
    assert all("'rows_written': 4" in t["result"] for t in tasks)
    # The task page shows the job's schedule: its tenant, priority class and deadline (broker.TaskLabels).
    deadline = datetime.fromisoformat(job["deadline"]).isoformat(timespec="seconds")
    for task in tasks:
        assert "'tenant': 'acme'" in task["kwargs"] and "'priority': 'high'" in task["kwargs"]
        assert f"'deadline': '{deadline}'" in task["kwargs"], task["kwargs"]

    finalize = httpx.get(f"{flower_url}/api/tasks", params={"taskname": TASK_FINALIZE_JOB}, timeout=5).json()
    assert any(job["id"] in task["args"] and task["state"] == "SUCCESS" for task in finalize.values())

    workers = httpx.get(f"{flower_url}/api/workers", params={"refresh": "1"}, timeout=30).json()
    queues = {queue["name"] for queue in workers[worker.hostname]["active_queues"]}
    assert queue_for_model(service_env.settings, service_env.settings.default_model) in queues

    wait_until(lambda: any(e.get("job_id") == job["id"] for e in listener.events), 10, "progress events")
    listener.stop()
    mine = [e for e in listener.events if e.get("job_id") == job["id"]]
    assert {e["shard"] for e in mine} == {0, 1}
    assert all(e["rows_total"] == 4 and 0 <= e["rows_done"] <= 4 for e in mine)
    assert any(e["rows_done"] == 4 for e in mine)
    assert all(json.loads(e["result"])["rows_total"] == 4 for e in mine)
