"""Issue 28: a submission is stored in one step that completes or leaves nothing, and reads never fail on
stored data.

Atomic submission: the real JobService on the session's Postgres, its real blob folder and a real Celery
dispatcher on Redis; a failure is injected at each step (the upload written, validated, moved into place,
the job row, its shards, its events, the commit, the first and a later shard message, the batch row), and
afterwards no row, no file and no queue message is left. Poisoned listings: hostile values are written
straight into the tables, and a real API lists and reads them."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest
from sqlalchemy.orm import Session

from jobs.domain import service as service_module
from jobs.domain.batch_files import BatchFiles
from jobs.domain.broker import CeleryDispatcher
from jobs.domain.openai_service import BatchService
from jobs.domain.schemas import job_params
from jobs.domain.service import JobService
from storage import job_store, openai_store
from storage.blobs import BlobStore
from storage.db import make_engine, make_session_factory
from storage.models import Job, JobEvent, OpenAIBatch, OpenAIFile, utcnow
from tests.service.fixtures import (
    PARKED_MODEL,
    Process,
    ServiceEnv,
    create_api_key,
    make_service_env,
    start_api,
)
from tests.service.hostile_helpers import Leftovers, parquet_bytes

TENANT = "atomic"
SIX_ROWS = parquet_bytes(pa.table({"prompt": [f"Say {i}" for i in range(6)]}))  # shard size 4: two shards


class Injected(Exception):
    pass


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, pg_url: str, redis_url: str, queue_prefix: str) -> ServiceEnv:
    return make_service_env(tmp_path_factory.mktemp("atomic"), pg_url, redis_url, queue_prefix, PARKED_MODEL)


@pytest.fixture(scope="module")
def service(env: ServiceEnv) -> Iterator[JobService]:
    engine = make_engine(env.settings.resolved_database_url)
    dispatcher = CeleryDispatcher(env.settings)
    yield JobService(
        env.settings, make_session_factory(engine), BlobStore(env.settings.resolved_data_dir), dispatcher
    )
    dispatcher.app.close()
    engine.dispose()


@pytest.fixture
def leftovers(env: ServiceEnv) -> Iterator[Leftovers]:
    view = Leftovers(env, TENANT)
    yield view
    view.close()


def after_original(target: Any, name: str) -> Callable[..., Any]:
    """`target.name` that does its work, then fails."""
    original = getattr(target, name)

    def failing(*args: Any, **kwargs: Any) -> Any:
        original(*args, **kwargs)
        raise Injected(name)

    return failing


def on_call(number: int, original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` that fails on its `number`-th call (the calls before it do their work)."""
    calls = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == number:
            raise Injected(f"call {number}")
        return original(*args, **kwargs)

    return failing


STEPS = [
    "upload written",
    "validated",
    "moved into place",
    "job row",
    "shards",
    "events",
    "commit",
    "first shard message",
    "second shard message",
]


def inject(step: str, monkeypatch: pytest.MonkeyPatch, service: JobService) -> None:
    if step == "upload written":
        monkeypatch.setattr(BlobStore, "write_stream", after_original(BlobStore, "write_stream"))
    elif step == "validated":
        monkeypatch.setattr(service_module, "validate_parquet", after_original(service_module, "validate_parquet"))
    elif step == "moved into place":
        monkeypatch.setattr(BlobStore, "rename", after_original(BlobStore, "rename"))
    elif step in ("job row", "shards", "events"):
        name = {"job row": "_add_job", "shards": "_add_shards", "events": "_add_events"}[step]
        monkeypatch.setattr(job_store, name, after_original(job_store, name))
    elif step == "commit":
        monkeypatch.setattr(Session, "commit", on_call(1, Session.commit))
    else:
        app = service.dispatcher.app
        number = 1 if step == "first shard message" else 2
        monkeypatch.setattr(app, "send_task", on_call(number, app.send_task))


def test_a_submission_that_succeeds_stores_everything(service: JobService, leftovers: Leftovers) -> None:
    """The counterpart of the test below: the same submission, not failing, leaves its rows, file and
    messages (so the checks there can fail)."""
    job = service.submit(TENANT, io.BytesIO(SIX_ROWS), job_params({"model": PARKED_MODEL, "max_tokens": 2}))
    after = leftovers.snapshot()
    grown = {name: after.rows[name] - leftovers.before.rows[name] for name in after.rows}
    assert grown == {"jobs": 1, "shards": 2, "events": 2, "batches": 0, "files": 0}
    assert leftovers.messages(job.id) == 2
    assert any(path.name == "input.parquet" and job.id in str(path) for path in after.files)
    events = service.events(TENANT, job.id)
    assert [event.status for event in events] == ["validating", "queued"]
    service.undo_submission(job.id)  # and the undo leaves nothing either
    leftovers.assert_none()


