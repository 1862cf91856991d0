"""A job end to end through real processes: the client, `freight api`, Redis, `freight worker` with
the engine, Postgres, finalize. Then the same job through `freight run` with the real model."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.cli.client import FreightClient
from jobs.domain.sample_docs import SUMMARIZE_TEMPLATE, sample_docs_table
from jobs.domain.schemas import JobMetrics
from storage.blobs import metrics_name
from tests.service.fixtures import FREIGHT_BIN, Process, ServiceEnv, start_worker

FINAL_EVENTS = ["validating", "queued", "in_progress", "finalizing", "completed"]


def mixed_input() -> pa.Table:
    """Ten rows in no particular order of length: one empty prompt, one too long for the context
    (512 tokens in these tests), one with its own max_tokens."""
    prompts = [f"Tell me about the number {i}. " + "Numbers are interesting. " * (i % 4) for i in range(10)]
    prompts[3] = "   "
    prompts[6] = "word " * 800
    return pa.table(
        {
            "custom_id": [f"doc-{(7 * i) % 10}-{i}" for i in range(10)],
            "prompt": prompts,
            "max_tokens": pa.array([None, None, None, None, None, None, None, 2, None, None], pa.int64()),
        }
    )


@pytest.mark.slow
def test_job_through_the_service(
    client: FreightClient, worker: Process, service_env: ServiceEnv, tmp_path: Path
) -> None:
    table = mixed_input()
    job = client.submit(table, max_tokens=6, metadata={"purpose": "e2e"})
    assert job["status"] == "queued"
    done = client.wait(job["id"], poll_seconds=0.5, timeout=300)
    assert done["status"] == "completed", done
    assert [e["status"] for e in client.events(job["id"])] == FINAL_EVENTS
    assert done["created_at"] <= done["started_at"] <= done["finished_at"]
    assert done["request_counts"] == {"total": 10, "completed": 8, "failed": 2}

    results = client.results_table(job["id"]).to_pylist()
    assert [row["row_index"] for row in results] == list(range(10))
    assert [row["custom_id"] for row in results] == table.column("custom_id").to_pylist()
    assert results[3]["finish_reason"] == "error" and results[3]["error"] == "empty prompt"
    assert (
        results[6]["finish_reason"] == "error" and "the model's context is 512 tokens" in results[6]["error"]
    )
    for index, row in enumerate(results):
        if index in (3, 6):
            assert row["output_tokens"] == 0 and row["output_text"] == ""
            continue
        assert row["finish_reason"] in ("stop", "length") and row["error"] is None
        assert row["prompt_tokens"] > 5
        assert 1 <= row["output_tokens"] <= (2 if index == 7 else 6)

    metrics = client.metrics(job["id"])
    assert set(metrics) == set(JobMetrics.model_fields)
    assert metrics["prompt_tokens"] == sum(row["prompt_tokens"] for row in results)
    assert metrics["output_tokens"] == sum(row["output_tokens"] for row in results)
    assert (metrics["rows"], metrics["rows_completed"], metrics["rows_failed"], metrics["shards"]) == (
        10,
        8,
        2,
        3,
    )
    # prompt tokens served from the prefix cache (the rows share the chat template's header) are not computed
    assert 0 <= metrics["cached_prompt_tokens"] < metrics["prompt_tokens"]
    assert metrics["computed_tokens"] + metrics["cached_prompt_tokens"] >= metrics["prompt_tokens"]
    assert 0 < metrics["device_seconds"] <= metrics["wall_seconds"] + 1
    assert metrics["cost_usd"] == pytest.approx(
        metrics["device_seconds"] / 3600 * metrics["device_hour_usd"], rel=1e-3, abs=1e-8
    )
    assert metrics["tokens_per_second"] > 0 and metrics["mean_batch_size"] >= 1
    assert 0 < metrics["peak_kv_utilization"] <= 1 and metrics["queue_seconds"] >= 0
    stored = json.loads((service_env.settings.resolved_data_dir / metrics_name(job["id"])).read_text())
    assert stored == metrics

    # A finished job cannot be cancelled.
    from jobs.cli.client import FreightAPIError

    with pytest.raises(FreightAPIError) as caught:
        client.cancel(job["id"])
    assert caught.value.status_code == 409


@pytest.mark.slow
def test_cli_submit_waits_with_progress_and_downloads(
    api_url: str, api_keys: dict[str, str], worker: Process, service_env: ServiceEnv, tmp_path: Path
) -> None:
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"Say {i}" for i in range(5)]}), source)
    out = tmp_path / "out.parquet"
    env = service_env.subprocess_env(FREIGHT_API_URL=api_url, FREIGHT_API_KEY=api_keys["acme"])
    run = subprocess.run(
        [FREIGHT_BIN, "submit", str(source), "--max-tokens", "3", "--wait", "-o", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["status"] == "completed"
    assert "rows" in run.stderr and "5/5" in run.stderr  # the progress bar
    assert pq.read_table(out).num_rows == 5


@pytest.fixture(scope="module")
def real_model_worker(service_env: ServiceEnv, log_dir: Path, smollm2_path: Path) -> Iterator[Process]:
    process = start_worker(service_env, log_dir, "real", "--model", str(smollm2_path))
    yield process
    process.stop()


@pytest.mark.slow
def test_freight_run_gives_the_same_greedy_outputs_as_the_service(
    client: FreightClient,
    real_model_worker: Process,
    service_env: ServiceEnv,
    smollm2_path: Path,
    tmp_path: Path,
) -> None:
    docs = sample_docs_table(8)
    source = tmp_path / "docs.parquet"
    pq.write_table(docs, source)
    params = {"model": str(smollm2_path), "max_tokens": 12, "template": SUMMARIZE_TEMPLATE}

    job = client.submit(source, params)
    done = client.wait(job["id"], poll_seconds=0.5, timeout=600)
    assert done["status"] == "completed", done
    service_rows = client.results_table(job["id"]).to_pylist()

    embedded_out = tmp_path / "embedded.parquet"
    metrics_path = tmp_path / "metrics.json"
    # the same measured plan (dtype, INT8 GEMM, kernels) as the worker's, as two processes sharing one
    # FREIGHT_HOME would have: measured apart on a busy machine, near-tied schemes may come out either way
    calibration = Path(service_env.env["FREIGHT_HOME"]) / "calibration"
    if calibration.is_dir():  # not written when the machine was busy during the worker's calibration
        shutil.copytree(calibration, tmp_path / "embedded-home" / "calibration")
    env = service_env.subprocess_env(
        FREIGHT_HOME=str(tmp_path / "embedded-home"), FREIGHT_DATA_DIR=str(tmp_path / "embedded-data")
    )
    run = subprocess.run(
        [
            FREIGHT_BIN,
            "run",
            str(source),
            "-o",
            str(embedded_out),
            "--params",
            json.dumps(params),
            "--metrics-json",
            str(metrics_path),
            "--no-progress",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert "cost:" in run.stdout and "tokens/s" in run.stdout
    assert (tmp_path / "embedded-home" / "freight.db").exists()  # embedded SQLite, not the service's Postgres
    embedded_rows = pq.read_table(embedded_out).to_pylist()

    assert [r["custom_id"] for r in embedded_rows] == docs.column("custom_id").to_pylist()
    assert all(r["finish_reason"] in ("stop", "length") and r["output_text"] for r in service_rows)
    for service_row, embedded_row in zip(service_rows, embedded_rows, strict=True):
        assert embedded_row == service_row
    embedded_metrics = json.loads(metrics_path.read_text())
    assert embedded_metrics["output_tokens"] == sum(r["output_tokens"] for r in embedded_rows)
