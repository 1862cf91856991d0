"""The model registry at submission, through the real app (FastAPI's TestClient) on Postgres: a model a
worker recorded as one the engine cannot load is a 422 naming the loader's refusal (with the supported
model types) and field "model", on the native and the OpenAI-compatible API; max_tokens and per-row
overrides are checked against each model's own context (capped by FREIGHT_MAX_MODEL_LEN when set), and a
model no worker has recorded yet keeps the 2,048-token default."""

from __future__ import annotations

import io
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from jobs.api.app import create_app
from jobs.domain.errors import InputError
from jobs.domain.schemas import JobParams
from jobs.domain.served_models import UNRECORDED_CONTEXT
from jobs.domain.service import JobService
from jobs.domain.settings import Settings
from storage.blobs import BlobStore
from storage.db import make_engine, make_session_factory
from storage.keys import create_key
from storage.model_store import record_model
from worker.engine.config import SUPPORTED_MODEL_TYPES
from worker.model_registry import ModelRegistry, inspect_model

TENANT = "served-models"
SUFFIX = secrets.token_hex(3)  # the Postgres database is the session's: names of this module only
LONG = f"long-context-{SUFFIX}"  # recorded: its own context is 32k (Gemma 3 270M's)
FRESH = f"unrecorded-{SUFFIX}"  # no worker has recorded it


@pytest.fixture(scope="module")
def sessions(pg_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(pg_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture(scope="module")
def settings(
    pg_url: str, tmp_path_factory: pytest.TempPathFactory, falcon_dir: Path, sessions: sessionmaker[Session]
) -> Settings:
    # What workers would record: the falcon folder through the real inspection (the loader's message).
    ModelRegistry(sessions).record(inspect_model(str(falcon_dir)))
    with sessions() as session:
        record_model(
            session,
            name=LONG,
            model_type="gemma3_text",
            context_len=32768,
            loadable=True,
            error=None,
            recorded_by="test:0",
        )
    return Settings(
        database_url=pg_url,
        broker_url=None,
        home=tmp_path_factory.mktemp("served-home"),
        data_dir=tmp_path_factory.mktemp("served-data"),
        default_model=FRESH,
        models=[FRESH, LONG, str(falcon_dir)],
        grammar_check=False,
        max_upload_mb=1,
    )


@pytest.fixture(scope="module")
def http(settings: Settings, sessions: sessionmaker[Session]) -> Iterator[TestClient]:
    with sessions() as session:
        key = create_key(session, TENANT).key
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        yield client


def parquet(**columns: list[Any]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"prompt": ["Once upon a time", "The sea"], **columns}), sink)
    return sink.getvalue()


def submit(http: TestClient, params: dict[str, Any], content: bytes | None = None):
    return http.post(
        "/v1/jobs", files={"file": ("in.parquet", content or parquet())}, data={"params": json.dumps(params)}
    )


def job_ids(http: TestClient) -> list[str]:
    return [job["id"] for job in http.get("/v1/jobs", params={"limit": 100}).json()["data"]]


def test_a_model_the_engine_cannot_load_is_refused_with_the_loaders_message(
    http: TestClient, falcon_dir: Path
) -> None:
    before = job_ids(http)
    response = submit(http, {"model": str(falcon_dir), "max_tokens": 8})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "model" and error["field"] == "model"
    assert error["message"].startswith(f"model {str(falcon_dir)!r} cannot be served: ")
    assert f"unsupported architecture 'falcon' in {falcon_dir}" in error["message"]
    assert f"supported model types are {', '.join(SUPPORTED_MODEL_TYPES)}" in error["message"]
    assert job_ids(http) == before  # nothing stored


def test_max_tokens_is_checked_against_each_models_own_context(http: TestClient) -> None:
    accepted = submit(http, {"model": LONG, "max_tokens": 4000})
    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["params"]["max_tokens"] == 4000

    refused = submit(http, {"model": FRESH, "max_tokens": 4000})
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["field"] == "max_tokens"
    assert error["message"] == (
        f"max_tokens is 4000; it must be below the model context of {UNRECORDED_CONTEXT} tokens"
    )
    assert submit(http, {"model": FRESH, "max_tokens": UNRECORDED_CONTEXT - 1}).status_code == 201


def test_row_overrides_are_checked_against_the_models_own_context(http: TestClient) -> None:
    rows = parquet(max_tokens=pa.array([30000, 8], pa.int64()))
    assert submit(http, {"model": LONG, "max_tokens": 8}, rows).status_code == 201
    refused = submit(http, {"model": FRESH, "max_tokens": 8}, rows)
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert (error["row"], error["column"]) == (0, "max_tokens")
    assert (
        error["message"] == f"row 0: max_tokens is 30000; it must be between 1 and {UNRECORDED_CONTEXT - 1}"
    )


def test_the_operators_cap_bounds_every_models_context(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    capped = settings.model_copy(update={"max_model_len": 1024})
    service = JobService(capped, sessions, BlobStore(capped.resolved_data_dir), None)
    assert service.served(LONG).context_len == 1024
    assert service.served(FRESH).context_len == 1024  # unrecorded: the cap, as before the registry
    with pytest.raises(InputError, match="below the model context of 1024 tokens"):
        service.resolve(JobParams(model=LONG, max_tokens=4000))
    summarize = service.resolve(JobParams(model=LONG, task="summarize", max_tokens=256))
    assert summarize.task == "summarize"
    uncapped = JobService(settings, sessions, BlobStore(settings.resolved_data_dir), None)
    assert uncapped.served(LONG).context_len == 32768


def test_an_openai_batch_for_a_refused_model_fails_naming_its_lines(
    http: TestClient, falcon_dir: Path
) -> None:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": str(falcon_dir), "messages": [{"role": "user", "content": "Hi"}]},
        }
        for i in range(2)
    ]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    uploaded = http.post("/v1/files", files={"file": ("b.jsonl", data)}, data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    batch = http.post(
        "/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert batch.status_code == 200, batch.text
    body = batch.json()
    assert body["status"] == "failed"
    errors = body["errors"]["data"]
    assert [error["line"] for error in errors] == [1, 2]
    assert all("unsupported architecture 'falcon'" in error["message"] for error in errors), errors


def test_an_openai_chat_batch_defaults_max_tokens_to_the_models_context(http: TestClient) -> None:
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": LONG, "messages": [{"role": "user", "content": "Hi"}]},
    }
    uploaded = http.post(
        "/v1/files", files={"file": ("b.jsonl", json.dumps(line).encode())}, data={"purpose": "batch"}
    )
    batch = http.post(
        "/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    ).json()
    assert batch["status"] != "failed", batch
    jobs = http.get("/v1/jobs", params={"limit": 100}).json()["data"]
    # the batch's job, the newest: chat outputs are bounded by the model's own context alone
    assert (jobs[0]["params"]["model"], jobs[0]["params"]["max_tokens"]) == (LONG, 32767), jobs[0]