@pytest.mark.parametrize("step", STEPS)
def test_a_failure_at_any_step_of_submission_leaves_nothing(
    service: JobService, leftovers: Leftovers, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    inject(step, monkeypatch, service)
    with pytest.raises(Exception) as caught:
        service.submit(TENANT, io.BytesIO(SIX_ROWS), job_params({"model": PARKED_MODEL, "max_tokens": 2}))
    assert "Injected" in repr(caught.value) or "injected" in str(caught.value.__cause__ or caught.value).lower() or (
        caught.value.__class__.__name__ == "BrokerUnavailable"
    ), repr(caught.value)
    monkeypatch.undo()
    leftovers.assert_none()


def test_a_batch_whose_row_cannot_be_stored_leaves_no_job(
    service: JobService, leftovers: Leftovers, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = BatchService(service)
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": PARKED_MODEL, "messages": [{"role": "user", "content": "hi"}]},
    }
    uploaded = batches.upload(TENANT, io.BytesIO(json.dumps(line).encode() + b"\n"), "in.jsonl", "batch")
    leftovers.before = leftovers.snapshot()
    monkeypatch.setattr(openai_store, "add_batch", after_original(openai_store, "add_batch"))
    with pytest.raises(Injected):
        batches.create(
            TENANT, input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={}
        )
    monkeypatch.undo()
    leftovers.assert_none()


def test_a_batch_whose_messages_cannot_be_sent_leaves_no_batch(
    service: JobService, leftovers: Leftovers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch row is committed with its job; a failure after the commit (sending the shard messages)
    removes it with the job, its shards, events and files."""
    batches = BatchService(service)
    lines = [
        {
            "custom_id": str(index),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": PARKED_MODEL, "messages": [{"role": "user", "content": f"hi {index}"}]},
        }
        for index in range(6)  # shard size 4: two shards, two messages
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    uploaded = batches.upload(TENANT, io.BytesIO(data), "in.jsonl", "batch")
    leftovers.before = leftovers.snapshot()
    inject("second shard message", monkeypatch, service)
    with pytest.raises(Exception) as caught:
        batches.create(
            TENANT, input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={}
        )
    assert caught.value.__class__.__name__ == "BrokerUnavailable", repr(caught.value)
    monkeypatch.undo()
    leftovers.assert_none()


# ---- reads never fail on stored data ---------------------------------------------------------

HOSTILE = {"k\ud800": "v\udfff", "nul": "a\x00b", "ctl": "\x07\x1b[31m", "pair": "\U0001f600"}


@pytest.fixture(scope="module")
def api_url(env: ServiceEnv, log_dir: Path) -> Iterator[str]:
    process: Process
    process, url = start_api(env, log_dir)
    yield url
    process.stop()


def test_listings_and_gets_render_any_stored_value(env: ServiceEnv, api_url: str) -> None:
    tenant = "poisoned"
    key = create_api_key(env, tenant)
    engine = make_engine(env.settings.resolved_database_url)
    now = utcnow()
    job_id = job_store.new_job_id()
    batch_id = openai_store.new_batch_id()
    file_id = openai_store.new_file_id()
    try:
        with make_session_factory(engine)() as session:
            # Straight into the tables, as rows written before the rule (or by hand) could hold them.
            session.add(
                Job(
                    id=job_id, tenant=tenant, status="queued", model=PARKED_MODEL,
                    params={"model": PARKED_MODEL, "template": "\ud800{prompt}", "stop": ["\x00", "\udc00"]},
                    job_metadata=HOSTILE, input_name=f"jobs/{job_id}/input.parquet", num_rows=1, num_shards=0,
                    created_at=now,
                )
            )  # fmt: skip
            session.add(JobEvent(job_id=job_id, status="queued", at=now))
            session.add(
                OpenAIBatch(
                    id=batch_id, tenant=tenant, job_id=None, endpoint="/v1/chat/completions",
                    input_file_id=file_id, completion_window="24h", batch_metadata=HOSTILE, created_at=now,
                    expires_at=now, line_errors=[{"line": 1, "custom_id": "c\ud800", "message": "m\udfff\x00",
                                                  "param": None, "code": "invalid_request"}],
                    errors=[{"code": "x", "message": "e\ud800", "param": None, "line": 1}],
                )
            )  # fmt: skip
            session.add(
                OpenAIFile(
                    id=file_id, tenant=tenant, purpose="batch", filename="f\x07\x1b.jsonl", bytes=1,
                    blob_name=openai_store.file_blob_name(file_id),
                )
            )  # fmt: skip
            session.commit()
            # Its error file, as the request that made it (or the recovery sweep) writes it: a read never does.
            blobs = BlobStore(env.settings.resolved_data_dir)
            jobs = JobService(env.settings, make_session_factory(engine), blobs, None)
            assert BatchFiles(jobs).write(session, openai_store.get_batch(session, batch_id, tenant), None)
        with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
            for method, path in [
                ("GET", "/v1/jobs"),
                ("GET", f"/v1/jobs/{job_id}"),
                ("GET", f"/v1/jobs/{job_id}/events"),
                ("POST", f"/v1/jobs/{job_id}/cancel"),
                ("GET", "/v1/batches"),
                ("GET", f"/v1/batches/{batch_id}"),
                ("GET", "/v1/files"),
                ("GET", f"/v1/files/{file_id}"),
            ]:
                response = http.request(method, path)
                assert response.status_code == 200, (path, response.text)
            job = http.get(f"/v1/jobs/{job_id}").json()
            assert job["metadata"] == {"k\ufffd": "v\ufffd", "nul": "a\x00b", "ctl": "\x07\x1b[31m", "pair": "\U0001f600"}
            assert job["params"]["template"] == "\ufffd{prompt}" and job["status"] == "cancelling"
            batch = http.get(f"/v1/batches/{batch_id}").json()
            assert batch["metadata"]["k\ufffd"] == "v\ufffd" and batch["errors"]["data"][0]["message"] == "e\ufffd"
            error_file = http.get(f"/v1/files/{batch['error_file_id']}/content")
            assert error_file.status_code == 200 and "\ufffd" in error_file.text
            # the batch's error file, written above, is newer than the odd name: find it by id
            names = {file["id"]: file["filename"] for file in http.get("/v1/files").json()["data"]}
            assert names[file_id] == "f\x07\x1b.jsonl"
            assert http.get(f"/v1/files/{file_id}").json()["filename"] == "f\x07\x1b.jsonl"
    finally:
        engine.dispose()
