"""The OpenAI-compatible Batch API through the official `openai` package, against a real `freight api`,
Redis, a real `freight worker`, and Postgres: files.create, batches.create / retrieve / list / cancel,
files.content of the output and error files; the outputs match a native job's on the same prompts
(greedy); bad lines go to the error file; expiry and cancel keep what finished; another tenant sees
nothing; an oversize file is refused; the OpenAPI page shows OpenAI's objects field for field. (That a
read writes nothing is tests/jobs/test_batch_files.py.)"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import get_args

import httpx
import openai
import pyarrow as pa
import pytest
from openai import OpenAI
from openai.types import Batch, BatchError, BatchRequestCounts, BatchUsage, FileDeleted, FileObject
from pydantic import BaseModel
from sqlalchemy import select, update

from jobs.cli.client import FreightClient
from jobs.domain.openai_service import expire_if_due
from storage import job_store
from storage.models import OpenAIBatch, utcnow
from tests.service.fault_helpers import ServiceDB, wait_for
from tests.service.fixtures import Process, ServiceEnv

pytestmark = pytest.mark.slow
FINAL = ("completed", "failed", "cancelled", "expired")
QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Say hello.", "Count to three.", "What is the sky?"]


@pytest.fixture
def sdk(api_url: str, api_keys: dict[str, str]) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{api_url}/v1", api_key=api_keys["acme"], max_retries=0) as client:
        yield client


@pytest.fixture
def other_sdk(api_url: str, api_keys: dict[str, str]) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{api_url}/v1", api_key=api_keys["globex"], max_retries=0) as client:
        yield client


@pytest.fixture
def db(service_env: ServiceEnv) -> Iterator[ServiceDB]:
    view = ServiceDB(service_env)
    yield view
    view.close()


def jsonl(lines: list) -> bytes:
    return b"".join(
        (json.dumps(line) if not isinstance(line, bytes) else line.decode()).encode() + b"\n"
        for line in lines
    )


def chat(custom_id: str, content: str, model: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": content}], **body},
    }


def upload(sdk: OpenAI, lines: list) -> str:
    return sdk.files.create(file=("requests.jsonl", io.BytesIO(jsonl(lines))), purpose="batch").id


def wait_final(sdk: OpenAI, batch_id: str, timeout: float = 180):
    return wait_for(
        lambda: (batch := sdk.batches.retrieve(batch_id)).status in FINAL and batch,
        timeout,
        "a final batch",
        poll=0.3,
    )


def read_lines(sdk: OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in sdk.files.content(file_id).text.splitlines()]


def test_chat_batch_matches_the_native_job(
    sdk: OpenAI, client: FreightClient, worker: Process, service_env: ServiceEnv
) -> None:
    model = service_env.settings.default_model
    _native_chat_job(client)  # warm-up
    lines = [
        chat(f"q{i}", question, model, max_tokens=8, temperature=0) for i, question in enumerate(QUESTIONS)
    ]
    lines.insert(2, {**chat("bad", "x", model), "method": "GET"})
    uploaded = sdk.files.create(file=("requests.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.filename) == ("file", "batch", "requests.jsonl")
    assert uploaded.bytes == len(jsonl(lines))
    assert sdk.files.retrieve(uploaded.id).id == uploaded.id
    assert sdk.files.content(uploaded.id).content == jsonl(lines)

    batch = sdk.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="7d",  # beyond OpenAI's 24h: the batch's job is scheduled by it
        metadata={"purpose": "openai-e2e"},
    )
    assert batch.status in ("in_progress", "finalizing", "completed") and batch.object == "batch"
    assert batch.metadata == {"purpose": "openai-e2e"} and batch.expires_at == batch.created_at + 7 * 86400
    dues = [datetime.fromisoformat(job["deadline"]).timestamp() for job in client.iter_jobs() if job["deadline"]]
    assert any(abs(due - batch.expires_at) <= 2 for due in dues), (dues, batch.expires_at)  # the batch's job
    done = wait_final(sdk, batch.id)
    assert done.status == "completed", done
    assert (
        done.request_counts.total == 6
        and done.request_counts.completed == 5
        and done.request_counts.failed == 1
    )
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.usage.output_tokens > 0 and done.usage.input_tokens > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    assert done.usage.input_tokens_details.cached_tokens >= 0
    assert done.model == model

    outputs = read_lines(sdk, done.output_file_id)
    assert [line["custom_id"] for line in outputs] == [f"q{i}" for i in range(5)]
    assert all(line["error"] is None and line["response"]["status_code"] == 200 for line in outputs)
    bodies = {line["custom_id"]: line["response"]["body"] for line in outputs}
    assert all(body["object"] == "chat.completion" for body in bodies.values())
    assert all(body["usage"]["completion_tokens"] <= 8 for body in bodies.values())
    errors = read_lines(sdk, done.error_file_id)
    assert len(errors) == 1 and errors[0]["custom_id"] == "bad"
    assert (
        errors[0]["response"]["status_code"] == 400
        and 'line 3: method must be "POST"' in errors[0]["error"]["message"]
    )
    assert sdk.files.retrieve(done.output_file_id).purpose == "batch_output"

    # The same prompts as a native job: the same words (greedy). Both run on a warm worker (the
    # session's first job on a fresh worker can differ in a near-tie: see _native_chat_job).
    native = _native_chat_job(client)
    for row in client.results_table(native["id"]).to_pylist():
        body = bodies[row["custom_id"]]
        assert body["choices"][0]["message"]["content"] == row["output_text"]
        assert body["choices"][0]["finish_reason"] == row["finish_reason"]
        assert body["usage"]["prompt_tokens"] == row["prompt_tokens"]

    listed = sdk.batches.list(limit=100)
    assert done.id in [item.id for item in listed.data]
    assert uploaded.id in [item.id for item in sdk.files.list().data]


def test_completions_batch_matches_the_native_job(
    sdk: OpenAI, client: FreightClient, worker: Process, service_env: ServiceEnv
) -> None:
    model = service_env.settings.default_model
    prompts = ["Once upon a time", "The capital of France is"]
    lines = [
        {
            "custom_id": f"p{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": p, "max_tokens": 6, "temperature": 0},
        }
        for i, p in enumerate(prompts)
    ]
    batch = sdk.batches.create(
        input_file_id=upload(sdk, lines), endpoint="/v1/completions", completion_window="24h"
    )
    done = wait_final(sdk, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    outputs = {line["custom_id"]: line["response"]["body"] for line in read_lines(sdk, done.output_file_id)}
    native = client.submit(
        pa.table({"custom_id": ["p0", "p1"], "prompt": prompts}), max_tokens=6, temperature=0.0
    )
    assert client.wait(native["id"], poll_seconds=0.3, timeout=180)["status"] == "completed"
    for row in client.results_table(native["id"]).to_pylist():
        assert outputs[row["custom_id"]]["object"] == "text_completion"
        assert outputs[row["custom_id"]]["choices"][0]["text"] == row["output_text"]


def test_response_format_constrains_the_lines_outputs(
    sdk: OpenAI, worker: Process, service_env: ServiceEnv
) -> None:
    model = service_env.settings.default_model
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    question = "Name a large city and its population, as JSON."  # bounded fields: the tiny model rambles
    lines = [
        chat("schema", question, model, max_tokens=100, temperature=0,
             response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}),
        chat("object", question, model, max_tokens=60, temperature=0, response_format={"type": "json_object"}),
        chat("text", question, model, max_tokens=8, temperature=0, response_format={"type": "text"}),
        chat("bad", question, model, response_format={"type": "json_schema", "json_schema": {"schema": schema}}),
        # well-formed, but the grammar engine refuses it: the API asks it (a child process) at creation
        chat("refused", question, model, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "no-such-type"}}}),
    ]  # fmt: skip
    batch = sdk.batches.create(
        input_file_id=upload(sdk, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_final(sdk, batch.id)
    assert done.status == "completed" and done.request_counts.failed == 2
    outputs = {line["custom_id"]: line["response"]["body"] for line in read_lines(sdk, done.output_file_id)}
    content = {key: body["choices"][0]["message"]["content"] for key, body in outputs.items()}
    parsed = json.loads(content["schema"])
    assert set(parsed) == {"city", "population"} and isinstance(parsed["population"], int)
    assert outputs["schema"]["choices"][0]["finish_reason"] == "stop"
    # any object: unbounded, so a random-weight model may run out of tokens inside it, but never leaves JSON
    finish = outputs["object"]["choices"][0]["finish_reason"]
    assert content["object"].startswith("{")
    assert finish == "length" or isinstance(json.loads(content["object"]), dict)
    errors = read_lines(sdk, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["bad", "refused"]
    assert "response_format.json_schema.name" in json.dumps(errors[0])
    refused = json.dumps(errors[1])
    assert "line 5" in refused and "refused by the grammar engine" in refused and "no-such-type" in refused


def test_cancel_keeps_what_finished(
    sdk: OpenAI, worker: Process, service_env: ServiceEnv, db: ServiceDB
) -> None:
    model = service_env.settings.default_model
    rows = 40  # 10 shards of 4, each about a second of decoding
    lines = [chat(f"c{i}", f"Count to {i}.", model, max_tokens=480, temperature=0) for i in range(rows)]
    batch = sdk.batches.create(
        input_file_id=upload(sdk, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    job_id = _job_of(db, batch.id)
    wait_for(lambda: db.stored_rows(job_id) >= 2, 60, "the first rows")
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    done = wait_final(sdk, batch.id, 60)
    assert done.status == "cancelled" and done.cancelled_at is not None
    outputs = read_lines(sdk, done.output_file_id)
    errors = read_lines(sdk, done.error_file_id)
    assert outputs and errors and len(outputs) + len(errors) == rows
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert done.request_counts.completed == len(outputs)
    with pytest.raises(openai.ConflictError):
        sdk.batches.cancel(batch.id)


def test_a_batch_past_its_window_expires_keeping_what_finished(
    sdk: OpenAI, worker: Process, service_env: ServiceEnv, db: ServiceDB
) -> None:
    model = service_env.settings.default_model
    rows = 40
    lines = [chat(f"e{i}", f"Count to {i}.", model, max_tokens=480, temperature=0) for i in range(rows)]
    batch = sdk.batches.create(
        input_file_id=upload(sdk, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    job_id = _job_of(db, batch.id)
    wait_for(lambda: db.stored_rows(job_id) >= 2, 60, "the first rows")
    with db.session() as session:  # the window passes
        session.execute(
            update(OpenAIBatch)
            .where(OpenAIBatch.id == batch.id)
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )
        session.commit()
        # What the API's recovery sweep does to such a batch (a read does not: reads never write); its
        # own sweep may come first, to the same effect.
        row = session.scalars(select(OpenAIBatch).where(OpenAIBatch.id == batch.id)).one()
        expire_if_due(session, row, job_store.job_status(session, job_id), utcnow())
    assert sdk.batches.retrieve(batch.id).status in ("finalizing", "expired")
    done = wait_final(sdk, batch.id, 60)
    assert done.status == "expired" and done.expired_at is not None and done.cancelled_at is None
    outputs = read_lines(sdk, done.output_file_id)
    errors = read_lines(sdk, done.error_file_id)
    assert outputs and errors and len(outputs) + len(errors) == rows
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}


def test_a_file_of_bad_lines_fails_the_batch_naming_them(sdk: OpenAI, service_env: ServiceEnv) -> None:
    model = service_env.settings.default_model
    lines = [b"{not json", {**chat("b", "x", model), "url": "/v1/embeddings"}, chat("c", "x", model, n=3)]
    batch = sdk.batches.create(
        input_file_id=upload(sdk, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "failed" and batch.failed_at is not None
    assert [error.line for error in batch.errors.data] == [1, 2, 3]
    assert "not valid JSON" in batch.errors.data[0].message
    assert batch.request_counts.total == 3 and batch.request_counts.failed == 3
    assert len(read_lines(sdk, batch.error_file_id)) == 3


def test_bad_requests_are_4xx(sdk: OpenAI, service_env: ServiceEnv) -> None:
    big = b'{"custom_id": "x"}\n' * (5 * 1024 * 1024 // 19)  # over FREIGHT_MAX_UPLOAD_MB=2
    with pytest.raises(openai.APIStatusError) as oversize:
        sdk.files.create(file=("big.jsonl", io.BytesIO(big)), purpose="batch")
    assert oversize.value.status_code == 413
    file_id = upload(sdk, [chat("a", "x", service_env.settings.default_model)])
    with pytest.raises(openai.UnprocessableEntityError):
        sdk.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.UnprocessableEntityError):
        sdk.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="soon")
    with pytest.raises(openai.NotFoundError):
        sdk.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.UnprocessableEntityError):
        sdk.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert sdk.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(file_id)


def test_another_tenant_sees_nothing(sdk: OpenAI, other_sdk: OpenAI) -> None:
    file_id = upload(sdk, [b"not json"])  # a batch that fails at once: no worker needed
    batch = sdk.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    calls = [
        lambda: other_sdk.files.retrieve(file_id),
        lambda: other_sdk.files.content(file_id),
        lambda: other_sdk.files.delete(file_id),
        lambda: other_sdk.files.content(batch.error_file_id),
        lambda: other_sdk.batches.retrieve(batch.id),
        lambda: other_sdk.batches.cancel(batch.id),
        lambda: other_sdk.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body["type"] == "not_found_error"
    assert file_id not in [item.id for item in other_sdk.files.list().data]
    assert batch.id not in [item.id for item in other_sdk.batches.list().data]
    with pytest.raises(openai.UnprocessableEntityError):
        other_sdk.batches.list(after=batch.id)
    assert sdk.files.retrieve(file_id).id == file_id  # still there for its owner


def test_the_openapi_page_shows_openais_objects(api_url: str, sdk: OpenAI) -> None:
    """/openapi.json: each route answers one of OpenAI's objects, whose schema has the `openai` SDK's
    fields (every one the SDK requires required), and a batch as served has exactly those fields."""
    spec = httpx.get(f"{api_url}/openapi.json", timeout=30).raise_for_status().json()
    schemas = spec["components"]["schemas"]

    def answer(path: str, method: str) -> dict:
        ref = spec["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        return schemas[ref.rsplit("/", 1)[1]]

    def same_fields(schema: dict, sdk_type: type[BaseModel]) -> None:
        assert set(schema["properties"]) == set(sdk_type.model_fields), schema["title"]
        required = {name for name, field in sdk_type.model_fields.items() if field.is_required()}
        assert required <= set(schema.get("required", ())), schema["title"]

    batch, file = answer("/v1/batches/{batch_id}", "get"), answer("/v1/files/{file_id}", "get")
    same_fields(batch, Batch)
    same_fields(file, FileObject)
    assert answer("/v1/batches", "post") == answer("/v1/batches/{batch_id}/cancel", "post") == batch
    assert answer("/v1/files", "post") == file
    same_fields(answer("/v1/files/{file_id}", "delete"), FileDeleted)
    same_fields(schemas["BatchRequestCounts"], BatchRequestCounts)
    same_fields(schemas["BatchUsage"], BatchUsage)
    same_fields(schemas["BatchError"], BatchError)
    assert set(batch["properties"]["status"]["enum"]) == set(get_args(Batch.model_fields["status"].annotation))
    assert set(file["properties"]["purpose"]["enum"]) == set(get_args(FileObject.model_fields["purpose"].annotation))
    for path, item in (("/v1/batches", batch), ("/v1/files", file)):
        page = answer(path, "get")
        assert set(page["properties"]) == {"object", "data", "first_id", "last_id", "has_more"}
        assert page["properties"]["data"]["items"]["$ref"].endswith("/" + item["title"])
    content = spec["paths"]["/v1/files/{file_id}/content"]["get"]["responses"]["200"]["content"]
    lines = {option["$ref"].rsplit("/", 1)[1] for option in content["application/jsonl"]["schema"]["anyOf"]}
    assert lines == {"BatchRequestInput", "BatchRequestOutput"}
    assert set(schemas["BatchRequestOutput"]["properties"]) == {"id", "custom_id", "response", "error"}

    # As served: a batch that fails at once (no worker needed) has exactly the schema's fields.
    failed = sdk.batches.create(input_file_id=upload(sdk, [b"not json"]), endpoint="/v1/completions",
                                completion_window="24h")  # fmt: skip
    served = sdk.batches.with_raw_response.retrieve(failed.id).http_response.json()
    assert set(served) == set(batch["properties"]) and served["errors"]["object"] == "list"
    assert set(served["request_counts"]) == set(BatchRequestCounts.model_fields)


def _native_chat_job(client: FreightClient) -> dict:
    """QUESTIONS as a native job (messages column, greedy, 8 tokens), finished. Run once before the
    batch as well: the first job a fresh worker runs can pick another token where two are nearly tied
    (the prefix cache starts cold), so both jobs compared run on a warm worker."""
    native = client.submit(
        pa.table(
            {
                "custom_id": [f"q{i}" for i in range(len(QUESTIONS))],
                "messages": [[{"role": "user", "content": question}] for question in QUESTIONS],
            }
        ),
        max_tokens=8,
        temperature=0.0,
    )
    assert client.wait(native["id"], poll_seconds=0.3, timeout=180)["status"] == "completed"
    return native


def _job_of(db: ServiceDB, batch_id: str) -> str:
    with db.session() as session:
        return session.scalar(select(OpenAIBatch.job_id).where(OpenAIBatch.id == batch_id))
