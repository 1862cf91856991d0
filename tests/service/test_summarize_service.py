"""A summarize job through the service (client, `freight api`, Redis, `freight worker`, Postgres): short
and long documents mixed in one job, empty documents as error rows, window counts in the results and
the metrics, the partial summaries stored in Postgres, and the job's report."""

from __future__ import annotations

import pyarrow as pa
import pytest
from sqlalchemy import func, select

from jobs.cli.client import FreightAPIError, FreightClient
from jobs.domain.sample_docs import sample_docs_table
from storage.db import make_engine, make_session_factory
from storage.models import SummaryPart
from tests.service.fixtures import Process, ServiceEnv

pytestmark = pytest.mark.slow


def documents() -> pa.Table:
    docs = {row["custom_id"]: row["text"] for row in sample_docs_table().to_pylist()}
    ids = ["tides", "almanac", "empty", "survey", "queue", "gettysburg"]
    texts = [
        docs["tides"],
        docs["harbour-almanac"],
        " ",
        docs["river-survey"],
        docs["queue"],
        docs["gettysburg"],
    ]
    return pa.table({"doc_id": ids, "title": [f"title {i}" for i in ids], "text": texts})


def test_summarize_job_mixes_short_and_long_documents(
    client: FreightClient, worker: Process, service_env: ServiceEnv, api_url: str, api_keys: dict[str, str]
) -> None:
    job = client.submit(
        documents(), task="summarize", column="text", style="three short sentences", max_tokens=8
    )
    assert job["params"]["summarize"]["style"] == "three short sentences"
    done = client.wait(job["id"], poll_seconds=0.5, timeout=300)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 6, "completed": 5, "failed": 1}

    rows = client.results_table(job["id"]).to_pylist()
    assert [row["doc_id"] for row in rows] == documents().column("doc_id").to_pylist()
    by_id = {row["doc_id"]: row for row in rows}
    assert by_id["empty"]["finish_reason"] == "error" and by_id["empty"]["error"] == "the document is empty"
    assert [by_id[d]["windows"] for d in ("tides", "queue", "gettysburg")] == [1, 1, 1]
    assert by_id["survey"]["windows"] == 2 and by_id["almanac"]["windows"] >= 5
    assert all(
        by_id[d]["summary"] and by_id[d]["summary"] == by_id[d]["output_text"] for d in by_id if d != "empty"
    )

    metrics = client.metrics(job["id"])
    assert metrics["windows"] == by_id["survey"]["windows"] + by_id["almanac"]["windows"]
    assert metrics["documents_split"] == 2 and metrics["reduce_requests"] >= 2
    assert metrics["output_tokens"] == sum(row["output_tokens"] for row in rows)

    # The partial summaries are in Postgres, and each long document's row counts all of its tokens.
    engine = make_engine(service_env.settings.resolved_database_url)
    with make_session_factory(engine)() as session:
        for doc in ("survey", "almanac"):
            index = by_id[doc]["row_index"]
            where = (SummaryPart.job_id == job["id"], SummaryPart.row_index == index)
            windows = session.scalar(select(func.count()).where(*where, SummaryPart.level == 0))
            part_output = session.scalar(select(func.sum(SummaryPart.output_tokens)).where(*where))
            assert windows == by_id[doc]["windows"]
            assert part_output < by_id[doc]["output_tokens"] <= part_output + 8
    engine.dispose()

    report = client.report_html(job["id"])
    assert "summary windows" in report and report.count("<svg") == 6
    with FreightClient(api_url, api_keys["globex"]) as other_tenant, pytest.raises(FreightAPIError) as caught:
        other_tenant.report_html(job["id"])
    assert caught.value.status_code == 404


def test_a_missing_document_column_is_refused_and_leaves_no_job(client: FreightClient) -> None:
    before = len(list(client.iter_jobs()))
    with pytest.raises(FreightAPIError) as caught:
        client.submit(documents(), task="summarize", column="body", max_tokens=8)
    assert caught.value.status_code == 422
    assert "column 'body' (the documents) is not in the file" in str(caught.value)
    assert len(list(client.iter_jobs())) == before
